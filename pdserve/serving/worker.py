"""What every worker actor shares: the engine in its role, the step thread, timing, stats, and failure.

A worker actor (prefill, decode, colocated) is a Ray actor around one EngineCore. The step thread
(pdserve.engine.step_loop) owns the engine; actor methods hand it functions. This base holds the skeleton:
ready / stats / cancel (and the record of what cancels did) / shutdown, the timed step with its
fail-the-batch path, the link to the router (step outputs out, the router's per-request calls in), and
the stats report. A subclass says what differs: its role and pool name, its step, and how it counts
waiting and running requests.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import EngineCore
from pdserve.engine.output import TextOutput, token_text
from pdserve.engine.request import FinishReason, Request
from pdserve.engine.scheduler_types import Role, SampledToken, ScheduledStep
from pdserve.engine.step_loop import StepLoop, StepLoopStopped
from pdserve.engine.utilization import device_peaks
from pdserve.faults import FaultPoints
from pdserve.model.loader import LoadedModel
from pdserve.serving.calls import Call
from pdserve.serving.link import WorkerLink
from pdserve.serving.messages import (
    CancelRecord,
    Failure,
    FailureReason,
    StepOutput,
    TokenEvent,
    WeightUpdateReport,
    WorkerStats,
)
from pdserve.tiers import ServiceTier

log = logging.getLogger(__name__)

TOMBSTONE_TTL_S = 60.0  # the race it covers lasts milliseconds
CANCELS_KEPT = 64  # the recent cancels a worker can tell (recent_cancels)


class StepRun(NamedTuple):
    sampled: list[SampledToken]
    failed: list[Failure]  # the whole queue and batch, if the step raised


class WorkerActor:
    """Subclasses set `pool` and `role`, implement `_step`, and call `_start()` last in __init__."""

    pool: str
    role: Role

    def __init__(self, worker_id: str, config: EngineConfig, torch_threads: int | None = None,
                 loaded: LoadedModel | None = None, placement=None):
        """placement: a tensor-parallel worker's placement group (pdserve.serving.tp_ranks.TPPlacement); this
        actor is rank 0 and starts the other ranks in it."""
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.ranks = None  # a TP worker's other ranks (pdserve.serving.tp_ranks.RayRanks)
        if config.tensor_parallel_size > 1:
            from pdserve.serving.tp_ranks import RayRanks

            if placement is None:
                raise ValueError("a tensor-parallel worker needs its placement group")
            self.ranks = RayRanks(worker_id, placement)
        self.tp = config.tensor_parallel_size
        self.core = EngineCore(config, loaded, self.role, self.ranks, self._rank_lost, torch_threads)
        self.core.scheduler.on_fork = self._forked
        self.peaks = device_peaks(self.core.runner.device, config.peak_flops, config.peak_bytes_per_second)
        self.busy_seconds = 0.0
        self.tier_seconds: collections.Counter[str] = collections.Counter()  # busy seconds by tier
        self.started = time.monotonic()
        # Outputs go out on the links to the routers (pdserve.serving.link), one queue each, by the router
        # whose tag begins a request's id ("tag/..."); with one router, everything goes on its link.
        self._outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()  # the first router's
        self._queues: dict[str, queue.SimpleQueue[StepOutput]] = {}  # router tag -> its link's queue
        self._links: dict[str, WorkerLink] = {}  # router tag -> its link
        # Ids cancelled before their request arrived here (Ray may run a cancel ahead of the call that
        # adds the request): the add then refuses them. Step thread; expire after TOMBSTONE_TTL_S.
        self._tombstones: collections.OrderedDict[str, float] = collections.OrderedDict()
        # What cancels did here (step thread): how many ended a request, and the latest ones' records.
        self.cancelled = 0
        self._cancels: collections.deque[CancelRecord] = collections.deque(maxlen=CANCELS_KEPT)
        self.faults = FaultPoints()  # inert unless a test arms one (pdserve.faults)
        # A weight update read and converted, waiting for commit_weights: (version, staged, seconds to stage).
        self._staged: tuple[int, object, float] | None = None
        self._group = None  # a trainer's weight group (pdserve.weights.group.WeightGroup), once joined
        self._receiving: asyncio.Future | None = None  # an update being received on it
        self.weight_updates = 0
        self.weight_update_seconds = 0.0
        self.weight_update_bytes = 0
        self.weight_update_failures = 0
        self.loop: StepLoop | None = None

    def _start(self) -> None:
        """Start the step thread: once the subclass's own state exists."""
        self.loop = StepLoop(self._step, name=f"{self.pool}-{self.worker_id}")

    # -- actor methods ----------------------------------------------------------------------------
    async def ready(self) -> str:
        return self.worker_id

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.loop.call(self._stats))

    async def cancel(self, request_id: str) -> bool:
        """End a request here wherever it stands and free its KV (False: this worker does not have it)."""
        try:
            return await asyncio.wrap_future(self.loop.call(lambda: self._cancel_or_remember(request_id)))
        except StepLoopStopped:  # shutting down: nothing left to free
            return False

    async def recent_cancels(self) -> list[CancelRecord]:
        """The last CANCELS_KEPT cancels that ended a request here, oldest first: a cancel's arrival, checkable."""
        return await asyncio.wrap_future(self.loop.call(lambda: list(self._cancels)))

    async def link_to(self, host: str, port: int, token: bytes, router: str = "") -> None:
        """Connect to the router at host:port (pdserve.serving.link): the router's per-request calls come
        from there, and the outputs of its requests go there; returns once connected.

        `router` is the router's tag when several routers serve the cluster (router replicas): each has
        a link here, its requests' ids begin with "tag/", and when its link ends (the router died) the
        requests it placed here are cancelled, their KV freed."""
        old = self._links.get(router)
        if old is not None and old.alive:
            raise RuntimeError(f"{self.worker_id} is already linked to router {router!r}")
        # A queue of its own (a router that comes back under its name gets a new one: the old one ended
        # with its link); the first link takes what was published before it.
        q = queue.SimpleQueue() if self._queues else self._outputs
        self._queues[router] = q
        self._links[router] = await asyncio.to_thread(
            WorkerLink, q, host, port, token, self.worker_id, self.handlers(),
            (lambda: self._router_gone(router)) if router else None)

    def _router_gone(self, router: str) -> None:
        """A router's link ended (it died): cancel what it placed here; its clients retry elsewhere."""
        prefix = f"{router}/"

        def cancel_its_requests() -> None:
            mine = [rid for rid in self.core.scheduler.requests if rid.startswith(prefix)]
            for rid in mine:
                self._cancel_soon(rid)
            log.warning("%s: router %s is gone; %d of its requests cancelled here", self.worker_id, router, len(mine))

        self.loop.call(cancel_its_requests)

    def _queue(self, request_id: str) -> queue.SimpleQueue[StepOutput]:
        """The queue of the link to the router that placed the request."""
        if len(self._queues) <= 1:
            return next(iter(self._queues.values()), self._outputs)
        return self._queues.get(request_id.split("/", 1)[0], self._outputs)

    def _put(self, events: tuple[TokenEvent, ...], failed: tuple[Failure, ...]) -> None:
        """One StepOutput per router whose requests have events or failures, each with the stats."""
        stats = self._stats()
        if len(self._queues) <= 1:
            self._queue("").put(StepOutput(self.worker_id, events, failed, stats))
            return
        by_queue: dict[int, tuple[queue.SimpleQueue, list, list]] = {}
        for items, i in ((events, 1), (failed, 2)):
            for item in items:
                q = self._queue(item.request_id)
                by_queue.setdefault(id(q), (q, [], []))[i].append(item)
        for q, ev, fa in by_queue.values():
            q.put(StepOutput(self.worker_id, tuple(ev), tuple(fa), stats))

    def handlers(self) -> dict[str, Callable]:
        """This worker's answers to the router's calls on its link (pdserve.serving.calls: Call), each run on
        the link's reader thread in arrival order; one returns its value or a concurrent Future of it."""
        # STATS: the router's heartbeat. Run on the step thread, so a worker whose steps hang does not answer.
        return {Call.CANCEL.value: self._cancel_soon, Call.STATS.value: lambda: self.loop.call(self._stats)}

    def _cancel_soon(self, request_id: str) -> None:
        """cancel() without waiting for the step thread to have done it."""
        self.loop.call(lambda: self._cancel_or_remember(request_id))

    async def peer_lost(self, worker_id: str) -> None:
        """A worker of another pool has left its pool (dead or stuck): drop what this one holds for it."""

    async def shutdown(self) -> None:
        await self.leave_weight_group()
        self.loop.stop()
        for link in list(self._links.values()):
            await asyncio.to_thread(link.close)
        self._close()
        await asyncio.to_thread(self.core.close)  # a TP worker's other ranks (collectives: off the event loop)

    # -- weights (pdserve.weights) ------------------------------------------------------------------
    async def stage_weights(self, source: str, version: int) -> int:
        """Read and convert checkpoint `source` for weight version `version`, held aside until commit_weights
        (the worker serves meanwhile); its bytes. Raises with nothing applied if it does not fit the model."""
        await asyncio.to_thread(self.faults.hit, "stage_weights")
        t0 = time.perf_counter()
        try:
            staged = await asyncio.to_thread(self.core.stage_weights, source)
        except Exception:
            self.weight_update_failures += 1
            raise
        self._staged = (version, staged, time.perf_counter() - t0)
        return staged.num_bytes if staged is not None else 0

    async def commit_weights(self, version: int) -> WeightUpdateReport:
        """Between two steps: the staged update becomes the weights served, as `version`; requests holding
        older KV follow their version policy (aborted ones end with FinishReason.ABORT)."""
        if self._staged is None or self._staged[0] != version:
            raise ValueError(f"{self.worker_id} has no update staged for weight version {version}")
        _, staged, stage_s = self._staged
        self._staged = None
        t0 = time.perf_counter()
        await asyncio.wrap_future(self.loop.call(lambda: self._commit_weights(staged, version)))
        commit_s = time.perf_counter() - t0
        num_bytes = staged.num_bytes if staged is not None else 0
        self.weight_updates += 1
        self.weight_update_seconds += stage_s + commit_s
        self.weight_update_bytes += num_bytes
        log.info("%s: weight version %d (staged in %.2f s, committed in %.3f s, %.1f MB)", self.worker_id, version,
                 stage_s, commit_s, num_bytes / 1e6)
        return WeightUpdateReport(self.worker_id, version, stage_s, commit_s, num_bytes)

    async def update_weights(self, source: str, version: int) -> WeightUpdateReport:
        """stage_weights, then commit_weights (a rolling update: this worker switches as soon as it can)."""
        await self.stage_weights(source, version)
        return await self.commit_weights(version)

    async def join_weight_group(self, address, rank: int, timeout_s: float) -> None:
        """Join a trainer's weight group (pdserve.weights.group) as `rank` (a tensor-parallel worker's rank r as
        rank + r); returns once every rank has."""
        await self.leave_weight_group()
        self._group = await asyncio.to_thread(self.core.join_weight_group, address, rank, timeout_s)

    async def receive_weights(self, metas: list, bucket_bytes: int, version: int) -> None:
        """Start receiving an update broadcast on the weight group, staging each tensor as it arrives (the worker
        serves meanwhile); weights_received() waits for the end."""
        if self._group is None:
            raise RuntimeError(f"{self.worker_id} is in no weight group")
        group = self._group
        loop = asyncio.get_running_loop()

        def receive() -> None:
            t0 = time.perf_counter()
            staged = self.core.receive_weights(group, metas, bucket_bytes)
            self._staged = (version, staged, time.perf_counter() - t0)

        self._receiving = loop.run_in_executor(None, receive)

    async def weights_received(self, version: int) -> int:
        """Wait for the update being received; its bytes. If it failed (the trainer gone, a timeout), the group is
        closed and this raises: nothing is staged."""
        receiving, self._receiving = self._receiving, None
        if receiving is None:
            raise RuntimeError(f"{self.worker_id} is receiving no update")
        try:
            await receiving
        except Exception:
            self.weight_update_failures += 1
            await self.leave_weight_group()
            raise
        return self._staged[1].num_bytes if self._staged and self._staged[1] is not None else 0

    async def leave_weight_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(self.core.leave_weight_group, group)

    async def export_weights(self, directory: str) -> int:
        """Write the weights served as a checkpoint in `directory` (EngineCore.export_weights), on the step
        thread: between two steps, so never half of an update; its bytes."""
        return await asyncio.wrap_future(self.loop.call(lambda: self.core.export_weights(directory)))

    async def pause(self) -> None:
        """Stop stepping after the step under way (requests stay where they are); returns once stopped."""
        await asyncio.wrap_future(self.loop.call(lambda: setattr(self.loop, "paused", True)))

    async def resume(self) -> None:
        await asyncio.wrap_future(self.loop.call(lambda: setattr(self.loop, "paused", False)))

    def _commit_weights(self, staged, version: int) -> None:
        """Step thread. A commit that fails part-way leaves a mix of two versions: the worker must not serve
        it, so it exits, and the router replaces it with a worker loaded at the version the cluster serves."""
        self.faults.hit("commit_weights")
        try:
            sampled = self.core.commit_weights(staged, version)
        except ValueError:
            raise  # refused before anything was applied (e.g. a version not newer)
        except BaseException as e:  # noqa: BLE001
            log.error("%s: weight update to version %d failed part-way (%s); the worker exits", self.worker_id,
                      version, e)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(71)
        self._publish(StepRun(sampled, []))

    async def rank_pids(self) -> list[int]:
        """The processes of this worker's ranks, rank 0 (this one) first."""
        others = await asyncio.to_thread(self.ranks.pids) if self.ranks is not None else []
        return [os.getpid(), *others]

    async def inject_fault(self, point: str, seconds: float = 0.0, count: int = 1, skip: int = 0) -> None:
        """Tests only: arm a fault point (pdserve.faults) for `count` hits after the next `skip`."""
        self.faults.arm(point, seconds, count, skip)

    async def release_fault(self, point: str) -> None:
        """Tests only: let a fault point armed with seconds=math.inf go on."""
        self.faults.release(point)

    async def fault_reached(self, point: str, timeout: float = 60.0) -> bool:
        """Tests only: wait until an armed fault point has been hit (False after the timeout)."""
        return await asyncio.to_thread(self.faults.wait_reached, point, timeout)

    def _rank_lost(self, why: str) -> None:
        """A rank of this TP worker died or hung (pdserve.engine.tp_runner): the worker cannot step any more. It
        ends at once, its ranks with it; the router sees it gone, replaces it, and its requests follow the
        failure matrix (streams resume elsewhere, prompts are placed again)."""
        log.error("%s: %s; the worker exits", self.worker_id, why)
        # Its ranks are its children (they end with it) and the router removes their placement group; the
        # kill below only makes it sooner, and must not hold the exit up (it is a call to Ray's GCS).
        killer = threading.Thread(target=self.ranks.close, daemon=True)
        killer.start()
        killer.join(2.0)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(70)

    # -- step thread ------------------------------------------------------------------------------
    def _step(self) -> bool:
        """One unit of work; whether there was any (pdserve.engine.step_loop)."""
        raise NotImplementedError

    def _cancel(self, request_id: str) -> bool:
        return self.core.cancel(request_id)

    def _cancel_or_remember(self, request_id: str) -> bool:
        req = self.core.scheduler.requests.get(request_id)
        # As it stands before the cancel ends it (a request whose push is under way may have left already).
        record = CancelRecord(request_id, self.core.steps, req.num_output_tokens if req else 0,
                              req.status.value if req else "pushing")
        if self._cancel(request_id):
            self.cancelled += 1
            self._cancels.append(record)
            return True
        now = time.monotonic()
        while self._tombstones and now - next(iter(self._tombstones.values())) > TOMBSTONE_TTL_S:
            self._tombstones.popitem(last=False)
        self._tombstones[request_id] = now
        return False

    def _cancelled_already(self, request_id: str) -> bool:
        """On the step thread, as a request is added: whether its cancel came first (it must not run)."""
        return self._tombstones.pop(request_id, None) is not None

    def _close(self) -> None:
        """Release what the subclass holds besides the step thread (channels, stores)."""

    def _run(self, step: ScheduledStep, layer_done: Callable[[int], None] | None = None) -> StepRun:
        """Run a scheduled step, timed. If it raises, every queued and running request is failed (their
        state is suspect) and reported; the worker keeps serving.

        Pipelined decode (EngineCore.pipelined): the step (if it has chunks) is launched, and the step
        launched before it is resolved: the tokens returned are that one's."""
        self.faults.hit("step")
        t0 = time.perf_counter()
        tokens = [(ServiceTier.of_rank(r.tier).value, len(c.token_ids)) for r, c in zip(step.requests, step.chunks)]
        core = self.core
        try:
            if core.pipelined:
                return StepRun(core.run_pipelined(step, layer_done), [])
            return StepRun(core.account(step, core.execute(step, layer_done)), [])
        except Exception as e:  # noqa: BLE001 - the batch fails, not the worker
            log.exception("%s step failed on %s", self.pool, self.worker_id)
            core.scheduler.abandon_launched()
            return StepRun([], [Failure(rid, FailureReason.STEP_FAILED, f"{self.pool} step failed: {e}")
                                for rid in core.cancel_all()])
        finally:
            dt = time.perf_counter() - t0
            self.busy_seconds += dt
            total = sum(n for _, n in tokens)
            for tier, n in tokens:  # each request's share of the step, by the tokens it computed
                self.tier_seconds[tier] += dt * n / total

    def _publish(self, run: StepRun, extra_failed: tuple[Failure, ...] = ()) -> None:
        """Put one StepOutput with every request's new token and its text (and the failures), if there is any."""
        events = tuple(self._event(s) for s in run.sampled)
        failed = (*run.failed, *extra_failed)
        if events or failed:
            self._put(events, failed)

    @staticmethod
    def _text(s: SampledToken) -> tuple[str, FinishReason | None]:
        """A sampled token's text and finish reason, a completed stop string's STOP included (no text for
        a model without a tokenizer). Text is made where the tokens are sampled, not at the router: the
        work is spread over the workers, and a stop string ends the request at once."""
        req = s.request
        return ("", s.finish_reason) if req.text is None else token_text(req.text, s.token, s.finish_reason)

    def _forked(self, group: Request, sample: Request) -> None:
        """A group's sample forked here (pdserve.engine.scheduler.Scheduler.fork) streams its own text from
        its first token, which the caller then adds."""
        if group.text is not None:
            sample.text = TextOutput(self.core.tokenizer, sample.prompt_token_ids, sample.params.stop)

    def _event(self, s: SampledToken) -> TokenEvent:
        """A sampled token with its text; a completed stop string ends the request here, with this token."""
        text, reason = self._text(s)
        if reason is not s.finish_reason:
            self.core.scheduler.finish(s.request, reason)
        return TokenEvent(s.request.request_id, s.token, reason, text, s.logprobs, s.prompt_logprobs, s.version)

    # -- stats ------------------------------------------------------------------------------------
    def _load(self) -> tuple[int, int, int]:
        """(requests waiting, their tokens, requests running), as this role counts them."""
        s = self.core.scheduler
        return len(s.waiting), sum(r.num_tokens - r.num_computed_tokens for r in s.waiting), len(s.running)

    def _extra_stats(self) -> dict:
        """WorkerStats fields only this kind of worker reports (transfer, hand-off histograms)."""
        return {}

    def _stats(self) -> WorkerStats:
        c = self.core
        pool, runner = c.pool, c.runner
        waiting, waiting_tokens, running = self._load()
        return WorkerStats(
            worker_id=self.worker_id, pool=self.pool, waiting=waiting, waiting_tokens=waiting_tokens,
            running=running, kv_blocks_used=pool.num_used_blocks, kv_blocks_total=pool.num_blocks, steps=c.steps,
            tokens_processed=c.tokens_processed, busy_seconds=self.busy_seconds,
            uptime_seconds=time.monotonic() - self.started, flops=runner.flops_total, bytes_read=runner.bytes_total,
            peak_flops=self.peaks.flops_per_second, peak_bytes_per_second=self.peaks.bytes_per_second,
            peak_source=self.peaks.source, prefix_hit_blocks=pool.prefix_hits, prefix_query_blocks=pool.prefix_queries,
            pid=os.getpid(), preemptions=c.scheduler.num_preemptions, tier_seconds=dict(self.tier_seconds),
            tier_preemptions={f"{t}/{kind}": n for (t, kind), n in c.scheduler.preemptions.items()},
            cancelled=self.cancelled, late_steps=getattr(runner, "late_steps", 0),
            prompt_tokens_requested=c.scheduler.prompt_tokens_requested,
            prompt_tokens_computed=c.prompt_tokens_computed,
            weight_version=c.weight_version, paused=self.loop.paused if self.loop else False,
            weight_updates=self.weight_updates, weight_update_seconds=self.weight_update_seconds,
            weight_update_bytes=self.weight_update_bytes, weight_update_failures=self.weight_update_failures,
            version_outcomes=dict(c.version_outcomes), expert_tokens=c.expert_tokens(),
            **self._extra_stats())
