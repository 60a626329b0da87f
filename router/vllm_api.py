"""vLLM's token-in/token-out route and its RL control routes, so that frameworks written for a vLLM server
(SkyRL's RemoteInferenceClient, verifiers' TrainClient) drive pdserve as they are.

POST /inference/v1/generate (the inference role): {"token_ids", "sampling_params" (vLLM's names: max_tokens,
min_tokens, temperature, top_p, top_k, min_p, seed, n, stop, stop_token_ids, ignore_eos, the three penalties,
logprobs, prompt_logprobs, include_stop_str_in_output, skip_special_tokens), "model"?, "request_id"?} ->
{"request_id", "choices": [{"index", "token_ids", "finish_reason", "logprobs": {"content": [{"token":
"token_id:<id>", "logprob", "bytes": null, "top_logprobs": [...]}]} or null}], "prompt_logprobs": null or
[null, {"<id>": {"logprob", "rank", "decoded_token": "token_id:<id>"}}, ...]} (vLLM's shape; each choice also
has "weight_versions", pdserve's, the weight version that sampled each token). With "stream": true, vLLM's
server-sent events: each `data: {"request_id", "choices": [{"index", "token_ids", "logprobs", "finish_reason",
"weight_versions"}]}` holds a sample's new tokens only (finish_reason set on its last chunk), `stream_options`
{"include_usage", "continuous_usage_stats"} add the usage (a last chunk with no choices; each chunk's), then
`data: [DONE]`.

The control routes (admin): /pause?mode=abort|wait|keep (vLLM's defaults: mode abort and clear_cache=true, which
flushes the prefix caches once paused, except under keep; wait_for_inflight_requests=true is mode wait),
/resume, /is_paused, /get_world_size (the workers' ranks), /reset_prefix_cache (every worker's prefix cache
flushed, and the router's record of it; refused while a request holds KV). vLLM's weight-transfer routes and
/weight_info: router.vllm_weights_api.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from pdserve.engine.logprobs import TokenLogprob
from router.admission import Ask
from router.frontend import Frontend
from router.openai_choices import MIN_LOGPROB
from router.openai_schema import HTTPError
from router.rl_runs import Sample, collect, flush_prefix_caches, new_id, prepare_runs, samples_of, sse, \
    stream_samples
from router.weights import WeightControl

DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default


class VLLMSampling(BaseModel):
    """vLLM's SamplingParams, the fields pdserve has (an unknown one is a 400 naming it)."""

    model_config = ConfigDict(extra="forbid")
    n: int = 1
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: Literal[True] = True
    detokenize: Literal[True] = True

    def sampling(self) -> dict[str, Any]:
        fields = self.model_dump(exclude={"spaces_between_special_tokens", "detokenize", "stop", "stop_token_ids"})
        fields["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        fields["stop_token_ids"] = tuple(self.stop_token_ids or ())
        # -1 is "every logprob" in vLLM: the bound here is the server's
        for name in ("logprobs", "prompt_logprobs"):
            if fields[name] == -1:
                raise HTTPError(400, f"sampling_params.{name}: -1 (the whole vocabulary) is not supported; give k",
                                param=f"sampling_params.{name}")
        return fields


class StreamOptions(BaseModel):
    """vLLM's stream_options: a last chunk with the usage (include_usage), and each chunk's (continuous_usage_stats,
    with include_usage)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_ids: list[int]
    sampling_params: VLLMSampling = VLLMSampling()
    model: str | None = None
    request_id: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: None = None
    priority: Literal[0] = 0
    kv_transfer_params: None = None
    features: None = None


def _logprobs(logprobs: list[TokenLogprob], k: int) -> dict:
    def entry(token: int, logprob: float) -> dict:
        return {"token": f"token_id:{token}", "logprob": max(logprob, MIN_LOGPROB), "bytes": None}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, x) for t, x in lp.top[:k]]}
                        for lp in logprobs]}


def _usage(s: Sample) -> dict:
    return {"prompt_tokens": len(s.prompt), "completion_tokens": len(s.ids),
            "total_tokens": len(s.prompt) + len(s.ids)}


async def _chunks(runs, rid: str, k: int | None, options: StreamOptions | None):
    """vLLM's stream: a chunk per sample's new tokens (token_ids, logprobs and pdserve's weight_versions of those
    tokens alone; finish_reason on the last), then the usage as asked. k: the logprobs' top count."""
    usage = bool(options and options.include_usage)
    each = usage and bool(options.continuous_usage_stats)
    samples = samples_of(runs)
    sent = [0] * len(samples)
    async for j in stream_samples(runs, samples):
        s, start = samples[j], sent[j]
        if len(s.ids) == start and s.finish is None:
            continue
        sent[j] = len(s.ids)
        choice = {"index": j, "token_ids": s.ids[start:], "finish_reason": s.finish.value if s.finish else None,
                  "logprobs": _logprobs(s.logprobs[start:], k) if k is not None else None,
                  "weight_versions": s.versions[start:]}
        yield {"request_id": rid, "choices": [choice], **({"usage": _usage(s)} if each else {})}
    if usage:
        prompt, done = (len(samples[0].prompt) if samples else 0), sum(len(s.ids) for s in samples)
        yield {"request_id": rid, "choices": [],
               "usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}}


def _prompt_logprobs(s: Sample) -> list | None:
    if s.prompt_logprobs is None:
        return None
    out: list = []
    for lp in s.prompt_logprobs:
        if lp is None:
            out.append(None)
            continue
        d = {str(lp.token_id): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank,
                                "decoded_token": f"token_id:{lp.token_id}"}}
        for rank, (t, x) in enumerate(lp.top, 1):
            d.setdefault(str(t), {"logprob": max(x, MIN_LOGPROB), "rank": rank, "decoded_token": f"token_id:{t}"})
        out.append(d)
    return out


def generate_routes(front: Frontend, names: set[str]) -> APIRouter:
    routes = APIRouter()

    @routes.post("/inference/v1/generate")
    async def generate(body: GenerateRequest, request: Request):
        if body.model is not None and body.model not in names:
            raise HTTPError(404, f"the model {body.model!r} does not exist; this server has {sorted(names)[0]!r}",
                            param="model", code="model_not_found", grpc_code="NOT_FOUND")
        if body.stream_options is not None and not body.stream:
            raise HTTPError(400, "stream_options: only with stream true", param="stream_options")
        sp = body.sampling_params
        ask = Ask(token_ids=body.token_ids, sampling=sp.sampling(), default_max_tokens=DEFAULT_MAX_TOKENS,
                  request_id=body.request_id)
        rid = body.request_id or new_id()
        runs = await prepare_runs(front, [ask], rid)
        if body.stream:
            await runs.start()
            return StreamingResponse(sse(runs, _chunks(runs, rid, sp.logprobs, body.stream_options)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        samples = await collect(runs, request)
        choices = [{"index": j, "token_ids": s.ids, "finish_reason": s.finish.value if s.finish else None,
                    "logprobs": _logprobs(s.logprobs, sp.logprobs) if sp.logprobs is not None else None,
                    "weight_versions": s.versions} for j, s in enumerate(samples)]
        return JSONResponse({"request_id": rid, "choices": choices,
                             "prompt_logprobs": _prompt_logprobs(samples[0]) if samples else None,
                             "kv_transfer_params": None})

    return routes


def add_control_routes(control: APIRouter, weights: WeightControl) -> None:
    """vLLM's RL control routes on the router's http_control (admin only)."""

    @control.post("/pause")
    async def pause(mode: Literal["keep", "wait", "abort"] = "abort", clear_cache: bool = True,
                    wait_for_inflight_requests: bool = False):
        # vLLM's defaults: abort, caches cleared (not under keep); wait_for_inflight_requests is its older "wait"
        if wait_for_inflight_requests:
            mode = "wait"
        await weights.pause(mode)
        if clear_cache and mode != "keep":
            ok, message = await flush_prefix_caches(weights.cluster)
            if not ok:
                return JSONResponse({"status": "paused", "cache_cleared": False, "message": message}, status_code=409)
        return {"status": "paused", "mode": mode}

    @control.post("/resume")
    async def resume():
        await weights.resume()
        return {"status": "resumed"}

    @control.get("/is_paused")
    async def is_paused():
        return {"is_paused": weights.paused}

    @control.get("/get_world_size")
    async def get_world_size():
        versions = await weights.versions()
        return {"world_size": sum(v.ranks for v in versions)}

    @control.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        ok, message = await flush_prefix_caches(weights.cluster)
        if not ok:
            return JSONResponse({"success": False, "message": message}, status_code=409)
        return {"success": True, "message": message}
