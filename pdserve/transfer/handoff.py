"""The prefill -> decode hand-off: KV pushed by the prefill worker as it is computed, in an order it announces.

Request path (pdserve.engine.request has the states):
1. The router places a request on a prefill worker P and a decode worker D at once. D reserves blocks
   for the prompt's KV (WAITING_FOR_KV) while P computes, and tells P that the destination is ready
   (one `kv_ready` call per D step, for all the requests it reserved for P).
2. P pushes. A request whose prompt completes in a step and whose destination is ready is sent layer
   by layer during that step's forward (layer i travels while layer i+1 computes); one whose
   destination became ready later is sent at once from its HELD blocks. The requests of one step bound
   for the same D travel as one transfer. Nothing waits for another step or a per-request call.
3. Ordering: per (P, D) pair, P's `KVPusher` takes queued transfers by service tier, then queue order,
   numbers each (generation, seq) as its turn comes and announces it (`KVAnnounce`, a small Ray call to
   D) before sending it; D's `KVIntake` receives them strictly in that order, whatever order the
   announcements arrive in. NCCL matches operations by order alone, so the sender orders and the
   receiver follows.
4. Each transfer is: a header, the KV (one part per layer, or one part for all), and a trailer with
   the first token of each request, when it was sampled and, if switched on, a checksum of the KV
   (`kv_checksum`). D writes each part straight into the reserved blocks and, after the trailer
   (a checksum that differs fails the transfer), hands each request to its scheduler (`kv_arrived`).
5. Tensor parallelism (pdserve.parallel.layout): a pair of a TP A prefill worker and a TP B decode
   worker is several channels, one per (prefill rank, decode rank) of `handoff_plan`, each carrying
   the KV heads its decode rank holds, straight from a prefill rank that holds them (`PairLink`). Rank
   0 of each side orders and announces as above; the other ranks' shares of each transfer are started
   by a call from their rank 0 and run at the same time as its own. The channel of ranks (0, 0) carries
   the trailer's first tokens.
6. Failure: every wait is bounded. A transfer that fails breaks its pair channel; every transfer of
   that generation fails on both sides (P releases the KV, D frees the reservations and reports the
   requests failed, and the router retries them once elsewhere); the next transfer rebuilds the
   channel under the next generation. A request cancelled while its KV is being written into its
   blocks keeps those blocks until the write has finished (`InboundTable`), so a late write can never
   land in blocks that another request owns.
"""
from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.faults import FaultPoints
from pdserve.parallel.layout import HeadTransfer
from pdserve.transfer.channel import (
    RECEIVER_RANK,
    SENDER_RANK,
    PairChannel,
    TransferError,
    TransferStats,
    TransferTimeout,
)

log = logging.getLogger(__name__)


# --- control message and layout --------------------------------------------------------------------

@dataclass(frozen=True)
class KVAnnounce:
    """What transfer (generation, seq) of a pair carries: the requests' KV, in this order."""

    prefill_id: str
    generation: int
    seq: int
    request_ids: tuple[str, ...]
    num_blocks: tuple[int, ...]  # per request: blocks of KV sent
    num_parts: int  # KV parts, each a run of whole layers (layer_spans): 1 sends all layers at once
    checksum: bool = False  # the trailer ends with kv_checksum of the parts

    @property
    def order(self) -> tuple[int, int]:
        return self.generation, self.seq


# A part of a layer-wise push carries at least this much KV (whole layers): small parts cost more in
# per-message latency than sending them early saves.
MIN_PART_BYTES = 1 << 20


