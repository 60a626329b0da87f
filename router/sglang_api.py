"""SGLang's native routes, so that RL frameworks written for an SGLang server drive pdserve as they are.

POST /generate (the inference role): one prompt or a batch, as `text` or `input_ids`, `sampling_params` by
SGLang's names (max_new_tokens, min_new_tokens, temperature, top_p, top_k, min_p, stop, stop_token_ids,
ignore_eos, skip_special_tokens, no_stop_trim, n, sampling_seed, the three penalties, json_schema / regex /
ebnf), `return_logprob` with `top_logprobs_num`, `logprob_start_len` (the prompt's logprobs from that
position; -1, the default: none), `return_text_in_logprobs`, `rid` and `stream`. The answer is SGLang's:
{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
"cached_tokens", "weight_version", "e2e_latency", and with return_logprob "output_token_logprobs"
[[logprob, id, text or null], ...], "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"}};
a batch (at most router.config.MAX_PROMPTS prompts), or n > 1, is a list, prompt i's sample j at i * n + j.
finish_reason is {"type": "stop", "matched": the token id or stop string}, {"type": "length", "length": tokens} or {"type": "abort", "message"} (a pause
with mode abort, a weight update: the client resubmits with the tokens so far). meta_info also has
"output_weight_versions", the weight version that sampled each output token (pdserve's own). With
`return_routed_experts` (a mixture-of-experts model), meta_info's "routed_experts" is SGLang's: base64 of the
int32 [positions][moe layers][top_k] of every token but the last, prompt then output
(pdserve.engine.routed_experts). Streamed:
server-sent events, each `data: {json}` the sample's answer so far (text, ids and logprobs cumulative, as
SGLang's default), "index" naming the sample in a batch, then `data: [DONE]`.

The control routes (admin, router.http_limits.Roles) are added to the router's http_control:
/pause_generation (mode abort, in_place or retract: the latter two keep requests where they are),
/continue_generation, /update_weights_from_disk (router.weights: a checkpoint under the weights root, its
version the client's weight_version or the next), /flush_cache (every worker's prefix cache, when idle),
/get_model_info, /get_server_info, /get_weight_version, /health_generate (one token generated), and
/release_memory_occupation and /resume_memory_occupation answered 501 (pdserve has no sleep mode).

A field SGLang has and pdserve does not do (image_data, lora_path, return_hidden_states, ...) is refused
by name when set; an unknown field is a 400 naming it.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.request import FinishReason
from pdserve.engine.routed_experts import join
from pdserve.engine.structured import StructuredOutput
from router.admission import Ask
from router.config import MAX_PROMPTS
from router.frontend import Frontend
from router.openai_choices import MIN_LOGPROB, Vocab
from router.openai_schema import HTTPError
from router.rl_runs import Sample, check_serving, collect, flush_prefix_caches, new_id, prepare_runs, samples_of, \
    sse, stream_samples
from router.weights import WeightControl

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's

# Fields of SGLang's request that pdserve does not do: refused when set (null, false and empty pass).
_NOT_DONE = {
    "image_data": "images are not supported (text models only)",
    "video_data": "video is not supported", "audio_data": "audio is not supported",
    "input_embeds": "input embeddings are not supported: send input_ids",
    "lora_path": "LoRA adapters are not supported",
    "return_hidden_states": "hidden states are not returned",
    "custom_logit_processor": "custom logit processors are not supported",
    "token_ids_logprob": "logprobs of chosen token ids are not supported: use top_logprobs_num",
    "session_params": "sessions are not supported", "data_parallel_rank": "placement is the router's",
    "bootstrap_host": "disaggregation is pdserve's own", "bootstrap_port": "disaggregation is pdserve's own",
    "bootstrap_room": "disaggregation is pdserve's own",
}
_SAMPLING_NOT_DONE = {
    "logit_bias": "logit bias is not supported", "custom_params": "custom parameters are not supported",
    "structural_tag": "structural tags are not supported", "spaces_between_special_tokens":
    "special tokens are decoded without spaces between them (only true is taken)",
}


class SGLangSampling(BaseModel):
    """SGLang's sampling_params (its names and defaults)."""

    model_config = ConfigDict(extra="allow")
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stream_interval: int | None = None  # a pacing hint of SGLang's: every token is streamed here

    def sampling(self, vocab_size: int, where: str) -> dict[str, Any]:
        """SamplingParams' fields (router.admission.Ask.sampling)."""
        for name, value in (self.model_extra or {}).items():
            why = _SAMPLING_NOT_DONE.get(name)
            if why is None:
                raise HTTPError(400, f"{where}.{name}: unknown field", param=f"{where}.{name}")
            if value not in (None, {}, [], True if name == "spaces_between_special_tokens" else None):
                raise HTTPError(400, f"{where}.{name}: {why}", param=f"{where}.{name}")
        structured = [(k, getattr(self, k)) for k in ("json_schema", "regex", "ebnf") if getattr(self, k)]
        if len(structured) > 1:
            raise HTTPError(400, f"{where}: give one of json_schema, regex and ebnf", param=where)
        kind = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
        return dict(
            max_tokens=self.max_new_tokens, min_tokens=self.min_new_tokens,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()), temperature=self.temperature, top_p=self.top_p,
            # SGLang clamps top_k to the vocabulary (clients send 1e8 for "off"): all of it is no filter.
            top_k=0 if self.top_k >= vocab_size else self.top_k, min_p=self.min_p,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.no_stop_trim,
            n=self.n, seed=self.sampling_seed,
            structured=StructuredOutput(kind[structured[0][0]], structured[0][1]) if structured else None)


