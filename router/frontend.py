"""The one front behind both doors: a request's checks, admission, its run through the cluster, and the counts.

The gRPC door (router.grpc_api) and the HTTP door (router.openai_api) each turn their wire format into an
Ask (router.admission) and the outputs back into theirs; everything between is here, once: the request's
fields into token ids and sampling parameters (with the server's defaults), its tier, admission (flex has
one of its own, so flex never takes the other tiers' places), the cluster's stream of outputs recorded on
the request's timeline, the queue counts and pool sizes the metrics and the status read, the autoscaler
that follows the demand seen here, and whether the router still serves (a drain turns it off for both).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from pdserve.engine.grammar import Grammars
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import ModelInfo
from pdserve.serving.messages import WorkerStats
from pdserve.tiers import ServiceTier, parse_tier
from router.admission import Admission, Ask, Checked, Overloaded, RequestFailed, check, finish, tokenize
from router.autoscaler import AutoscaleLoop
from router.chat_reply import ReplyPlan, plan
from router.cluster import Cluster
from router.config import RouterConfig
from router.metrics import PoolScale, RouterMetrics
from router.workers import Worker
from router.tool_parsers import KEEPS_SPECIAL_TOKENS, detect
from router.tracking import Timeline


@dataclass
class Prepared:
    """A request the front has checked: its prompt's token ids, sampling parameters, tier and id. A prompt of
    text is tokenized once the request is admitted (Frontend.run): until then `prompt` is None and `params`
    provisional (chat's default max_tokens is the rest of the context); both are final once run() yields."""

    checked: Checked
    prompt: list[int] | None
    params: SamplingParams
    tier: ServiceTier
    request_id: str | None
    session_id: str | None = None
    reply: ReplyPlan | None = None  # a chat's replies read for reasoning and tool calls (router.chat_reply)


def _without_tokens(out: RequestOutput) -> RequestOutput:
    """A prompt-only request's output (Ask.prompt_only): the token it was run for dropped, the prompt's logprobs
    and the finish kept."""
    return replace(out, new_token_ids=[], new_text="", num_output_tokens=0, weight_versions=[],
                   logprobs=None if out.logprobs is None else [])


@dataclass(frozen=True)
class PoolView:
    """One pool as the status shows it: its scale, its members (ready, starting, draining) with each one's
    state and its latest stats (None while it starts)."""

    scale: PoolScale
    members: list[tuple[Worker, WorkerStats | None]]


class Frontend:
    def __init__(self, cluster: Cluster, config: RouterConfig, metrics: RouterMetrics | None = None):
        self.cluster = cluster
        self.config = config
        self.metrics = metrics
        self.admission = Admission(config.max_running, config.max_queued)
        self.flex_admission = Admission(config.max_running, cluster.config.tiers.flex_max_queued)
        self._waiting: collections.Counter[ServiceTier] = collections.Counter()  # for admission, by tier
        self.serving = True
        self._defaults = dict(logprobs_mode=config.logprobs_mode, version_policy=config.version_policy)
        self.tool_call_parser = tool_call_parser(config.tool_call_parser, cluster.info.tokenizer)
        # One thread: HF tokenizers are not to be entered by two threads at once ("Already borrowed"), and the
        # event loop is what must stay free; requests tokenize in admission order.
        self._tokenizer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        # Structured output specs compiled here too (a bounded cache), so that one that does not compile is
        # refused before any work; the workers compile their own.
        info = cluster.info
        self.grammars = Grammars(info.tokenizer, info.config.vocab_size, info.eos_token_ids) \
            if info is not None and info.tokenizer is not None else None
        # Autoscaled pools follow the demand seen here (the admission queue included).
        self.autoscaler = AutoscaleLoop(cluster, lambda: self.admitting) if cluster.config.ranges else None
        if metrics is not None:
            metrics.running.set_function(lambda: self.admitted)
            metrics.queued.set_function(lambda: self.admitting)
            metrics.tier_queued(self.queued)

    @property
    def info(self) -> ModelInfo:
        return self.cluster.info

    def prepare(self, ask: Ask) -> Prepared:
        """The request checked (router.admission.check: every field, the server's defaults where it gave none)
        and its tier; token ids given are checked against the context here too. ValueError says what is wrong,
        naming the field. Text is tokenized later, once admitted (run)."""
        defaults = self._defaults
        if self.tool_call_parser in KEEPS_SPECIAL_TOKENS and ask.tools and ask.tool_choice != "none":
            defaults = {**defaults, "skip_special_tokens": False}  # the reply's calls are read by their markers
        checked = check(self.info, self.config.max_input_chars, ask, defaults)
        prompt, params = finish(self.info, checked, list(ask.token_ids)) if ask.token_ids is not None \
            else (None, checked.params)
        reply = plan(checked.tools, self.tool_call_parser, self.config.reasoning_parser) \
            if ask.messages is not None else None
        return Prepared(checked, prompt, params, parse_tier(ask.service_tier), ask.request_id, ask.session_id, reply)

    async def prepare_compiled(self, ask: Ask) -> Prepared:
        """prepare, then the request's structured output compiled (check_structured): both doors' checks."""
        prepared = self.prepare(ask)
        await self.check_structured(prepared.params)
        return prepared

    async def check_structured(self, params: SamplingParams) -> None:
        """A request's structured output (if it asks for one) compiled with the model's tokenizer on the front's
        tokenizer thread (a schema takes milliseconds; the tokenizer's view, once, a tenth of a second), not on
        the event loop; ValueError (pdserve.engine.grammar.GrammarError) saying why one does not compile."""
        if params.structured is None:
            return
        if self.grammars is None:
            raise ValueError("structured output needs the model's tokenizer, and this model has none")
        await asyncio.get_running_loop().run_in_executor(self._tokenizer, self.grammars.compile, params.structured)

    async def _tokenized(self, request: Prepared) -> None:
        """A text prompt's token ids and its final parameters, into the request: rendered and tokenized on the
        front's tokenizer thread, not the event loop every stream of both doors is served from (a million
        characters take about a second). ValueError: the prompt does not fit the context, ..."""
        if request.prompt is None:
            ids = await asyncio.get_running_loop().run_in_executor(self._tokenizer, tokenize, self.info,
                                                                   request.checked.ask, request.checked.tools)
            request.prompt, request.params = finish(self.info, request.checked, ids)

    async def run(self, request: Prepared, t: Timeline) -> AsyncIterator[RequestOutput]:
        """A checked request through admission and the cluster: its outputs, recorded on its timeline as
        they stream. A text prompt is tokenized once admitted (request.prompt and request.params are final from
        the first output on). Raises Overloaded (the admission queue is full, or flex's queue is), ValueError
        (the checks that need the prompt's ids: context length, logprob entries; the cluster's own: a
        duplicate request id, ...) or RequestFailed (the workers failed it). Closing it early cancels the
        request on every worker."""
        tier = request.tier
        t.service_tier = t.served_tier = tier.value
        bound = self.cluster.config.tiers.flex_max_queued
        if tier is ServiceTier.FLEX and self.queued(tier) >= bound:
            raise Overloaded(f"the flex tier's queue is full ({bound} waiting); retry later")
        admission = self.flex_admission if tier is ServiceTier.FLEX else self.admission
        self._waiting[tier] += 1
        waiting = True
        try:
            async with admission.slot():
                self._waiting[tier] -= 1
                waiting = False
                t.admitted = time.monotonic()
                await self._tokenized(request)  # only once admitted: a queued request costs no tokenizing
                t.prompt_tokens = len(request.prompt)
                outs = self.cluster.generate(request.prompt, request.params, request.request_id, tier,
                                             request.session_id)
                async with contextlib.aclosing(outs):
                    async for out in outs:
                        if request.checked.ask.prompt_only:
                            out = _without_tokens(out)
                        self._observe(out, t)
                        yield out
        finally:
            if waiting:
                self._waiting[tier] -= 1

    @staticmethod
    def _observe(out: RequestOutput, t: Timeline) -> None:
        t.served_tier = out.service_tier
        if out.finish_reason is FinishReason.ERROR:
            t.finish_reason = "error"
            raise RequestFailed(out.error or "the request failed on a worker")
        t.tokens(len(out.new_token_ids))
        t.token_versions += out.weight_versions
        if out.finish_reason is not None:
            t.finish_reason = out.finish_reason.value

    # -- counts -------------------------------------------------------------------------------------
    @property
    def admitted(self) -> int:
        """Requests admitted to the cluster, every tier's admission together."""
        return self.admission.running + self.flex_admission.running

    @property
    def admitting(self) -> int:
        """Requests waiting for admission, every tier's together."""
        return self.admission.queued + self.flex_admission.queued

    def queued(self, tier: ServiceTier) -> int:
        """Requests of a tier waiting: for admission, or in the cluster's line for workers."""
        return self._waiting[tier] + self.cluster.queued(tier)

    def pool_scale(self) -> list[PoolScale]:
        """Each pool's size by state, its target and range, its scale events and start-up times."""
        pools, out = self.cluster.scaling, []
        for name, pc in self.cluster.config.pools.items():
            lo, hi = pc.num_workers, max(pc.num_workers, pc.max_workers or 0)
            desired = self.autoscaler.desired(name) if self.autoscaler is not None else None
            events = {(d, r): n for (p, d, r), n in pools.scale_events.items() if p == name}
            out.append(PoolScale(name, len(pools.by_name[name]), len(pools.starting[name]),
                                 sum(w.pool == name for w in pools.draining),
                                 desired if desired is not None else pools.size(name) if lo < hi else lo,
                                 lo, hi, tuple(pools.start_seconds[name]), events,
                                 self.cluster.config.engine_for(pc).tensor_parallel_size))
        return out

    async def pools(self) -> list[PoolView]:
        """Every pool with its members and their fresh stats (one call to each worker)."""
        stats = {s.worker_id: s for s in await self.cluster.stats()}
        pools, out = self.cluster.scaling, []
        for scale in self.pool_scale():
            name = scale.pool
            members = pools.starting[name] + pools.by_name[name] + [w for w in pools.draining if w.pool == name]
            out.append(PoolView(scale, [(w, stats.get(w.worker_id)) for w in members]))
        return out

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.start()

    async def drain(self) -> None:
        """Refuse new requests at both doors; the pools keep their size while the router drains."""
        self.serving = False
        if self.autoscaler is not None:
            await self.autoscaler.stop()

    def close(self) -> None:
        """After the drain: the tokenizer's thread ends."""
        self._tokenizer.shutdown(wait=False)


def tool_call_parser(name: str, tokenizer) -> str:
    """The family --tool-call-parser names; auto: the one the model's chat template and vocabulary say
    (router.tool_parsers.detect)."""
    if name != "auto":
        return name
    if tokenizer is None:
        return "hermes"
    special = {t.content for t in tokenizer.hf_tokenizer.added_tokens_decoder.values() if t.special}
    return detect(tokenizer.chat_template, special)
