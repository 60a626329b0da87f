"""The prefill worker as a Ray actor: prompts in, first tokens out, each prompt's KV pushed to its decode worker.

It runs the shared EngineCore in the PREFILL role (pdserve.engine.scheduler): prompts are batched up to a
token budget and chunked; a prompt whose last chunk has run is HELD until its KV has been sent. The
KV is pushed (pdserve.transfer.sender): during the forward that completes a prompt, layer by layer, if its
decode worker has already reserved room; otherwise from the held blocks as soon as the reservation is
announced (`kv_ready`), from the thread that hears of it, without waiting for a step.

Threads: the step thread owns the engine (pdserve.engine.step_loop); Ray's event loop answers calls; one
pusher thread per decode worker sends. The hand-off's shared state (which destinations are ready,
held KV not yet sent, pushes in flight) is guarded by one lock; blocks are freed on the step thread.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, InvalidStateError, wait
from dataclasses import dataclass
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import EngineCore
from pdserve.engine.output import TextOutput, token_text
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_types import Role, SampledToken, ScheduledStep
from pdserve.parallel.layout import pair_plan, shares_by_rank
from pdserve.serving.calls import Call
from pdserve.serving.messages import FailureReason, FirstToken, PrefillResult, PrefillTask
from pdserve.serving.worker import WorkerActor, new_request
from pdserve.transfer.channel import TransferError, TransferStats
from pdserve.transfer.protocol import KVAnnounce, KVMac
from pdserve.transfer.sender import KVPusher, PushJob
from pdserve.transfer.shares import PairLink, open_shares

log = logging.getLogger(__name__)

READY_TTL_S = 600.0  # a destination-ready notice nobody claims (its request ended) is dropped after this


@dataclass
class _Destination:
    handle: Any  # the decode worker's actor handle
    host: str  # its rendezvous store
    port: int
    tp: int  # its tensor-parallel size: which channels the pair has (pdserve.parallel.layout.pair_plan)
    pusher: KVPusher


@dataclass(frozen=True)
class _HeldKV:
    """A computed prompt whose decode worker has not reserved room yet."""

    block_ids: list[int]
    tokens: tuple[int, ...]  # its first token (a group's n first tokens)
    sampled_at: float
    tier: int  # its service tier's rank: pushes go by it
    step: int  # the engine step that computed it (a TP worker's other ranks wait for it)
    version: int  # the weight version that computed it (an update may come before it is pushed)


class PrefillActor(WorkerActor):
    """Wrapped with ray.remote by the router's pool (which sets its resources)."""

    pool = "prefill"
    role = Role.PREFILL

    def __init__(self, worker_id: str, config: EngineConfig, transfer_timeout_s: float, torch_threads: int | None = None,
                 push_layerwise: bool = True, kv_checksum: bool = False, placement=None):
        """push_layerwise=False sends a prompt's KV once its whole forward has run (to measure what the
        layer-by-layer push hides: bench.cluster.kv_transfer); kv_checksum=True adds a checksum keyed with the
        cluster's key (config.kv_checksum_key) to every transfer."""
        super().__init__(worker_id, config, torch_threads, placement=placement)
        self.transfer_timeout_s = transfer_timeout_s
        if kv_checksum and config.kv_checksum_key is None:
            raise ValueError("kv_checksum needs the cluster's key (EngineConfig.kv_checksum_key)")
        self.kv_mac = KVMac(config.kv_checksum_key) if kv_checksum else None
        self.transfer_stats = TransferStats()
        self.push_layerwise = push_layerwise
        self._results: dict[str, Future[PrefillResult]] = {}
        # Step thread: requests whose KV goes to a decode worker, each with its leading blocks not to push (those
        # the decode worker holds already: PrefillTask.skip_blocks).
        self._hand_off: dict[str, int] = {}
        # The hand-off's shared state, under _lock.
        self._lock = threading.Lock()
        self._destinations: dict[str, _Destination] = {}
        self._lost_peers: set[str] = set()  # decode workers the router has given up on (ids are never reused)
        # Requests whose decode worker has reserved room: when it said so, and which worker it is. A notice
        # can come for a request that already ended here (or before it arrived): unclaimed ones expire
        # after READY_TTL_S.
        self._ready: dict[str, tuple[float, str]] = {}
        self._held: dict[str, _HeldKV] = {}  # computed, waiting for their reservation
        self._pushing: set[str] = set()  # in a push job not yet done
        # Call.ADMITTED's answers still to give: requests waiting here for blocks (step thread; a request that
        # ends drops its own from any thread, as its result completes).
        self._admit_waiters: dict[str, Future[bool]] = {}
        self._start()

    def _submit(self, task: PrefillTask) -> Future[PrefillResult]:
        """Call.PREFILL: queue the prompt (any thread); the future resolves as soon as its first token is
        sampled (the KV goes on to the decode worker that reserves room for it, `kv_ready`)."""
        req = new_request(self.core, task)
        if self.core.kv.blocks_needed(req.num_tokens) > self.core.pool.num_blocks:
            raise ValueError(f"prompt of {req.num_tokens} tokens does not fit this worker's KV cache "
                             f"({self.core.pool.num_blocks} blocks of {self.core.pool.block_size})")
        rid = task.request_id
        fut: Future[PrefillResult] = Future()
        self._results[rid] = fut
        fut.add_done_callback(lambda _: self._results.pop(rid, None) if self._results.get(rid) is fut else None)

        def add() -> None:
            if self._cancelled_already(rid):
                raise asyncio.CancelledError(f"request {rid} was cancelled before it arrived")
            self.core.scheduler.add(req)
            if task.hand_off:
                self._hand_off[rid] = task.skip_blocks

        self.loop.call(add).add_done_callback(lambda f: f.exception() and self._fail(rid, f.exception()))
        return fut

    def _admitted(self, request_id: str) -> Future[bool]:
        """Call.ADMITTED: True once the prompt holds blocks for all of its KV here (a prefill worker allocates a
        whole prompt at admission, so its computation then waits for nothing), at once if it does already; False
        if it ends first (failed, cancelled, or never taken in: its prefill call says why). The router reserves
        the decode worker's room only then, so that no decode worker holds room for KV that waits for room here
        (docs/serving.md, "Why the hand-off cannot deadlock")."""
        waiter: Future[bool] = Future()

        def look() -> None:  # step thread, after the prompt's own add (the link's calls are taken in order), maybe
            req = self.core.scheduler.requests.get(request_id)  # after its first steps too
            result = self._results.get(request_id)
            if req is not None and req.status is not RequestStatus.WAITING:
                _settle(waiter, True)  # running or computed (HELD: its result may be answered already)
            elif req is None or result is None:
                _settle(waiter, False)  # ended, or never taken in
            else:
                self._admit_waiters[request_id] = waiter
                result.add_done_callback(lambda _: _settle(self._admit_waiters.pop(request_id, waiter), False))

        self.loop.call(look).add_done_callback(lambda f: f.exception() and _settle(waiter, False))
        return waiter

    async def kv_ready(self, decode_id: str, handle: Any, host: str, port: int, request_ids: tuple[str, ...],
                       tp: int = 1) -> None:
        """A decode worker (of TP size tp) has reserved room for these requests' KV: push what is already
        held, at once."""
        with self._lock:
            if decode_id in self._lost_peers:
                return  # a notice still on its way when the worker was lost; the router retries its requests
            self._destination(decode_id, handle, host, port, tp)  # the pusher the jobs below go to
            held = [(rid, self._held.pop(rid)) for rid in request_ids if rid in self._held]
            pushed_now = {rid for rid, _ in held}
            now = time.monotonic()
            for rid in request_ids:
                if rid not in pushed_now:
                    self._ready[rid] = (now, decode_id)
            for rid in [r for r, (t, _) in self._ready.items() if now - t > READY_TTL_S]:
                del self._ready[rid]
            self._pushing.update(pushed_now)
        for job in self._held_jobs(decode_id, held):
            self._push(job)

    async def prompts_submitted(self) -> int:
        """Prompts submitted whose first token is not answered yet: a test holding the step thread at a fault
        point waits on it (stats would wait for the step thread) until every prompt it sent is here."""
        return len(self._results)

    async def cancel(self, request_id: str) -> bool:
        self._fail(request_id, asyncio.CancelledError(f"request {request_id} cancelled"))
        return await super().cancel(request_id)

    def handlers(self) -> dict[str, Callable]:
        return {**super().handlers(), Call.PREFILL.value: self._submit, Call.ADMITTED.value: self._admitted}

    def _cancel_soon(self, request_id: str) -> None:
        self._fail(request_id, asyncio.CancelledError(f"request {request_id} cancelled"))
        super()._cancel_soon(request_id)

    async def peer_lost(self, worker_id: str) -> None:
        """A decode worker is gone: stop its pusher (what it still had queued fails, and is freed here)."""
        with self._lock:
            self._lost_peers.add(worker_id)
            d = self._destinations.pop(worker_id, None)
        if d is not None:
            d.pusher.stop()
        if self.ranks is not None:
            self.ranks.call("peer_lost", worker_id)

    def _close(self) -> None:
        with self._lock:
            for d in self._destinations.values():
                d.pusher.stop()

    # -- hand-off ---------------------------------------------------------------------------------
    def _destination(self, decode_id: str, handle: Any, host: str, port: int, tp: int) -> _Destination:
        """The pusher to a decode worker (under _lock); a worker at a new address gets a new one."""
        d = self._destinations.get(decode_id)
        if d is None or (d.host, d.port) != (host, port):
            if d is not None:
                d.pusher.stop()
            pusher = KVPusher(self.worker_id, decode_id, self.core.runner.kv_cache,
                              open_pair=lambda gen, did=decode_id: self._open_pair(did, gen),
                              announce=lambda a, h=handle: self._announce(h, a),
                              done=self._pushed, checksum=self.kv_mac, faults=self.faults)
            d = self._destinations[decode_id] = _Destination(handle, host, port, tp, pusher)
        return d

    def _open_pair(self, decode_id: str, generation: int) -> PairLink:
        """Rendezvous with a decode worker for a new generation of the pair (on the pusher's thread): its
        ranks, this worker's rank 0 and this worker's other ranks build their channels side by side."""
        with self._lock:
            d = self._destinations[decode_id]
        by_rank = shares_by_rank(pair_plan(self.core.model_config, self.tp, d.tp), sender=True)
        mine, theirs = by_rank.pop(0), sorted(by_rank)
        calls = [d.handle.open_channel.remote(self.worker_id, generation, self.tp).future()]
        calls += [self.ranks.handles[r - 1].open_shares.remote(True, self.worker_id, decode_id, d.host, d.port,
                                                               generation, by_rank[r], self.transfer_timeout_s).future()
                  for r in theirs]
        own: Future[list] = Future()

        def build() -> None:
            try:
                own.set_result(open_shares(d.host, d.port, self.worker_id, decode_id, True, mine,
                                           self.transfer_timeout_s, self.core.runner.kv_cache.device, generation,
                                           self.transfer_stats, lambda _: self.faults.hit("send")))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter below
                own.set_exception(e)

        threading.Thread(target=build, name=f"kv-rendezvous-{decode_id}", daemon=True).start()
        # A dead decode worker fails its call at once: do not wait out the rendezvous timeout for it.
        deadline = time.monotonic() + self.transfer_timeout_s
        wait([*calls, own], self.transfer_timeout_s, return_when=FIRST_EXCEPTION)
        try:
            for f in (*calls, own):
                f.result(timeout=max(deadline - time.monotonic(), 0.0))
        except BaseException as e:  # every rank gives this generation up
            own.add_done_callback(lambda f: f.exception() is None and PairLink(f.result()).close())
            if theirs:
                self.ranks.drop(theirs, decode_id, generation)
            raise TransferError(f"no channel to decode worker {decode_id}: {e or type(e).__name__}") from e
        return self.ranks.link(own.result(), decode_id, generation, theirs, "send_share") if theirs \
            else PairLink(own.result())

    @staticmethod
    def _announce(handle: Any, a: KVAnnounce) -> None:
        handle.kv_incoming.remote(a)

    def _pushed(self, job: PushJob, error: str | None) -> None:
        """A push ended (on the pusher's thread): the KV is the decode worker's now, or the transfer
        failed (the decode worker is told, and reports it to the router). Either way it is freed here."""
        with self._lock:
            self._pushing.difference_update(job.request_ids)
            for rid in job.request_ids:
                self._ready.pop(rid, None)
            dest = self._destinations.get(job.destination)
        if error is not None and dest is not None:
            dest.handle.kv_failed.remote(self.worker_id, job.request_ids, error)
        self.loop.call(lambda: [self.core.cancel(rid) for rid in job.request_ids])

    # -- step thread ------------------------------------------------------------------------------
    def _step(self) -> bool:
        scheduler = self.core.scheduler
        step = scheduler.schedule()
        if not step.chunks:
            return False
        for req in step.requests if self._admit_waiters else ():  # admitted: their decode room may be reserved
            _settle(self._admit_waiters.pop(req.request_id, None), True)
        pushes = _StepPushes(step, self.core, self._hand_off, self.push_layerwise, self._claim_ready, self._push)
        try:
            pushes.layer_done(-1)  # destinations already ready: their KV goes out layer by layer
            sampled, failed = self._run(step, pushes.layer_done)
            # Requests whose own data failed the step fail alone (the step ran again without them); any other
            # failure is the whole step's.
            bad = {f.request_id for f in failed if f.reason is FailureReason.BAD_REQUEST}
            whole = len(bad) < len(failed)
            firsts: dict[str, list[SampledToken]] = {}  # a group's n first tokens, in sample order
            for s in sampled:
                firsts.setdefault(s.request.request_id, []).append(s)
            if not whole:
                pushes.sampled({rid: [s.token for s in group] for rid, group in firsts.items()})
        except BaseException as e:  # a push that never hears of its layers or tokens would wait forever
            pushes.abort(f"{type(e).__name__}: {e}")
            raise
        for f in failed:
            self._forget(f.request_id)
            self._fail(f.request_id, ValueError(f.detail) if f.request_id in bad else RuntimeError(f.detail))
        if whole:  # the step raised: its pushes cannot complete, its requests fail
            pushes.abort(failed[0].detail)
            return True
        sampled_at = time.time()
        late: dict[str, list[tuple[str, _HeldKV]]] = {}
        for rid, group in firsts.items():
            req = group[0].request
            hand_off = rid in self._hand_off
            skip = self._hand_off.pop(rid, 0)
            ended = self._resolve(req, group)
            if rid in pushes.started:
                continue  # freed when its push ends
            if not hand_off or ended:
                self._forget(rid)
                self.core.cancel(rid)  # nothing follows the first token (of any sample)
                continue
            held = _HeldKV(scheduler.kv_blocks(req)[skip:], tuple(s.token for s in group), sampled_at, req.tier,
                           pushes.step, req.kv_version)
            with self._lock:
                if rid in self._ready:
                    dest = self._ready.pop(rid)[1]
                    self._pushing.add(rid)
                    late.setdefault(dest, []).append((rid, held))
                else:
                    self._held[rid] = held
        for dest, items in late.items():  # the reservation came during this step
            for job in self._held_jobs(dest, items):
                self._push(job)
        return True

    def _push(self, job: PushJob) -> None:
        """Queue a push behind its pair's earlier ones; one to a decode worker that is gone fails at once."""
        with self._lock:
            d = self._destinations.get(job.destination)
        if d is None:
            self._pushed(job, f"decode worker {job.destination} is gone")
        else:
            d.pusher.push(job)

    def _claim_ready(self, request_ids: Iterable[str]) -> dict[str, str]:
        """Those of these requests whose decode worker has reserved room, each with that worker: their push
        starts now (any thread)."""
        with self._lock:
            claimed = {rid: self._ready.pop(rid)[1] for rid in request_ids if rid in self._ready}
            self._pushing.update(claimed)
        return claimed

    def _held_jobs(self, destination: str, items: list[tuple[str, _HeldKV]]) -> list[PushJob]:
        """Pushes of computed KV, one per service tier (all of their layers are there, and so are the first
        tokens), highest tier first."""
        num_layers = self.core.model_config.num_layers
        jobs = []
        for tier in sorted({h.tier for _, h in items}):
            mine = [(rid, h) for rid, h in items if h.tier == tier]
            jobs.append(PushJob(destination, [rid for rid, _ in mine], [h.block_ids for _, h in mine], num_layers,
                                num_layers, [t for _, h in mine for t in h.tokens], min(h.sampled_at for _, h in mine),
                                tier, max(h.step for _, h in mine), [len(h.tokens) for _, h in mine],
                                [h.version for _, h in mine]))
        return jobs

    def _cancel(self, request_id: str) -> bool:
        if self._forget(request_id):
            return True  # freed when its push ends
        return self.core.cancel(request_id)

    def _forget(self, request_id: str) -> bool:
        """Drop a request's hand-off state (it ended here); whether a push of its KV is still under way."""
        self._hand_off.pop(request_id, None)
        with self._lock:
            self._ready.pop(request_id, None)
            self._held.pop(request_id, None)
            return request_id in self._pushing

    def _resolve(self, req: Request, group: list[SampledToken]) -> bool:
        """Answer the prefill call with the first token and its text (a group's: each sample's, sample 0's
        on the request's own text, the others' on texts of their own); whether every sample ended with it."""
        s = group[0]
        text, reason = self._text(s)
        others = []
        for t in group[1:]:  # a group's samples 1..n-1: the decode worker forks them
            own = TextOutput.of(self.core.tokenizer, req.prompt_token_ids, req.params) \
                if req.text is not None else None
            text_j, reason_j = ("", t.finish_reason) if own is None else token_text(own, t.token, t.finish_reason)
            others.append(FirstToken(t.token, text_j, reason_j, t.logprobs))
        fut = self._results.get(req.request_id)
        try:
            if fut is not None:
                fut.set_result(PrefillResult(req.request_id, s.token, req.num_cached_tokens, text, reason, s.logprobs,
                                             s.prompt_logprobs, tuple(others), s.version, s.routed_experts))
        except InvalidStateError:  # cancelled meanwhile
            pass
        return reason is not None and all(o.finish_reason is not None for o in others)

    def _fail(self, request_id: str, error: BaseException) -> None:
        fut = self._results.get(request_id)
        if fut is not None:
            try:
                fut.set_exception(error)
            except InvalidStateError:
                pass

    def _load(self) -> tuple[int, int, int]:
        s = self.core.scheduler
        queued = (*s.waiting, *s.running)  # prompts not yet ingested; HELD ones count as running
        return len(queued), sum(r.num_tokens - r.num_computed_tokens for r in queued), len(s.held)

    def _extra_stats(self) -> dict:
        with self._lock:
            peers = len(self._destinations)
        return dict(transfer=self.transfer_stats.snapshot(), kv_peers=peers)


