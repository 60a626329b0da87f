"""What the RL frameworks' routes share: a request's samples gathered as they stream, and the flush of every
worker's prefix cache.

SGLang's /generate (router.sglang_api) and vLLM's /inference/v1/generate (router.vllm_api) run their requests
through the same front as the OpenAI door (its _Run and _Runs: admission, the cluster, the timeline, the
errors as HTTP errors); what they answer is each sample's tokens, their logprobs and weight versions, its
finish, and the prompt's logprobs, gathered here (Sample) and shaped there; streamed, as server-sent events
framed here (sse).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request

from pdserve.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import FinishReason
from pdserve.engine.routed_experts import RoutedExperts
from router.admission import Ask
from router.frontend import Frontend
from router.openai_api import _Run, _Runs
from router.openai_schema import HTTPError
from router.tracking import Timeline

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One sample of one prompt as its outputs came: its tokens, text, logprobs, versions and finish."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    cached: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    routed: list[RoutedExperts] = field(default_factory=list)  # with return_routed_experts, as they came

    def add(self, out: RequestOutput, prompt_logprobs: PromptLogprobs | None) -> None:
        self.ids += out.new_token_ids
        if out.routed_experts is not None:
            self.routed.append(out.routed_experts)
        self.text += out.new_text
        self.logprobs += out.logprobs or ()
        self.versions += out.weight_versions
        self.cached = out.num_cached_tokens or self.cached
        self.prompt_logprobs = prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs
        if out.finish_reason is not None:
            self.finish = out.finish_reason


def check_serving(front: Frontend) -> None:
    if not front.serving:
        raise HTTPError(503, "the router is draining; retry on another replica", kind="server_error",
                        grpc_code="UNAVAILABLE")


async def prepare_runs(front: Frontend, asks: list[Ask], rid: str) -> _Runs:
    """The requests checked (ValueError: a 400 with its message) and made runs, one per prompt."""
    check_serving(front)
    try:
        prepared = [await front.prepare_compiled(ask) for ask in asks]
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
    return _Runs([_Run(front, Timeline("http"),
                       replace(p, request_id=p.request_id or (rid if len(prepared) == 1 else f"{rid}.{i}")))
                  for i, p in enumerate(prepared)])


def samples_of(runs: _Runs) -> list[Sample]:
    """Every run's samples, prompt i's sample j at i * n + j (once the runs have started: prompts tokenized)."""
    return [Sample(list(run.request.prompt or ())) for run in runs.runs for _ in range(run.request.params.n)]


async def stream_samples(runs: _Runs, samples: list[Sample]) -> AsyncIterator[int]:
    """Add each output to its sample as it comes (runs started); yields the sample's index after each."""
    async with contextlib.aclosing(runs.outputs()) as outs:
        async for i, out in outs:
            run = runs.runs[i]
            k = i * run.request.params.n + out.index
            samples[k].add(out, run.prompt_logprobs)
            yield k


async def collect(runs: _Runs, request: Request) -> list[Sample]:
    """A non-streamed request run whole, cancelled on every worker if its client goes away meanwhile."""
    samples: list[Sample] = []

    async def gather() -> None:
        await runs.start()
        samples.extend(samples_of(runs))
        async for _ in stream_samples(runs, samples):
            pass

    await runs.whole(request, gather)
    return samples


async def sse(runs: _Runs, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events: each chunk (made from the runs' outputs) as `data: {json}`, then `data: [DONE]`; a
    failure of the workers mid-stream as an error event instead. The runs are closed with how they ended."""
    code = "OK"
    try:
        async with contextlib.aclosing(chunks) as events:
            async for chunk in events:
                yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    except HTTPError as e:
        code = e.grpc_code
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind}})}\n\n"
    finally:
        await runs.close(code)


def new_id() -> str:
    return uuid.uuid4().hex


async def flush_prefix_caches(cluster) -> tuple[bool, str]:
    """Forget every worker's prefix cache, and the router's record of it (router.kv_index, the placement
    estimate). A worker flushes only while it holds no request's KV (pdserve.engine.block_pool): (False, why)
    where one could not; the others are flushed all the same."""
    workers = [w for w in cluster.scaling.workers if w.alive]
    results = await asyncio.gather(*(w.handle.flush_prefix_cache.remote() for w in workers), return_exceptions=True)
    busy, failed = [], []
    for w, r in zip(workers, results):
        if r is True:
            cluster.dispatch.forget_cache(w.worker_id)
        elif r is False:
            busy.append(w.worker_id)
        else:
            failed.append(w.worker_id)
            log.warning("flush of %s's prefix cache failed: %s", w.worker_id, r)
    if busy or failed:
        why = []
        if busy:
            why.append(f"{len(busy)} of {len(workers)} workers hold running requests' KV ({', '.join(busy)}); "
                       "flush when idle (pause with mode wait or abort first)")
        if failed:
            why.append(f"{len(failed)} workers did not answer ({', '.join(failed)})")
        return False, "; ".join(why)
    return True, f"the prefix caches of {len(workers)} workers flushed"