class GenerateReqInput(BaseModel):
    """SGLang's /generate body: one prompt or a batch (lists), per-prompt fields either one value or a list."""

    model_config = ConfigDict(extra="allow")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSampling | list[SGLangSampling] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    # Every token's top-k experts in each MoE layer (pdserve.engine.routed_experts): meta_info.routed_experts.
    return_routed_experts: bool | list[bool] = False
    stream: bool = False
    rid: str | list[str] | None = None
    log_metrics: bool = True  # SGLang's logging switch: the router's metrics count every request
    priority: int | None = None

    def refused(self) -> None:
        for name, value in (self.model_extra or {}).items():
            why = _NOT_DONE.get(name)
            if why is None:
                raise HTTPError(400, f"unknown field {name!r}", param=name)
            if value not in (None, False, [], {}, ""):
                raise HTTPError(400, f"{name}: {why}", param=name)
        if self.priority is not None:
            raise HTTPError(400, "priority: use pdserve's service tiers (the OpenAI door's service_tier)",
                            param="priority")

    def prompts(self) -> tuple[list[str] | list[list[int]], bool]:
        """The prompts, and whether the request is a batch."""
        if (self.text is None) == (self.input_ids is None):
            raise HTTPError(400, "give one of text and input_ids", param="text")
        if self.text is not None:
            return ([self.text], False) if isinstance(self.text, str) else (self.text, True)
        ids = self.input_ids
        if ids and isinstance(ids[0], list):
            return ids, True
        return [ids], False

    def per(self, name: str, i: int, count: int):
        """A per-prompt field's value for prompt i: the one value, or the list's i-th."""
        value = getattr(self, name)
        if not isinstance(value, list):
            return value
        if len(value) != count:
            raise HTTPError(400, f"{name} has {len(value)} entries for {count} prompts", param=name)
        return value[i]


def generate_asks(body: GenerateReqInput, vocab_size: int) -> tuple[list[Ask], list[tuple[bool, int, int]], bool]:
    """The body's requests, each prompt's (return_logprob, logprob_start_len, top_logprobs_num), and whether
    it is a batch."""
    body.refused()
    prompts, batch = body.prompts()
    field = "text" if body.text is not None else "input_ids"
    if not prompts:
        raise HTTPError(400, "the batch is empty", param=field)
    if len(prompts) > MAX_PROMPTS:
        raise HTTPError(400, f"{field} has {len(prompts)} prompts; the most is {MAX_PROMPTS}", param=field)
    asks, logprob = [], []
    for i, p in enumerate(prompts):
        sp = body.per("sampling_params", i, len(prompts)) or SGLangSampling()
        want, start, k = (body.per(name, i, len(prompts)) for name in
                          ("return_logprob", "logprob_start_len", "top_logprobs_num"))
        if not isinstance(k, int) or k < 0:
            raise HTTPError(400, f"top_logprobs_num must be >= 0, got {k}", param="top_logprobs_num")
        if start < -1:
            raise HTTPError(400, f"logprob_start_len must be >= -1, got {start}", param="logprob_start_len")
        sampling = sp.sampling(vocab_size, "sampling_params")
        if want:
            sampling["logprobs"] = k
            if start >= 0:
                sampling["prompt_logprobs"] = k
        if body.per("return_routed_experts", i, len(prompts)):
            sampling["return_routed_experts"] = True
        rid = body.per("rid", i, len(prompts))
        asks.append(Ask(prompt=p if isinstance(p, str) else None, token_ids=None if isinstance(p, str) else list(p),
                        sampling=sampling, default_max_tokens=DEFAULT_MAX_NEW_TOKENS, request_id=rid,
                        prompts=len(prompts)))
        logprob.append((bool(want), start, k))
    return asks, logprob, batch