def _settle(waiter: Future[bool] | None, admitted: bool) -> None:
    """Answer a Call.ADMITTED once (the first answer stands)."""
    if waiter is not None:
        try:
            waiter.set_result(admitted)
        except InvalidStateError:
            pass


class _StepPushes:
    """The pushes of one prefill step: prompts completing in it whose decode worker is ready go out
    layer by layer, one job per decode worker; a reservation that arrives mid-forward joins at the next
    layer (the layers already computed go first).

    What it needs of its prefill worker is passed in: the engine, the requests whose KV goes to a decode
    worker (`hand_off`), whether pushes go layer by layer, `claim` (PrefillActor._claim_ready: which of
    them have their reservation, each taken for a push) and `push` (PrefillActor._push: queue a job)."""

    def __init__(self, step: ScheduledStep, core: EngineCore, hand_off: dict[str, int], layerwise: bool,
                 claim: Callable[[Iterable[str]], dict[str, str]], push: Callable[[PushJob], None]):
        self.layerwise = layerwise
        self.claim = claim
        self.push = push
        self.num_layers = core.model_config.num_layers
        # request -> (its service tier's rank, its KV blocks): those whose KV goes to a decode worker
        self.candidates: dict[str, tuple[int, list[int]]] = {}
        self.samples: dict[str, int] = {}  # first tokens each candidate samples (a group's n)
        self.versions: dict[str, int] = {}  # the weight version computing each candidate's KV (this step's)
        for req, chunk in zip(step.requests, step.chunks):
            if chunk.sample is not None and req.request_id in hand_off:
                blocks = req.block_ids[hand_off[req.request_id]:core.kv.blocks_needed(req.num_tokens)]  # what D lacks
                self.candidates[req.request_id] = (req.tier, blocks)
                self.samples[req.request_id] = chunk.fanout
                self.versions[req.request_id] = req.kv_version
        self.started: dict[str, PushJob] = {}
        self.jobs: list[PushJob] = []
        # The engine step about to run (a TP worker's runner counts them; its other ranks wait for it).
        self.step = getattr(core.runner, "steps", -1) + 1

    def layer_done(self, layer: int) -> None:
        for job in self.jobs:  # the pushes under way may send this layer now
            if layer >= 0:
                job.layer_done(layer)
        if len(self.started) == len(self.candidates) or (not self.layerwise and layer < self.num_layers - 1):
            return
        groups: dict[tuple[int, str], list[str]] = {}  # one job per (tier, decode worker), highest tier first
        for rid, dest in self.claim([rid for rid in self.candidates if rid not in self.started]).items():
            groups.setdefault((self.candidates[rid][0], dest), []).append(rid)
        for (tier, dest), rids in sorted(groups.items()):
            job = PushJob(dest, rids, [self.candidates[r][1] for r in rids], self.num_layers, layer + 1, tier=tier,
                          step=self.step, samples=[self.samples[r] for r in rids],
                          versions=[self.versions[r] for r in rids])
            self.jobs.append(job)
            self.started.update((r, job) for r in rids)
            self.push(job)

    def sampled(self, tokens: dict[str, list[int]]) -> None:
        """The first tokens, into every push's trailer. A request whose own data failed the step has none (the
        step ran again without it): a push it shares with others still completes, with token 0 in its place;
        its router has failed it and cancels it on the decode worker, which frees what lands for it."""
        for job in self.jobs:
            job.sampled([t for r in job.request_ids for t in tokens.get(r, [0] * self.samples[r])])

    def abort(self, reason: str) -> None:
        for job in self.jobs:
            job.abort(reason)
