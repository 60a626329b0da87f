"""What the router checks before a request reaches the cluster: the wire format, the request's
fields (prompt, messages or token ids; sampling), and admission (how many run, how many may wait); and
what both doors count of a request's samples as they stream (Samples)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import ModelInfo
from pdserve.v1 import generation_pb2 as pb

DEFAULT_MAX_TOKENS = 16


class RequestFailed(Exception):
    """The workers failed a request, retries included: UNAVAILABLE (gRPC) or 503 (HTTP)."""


class Overloaded(Exception):
    pass


class Admission:
    """Up to max_running requests run; up to max_queued more wait in arrival order; the rest are refused."""

    def __init__(self, max_running: int, max_queued: int):
        self.max_running, self.max_queued = max_running, max_queued
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.queued = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._slots.locked() and self.queued >= self.max_queued:
            raise Overloaded(f"admission queue is full ({self.max_queued} waiting, {self.max_running} running)")
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()


@dataclass(frozen=True)
class Malformed:
    reason: str


def parse_wire(data: bytes) -> pb.GenerateRequest | Malformed:
    # grpc answers INTERNAL when a deserializer raises; a malformed request is the client's error.
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        return Malformed(f"malformed request (text fields must be valid UTF-8): {e}")


def parse_request(request: pb.GenerateRequest, info: ModelInfo, limit: int, default_logprobs_mode: str = "raw",
                  default_version_policy: str = "recompute") -> tuple[list[int], SamplingParams]:
    """The prompt's token ids and the sampling parameters of a gRPC request; ValueError says what is wrong.
    limit: characters of text accepted before tokenizing (prompt, or all messages); default_logprobs_mode:
    the server's, for a request whose logprobs_mode is empty."""
    which = request.WhichOneof("input")
    s = request.sampling

    def given(message, name: str):  # an unset optional is the server's default, not the wire's zero
        return getattr(message, name) if message.HasField(name) else None

    return prepare(
        info, limit,
        prompt=request.prompt if which == "prompt" else None,
        messages=[{"role": m.role, "content": m.content} for m in request.messages.messages]
        if which == "messages" else None,
        token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
        max_tokens=given(request, "max_tokens"),
        temperature=given(s, "temperature"), top_p=given(s, "top_p"), top_k=given(s, "top_k"), seed=given(s, "seed"),
        stop=tuple(request.stop), stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos,
        logprobs=given(request, "logprobs"), prompt_logprobs=given(request, "prompt_logprobs"),
        logprobs_mode=request.logprobs_mode or None, default_logprobs_mode=default_logprobs_mode,
        presence_penalty=given(s, "presence_penalty"), frequency_penalty=given(s, "frequency_penalty"),
        repetition_penalty=given(s, "repetition_penalty"), min_tokens=given(s, "min_tokens"),
        n=given(request, "n"), version_policy=request.version_policy or None,
        default_version_policy=default_version_policy, max_staleness=given(request, "max_staleness"))


def prepare(info: ModelInfo, limit: int, *, prompt: str | None = None, messages: list[dict[str, str]] | None = None,
            token_ids: list[int] | None = None, max_tokens: int | None = None, temperature: float | None = None,
            top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
            stop: tuple[str, ...] = (), stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False,
            default_max_tokens: int | None = DEFAULT_MAX_TOKENS, logprobs: int | None = None,
            prompt_logprobs: int | None = None, logprobs_mode: str | None = None,
            default_logprobs_mode: str = "raw", presence_penalty: float | None = None,
            frequency_penalty: float | None = None, repetition_penalty: float | None = None,
            min_tokens: int | None = None, n: int | None = None, version_policy: str | None = None,
            default_version_policy: str = "recompute",
            max_staleness: int | None = None) -> tuple[list[int], SamplingParams]:
    """What every protocol's request comes down to: the prompt's token ids (from exactly one of prompt
    text, chat messages or token ids) and the sampling parameters, checked against the model; None
    (or an empty logprobs_mode) leaves a default. default_max_tokens None: up to the end of the context
    (OpenAI's chat API); default_logprobs_mode, default_version_policy: the server's (RouterConfig).
    ValueError says what is wrong."""
    tok = info.tokenizer
    inputs = (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
    given = [name for name, v in inputs if v is not None]
    if not given:
        raise ValueError("the request has no input: set prompt, messages or token_ids")
    if len(given) > 1:
        raise ValueError(f"give one input, not {' and '.join(given)}")
    if token_ids is not None:
        ids = list(token_ids)
    else:
        if tok is None:
            raise ValueError("this model has no tokenizer: send token_ids")
        if prompt is not None:
            if len(prompt) > limit:
                raise ValueError(f"prompt has {len(prompt)} characters; the limit is {limit}")
            if not prompt:
                raise ValueError("prompt is empty")
            ids = tok.encode(prompt)
        else:
            if not messages:
                raise ValueError("messages is empty")
            if sum(len(m["content"]) + len(m["role"]) for m in messages) > limit:
                raise ValueError(f"messages exceed {limit} characters in all")
            if any(not m["role"] for m in messages):
                raise ValueError("every message needs a role")
            if not tok.has_chat_template:
                raise ValueError("this model has no chat template: send a prompt or token_ids")
            ids = tok.apply_chat_template(messages)
    if not ids:
        raise ValueError("prompt is empty")
    if max_tokens is None:
        max_tokens = info.max_model_len - len(ids) if default_max_tokens is None else default_max_tokens
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(ids) + max_tokens > info.max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                         f"context of {info.max_model_len} tokens")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None else top_k,
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logprobs_mode=logprobs_mode or default_logprobs_mode,
        presence_penalty=0.0 if presence_penalty is None else presence_penalty,
        frequency_penalty=0.0 if frequency_penalty is None else frequency_penalty,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        min_tokens=0 if min_tokens is None else min_tokens,
        n=1 if n is None else n,
        version_policy=version_policy or default_version_policy,
        max_staleness=max_staleness,
    )
    vocab = info.config.vocab_size
    bad = [t for t in (*ids, *params.stop_token_ids) if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"unknown token ids (the vocabulary is [0, {vocab})): {bad[:5]}")
    return ids, params


class Samples:
    """The n samples of one request (SamplingParams.n) as their outputs stream in, interleaved: each one's
    output tokens so far and how many have finished, so that a door knows which output is the request's
    last (it carries the usage) and how many tokens the request generated in all."""

    def __init__(self, n: int):
        self.n = n
        self.tokens = [0] * n  # per sample: its output tokens so far
        self.finished = 0

    def add(self, out: RequestOutput) -> bool:
        """Count an output; whether it is the request's last (every sample has finished with it)."""
        self.tokens[out.index] = out.num_output_tokens
        self.finished += out.finished
        return self.done

    @property
    def done(self) -> bool:
        return self.finished == self.n

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens)
