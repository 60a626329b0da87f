"""One attempt of a request: its placement, the prefill-to-decode hand-off, and its stream of outputs.

Disaggregated: the request is placed on a prefill worker and, if a token will follow the first, a decode
worker, both at once: the decode worker reserves room for the prompt's KV once the prefill worker has taken the
prompt in (blocks for all of it), while it computes it, and the prefill worker pushes the KV there as it is
computed (pdserve.transfer.protocol). The first token
comes straight back from the prefill worker (TTFT does not wait for the KV); the decode worker's per-step
outputs arrive in the request's inbox (router.streams) and go out stream_interval tokens a message. Every
call goes on the worker's link (pdserve.serving.calls). Colocated: one worker does both phases.

An attempt continues from the tokens (and the characters of text) the request already streamed, under a
worker-side id of its own. A failure (a lost worker, a failed step or transfer) raises Retry with its
FailureReason and the attempt's workers; router.retries decides what follows. However it ends, its
workers are told to free what they hold for it unless it finished there.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from typing import Any

from pdserve.config import ClusterConfig
from pdserve.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import NO_TOKEN, FinishReason, Request, group_of
from pdserve.engine.routed_experts import relay
from pdserve.model.loader import ModelInfo
from pdserve.serving.link import CallFailed, LinkClosed
from pdserve.serving.messages import DecodeTask, Failure, FailureReason, PrefillResult, PrefillTask
from pdserve.tiers import ServiceTier
from router.dispatch import Dispatch, PoolEmpty, prefer
from router.placement import pick_decode
from router.pools import Pools
from router.streams import Inbox, Streams
from router.workers import Worker

LOST = {"prefill": FailureReason.PREFILL_LOST, "decode": FailureReason.DECODE_LOST, "fast": FailureReason.DECODE_LOST,
        "colocated": FailureReason.COLOCATED_LOST}


class Retry(Exception):
    def __init__(self, reason: FailureReason, detail: str, workers=()):
        super().__init__(detail)
        self.reason = reason
        self.workers = tuple(workers)  # the attempt's workers: the next attempt avoids them if it can


@dataclass(frozen=True)
class Parts:
    """What an attempt works with: the cluster's configuration and model, the pools, the line and placement,
    the requests' inboxes."""

    config: ClusterConfig
    info: ModelInfo
    pools: Pools
    dispatch: Dispatch
    streams: Streams

    def no_worker(self, pool: str) -> Retry:
        return Retry(FailureReason.NO_WORKER, f"no {pool} worker is available (waited "
                                              f"{self.config.pool_wait_timeout_s:g} s for one)")