def finish_reason(s: Sample, stop_ids: set[int], stops: tuple[str, ...], tokenizer) -> dict | None:
    """SGLang's finish_reason of a sample."""
    f = s.finish
    if f is None:
        return None
    if f is FinishReason.LENGTH:
        return {"type": "length", "length": len(s.ids)}
    if f is FinishReason.STOP:
        if s.ids and s.ids[-1] in stop_ids:
            return {"type": "stop", "matched": s.ids[-1]}
        if stops and tokenizer is not None:  # the stop string the output's text met first
            text = tokenizer.decode(s.ids, skip_special_tokens=False)
            found = [(text.find(x), x) for x in stops if x in text]
            if found:
                return {"type": "stop", "matched": min(found)[1]}
        return {"type": "stop", "matched": s.ids[-1] if s.ids else None}
    why = "aborted: the server paused with mode abort or a weight update ended it; resubmit with its tokens" \
        if f is FinishReason.ABORT else f"the request ended: {f.value}"
    return {"type": "abort", "message": why}


class Shaper:
    """Samples as SGLang's answers."""

    def __init__(self, front: Frontend):
        info = front.info
        self.tokenizer = info.tokenizer
        self.eos = set(info.eos_token_ids)
        self.vocab = Vocab(info.tokenizer)

    def _entry(self, logprob: float | None, token: int, text: bool) -> list:
        return [None if logprob is None else max(logprob, MIN_LOGPROB), token,
                self.vocab.text(token) if text else None]

    def _top(self, lp: TokenLogprob | None, k: int, text: bool) -> list | None:
        if lp is None or k == 0:
            return None
        return [self._entry(x, t, text) for t, x in lp.top[:k]]

    def answer(self, s: Sample, rid: str, params, logprob: tuple[bool, int, int], text: bool, t0: float) -> dict:
        want, start, k = logprob
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos)
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": finish_reason(s, stop_ids, params.stop, self.tokenizer),
            "prompt_tokens": len(s.prompt), "completion_tokens": len(s.ids), "cached_tokens": s.cached,
            "weight_version": str(s.versions[-1]) if s.versions else None,
            "output_weight_versions": s.versions, "e2e_latency": time.monotonic() - t0}
        if want:
            meta["output_token_logprobs"] = [self._entry(lp.logprob, lp.token_id, text) for lp in s.logprobs]
            meta["output_top_logprobs"] = [self._top(lp, k, text) for lp in s.logprobs]
            prompt = s.prompt_logprobs or ()
            first = start if start >= 0 else len(s.prompt)
            meta["input_token_logprobs"] = [self._entry(prompt[i].logprob if prompt[i] is not None else None,
                                                        s.prompt[i], text)
                                            for i in range(first, len(prompt))]
            meta["input_top_logprobs"] = [self._top(prompt[i], k, text) for i in range(first, len(prompt))]
        if params.return_routed_experts:  # SGLang's form: base64 of int32 [positions][moe layers][top_k]
            meta["routed_experts"] = join(s.routed).to_base64()
        return {"text": s.text, "output_ids": s.ids, "meta_info": meta}


def generate_routes(front: Frontend) -> APIRouter:
    """POST /generate (the inference role)."""
    routes = APIRouter()
    shaper = Shaper(front)

    @routes.post("/generate")
    async def generate(body: GenerateReqInput, request: Request):
        t0 = time.monotonic()
        asks, logprob, batch = generate_asks(body, front.info.config.vocab_size)
        rid = new_id()
        runs = await prepare_runs(front, asks, rid)
        many = batch or any(r.request.params.n > 1 for r in runs.runs)
        text = body.return_text_in_logprobs

        owners = [(i, j) for i, r in enumerate(runs.runs) for j in range(r.request.params.n)]  # sample k's

        def answer(samples: list[Sample], k: int) -> dict:
            i, j = owners[k]
            p = runs.runs[i].request
            out = shaper.answer(samples[k], p.request_id if p.params.n == 1 else f"{p.request_id}.{j}", p.params,
                                logprob[i], text, t0)
            if many:
                out["index"] = k
            return out

        if body.stream:
            await runs.start()
            return StreamingResponse(_sse(runs, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        samples = await collect(runs, request)
        answers = [answer(samples, k) for k in range(len(samples))]
        for a in answers:
            a.pop("index", None)
        return JSONResponse(answers if many else answers[0])

    return routes


def _sse(runs, answer):
    samples = samples_of(runs)
    return sse(runs, (answer(samples, k) async for k in stream_samples(runs, samples)))


# -- control ------------------------------------------------------------------------------------------


class PauseGenerationReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "in_place", "retract"] = "abort"


class UpdateWeightFromDiskReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: Literal["auto", "safetensors"] | None = None
    flush_cache: bool = True  # the prefix cache is keyed by weight version: the old version's KV is never reused
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = Field(0, ge=0)


def _ok(message: str, **more) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, **more})


