"""What every worker actor shares: the engine in its role, the step thread, timing, outputs, stats, and failure.

A worker actor (prefill, decode, colocated) is a Ray actor around one EngineCore. The step thread
(pdserve.engine.step_loop) owns the engine; actor methods hand it functions. This base holds the skeleton:
ready / stats / shutdown, the timed step with its fail-the-batch path, a step's tokens made into outputs
(with their text) for the links to the routers, the call table the links answer, and the stats report.
A subclass says what differs: its role and pool name, its step, and how it counts waiting and running
requests.

Its other jobs are parts of their own, each in its module: the weight-update calls
(pdserve.serving.weight_calls), cancels (pdserve.serving.cancels) and the tests' fault calls
(pdserve.serving.fault_calls) are mixins, because Ray finds an actor's methods on its class; the links to
the routers (pdserve.serving.router_links) are an object it holds, since nothing there is a Ray call.
Each mixin sets its own state in its `__init__`, run first by `WorkerActor.__init__` (super().__init__()).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import EngineCore
from pdserve.engine.output import TextOutput, token_text
from pdserve.engine.request import FinishReason, Request
from pdserve.engine.routed_experts import check_asked
from pdserve.engine.scheduler_types import Role, SampledToken, ScheduledStep
from pdserve.engine.step_loop import StepLoop
from pdserve.engine.utilization import device_peaks
from pdserve.model.loader import LoadedModel
from pdserve.serving.calls import Call
from pdserve.serving.cancels import Cancels
from pdserve.serving.fault_calls import FaultCalls
from pdserve.serving.messages import Failure, FailureReason, StepOutput, TokenEvent, WorkerStats
from pdserve.serving.router_links import RouterLinks
from pdserve.serving.weight_calls import WeightCalls
from pdserve.tiers import ServiceTier

log = logging.getLogger(__name__)


def count_prompts(counts: collections.Counter[str], step: ScheduledStep, hop: Callable[[Request], str]) -> None:
    """A step's prompt tokens by hop (WorkerStats.hop_tokens): those its chunks compute, and, with a prompt's first
    chunk after its admission (the chunk that starts where the prefix cache's hit ended), those the cache served."""
    for r, c in zip(step.requests, step.chunks):
        computed = min(c.start + len(c.token_ids), r.num_prompt_tokens) - c.start
        if computed > 0:
            counts[f"{hop(r)}/computed"] += computed
        if c.start == r.num_cached_tokens and r.num_cached_tokens:
            counts[f"{hop(r)}/cached"] += min(r.num_cached_tokens, r.num_prompt_tokens)


def new_request(core: EngineCore, task) -> Request:
    """A task (pdserve.serving.messages) as a worker's Request, checked (ValueError: the caller's error), under
    structured output with its matcher and the tokens it has replayed (GrammarError): on the thread that takes it
    in, so that the step thread neither compiles nor replays."""
    check_asked(task.params, core.routes_experts)
    req = task.new_request(core.tokenizer, core.model_config.vocab_size)
    core.scheduler.structure(req)
    return req


class StepRun(NamedTuple):
    sampled: list[SampledToken]
    failed: list[Failure]  # the whole queue and batch, if the step raised


class WorkerActor(WeightCalls, Cancels, FaultCalls):
    """Subclasses set `pool` and `role`, implement `_step`, and call `_start()` last in __init__."""

    pool: str
    role: Role

    def __init__(self, worker_id: str, config: EngineConfig, torch_threads: int | None = None,
                 loaded: LoadedModel | None = None, placement=None):
        """placement: a tensor-parallel worker's placement group (pdserve.serving.tp_ranks.TPPlacement); this
        actor is rank 0 and starts the other ranks in it."""
        super().__init__()  # the mixins' own state
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
        self.hop_tokens: collections.Counter[str] = collections.Counter()  # WorkerStats.hop_tokens
        self.started = time.monotonic()
        self.links = RouterLinks(worker_id)
        self.loop: StepLoop | None = None

    def _start(self) -> None:
        """Start the step thread: once the subclass's own state exists."""
        self.core.pool.record_events()
        self.loop = StepLoop(self._step, name=f"{self.pool}-{self.worker_id}", after=self._send_kv_events)
        tier = self.core.kv.tier
        if tier is not None:  # a load from a KV tier: a test's fault point as it starts; the step thread woken as it ends
            tier.before_load = lambda: self.faults.hit("tier_load")
            tier.on_load_done = lambda: self.loop.call(lambda: None)

    # -- actor methods ----------------------------------------------------------------------------
    async def ready(self) -> str:
        return self.worker_id

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.loop.call(self._stats))

    async def link_to(self, host: str, port: int, token: bytes, router: str = "") -> None:
        """Connect to the router at host:port (pdserve.serving.link): the router's per-request calls come
        from there, and the outputs of its requests go there; returns once connected.

        `router` is the router's tag when several routers serve the cluster (router replicas): each has
        a link here, its requests' ids begin with "tag/", and when its link ends (the router died) the
        requests it placed here are cancelled, their KV freed."""
        await self.links.connect(router, host, port, token, self.handlers(),
                                 (lambda: self._router_gone(router)) if router else None)

    def handlers(self) -> dict[str, Callable]:
        """This worker's answers to the router's calls on its link (pdserve.serving.calls: Call), each run on
        the link's reader thread in arrival order; one returns its value or a concurrent Future of it."""
        # STATS: the router's heartbeat. Run on the step thread, so a worker whose steps hang does not answer.
        return {Call.CANCEL.value: self._cancel_soon, Call.STATS.value: lambda: self.loop.call(self._stats)}

    async def peer_lost(self, worker_id: str) -> None:
        """A worker of another pool has left its pool (dead or stuck): drop what this one holds for it."""

    async def shutdown(self) -> None:
        await self.leave_weight_group()
        self.loop.stop()
        await self.links.close()
        self._close()
        await asyncio.to_thread(self.core.close)  # a TP worker's other ranks (collectives: off the event loop)

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

    def _close(self) -> None:
        """Release what the subclass holds besides the step thread (channels, stores)."""

    def _run(self, step: ScheduledStep, layer_done: Callable[[int], None] | None = None) -> StepRun:
        """Run a scheduled step, timed. If it raises, the requests whose own data fails the worker's check
        fail alone (BAD_REQUEST) and the others run the step again without them (_isolate); if none does,
        every queued and running request is failed (their state is suspect) and reported; the worker keeps
        serving either way.

        Pipelined decode (EngineCore.pipelined): the step (if it has chunks) is launched, and the step
        launched before it is resolved: the tokens returned are that one's."""
        self.faults.hit("step")
        t0 = time.perf_counter()
        tokens = [(ServiceTier.of_rank(r.tier).value, len(c.token_ids)) for r, c in zip(step.requests, step.chunks)]
        count_prompts(self.hop_tokens, step, self._hop)
        try:
            return StepRun(self._execute(step, layer_done), [])
        except Exception as e:  # noqa: BLE001 - the batch fails, not the worker
            log.exception("%s step failed on %s", self.pool, self.worker_id)
            return self._isolate(step, layer_done, e)
        finally:
            dt = time.perf_counter() - t0
            self.busy_seconds += dt
            total = sum(n for _, n in tokens)
            for tier, n in tokens:  # each request's share of the step, by the tokens it computed
                self.tier_seconds[tier] += dt * n / total

    def _hop(self, req: Request) -> str:
        """The hop (messages.HOPS) that computes this request's prompt here: the pool's own by default."""
        return self.pool

    def _execute(self, step: ScheduledStep, layer_done: Callable[[int], None] | None) -> list[SampledToken]:
        core = self.core
        for req in step.requests:  # nothing armed: one check each
            self._fault_data(req)
        if core.pipelined:
            return core.run_pipelined(step, layer_done)
        return core.account(step, core.execute(step, layer_done))

    def _fault_data(self, req: Request) -> None:
        """A test's fault point: this request's data fails every step it is in (a bad value the checks missed)."""
        if self.faults.hit("request_data", req.request_id):
            raise ValueError("its data fails every step it is in (fault point request_data)")

    def _check_data(self, req: Request) -> None:
        """Raises if this request's own data is bad: its sampling parameters checked again (they were, at
        intake: an exception here is a bug or a test's fault point)."""
        self._fault_data(req)
        req.params.checked()

    def _isolate(self, step: ScheduledStep, layer_done: Callable[[int], None] | None, error: Exception) -> StepRun:
        """A step raised: find the requests whose own data fails the check (_check_data). They fail alone,
        as the client's error (BAD_REQUEST, never retried: the next worker's step would fail the same way),
        and the others run the step again without them: a request's bad value never fails its neighbours.
        (Not after a pipelined step, whose launched steps are gone with it, nor on a tensor-parallel worker,
        whose ranks ran the step too: there the others fail as before, and the router places them again.)"""
        core = self.core
        culprits: dict[str, str] = {}
        for req in step.requests:
            try:
                self._check_data(req)
            except Exception as e:  # noqa: BLE001 - what is wrong with it is what its client is told
                culprits[req.request_id] = f"{type(e).__name__}: {e}"
        failed = [Failure(rid, FailureReason.BAD_REQUEST, f"the request's own data failed the {self.pool} step: {why}")
                  for rid, why in culprits.items()]
        for rid in culprits:
            self._cancel(rid)
        rest = [(r, c) for r, c in zip(step.requests, step.chunks) if r.request_id not in culprits]
        if culprits and not rest and not core.pipelined:
            return StepRun([], failed)  # the step was theirs alone: nobody else's state is in doubt
        if culprits and rest and not core.pipelined and self.tp == 1:
            try:
                again = ScheduledStep([r for r, _ in rest], [c for _, c in rest], [])
                return StepRun(self._execute(again, layer_done), failed)
            except Exception as e:  # noqa: BLE001 - then as any failed step
                log.exception("%s step failed again on %s without its %d bad requests", self.pool, self.worker_id,
                              len(culprits))
                error = e
        core.scheduler.abandon_launched()
        return StepRun([], failed + [Failure(rid, FailureReason.STEP_FAILED, f"{self.pool} step failed: {error}")
                                     for rid in core.cancel_all()])

    def _send_kv_events(self) -> None:
        """What the prefix cache stored and evicted since the last round, to every router (router.kv_index): they
        place requests where their KV is."""
        kv = self.core.pool.take_events()
        if kv is not None:
            self.links.broadcast(StepOutput(self.worker_id, (), kv=kv))

    def _publish(self, sampled: Iterable[SampledToken], failed: Iterable[Failure] = ()) -> None:
        """Put one StepOutput with every request's new token and its text (and the failures), if there is any,
        on the link to the router that placed them."""
        events, ended = [], set()
        for s in sampled:
            if s.request.request_id in ended:  # a verification's tokens past the stop string that ended it
                continue
            events.append(self._event(s))
            if events[-1].finish_reason is not None:
                ended.add(s.request.request_id)
        events, failed = tuple(events), tuple(failed)
        if events or failed:
            self.links.put(events, failed, self._stats())

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
            sample.text = TextOutput.of(self.core.tokenizer, sample.prompt_token_ids, sample.params)

    def _event(self, s: SampledToken) -> TokenEvent:
        """A sampled token with its text; a completed stop string ends the request here, with this token."""
        text, reason = self._text(s)
        if reason is not s.finish_reason:
            self.core.scheduler.finish(s.request, reason)
        req = s.request
        return TokenEvent(req.request_id, s.token, reason, text, s.logprobs, s.prompt_logprobs, s.version,
                          None if req.remote_kv else req.num_cached_tokens, s.routed_experts)

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
            hop_tokens=dict(self.hop_tokens), kv_offload=c.kv.tier.stats.as_dict() if c.kv.tier is not None else {},
            speculation=c.scheduler.speculation.stats() if c.scheduler.speculation is not None else {},
            **self._extra_stats())
