"""The offline engine: one process, no Ray, no gRPC. Continuous batching over the paged cache.

It is the reference that the disaggregated cluster must match token for token.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pdserve.block_pool import BlockPool
from pdserve.config import EngineConfig
from pdserve.kv_cache import KVCacheManager
from pdserve.loader import LoadedModel, load
from pdserve.output import TextOutput
from pdserve.request import FinishReason, Request, token_stop_reason
from pdserve.runner import ModelRunner
from pdserve.sampling import SamplingParams
from pdserve.scheduler import Scheduler


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        loaded = loaded or load(config)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        eos = set(loaded.config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))
        num_blocks = config.cache.resolve_num_blocks(loaded.config, config.torch_dtype)
        self.pool = BlockPool(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool)
        self.runner = ModelRunner(loaded.model, num_blocks, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self._requests: dict[str, Request] = {}
        self._text: dict[str, TextOutput] = {}
        self._ids = itertools.count()
        self._seed_rng = random.Random(config.seed)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        prompt = list(prompt_token_ids)
        self.validate_prompt(prompt, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(rid, prompt, params, seed)
        text = TextOutput(self.tokenizer, prompt, params.stop)
        self.scheduler.add(req)
        self._requests[rid] = req
        self._text[rid] = text
        return rid

    def validate_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not (0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; the model's context is {self.max_model_len}, "
                             "which must also hold at least one generated token")

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self._text.pop(request_id)
        self.scheduler.finish(req, FinishReason.CANCELLED)
        return RequestOutput(request_id, [], "", FinishReason.CANCELLED, req.num_prompt_tokens, req.num_output_tokens)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- stepping ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        result = self.runner.execute(step.chunks)
        return self.process(step.requests, step.chunks, result.sampled.tolist(), result.sampling_chunks)

    def process(self, requests: list[Request], chunks, sampled: list[int], sampling_chunks: list[int]) -> list[RequestOutput]:
        for req, chunk in zip(requests, chunks):
            req.num_computed_tokens += len(chunk.token_ids)
            self.kv.cache_computed_blocks(req)
        outputs = []
        for i, token in zip(sampling_chunks, sampled):
            req = requests[i]
            req.token_ids.append(token)
            reason = token_stop_reason(req, self.eos_token_ids, self.max_model_len)
            # EOS and stop ids end the stream but are not text.
            visible = [] if reason is FinishReason.STOP else [token]
            delta = self._text[req.request_id].add(visible, reason)
            if delta.stopped:
                reason = FinishReason.STOP
            if reason is not None:
                self.scheduler.finish(req, reason)
                del self._requests[req.request_id], self._text[req.request_id]
            outputs.append(RequestOutput(req.request_id, [token], delta.text, reason, req.num_prompt_tokens,
                                         req.num_output_tokens))
        return outputs

    # -- convenience ------------------------------------------------------------------------------
    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding outputs as they come."""
        while self.has_unfinished:
            yield from self.step()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        acc = {rid: ([], []) for rid in rids}
        reasons: dict[str, FinishReason] = {}
        for out in self.stream():
            ids, text = acc[out.request_id]
            ids.extend(out.new_token_ids)
            text.append(out.new_text)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        return [Completion(rid, list(p), acc[rid][0], "".join(acc[rid][1]), reasons[rid]) for rid, p in zip(rids, prompts)]