def _failed(status: int, message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


def add_control_routes(control: APIRouter, front: Frontend, weights: WeightControl) -> None:
    """SGLang's control routes on the router's http_control (admin only)."""
    info = front.info

    @control.post("/pause_generation")
    async def pause_generation(body: PauseGenerationReqInput | None = None):
        mode = "abort" if body is None or body.mode == "abort" else "keep"
        await weights.pause(mode)
        return _ok(f"generation paused (requests in flight: {'aborted' if mode == 'abort' else 'kept'})")

    @control.post("/continue_generation")
    async def continue_generation():
        # A client's weight update under way (router.sglang_weights_api) has sent all it will: committed first.
        try:
            committed = await weights.commit_client_update()
        except Exception as e:  # noqa: BLE001 - the client is told; the cluster serves its old version
            log.warning("continue_generation: the client's weight update could not be committed: %r", e)
            return _failed(503, f"the weight update under way could not be committed ({type(e).__name__}); "
                                "the router's log says why; the server stays paused")
        await weights.resume()
        return _ok("generation continues" if committed is None else
                   f"weight version {committed.version} committed; generation continues")

    @control.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightFromDiskReqInput):
        if body.keep_pause and not weights.paused:
            return _failed(400, "keep_pause: the server is not paused (pause_generation first)")
        try:
            version = int(body.weight_version) if body.weight_version is not None else weights.version + 1
        except ValueError:
            return _failed(400, f"weight_version must be an integer (pdserve's versions are), "
                                f"got {body.weight_version!r}")
        try:
            result = await weights.update(body.model_path, version,
                                          pause_mode="abort" if body.abort_all_requests else "keep")
        except (ValueError, FileNotFoundError) as e:
            return _failed(400, str(e))
        return _ok(f"weights updated to version {result.version} from {body.model_path} in {result.seconds:.2f} s",
                   num_paused_requests=0)

    @control.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        ok, message = await flush_prefix_caches(weights.cluster)
        return _ok(message) if ok else _failed(400, message)

    @control.get("/get_model_info")
    async def get_model_info():
        return {"model_path": info.path, "tokenizer_path": info.path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": str(weights.version),
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(info.config, "model_type", None),
                "architectures": getattr(info.config, "architectures", None)}

    @control.get("/get_server_info")
    async def get_server_info():
        """The server's settings, and each worker's state now (one stats call each)."""
        c = weights.cluster
        states = [{"worker_id": s.worker_id, "pool": s.pool, "weight_version": s.weight_version, "paused": s.paused,
                   "running": s.running, "waiting": s.waiting, "kv_blocks_used": s.kv_blocks_used,
                   "kv_blocks_total": s.kv_blocks_total} for s in await c.stats()]
        return {"model_path": info.path, "served_by": "pdserve", "context_length": info.max_model_len,
                "mode": c.config.mode, "weight_version": str(weights.version), "paused": weights.paused,
                "internal_states": states}

    @control.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": str(weights.version)}

    @control.get("/health_generate")
    async def health_generate(request: Request):
        check_serving(front)
        runs = await prepare_runs(front, [Ask(token_ids=[info.eos_token_ids[0] if info.eos_token_ids else 0],
                                              sampling={"max_tokens": 1, "temperature": 0.0})], "health-" + new_id())
        samples = await collect(runs, request)
        if not samples or not samples[0].ids:
            raise HTTPError(503, "the health request generated nothing", kind="server_error", grpc_code="UNAVAILABLE")
        return JSONResponse({"status": "ok"})

    for route in ("/release_memory_occupation", "/resume_memory_occupation"):
        control.add_api_route(route, _no_sleep, methods=["POST"])


async def _no_sleep() -> JSONResponse:
    return _failed(501, "pdserve has no sleep mode: workers keep their weights and KV cache in memory "
                        "(scale a pool down to free a machine)")
