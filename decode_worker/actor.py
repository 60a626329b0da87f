"""The decode worker as a Ray actor: reserves room for KV pushed by prefill workers, streams one output per step.

It runs the shared EngineCore in the DECODE role (pdserve.engine.scheduler). The router reserves when
it places a request, while the prefill worker computes the prompt: the scheduler reserves blocks as
soon as there is room (backpressure: the request waits, it is never dropped), and this worker tells
the prefill worker that the destination is ready, one call per step for all the requests reserved for
it. Prefill workers announce their transfers (`kv_incoming`) and push the KV; one intake thread per
prefill worker writes it into the reserved blocks (pdserve.transfer.receiver), and the request joins the running
batch at the next step; KV of another weight version than this worker serves follows the request's
version policy as it lands (kept, recomputed here, or aborted). Each step decodes one token for every
running request; one StepOutput per step goes to the router on this worker's link (pdserve.serving.link),
which also carries the router's calls.

Threads: the step thread owns the engine (pdserve.engine.step_loop); Ray's event loop answers calls; the
link's reader thread takes the router's calls; intake threads receive KV. The blocks an intake writes
into are published in an InboundTable, so a request cancelled during its transfer keeps them until the
write is over.
"""
from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import ray

from pdserve.config import EngineConfig
from pdserve.engine.grammar import GrammarError
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_types import Role, ScheduledStep
from pdserve.parallel.layout import pair_plan, shares_by_rank
from pdserve.serving.calls import Call
from pdserve.serving.messages import DecodeTask, Failure, FailureReason
from pdserve.serving.worker import WorkerActor, new_request
from pdserve.transfer.channel import StoreServer, TransferStats
from pdserve.transfer.protocol import KVAnnounce, KVMac, SecondsHistogram
from pdserve.transfer.receiver import InboundTable, KVIntake
from pdserve.transfer.shares import PairLink, open_shares

log = logging.getLogger(__name__)


class PrefixMissed(RuntimeError):
    """A partial hand-off's prefix is not here (any more): the router tries the request again as a full one."""