class Attempt:
    """One placement of `req`, continuing from its tokens and the `text_offset` characters of text it
    streamed, under worker-side id `wrid`, avoiding the workers in `avoid` where it can."""

    def __init__(self, parts: Parts, req: Request, text_offset: int, wrid: str, avoid: tuple[str, ...],
                 session: str | None = None, full_hand_off: bool = False):
        """full_hand_off: move all of the prompt's KV even where the decode worker holds a prefix of it (the
        attempt after a PREFIX_MISSED)."""
        self.parts, self.req, self.wrid, self.avoid, self.session = parts, req, wrid, avoid, session
        self.full_hand_off = full_hand_off
        self.inbox: Inbox = parts.streams.inbox(req.request_id)
        # A resumed attempt's prompt logprobs went out with its first token already: not computed again.
        params = req.params if not req.num_output_tokens or req.params.prompt_logprobs is None \
            else replace(req.params, prompt_logprobs=None)
        self.task = PrefillTask(wrid, tuple(req.prompt_token_ids), params, req.seed, tuple(req.output_token_ids),
                                tier=req.tier, text_offset=text_offset)
        self.placed: list[Worker] = []
        self.finished = False
        self.open_samples: set[int] | None = None  # a group's samples still streaming (None: all, none streamed)
        self.later: asyncio.Future[Worker] | None = None  # its decode worker, when chosen while it is prefilled
        self.local = False  # its decode worker computes the prompt itself (router.dispatch: local prefill)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        self.inbox.clear()  # failures meant for an earlier attempt
        self.parts.streams.attempt(self.wrid, self.req.request_id)  # until it ends: later events go nowhere
        try:
            if self.parts.config.mode == "colocated":
                await self._colocated()
            else:
                async for out in self._prefill():
                    yield out
            if self.req.params.n > 1 and not self.finished:
                async for out in self._group_stream():
                    yield out
                self.finished = True
            if not self.finished:
                async for out in self._stream():
                    yield out
        finally:
            self._release()

    async def _colocated(self) -> None:
        dispatch = self.parts.dispatch
        pool = prefer(await self._alive("colocated"), self.avoid)
        streamer = pool[pick_decode([dispatch.decode_load(x) for x in pool])]
        self.placed.append(streamer)
        streamer.requests.add(self.wrid)
        await self._call(streamer, streamer.calls.generate(self.task))

    async def _prefill(self) -> AsyncIterator[RequestOutput]:
        """Place the request, compute its prompt and hand its KV off; yields the first token(s)."""
        req, wrid, parts = self.req, self.wrid, self.parts
        # A decode worker only if a token follows the one the prefill worker samples; priority's is on the
        # fast lane, if the cluster has one.
        follows = req.params.max_tokens - req.num_output_tokens > 1 and req.num_tokens + 1 < parts.info.max_model_len
        lane = parts.config.fast is not None and req.tier == ServiceTier.PRIORITY.rank
        target = ("fast" if lane else "decode") if follows else None
        try:
            p, streamer = await parts.dispatch.place(req, wrid, target, self.avoid, self.session)
        except PoolEmpty as e:
            raise parts.no_worker(e.pool) from None
        if p is None:  # the decode worker holds most of the prompt: it computes the rest and streams every token
            self.local = True
            self.placed.append(streamer)
            await self._call(streamer, streamer.calls.reserve(self._decode_task("", local=True)))
            return
        self.placed += [p] + ([streamer] if streamer else [])
        # The decode worker reserves room once the prefill worker has taken the prompt in with blocks for all of
        # it (`admitted`), while it computes: never for KV that waits for room on the prefill worker, whose
        # computed prompts may wait for that very room (docs/serving.md, "Why the hand-off cannot deadlock").
        # A priority prompt whose decode pool had no room is computed first, its KV held until one has.
        # A partial hand-off: the leading blocks the decode worker holds (router.kv_index) are not moved.
        held, version = 0, 0
        if streamer is not None and not self.full_hand_off:
            held, version = parts.dispatch.held_prefix(streamer, req, p)
        if target is not None and streamer is None:
            self.later = asyncio.ensure_future(parts.dispatch.place_kv(req, wrid, p, target, self.avoid))
        # Its prefill at the tier it asked for, even when the fast lane's wait serves it as default.
        self.task = replace(self.task, hand_off=target is not None, skip_blocks=held)
        try:
            prefilled = p.calls.prefill(self.task)
            if streamer is not None and await self._call(p, p.calls.admitted(wrid)):
                await self._call(streamer, self._reserve(streamer, p, held, version))
            result = await self._call(p, prefilled)
        finally:
            p.queued_tokens -= req.num_tokens
            parts.pools.notify()  # room for the next prompt in line
        firsts = self._first_outputs(result)
        self.open_samples = {o.index for o in firsts if not o.finished}
        self.finished = not self.open_samples
        if self.finished:
            p.requests.discard(wrid)
            if target is not None:  # e.g. a stop string in the first token: release both sides
                if streamer is not None:
                    streamer.requests.discard(wrid)
                    streamer.calls.cancel(wrid)
                p.calls.cancel(wrid)
        else:
            assert target is not None, "a request with no decode worker ends with its first token"
        for o in firsts:
            yield self._annotate(o, self.placed if o.finished else [])
        if not self.finished and self.later is not None:
            streamer = await self._kv_destination()
            self.placed.append(streamer)
            await self._call(streamer, self._reserve(streamer, p))

    def _first_outputs(self, result: PrefillResult) -> list[RequestOutput]:
        """The prefill worker's first token as an output, and a group's other samples' first tokens (drawn
        from the same logits there), each its own sample's."""
        req = self.req
        req.token_ids.append(result.first_token)
        if req.num_output_tokens == 1:
            req.num_cached_tokens = result.num_cached_tokens
        out = RequestOutput(req.request_id, [result.first_token], result.text, result.finish_reason,
                            req.num_prompt_tokens, req.num_output_tokens,
                            logprobs=None if result.logprobs is None else [result.logprobs],
                            prompt_logprobs=result.prompt_logprobs, weight_versions=[result.version],
                            routed_experts=relay(req.routed, [result.routed_experts]))
        return [out] + [RequestOutput(req.request_id, [o.token], o.text, o.finish_reason, req.num_prompt_tokens, 1,
                                      logprobs=None if o.logprobs is None else [o.logprobs], index=j,
                                      weight_versions=[result.version])
                        for j, o in enumerate(result.others, 1)]

    async def _stream(self) -> AsyncIterator[RequestOutput]:
        """The decode side of a one-sample attempt: the first token at once (colocated: TTFT), then
        stream_interval tokens a message, every token already here in one message (when the client or this
        loop lags behind the decode steps, a message's cost is paid once for all of them)."""
        req, q = self.req, self.inbox
        interval = self.parts.config.stream_interval
        first_decode = True
        logprobs_asked = req.params.logprobs is not None
        while not self.finished:
            await q.wait(1 if req.num_output_tokens == 0 else interval)
            tokens, versions, texts, routed = [], [], [], []
            logprobs: list[TokenLogprob] | None = [] if logprobs_asked else None
            prompt_logprobs: PromptLogprobs | None = None
            reason: FinishReason | None = None
            while q.items and reason is None:
                ev = q.take()
                if ev.request_id != self.wrid:
                    continue  # an earlier attempt's
                if isinstance(ev, Failure):
                    if tokens:  # after the tokens that came before it
                        q.items.appendleft(ev)
                        break
                    raise Retry(ev.reason, ev.detail, [w.worker_id for w in self.placed])
                if ev.token != NO_TOKEN:  # (an end with no token: a weight update aborted it)
                    tokens.append(ev.token)
                    versions.append(ev.version)
                texts.append(ev.text)
                if logprobs is not None and ev.logprobs is not None:
                    logprobs.append(ev.logprobs)
                if ev.prompt_logprobs is not None:  # a colocated worker's, with the first token
                    prompt_logprobs = ev.prompt_logprobs
                if ev.cached_tokens is not None:  # this worker computed the prompt (colocated, local prefill)
                    req.num_cached_tokens = ev.cached_tokens
                routed.append(ev.routed_experts)
                reason = ev.finish_reason
            if not tokens and reason is None:
                continue
            if first_decode:
                self._landed()
                first_decode = False
            req.token_ids += tokens
            self.finished = reason is not None
            out = RequestOutput(req.request_id, tokens, "".join(texts), reason, req.num_prompt_tokens,
                                req.num_output_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                weight_versions=versions, routed_experts=relay(req.routed, routed))
            yield self._annotate(out, self.placed if self.finished else [])

    async def _group_stream(self) -> AsyncIterator[RequestOutput]:
        """The decode-side stream of a group's attempt: each sample's events (its id "wrid~i" where the
        worker forked it) to one output per sample per wake-up, until every open sample has ended. A failure
        ends the attempt (Retry)."""
        group, q = self.req, self.inbox
        n = group.params.n
        streamed = self.open_samples is not None  # each sample's first token went out with the prefill result
        open_samples = set(range(n)) if self.open_samples is None else self.open_samples
        counts = [int(streamed)] * n
        interval = self.parts.config.stream_interval
        first_decode = True
        while open_samples:
            await q.wait(interval if streamed else 1)
            streamed = True
            batch, prompt_logprobs, failure = self._group_events(q)
            if batch and first_decode:
                self._landed()
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
                yield self._annotate(out, self.placed if reason is not None else [])
            if failure is not None:
                raise Retry(failure.reason, failure.detail, [w.worker_id for w in self.placed])

    def _group_events(self, q: Inbox) -> tuple[dict[int, tuple], PromptLogprobs | None, Failure | None]:
        """What a group's inbox holds for this attempt, by sample: (tokens, versions, texts, logprobs,
        [finish reason]); the prompt's logprobs (a colocated worker's, with sample 0's first token); the
        first failure, which ends the reading."""
        batch: dict[int, tuple[list[int], list[int], list[str], list[TokenLogprob], list]] = {}
        prompt_logprobs: PromptLogprobs | None = None
        while q.items:
            ev = q.take()
            base, i = group_of(ev.request_id)
            if base != self.wrid:
                continue  # an earlier attempt's
            if isinstance(ev, Failure):
                return batch, prompt_logprobs, ev
            tokens, versions, texts, logprobs, reason = batch.setdefault(i, ([], [], [], [], [None]))
            if ev.token != NO_TOKEN:  # (an end with no token: a weight update aborted it)
                tokens.append(ev.token)
                versions.append(ev.version)
            texts.append(ev.text)
            if ev.logprobs is not None:
                logprobs.append(ev.logprobs)
            if ev.prompt_logprobs is not None:
                prompt_logprobs = ev.prompt_logprobs
            if ev.cached_tokens is not None and i == 0:
                self.req.num_cached_tokens = ev.cached_tokens
            reason[0] = ev.finish_reason
        return batch, prompt_logprobs, None

    def _landed(self) -> None:
        """The first decode output has come: the KV landed, and the prefill worker's part is over."""
        if self.parts.config.mode != "colocated" and not self.local:
            self.placed[0].requests.discard(self.wrid)

    def _reserve(self, streamer: Worker, p: Worker, held: int = 0, version: int = 0) -> Any:
        """The decode worker's reservation of the KV that prefill worker p computes for this attempt's task
        (pushed as soon as the reservation reaches it): the same prompt and tokens, whenever it is made; all of
        it but the `held` leading blocks the decode worker's cache holds at weight version `version`."""
        known = p.worker_id in streamer.prefill_handles
        streamer.prefill_handles.add(p.worker_id)
        return streamer.calls.reserve(replace(self._decode_task(p.worker_id), held_blocks=held, held_version=version),
                                      None if known else p.handle)

    def _decode_task(self, prefill_worker: str, local: bool = False) -> DecodeTask:
        task = self.task
        return DecodeTask(task.request_id, task.prompt_token_ids, task.output_token_ids, task.params, task.seed,
                          prefill_worker, tier=self.req.tier, text_offset=task.text_offset, local=local)

    async def _kv_destination(self) -> Worker:
        """The decode worker place_kv finds, unless the attempt fails first (its prefill worker lost)."""
        later, q = self.later, self.inbox
        while not later.done():
            getter = asyncio.ensure_future(q.wait(1))
            await asyncio.wait([later, getter], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            if getter.exception() is not None:  # aborted (Streams.abort_all)
                raise getter.exception()
            while q.items:
                ev = q.take()
                if isinstance(ev, Failure) and ev.request_id == self.wrid:
                    raise Retry(ev.reason, ev.detail, [w.worker_id for w in self.placed])
                # anything else belongs to an earlier attempt: no token comes before the reservation
        try:
            return later.result()
        except PoolEmpty as e:
            raise self.parts.no_worker(e.pool) from None

    async def _call(self, w: Worker, call: Awaitable) -> Any:
        """Await a call on a worker's link; a dead worker makes the attempt retry (and the worker be
        replaced). A ValueError (the worker refused the request itself) is the caller's error."""
        try:
            return await call
        except LinkClosed as e:
            self.parts.pools.lose(w, f"dead: {e}")
            raise Retry(LOST[w.pool], f"worker {w.worker_id} died", [w.worker_id]) from e
        except CallFailed as e:
            # Its step failed (the worker failed the whole batch and goes on serving): place it again.
            raise Retry(FailureReason.STEP_FAILED, str(e), [w.worker_id]) from e

    async def _alive(self, pool: str) -> list[Worker]:
        workers = await self.parts.pools.alive(pool)
        if not workers:
            raise self.parts.no_worker(pool)
        return workers

    def _annotate(self, out: RequestOutput, placed: list[Worker]) -> RequestOutput:
        out.num_cached_tokens = self.req.num_cached_tokens
        out.placement = tuple(w.worker_id for w in placed)
        out.service_tier = ServiceTier.of_rank(self.req.tier).value
        return out

    def _release(self) -> None:
        """The attempt is over: its id leaves the inboxes' map, its place in line is given up, and its workers
        free what they hold for it unless it finished there."""
        wrid, later = self.wrid, self.later
        self.parts.streams.ended(wrid)
        if later is not None and not later.done():
            later.cancel()  # its place in line is given up (Dispatch._wait)
        elif later is not None and not later.cancelled() and later.exception() is None \
                and later.result() not in self.placed:
            later.result().requests.discard(wrid)  # chosen as the attempt ended: nothing reserved there
        self.parts.dispatch.released(wrid)
        for w in self.placed:
            w.requests.discard(wrid)
            w.flex.discard(wrid)
            if not self.finished and w.alive:
                w.calls.cancel(wrid)  # a retry, the client went away, or an error: free its KV
        if self.placed:
            self.parts.pools.notify()  # room on its workers
