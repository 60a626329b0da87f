"""The prefill side of the hand-off (pdserve.transfer.protocol has the overview): jobs and the pusher.

A request whose prompt completes in a step and whose destination is ready is sent layer by layer during
that step's forward (layer i travels while layer i+1 computes: `PushJob` follows the step); one whose
destination became ready later is sent at once from its HELD blocks. The requests of one step bound for
the same decode worker travel as one transfer. Per (prefill, decode) pair, the `KVPusher` takes queued
transfers by service tier, then queue order, numbers each (generation, seq) as its turn comes and
announces it (`KVAnnounce`) before sending it. A transfer that fails breaks the pair's channel; the next
one rebuilds it under the next generation.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from pdserve.faults import FaultPoints
from pdserve.parallel.layout import HeadTransfer
from pdserve.transfer.channel import PairChannel, TransferError, TransferTimeout
from pdserve.transfer.protocol import (
    MIN_PART_BYTES,
    KVAnnounce,
    KVMac,
    block_index,
    layer_spans,
    num_parts_for,
    trailer_len,
)
from pdserve.transfer.shares import PairLink, as_link, is_lead, run_shares, send_share, share_heads

log = logging.getLogger(__name__)


def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class _NoPeer(TransferError):
    """The rendezvous with the decode worker failed: it is dead or unreachable."""


class PushJob:
    """One transfer's worth of KV: requests bound for one decode worker, and how far their KV is computed.

    The step thread reports layers as they are written (`layer_done`) and then the sampled tokens
    (`sampled`); the pusher's thread sends each part as soon as it is computed. A job made from HELD
    requests is complete from the start.
    """

    def __init__(self, destination: str, request_ids: Sequence[str], block_ids: Sequence[Sequence[int]],
                 num_layers: int, layers_done: int = 0, tokens: Sequence[int] | None = None,
                 sampled_at: float | None = None, tier: int = 1, step: int = 0, samples: Sequence[int] = (),
                 versions: Sequence[int] = ()):
        """tokens: the requests' first tokens, in order (a group's n in a row: `samples` says how many each
        has; empty, one each), once known (else `sampled` gives them). versions: per request, the weight
        version that computed its KV and first tokens (empty: all 0)."""
        self.destination = destination
        self.tier = tier  # the service tier's rank of its requests (pdserve.tiers): the pusher's order
        self.step = step  # the engine step whose forward computes this KV (the other TP ranks wait for it)
        self.request_ids = tuple(request_ids)
        self.samples = tuple(samples) if any(n != 1 for n in samples) else ()
        self.versions = tuple(versions) if any(versions) else ()  # all 0: the announce's old form
        if self.versions and len(self.versions) != len(self.request_ids):
            raise ValueError(f"{len(self.versions)} versions for {len(self.request_ids)} requests")
        self.block_ids = [list(b) for b in block_ids]
        self.num_layers = num_layers
        self.num_parts = 1 if layers_done == num_layers else num_layers
        self._layers_done = layers_done
        self._events: dict[int, torch.cuda.Event] = {}
        if layers_done and _cuda_active():
            event = torch.cuda.Event()  # covers every layer queued so far
            event.record()
            self._events = dict.fromkeys(range(layers_done), event)
        self._tokens = list(tokens) if tokens is not None else None
        self._sampled_at = sampled_at if sampled_at is not None else time.time()
        self._error: str | None = None
        self._cond = threading.Condition()

    def layer_done(self, layer: int) -> None:
        event = None
        if _cuda_active():
            # The layer's kernels are queued, not finished: the pusher's stream waits on this event.
            event = torch.cuda.Event()
            event.record()
        with self._cond:
            if event is not None:
                self._events[layer] = event
            self._layers_done = max(self._layers_done, layer + 1)
            self._cond.notify_all()

    def sampled(self, tokens: Sequence[int]) -> None:
        with self._cond:
            self._tokens = list(tokens)
            self._sampled_at = time.time()
            self._layers_done = self.num_layers
            self._cond.notify_all()

    def abort(self, reason: str) -> None:
        """The step that computes this KV failed: the transfer cannot complete."""
        with self._cond:
            self._error = reason
            self._cond.notify_all()

    def wait_layers(self, end: int, timeout_s: float) -> torch.cuda.Event | None:
        with self._cond:
            self._wait(lambda: self._layers_done >= end, timeout_s, f"layer {end - 1}")
            return self._events.get(end - 1)

    def wait_tokens(self, timeout_s: float) -> tuple[list[int], float]:
        with self._cond:
            self._wait(lambda: self._tokens is not None, timeout_s, "the sampled tokens")
            return list(self._tokens), self._sampled_at

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        if not self._cond.wait_for(lambda: ready() or self._error is not None, timeout_s):
            raise TransferTimeout(f"the prefill step did not produce {what} within {timeout_s:g} s")
        if self._error is not None:
            raise TransferError(f"the prefill step failed: {self._error}")


class KVPusher:
    """The sending end of one (prefill, decode) pair: orders, numbers, announces and sends transfers.

    Queued jobs go by (service tier, queue order): a priority request's KV never waits behind flex's.
    A job is numbered and announced when its turn comes, just before it is sent, so the order the
    decode worker receives in is the order they are sent in.
    open_pair(generation) must start the decode worker's side of a new channel and return this side
    (a rendezvous); announce(KVAnnounce) tells the decode worker what comes (asynchronously);
    done(job, error) is called once per job, from this pusher's thread, when the job has been sent
    (error None) or has failed (the owner then tells the decode worker, which drops the reservations).
    """

    def __init__(self, prefill_id: str, decode_id: str, kv_cache: torch.Tensor,
                 open_pair: Callable[[int], PairChannel], announce: Callable[[KVAnnounce], None],
                 done: Callable[[PushJob, str | None], None], min_part_bytes: int = MIN_PART_BYTES,
                 checksum: KVMac | None = None, faults: FaultPoints | None = None):
        self.prefill_id, self.decode_id = prefill_id, decode_id
        self.min_part_bytes = min_part_bytes
        self.checksum = checksum  # the cluster's keyed checksum on every transfer, if on (--kv-checksum)
        self.faults = faults or FaultPoints()
        self.kv_cache = kv_cache
        self._open_pair, self._announce, self._done = open_pair, announce, done
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)
        self._generation = 1
        self._next_seq = 0
        self._channel: PairLink | None = None
        self._stopped = False
        self._jobs: list[tuple[int, int, PushJob]] = []  # a heap on (tier, queue order)
        self._order = itertools.count()
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._thread = threading.Thread(target=self._run, name=f"kv-push-{prefill_id}->{decode_id}", daemon=True)
        self._thread.start()

    def push(self, job: PushJob) -> None:
        """Queue a job: it goes after the queued jobs of its tier and higher ones, before lower tiers'."""
        if job.num_parts > 1:
            cache = self.kv_cache
            layer_bytes = cache[0].nbytes // cache.shape[3] * sum(len(b) for b in job.block_ids)
            job.num_parts = num_parts_for(job.num_layers, layer_bytes, self.min_part_bytes)
        with self._lock:
            stopped = self._stopped
            if not stopped:
                heapq.heappush(self._jobs, (job.tier, next(self._order), job))
                self._queued.notify()
        if stopped:  # its decode worker is gone
            self._done(job, f"no channel to {self.decode_id}: it is gone")

    def stop(self) -> None:
        """No more jobs; those queued are tried (and fail fast if the peer is gone), then the thread ends."""
        with self._lock:
            self._stopped = True
            self._queued.notify()
            if self._channel is not None:
                self._channel.close()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._stopped:
                    self._queued.wait()
                if not self._jobs:
                    return  # stopped, and nothing left
                job = heapq.heappop(self._jobs)[2]
                a = KVAnnounce(self.prefill_id, self._generation, self._next_seq, job.request_ids,
                               tuple(len(b) for b in job.block_ids), job.num_parts, self.checksum is not None,
                               job.samples,
                               job.versions)
                self._next_seq += 1
            self._announce(a)
            try:
                self._send(a, job)
            except _NoPeer as e:  # the decode worker cannot be reached: fail what waits for it as well
                log.warning("KV push to %s failed: %s", self.decode_id, e)
                with self._lock:
                    self._break_locked(a.generation)
                    queued = [j for _, _, j in self._jobs]
                    self._jobs.clear()
                for other in (job, *queued):
                    self._done(other, str(e))
            except Exception as e:  # noqa: BLE001 - the job fails; the pair moves to the next generation
                log.warning("KV push %s/%s of %s to %s failed: %s", a.generation, a.seq, a.request_ids,
                            self.decode_id, e)
                self._break(a.generation)
                self._done(job, str(e) or type(e).__name__)
            else:
                self._done(job, None)

    def _send(self, a: KVAnnounce, job: PushJob) -> None:
        with self._lock:
            link = self._channel
        if link is None:
            try:
                link = as_link(self._open_pair(a.generation))
            except Exception as e:  # noqa: BLE001 - no channel: the peer is gone or unreachable
                raise _NoPeer(f"no channel to {self.decode_id}: {e}") from e
            with self._lock:
                self._channel = link
        cache = self.kv_cache
        timeout = link.timeout_s
        index = block_index(job.block_ids, cache.device)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())  # the index above was copied on it
        spans = layer_spans(job.num_layers, a.num_parts)
        others = link.others(a, job.block_ids, job.step) if link.others is not None else []  # the other TP ranks

        def trailer() -> list[int]:  # the first token of each request, when they were sampled (microseconds)
            tokens, sampled_at = job.wait_tokens(timeout)
            return [*tokens, int(sampled_at * 1e6)]

        def share(transfer: HeadTransfer | None, channel: PairChannel) -> None:
            lead = is_lead(transfer)
            send_share(channel, a.seq, cache, index, share_heads(transfer, True, cache), spans,
                       lambda end: job.wait_layers(end, timeout), trailer if lead else None,
                       trailer_len(sum(a.tokens_per_request), lead, a.checksum), self.checksum,
                       self.faults if lead else None, self._stream)

        run_shares(link, others, [lambda t=t, c=c: share(t, c) for t, c in link.shares], timeout,
                   f"the other ranks' shares of transfer {a.generation}/{a.seq}")

    def _break(self, generation: int) -> None:
        with self._lock:
            self._break_locked(generation)

    def _break_locked(self, generation: int) -> None:
        if generation == self._generation:
            if self._channel is not None:
                self._channel.break_()
            self._channel = None
            self._generation += 1
            self._next_seq = 0