class DecodeActor(WorkerActor):
    """Wrapped with ray.remote by the router's pool (which sets its resources)."""

    pool = "decode"
    role = Role.DECODE

    def __init__(self, worker_id: str, config: EngineConfig, transfer_timeout_s: float,
                 torch_threads: int | None = None, bind_host: str | None = None, placement=None):
        super().__init__(worker_id, config, torch_threads, placement=placement)
        self.transfer_timeout_s = transfer_timeout_s
        self.transfer_stats = TransferStats()
        self.handoff_seconds = SecondsHistogram()  # first token sampled -> KV usable here
        self.reservation_wait_seconds = SecondsHistogram()  # placed -> blocks reserved
        # Prefill workers on other nodes connect here: the node's address, unless told otherwise.
        self.store = StoreServer(bind_host or ray.util.get_node_ip_address())
        self.inbound = InboundTable()
        # The cluster's keyed KV checksum, for transfers that carry one (a prefill worker of --kv-checksum).
        self.kv_mac = KVMac(config.kv_checksum_key) if config.kv_checksum_key else None
        self._intakes: dict[str, KVIntake] = {}
        self._lost_peers: set[str] = set()  # prefill workers the router has given up on (ids are never reused)
        self._prefill: dict[str, Any] = {}  # prefill worker id -> handle
        self._source: dict[str, tuple[str, float]] = {}  # step thread: request -> (prefill worker, placed at)
        self._self_handle: Any = None
        # Sessions: the requests whose prompt this worker computes itself (DecodeTask.local), while they live here;
        # local prefills taken, the KV blocks hand-offs brought, and those local prefills kept from moving.
        self._local: weakref.WeakSet[Request] = weakref.WeakSet()
        self.local_prefills = self.handoff_blocks = self.handoff_avoided_blocks = 0
        self._start()

    def handlers(self) -> dict[str, Callable]:
        return {**super().handlers(), Call.RESERVE.value: self._reserve}

    def _reserve(self, task: DecodeTask, prefill: Any = None) -> None:
        """Call.RESERVE: take a request whose KV the prefill worker task.prefill_worker computes (or, task.local,
        whose prompt this worker computes itself); returns once it is queued. `prefill` is that worker's actor
        handle, given with the first reservation for it only."""
        if prefill is not None:
            self._prefill[task.prefill_worker] = prefill
        req = new_request(self.core, task)
        if self.core.kv.blocks_needed(req.num_tokens + 1) > self.core.pool.num_blocks:
            raise ValueError(f"request {task.request_id} needs more KV blocks than this decode worker has")
        placed = time.monotonic()

        def add() -> None:
            if self._cancelled_already(task.request_id):
                return  # its attempt is over: nothing to reserve
            if task.held_blocks:
                self._pin_prefix(req, task)
            try:
                self.core.scheduler.add(req)
            except BaseException:
                self.core.kv.free(req)  # the prefix pinned above
                raise
            if not task.local:
                self._source[task.request_id] = (task.prefill_worker, placed)
            else:
                self._local.add(req)
                self.local_prefills += 1
                self.handoff_avoided_blocks += self.core.kv.blocks_needed(req.num_tokens)

        def failed(f) -> None:  # e.g. a duplicate id: the router hears of it like any failed request
            if f.exception() is not None:
                e = f.exception()
                reason = FailureReason.PREFIX_MISSED if isinstance(e, PrefixMissed) \
                    else FailureReason.BAD_REQUEST if isinstance(e, GrammarError) else FailureReason.REJECTED
                self._publish((), (Failure(task.request_id, reason, f"decode worker: {f.exception()}"),))

        # Not awaited: the step thread takes it between two steps, and the caller need not wait for that.
        self.loop.call(add).add_done_callback(failed)

    def _pin_prefix(self, req, task: DecodeTask) -> None:
        """Step thread: a partial hand-off's prefix from this worker's own prefix cache (pinned: nothing evicts it
        while the rest of the KV comes), or PrefixMissed if the cache no longer holds all of it at the weight
        version the router matched it at, or this worker serves another version since."""
        core = self.core
        if self.faults.hit("evict_prefix", task.request_id):  # a test's: the prefix is evicted right now
            core.pool.free(core.pool.allocate(core.pool.num_free_blocks))
        if task.held_version != core.weight_version:
            raise PrefixMissed(f"the router matched {task.held_blocks} blocks at weight version {task.held_version}; "
                               f"this worker serves version {core.weight_version}")
        if not core.kv.pin_prefix(req, task.held_blocks, task.held_version):
            raise PrefixMissed(f"its prefix cache no longer holds the {task.held_blocks} leading blocks the router "
                               "counted on")

    async def kv_incoming(self, announce: KVAnnounce) -> None:
        """A prefill worker's notice of its next transfer to this worker (the order to receive in)."""
        if announce.prefill_id not in self._lost_peers:
            self._intake(announce.prefill_id).announce(announce)

    async def open_channel(self, prefill_id: str, generation: int, prefill_tp: int = 1) -> None:
        """This side of a new generation of the pair with a prefill worker of TP size prefill_tp: this
        rank's channels and those of this worker's other ranks; the prefill worker builds its side
        concurrently."""
        if prefill_id in self._lost_peers:
            raise ConnectionError(f"prefill worker {prefill_id} was lost; no channel to it")
        by_rank = shares_by_rank(pair_plan(self.core.model_config, prefill_tp, self.tp), sender=False)
        mine, theirs = by_rank.pop(0), sorted(by_rank)
        calls = [self.ranks.handles[r - 1].open_shares.remote(False, prefill_id, self.worker_id, self.store.host,
                                                              self.store.port, generation, by_rank[r],
                                                              self.transfer_timeout_s) for r in theirs]
        try:
            shares, *_ = await asyncio.gather(
                asyncio.to_thread(open_shares, self.store.host, self.store.port, prefill_id, self.worker_id, False,
                                  mine, self.transfer_timeout_s, self.core.runner.kv_cache.device, generation,
                                  self.transfer_stats), *calls)
        except BaseException:
            if theirs:
                self.ranks.drop(theirs, prefill_id, generation)
            raise
        link = self.ranks.link(shares, prefill_id, generation, theirs, "recv_share") if theirs else PairLink(shares)
        self.transfer_stats.record_channel()  # every rank's channels of this generation
        if prefill_id in self._lost_peers:  # lost while the rendezvous ran
            link.break_()
            raise ConnectionError(f"prefill worker {prefill_id} was lost; no channel to it")
        self._intake(prefill_id).install(link, generation)

    async def kv_failed(self, prefill_id: str, request_ids: tuple[str, ...], error: str) -> None:
        """A prefill worker could not push these requests' KV: drop their reservations, report them failed."""
        self.loop.call(lambda: self._kv_never_comes(request_ids, error))

    async def peer_lost(self, worker_id: str) -> None:
        """A prefill worker is gone: end its intake (the router places its requests again and cancels
        them here; one whose KV was being written keeps its blocks until the write has failed)."""
        self._lost_peers.add(worker_id)
        self._prefill.pop(worker_id, None)
        intake = self._intakes.pop(worker_id, None)
        if intake is not None:
            intake.stop()
        if self.ranks is not None:
            self.ranks.call("peer_lost", worker_id)

    def _close(self) -> None:
        for intake in self._intakes.values():
            intake.stop()
        self.store.close()

    # -- hand-off ---------------------------------------------------------------------------------
    def _intake(self, prefill_id: str) -> KVIntake:
        intake = self._intakes.get(prefill_id)
        if intake is None:
            intake = self._intakes[prefill_id] = KVIntake(
                prefill_id, self.worker_id, self.core.runner.kv_cache, self.inbound, self.transfer_timeout_s,
                landed=lambda rid, tokens, at, v: self.loop.call(lambda: self._landed(rid, tokens, at, v)),
                failed=lambda rid, err: self.loop.call(lambda: self._transfer_failed(rid, err)),
                cancelled=lambda rid: self.loop.call(lambda: self.core.cancel(rid)), checksum=self.kv_mac)
        return intake

    def _landed(self, request_id: str, tokens: tuple[int, ...], sampled_at: float, version: int = 0) -> None:
        """Step thread: a request's KV and first tokens, computed by weight version `version`, are here. If
        this worker serves another version, the request (and each sample forked from it) follows its version
        policy: kept, recomputed here, or aborted (its ABORT end published, after the first token)."""
        core = self.core
        held = core.scheduler.waiting_for_kv.get(request_id)
        if held is not None and self._would_mix(held, version):  # two versions' KV: never decoded on
            self._transfer_failed(request_id, f"its prefix here is of weight version {held.kv_version}, the rest "
                                  f"came of version {version}", FailureReason.PREFIX_MISSED)
            return
        try:
            firsts = core.scheduler.kv_arrived(request_id, tokens, version)
        except GrammarError as e:  # the first token does not follow its grammar here: failed, never free text
            self._source.pop(request_id, None)
            core.cancel(request_id)
            self._publish((), (Failure(request_id, FailureReason.BAD_REQUEST, f"decode worker: {e}"),))
            return
        if firsts:
            going_on = []  # samples the first token did not end (its stop string included)
            for first in firsts:  # (a group's: one per sample, forked here)
                _, reason = self._text(first)  # its text was the prefill worker's to send: taken in here, not sent
                if reason is None and not first.request.finished:
                    going_on.append(first.request)
            self.handoff_seconds.observe(max(time.time() - sampled_at, 0.0))
            self.handoff_blocks += core.kv.blocks_needed(firsts[0].request.num_tokens - 1)  # those reserved
            self._source.pop(request_id, None)
            ended = [end for req in going_on if req.kv_version != core.weight_version
                     and (end := core.version_policy(req)) is not None]
            if ended:
                self._publish(ended)

    def _would_mix(self, req, version: int) -> bool:
        """A partial hand-off's rest came of weight version `version`, its pinned prefix of another: decoding
        would read KV of two versions unless the version policy discards it (abort, or recompute: the prompt
        computed again here) rather than keep it."""
        if not req.held_blocks or req.kv_version == version:
            return False
        if version == self.core.weight_version:
            return True  # this worker switched since it pinned the prefix: nothing else would look at the KV
        return self.core.keeps(req.params, version)

    def _kv_never_comes(self, request_ids, error: str, reason: FailureReason = FailureReason.TRANSFER_FAILED) -> None:
        """Step thread: these reservations' KV will not come; each one no intake is writing into is failed
        and freed now (one being written is failed by its intake when the write ends)."""
        for rid in request_ids:
            if self.inbound.expire(rid):
                self._transfer_failed(rid, error, reason)

    def _transfer_failed(self, request_id: str, error: str,
                         reason: FailureReason = FailureReason.TRANSFER_FAILED) -> None:
        req = self.core.scheduler.requests.get(request_id)
        if req is not None and req.status is RequestStatus.WAITING_FOR_KV and self.core.cancel(request_id):
            self._source.pop(request_id, None)
            self._publish((), (Failure(request_id, reason, f"KV transfer failed: {error}"),))

    def _cancel(self, request_id: str) -> bool:
        req = self.core.scheduler.requests.get(request_id)
        if req is None:
            return self.core.cancel(request_id)  # a group's samples forked here may outlive its first
        self._source.pop(request_id, None)
        if req.status is RequestStatus.WAITING_FOR_KV and not self.inbound.withdraw(request_id):
            return True  # its KV is being written: its intake frees it when the write is over
        return self.core.cancel(request_id)

    # -- step thread ------------------------------------------------------------------------------
    def _step(self) -> bool:
        if self.core.scheduler.must_resolve:  # pipelined: a structured output's next mask needs its last token here
            self._publish(*self._run(ScheduledStep([], [], [])))
        step = self.core.scheduler.schedule()
        self._unpinned()
        if step.reserved:
            self._announce_reserved(step.reserved)
        launched = bool(self.core.scheduler.launched)  # pipelined: a step to resolve
        if step.chunks or launched:
            run = self._run(step)
            for f in run.failed:  # the step raised: the whole queue and batch were failed
                self._source.pop(f.request_id, None)
            self._publish(*run)
        return bool(step.chunks or step.reserved or launched)

    def _announce_reserved(self, reserved) -> None:
        """Publish the reserved blocks, then tell each prefill worker, in one call, which destinations are ready."""
        now = time.monotonic()
        by_prefill: dict[str, list[str]] = {}
        self.core.kv.fence()  # the blocks' evicted contents are copied to a KV tier before the transfer overwrites them
        for req in reserved:
            rid = req.request_id
            prefill_id, placed = self._source[rid]
            self.reservation_wait_seconds.observe(now - placed)
            self.inbound.publish(rid, self.core.scheduler.kv_blocks(req)[req.held_blocks:])  # what comes
            by_prefill.setdefault(prefill_id, []).append(rid)
        if self._self_handle is None:
            self._self_handle = ray.get_runtime_context().current_actor
        for prefill_id, rids in by_prefill.items():
            prefill = self._prefill.get(prefill_id)
            if prefill is None:  # lost (peer_lost) while these waited for room
                self._kv_never_comes(rids, f"prefill worker {prefill_id} was lost", FailureReason.PREFILL_LOST)
                continue
            prefill.kv_ready.remote(self.worker_id, self._self_handle, self.store.host, self.store.port, tuple(rids),
                                    self.tp)

    def _unpinned(self) -> None:
        """Partial hand-offs the scheduler ended to give their pinned prefix to a request ahead of them that needed
        the room: each fails as PREFIX_MISSED, and the router tries it again at once as a full hand-off."""
        missed = [Failure(req.request_id, FailureReason.PREFIX_MISSED, "decode worker: its pinned prefix of "
                          f"{req.held_blocks} blocks was given to a request ahead of it that needed the room")
                  for req in self.core.scheduler.unpinned]
        self.core.scheduler.unpinned.clear()
        for f in missed:
            self._source.pop(f.request_id, None)
        if missed:
            self._publish((), missed)

    def _load(self) -> tuple[int, int, int]:
        s = self.core.scheduler
        return len(s.waiting) + len(s.waiting_for_kv), sum(r.num_tokens for r in s.waiting), len(s.running)

    def _hop(self, req: Request) -> str:
        return "local_prefill" if req in self._local else "recompute"

    def _extra_stats(self) -> dict:
        return dict(transfer=self.transfer_stats.snapshot(), kv_peers=len(self._intakes),
                    handoff=self.handoff_seconds.snapshot(),
                    reservation_wait=self.reservation_wait_seconds.snapshot(), local_prefills=self.local_prefills,
                    handoff_blocks=self.handoff_blocks, handoff_avoided_blocks=self.handoff_avoided_blocks)


class FastLaneActor(DecodeActor):
    """A decode worker of the fast lane (pdserve.tiers): the same worker, serving priority requests only,
    with a small running-batch cap (its pool's max_num_seqs) so that each of its steps is short."""

    pool = "fast"