def layer_spans(num_layers: int, num_parts: int) -> list[tuple[int, int]]:
    """[start, end) layers of each part of a transfer: num_parts contiguous runs of near-equal length."""
    assert 1 <= num_parts <= num_layers, (num_parts, num_layers)
    bounds = [num_layers * i // num_parts for i in range(num_parts + 1)]
    return list(zip(bounds, bounds[1:]))


def num_parts_for(num_layers: int, layer_bytes: int, min_part_bytes: int = MIN_PART_BYTES) -> int:
    """How many parts a layer-wise push of layers of layer_bytes each is cut into."""
    per_part = max(1, -(-min_part_bytes // max(layer_bytes, 1)))  # layers
    return max(1, num_layers // per_part)


def kv_checksum(part: torch.Tensor) -> torch.Tensor:
    """A checksum of a KV part [layers, 2, kv_heads, blocks, block_size, head_dim], as a 0-dim int64
    tensor on the part's device (no host sync): the 64-bit words of each (layer, k/v, head, block) row
    are summed, and the row sums added with weights 1, 2, 3, ... A changed word or a row in the wrong
    place changes it. Arithmetic wraps on overflow, the same way on both ends. (Summing int64 words
    runs at memory speed; widening int32 words to int64 first is 25x slower on a CPU.)"""
    rows = part.reshape(-1, part[0, 0, 0, 0].numel())
    row_bytes = rows.shape[1] * rows.element_size()
    words = rows.view(torch.int64) if row_bytes % 8 == 0 else rows.view(torch.uint8).to(torch.int64)
    sums = words.sum(dim=1)
    return (sums * torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device)).sum()


def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def block_index(block_ids: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """The blocks of a push's requests, in order, as one index tensor."""
    return torch.tensor([b for ids in block_ids for b in ids], dtype=torch.int64, device=device)


# --- statistics ------------------------------------------------------------------------------------

HANDOFF_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class SecondsHistogram:
    """A thread-safe histogram of durations, shipped to the router as a snapshot (pdserve.serving.metrics)."""

    buckets: tuple[float, ...] = HANDOFF_SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket and +Inf, not cumulative
    total: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self.total += seconds

    def snapshot(self) -> dict:
        with self._lock:
            return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total}


# --- one rank's share of a transfer ----------------------------------------------------------------

def rank_name(worker_id: str, rank: int) -> str:
    """A pair channel's name for one rank of a worker (rank 0 is the worker itself)."""
    return worker_id if rank == 0 else f"{worker_id}#{rank}"


@dataclass
class PairLink:
    """One generation of a (prefill worker, decode worker) pair as one rank holds it: its channels, each
    with the heads it carries (None: every head; both workers are TP 1), and, on rank 0, how to start
    the other ranks' shares of a transfer (`others`, returning futures) and make them give this
    generation's channels up (`drop`)."""

    shares: list[tuple[HeadTransfer | None, PairChannel]]
    others: Callable[..., list[concurrent.futures.Future]] | None = None
    drop: Callable[[], None] | None = None

    @property
    def timeout_s(self) -> float:
        return self.shares[0][1].timeout_s

    def record_others(self, results: Sequence[Sequence[tuple[int, float]]]) -> None:
        """Count the other ranks' channels (their shares' (bytes, seconds)) in this worker's statistics."""
        stats = self.shares[0][1].stats
        for per_rank in results:
            for nbytes, seconds in per_rank:
                stats.record(nbytes, seconds)

    def break_(self) -> None:
        for _, channel in self.shares:
            channel.break_()
        if self.drop is not None:
            self.drop()

    def close(self) -> None:
        for _, channel in self.shares:
            channel.close()


def is_lead(transfer: HeadTransfer | None) -> bool:
    """The channel of ranks (0, 0), which carries the trailer's first tokens."""
    return transfer is None or (transfer.src_rank, transfer.dst_rank) == (0, 0)


def share_heads(transfer: HeadTransfer | None, sender: bool, cache: torch.Tensor) -> torch.Tensor | None:
    """Positions in this rank's cache of the heads a share carries (None: all of them, in order)."""
    if transfer is None:
        return None
    index = list(transfer.src_index if sender else transfer.dst_index)
    return None if index == list(range(cache.shape[2])) else torch.tensor(index, dtype=torch.int64, device=cache.device)


def share_numel(cache: torch.Tensor, heads: torch.Tensor | None, num_blocks: int, trailer: int) -> int:
    num_heads = cache.shape[2] if heads is None else heads.numel()
    return cache.shape[0] * 2 * num_heads * num_blocks * cache.shape[4] * cache.shape[5] + trailer


def trailer_len(num_requests: int, lead: bool, checksum: bool) -> int:
    """The lead channel's trailer: each request's first token, when they were sampled, [checksum];
    another channel's: [checksum]."""
    return (num_requests + 1 if lead else 0) + checksum


def run_concurrently(fns: Sequence[Callable[[], object]]) -> list[object]:
    """Run each fn in a thread of its own (one inline), wait for all; the first error raises. A rank's
    shares run side by side: one after the other could deadlock across ranks."""
    if len(fns) == 1:
        return [fns[0]()]
    with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result() for f in futures]


def send_share(channel: PairChannel, seq: int, cache: torch.Tensor, index: torch.Tensor, heads: torch.Tensor | None,
               spans: list[tuple[int, int]], wait_layers: Callable[[int], torch.cuda.Event | None],
               trailer: Callable[[], list[int]] | None, num_trailer: int, checksum: bool,
               faults: FaultPoints | None = None, stream: torch.cuda.Stream | None = None) -> None:
    """One rank's share of transfer seq on one channel: for each span of layers, once wait_layers says it
    is computed, the KV of blocks `index` (heads `heads`); then the trailer (trailer() gives its first
    values; the checksum of the parts ends it)."""
    faults = faults or FaultPoints()
    wait_layers(spans[0][1])  # the receiver's clock starts with the header: send it once the first part can follow

    def parts() -> Iterator[torch.Tensor]:
        total = None
        for i, (start, end) in enumerate(spans):
            event = wait_layers(end)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if event is not None:  # a GPU's: every caller there reads on a stream of its own
                    stream.wait_event(event)
                kv = cache[start:end] if heads is None else cache[start:end].index_select(2, heads)
                part = kv.index_select(3, index)
                if checksum:
                    total = kv_checksum(part) if total is None else total + kv_checksum(part)
                if faults.hit("corrupt"):
                    part.view(-1)[:1].view(torch.uint8)[0] ^= 1  # one bit, after the checksum was taken
                yield part
            if i == 0:
                faults.hit("mid_send")
        if num_trailer:
            values = torch.tensor(trailer() if trailer is not None else [], dtype=torch.int64, device=cache.device)
            yield values if total is None else torch.cat([values, total.view(1)])

    channel.send_parts(seq, parts(), share_numel(cache, heads, index.numel(), num_trailer))


def receive_share(channel: PairChannel, seq: int, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                  heads: torch.Tensor | None, total: int, spans: list[tuple[int, int]], num_trailer: int,
                  checksum: bool, label: str, stream: torch.cuda.Stream | None = None) -> list[int]:
    """One rank's share of transfer seq from one channel: rows `src` of the transfer's `total` blocks go
    into this cache's blocks `dst` (heads `heads`); returns the trailer's values, the checksum checked
    and taken off."""
    num_heads = cache.shape[2] if heads is None else heads.numel()
    trailer = torch.empty(num_trailer, dtype=torch.int64, device=cache.device)
    # One staging buffer, reused by every part: each is scattered into the blocks before the next arrives.
    staging = torch.empty((max(end - start for start, end in spans), 2, num_heads, total, *cache.shape[4:]),
                          dtype=cache.dtype, device=cache.device)
    buffers = [staging[: end - start] for start, end in spans]  # leading slices: contiguous
    parts = channel.recv_parts(seq, [*buffers, *([trailer] if num_trailer else [])],
                               share_numel(cache, heads, total, num_trailer))
    head_list = heads.tolist() if heads is not None else None
    sums = None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for (start, end), data in zip(spans, parts):
            if checksum:
                sums = kv_checksum(data) if sums is None else sums + kv_checksum(data)
            if not dst.numel():
                continue
            if head_list is None:
                cache[start:end].index_copy_(3, dst, data.index_select(3, src))
            else:
                for i, h in enumerate(head_list):
                    cache[start:end, :, h].index_copy_(2, dst, data[:, :, i].index_select(2, src))
        for _ in parts:  # the trailer, and the end of the transfer
            pass
        values = trailer.tolist()
    if stream is not None:  # the writes (and the staging buffer's reads) are done before the KV counts as here
        stream.synchronize()
    if sums is not None and int(sums) != values[-1]:
        channel.stats.record_checksum_failure()
        raise KVCorrupted(f"KV checksum mismatch on transfer {label}: sent {values[-1]}, received {int(sums)}")
    return values[:-1] if checksum else values


def open_shares(host: str, port: int, prefill_id: str, decode_id: str, sender: bool,
                transfers: Sequence[HeadTransfer | None], timeout_s: float, device: torch.device, generation: int,
                stats: TransferStats, before_send: Callable[[int], None] | None = None
                ) -> list[tuple[HeadTransfer | None, PairChannel]]:
    """One rank's channels of a generation of a pair, one per head transfer it sends or receives (None:
    the one channel of two TP 1 workers), built side by side: each is a rendezvous with its peer rank."""
    def one(t: HeadTransfer | None) -> tuple[HeadTransfer | None, PairChannel]:
        src, dst = (0, 0) if t is None else (t.src_rank, t.dst_rank)
        return t, PairChannel(host, port, rank_name(prefill_id, src), rank_name(decode_id, dst),
                              SENDER_RANK if sender else RECEIVER_RANK, timeout_s, device, generation=generation,
                              stats=stats, before_send=before_send if is_lead(t) else None)

    return run_concurrently([lambda t=t: one(t) for t in transfers])  # type: ignore[return-value]


def transfer_rows(num_blocks: Sequence[int], blocks: Sequence[Sequence[int] | None],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a transfer's blocks go where: (rows of the transfer, blocks of the cache), for the
    requests still expected (blocks None: withdrawn; their KV arrives and goes nowhere)."""
    for n, blk in zip(num_blocks, blocks):
        if blk is not None and len(blk) != n:
            raise TransferError(f"{n} blocks announced for a request that reserved {len(blk)}")
    offsets = [0, *itertools.accumulate(num_blocks)]
    keep = [(off, blk) for off, blk in zip(offsets, blocks) if blk is not None]
    src = torch.tensor([o + j for o, blk in keep for j in range(len(blk))], dtype=torch.int64, device=device)
    dst = torch.tensor([b for _, blk in keep for b in blk], dtype=torch.int64, device=device)
    return src, dst


# --- sender side (prefill worker) ------------------------------------------------------------------

class KVCorrupted(TransferError):
    """The KV received differs from the KV sent (its checksum): the transfer failed."""


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
                 sampled_at: float | None = None, tier: int = 1, step: int = 0):
        self.destination = destination
        self.tier = tier  # the service tier's rank of its requests (pdserve.tiers): the pusher's order
        self.step = step  # the engine step whose forward computes this KV (the other TP ranks wait for it)
        self.request_ids = tuple(request_ids)
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
                 checksum: bool = False, faults: FaultPoints | None = None):
        self.prefill_id, self.decode_id = prefill_id, decode_id
        self.min_part_bytes = min_part_bytes
        self.checksum = checksum
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
                               tuple(len(b) for b in job.block_ids), job.num_parts, self.checksum)
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
                       trailer_len(len(a.request_ids), lead, a.checksum), a.checksum,
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


def as_link(channel: PairChannel | PairLink) -> PairLink:
    return channel if isinstance(channel, PairLink) else PairLink([(None, channel)])


def run_shares(link: PairLink, others: Sequence[concurrent.futures.Future], shares: Sequence[Callable[[], object]],
               timeout_s: float, what: str) -> list[object]:
    """Rank 0's shares of a transfer, side by side, with the other ranks' (already started: `others`);
    the results of rank 0's. The other ranks' are waited for, bounded, whatever happens: if rank 0's
    fail, the others are ended first (the generation broken, unless all of rank 0's share arrived and
    only its checksum differed), so no block is freed while another rank still reads or writes it, and
    no rank starts the next transfer on a channel still busy with this one. Their traffic is counted
    in this worker's statistics."""
    bound = 2 * timeout_s + 5.0  # another rank's share waits for its layers, then sends or receives
    try:
        results = run_concurrently(shares)
    except BaseException as e:
        if others:
            if not isinstance(e, KVCorrupted):
                link.break_()
            if concurrent.futures.wait(others, bound).not_done:
                log.warning("%s did not end within %g s", what, bound)
        raise
    link.record_others(wait_all(others, bound, what))
    return results


def wait_all(futures: Sequence[concurrent.futures.Future], timeout_s: float, what: str) -> list[object]:
    """The results of futures (another rank's share), bounded: one that has not ended in time is a timeout."""
    done, pending = concurrent.futures.wait(futures, timeout_s)
    if pending:
        raise TransferTimeout(f"{what} did not end within {timeout_s:g} s")
    return [f.result() for f in futures]


# --- receiver side (decode worker) -----------------------------------------------------------------

class InboundTable:
    """Reserved blocks awaiting KV, shared by a decode worker's step thread and its intake threads.

    A request is RESERVED when published, RECEIVING once an intake has claimed its blocks. Cancelling a
    RECEIVING request does not free its blocks at once: the write into them has to finish first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[str, list[int]] = {}
        self._receiving: set[str] = set()
        self._cancelled: set[str] = set()

    def publish(self, request_id: str, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._blocks[request_id] = list(block_ids)

    def claim(self, request_id: str) -> list[int] | None:
        """The blocks to write a request's KV into, or None if it is no longer expected (cancelled)."""
        with self._lock:
            blocks = self._blocks.get(request_id)
            if blocks is not None:
                self._receiving.add(request_id)
            return blocks

    def settle(self, request_id: str) -> bool:
        """The write into a claimed request's blocks is over; whether it was cancelled meanwhile."""
        with self._lock:
            self._blocks.pop(request_id, None)
            self._receiving.discard(request_id)
            if request_id in self._cancelled:
                self._cancelled.discard(request_id)
                return True
            return False

    def withdraw(self, request_id: str) -> bool:
        """Stop expecting a request's KV. True: its blocks may be freed now; False: a write is under way,
        and its intake will report it (settle() then says it was cancelled)."""
        with self._lock:
            if request_id in self._receiving:
                self._cancelled.add(request_id)
                return False
            self._blocks.pop(request_id, None)
            return True

    def receiving(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._receiving

    def expire(self, request_id: str) -> bool:
        """Its KV will not come (the sender says so). True: it may be failed and freed now; False: an
        intake is writing it, and reports the outcome itself."""
        with self._lock:
            if request_id in self._receiving:
                return False
            self._blocks.pop(request_id, None)
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)


class KVIntake:
    """The receiving end of one (prefill, decode) pair: takes transfers in the order the sender announced.

    For every request of every announced transfer that was still expected when its turn came, exactly
    one of these is called, from this intake's thread: landed(request_id, token, sampled_at) (its KV is
    in its blocks), failed(request_id, error), or cancelled(request_id) (withdrawn while its KV was
    being written: its blocks may be freed now).
    """

    def __init__(self, prefill_id: str, decode_id: str, kv_cache: torch.Tensor, table: InboundTable,
                 timeout_s: float, landed: Callable[[str, int, float], None], failed: Callable[[str, str], None],
                 cancelled: Callable[[str], None]):
        self.prefill_id, self.decode_id = prefill_id, decode_id
        self.kv_cache, self.table, self.timeout_s = kv_cache, table, timeout_s
        self._landed, self._failed, self._cancelled = landed, failed, cancelled
        self._cond = threading.Condition()
        self._announced: dict[tuple[int, int], KVAnnounce] = {}
        self._channel: PairLink | None = None
        self._generation = 0  # of the channel installed last
        self._next_seq = 0  # within that generation
        self._dead_generation = 0  # transfers of this generation and older are void
        self._stopped = False
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._thread = threading.Thread(target=self._run, name=f"kv-intake-{prefill_id}->{decode_id}", daemon=True)
        self._thread.start()

    def announce(self, a: KVAnnounce) -> None:
        with self._cond:
            self._announced[a.order] = a
            self._cond.notify_all()

    def install(self, channel: PairChannel | PairLink, generation: int) -> None:
        """A new channel with the sender (after a rendezvous it started); older transfers are void."""
        channel = as_link(channel)
        with self._cond:
            if generation < self._generation or generation <= self._dead_generation:
                channel.close()  # a rendezvous that finished too late: the sender has moved on
                return
            if self._channel is not None:
                self._channel.close()
            self._channel, self._generation, self._next_seq = channel, generation, 0
            self._dead_generation = max(self._dead_generation, generation - 1)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            if self._channel is not None:
                self._channel.close()
            self._cond.notify_all()

    def _next(self) -> tuple[KVAnnounce, PairLink | None, str | None] | None:
        """The next transfer to take, with its channel; or one that is void, with why (None: drop it
        silently, its sender announces it again or reports it failed)."""
        with self._cond:
            deadline = None
            while not self._stopped:
                stale = [o for o in self._announced if o[0] <= self._dead_generation]
                if stale:
                    return self._announced.pop(min(stale)), None, None
                nxt = self._announced.pop((self._generation, self._next_seq), None)
                if nxt is not None and self._channel is not None:
                    self._next_seq += 1
                    return nxt, self._channel, None
                if nxt is not None:
                    self._announced[nxt.order] = nxt
                # Something announced cannot be taken yet (its channel or an earlier transfer is
                # missing): wait, bounded, then fail it.
                if self._announced:
                    deadline = deadline or time.monotonic() + self.timeout_s
                    if time.monotonic() >= deadline:
                        # The whole generation is given up on both sides (breaking the channel fails the
                        # sender's pending send), so the sender's order and this one cannot drift apart.
                        first = min(self._announced)
                        self._dead_generation = max(self._dead_generation, first[0])
                        if self._channel is not None and self._generation <= first[0]:
                            self._channel.break_()
                        return self._announced.pop(first), None, (
                            f"transfer {first[1]} of generation {first[0]} could not start within "
                            f"{self.timeout_s:g} s (no channel, or an earlier transfer never announced)")
                    self._cond.wait(max(deadline - time.monotonic(), 0.01))
                else:
                    deadline = None
                    self._cond.wait()
            return None

    def _run(self) -> None:
        while (item := self._next()) is not None:
            a, channel, error = item
            if channel is None and error is None:
                continue
            blocks = [self.table.claim(rid) for rid in a.request_ids]
            tokens: list[int] = []
            sampled_at = 0.0
            if channel is not None:
                try:
                    tokens, sampled_at = self._receive(a, channel, blocks)
                except Exception as e:  # noqa: BLE001 - every request of the transfer fails
                    log.warning("KV transfer %s/%s from %s failed: %s", a.generation, a.seq, self.prefill_id, e)
                    error = str(e) or type(e).__name__
                    if not isinstance(e, KVCorrupted):  # (all of a corrupted transfer arrived: the order holds)
                        channel.break_()  # the sender must not wait out its timeout on a receive never posted
                        with self._cond:
                            self._dead_generation = max(self._dead_generation, a.generation)
            for i, rid in enumerate(a.request_ids):
                if blocks[i] is None:
                    continue  # withdrawn before its turn: its owner already freed it
                if self.table.settle(rid):
                    self._cancelled(rid)
                elif error is not None:
                    self._failed(rid, error)
                else:
                    self._landed(rid, tokens[i], sampled_at)

    def _receive(self, a: KVAnnounce, link: PairLink,
                 blocks: list[list[int] | None]) -> tuple[list[int], float]:
        cache = self.kv_cache
        src, dst = transfer_rows(a.num_blocks, blocks, cache.device)
        spans = layer_spans(cache.shape[0], a.num_parts)
        others = link.others(a, blocks) if link.others is not None else []  # the other TP ranks' shares
        label = f"{a.generation}/{a.seq} from {a.prefill_id}"

        def share(transfer: HeadTransfer | None, channel: PairChannel) -> list[int]:
            lead = is_lead(transfer)
            return receive_share(channel, a.seq, cache, src, dst, share_heads(transfer, False, cache), sum(a.num_blocks),
                                 spans, trailer_len(len(a.request_ids), lead, a.checksum), a.checksum, label,
                                 self._stream)

        results = run_shares(link, others, [lambda t=t, c=c: share(t, c) for t, c in link.shares], self.timeout_s,
                             f"the other ranks' shares of transfer {label}")
        values = next(v for (t, _), v in zip(link.shares, results) if is_lead(t))
        return values[:len(a.request_ids)], values[len(a.request_ids)] / 1e6
