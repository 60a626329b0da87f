"""What the router checks before a request reaches the cluster: the gRPC wire format, a request as both doors
hand it over (Ask) and its fields turned into token ids and sampling parameters (prepare), and admission
(how many run, how many may wait); and what both doors count of a request's samples as they stream
(Samples)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from google.protobuf.message import DecodeError

from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import ModelInfo
from pdserve.v1 import generation_pb2 as pb

DEFAULT_MAX_TOKENS = 16
MAX_SESSION_ID = 256  # characters of a session key


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


@dataclass
class Ask:
    """A request as either door hands it to the front (router.frontend), its fields as the client gave them:
    exactly one input (prompt text, chat messages or token ids), SamplingParams' fields by their own names
    (absent or None: the default; pdserve.engine.sampling says what each does), and what is not sampling.
    A door translates its wire format into this and nothing more: a field the engine already has reaches it
    by being put in `sampling` under the engine's name."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS  # with no max_tokens; None: to the end of the context
    service_tier: str | None = None  # auto (or None), default, priority, flex (pdserve.tiers)
    request_id: str | None = None  # None: the router makes one
    session_id: str | None = None  # a conversation's turns under one key (router.dispatch keeps them together)


SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def ask_from_grpc(request: pb.GenerateRequest) -> Ask:
    """A gRPC request's fields (an unset optional is the server's default, not the wire's zero)."""
    which = request.WhichOneof("input")
    s = request.sampling

    def given(message, name: str):
        return getattr(message, name) if message.HasField(name) else None

    sampling = dict(
        max_tokens=given(request, "max_tokens"), temperature=given(s, "temperature"), top_p=given(s, "top_p"),
        top_k=given(s, "top_k"), seed=given(s, "seed"), stop=tuple(request.stop),
        stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos,
        logprobs=given(request, "logprobs"), prompt_logprobs=given(request, "prompt_logprobs"),
        logprobs_mode=request.logprobs_mode or None, presence_penalty=given(s, "presence_penalty"),
        frequency_penalty=given(s, "frequency_penalty"), repetition_penalty=given(s, "repetition_penalty"),
        min_tokens=given(s, "min_tokens"), n=given(request, "n"), version_policy=request.version_policy or None,
        max_staleness=given(request, "max_staleness"))
    return Ask(prompt=request.prompt if which == "prompt" else None,
               messages=[{"role": m.role, "content": m.content} for m in request.messages.messages]
               if which == "messages" else None,
               token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
               sampling=sampling, service_tier=request.service_tier, request_id=request.request_id or None,
               session_id=request.session_id or None)


def prepare(info: ModelInfo, limit: int, ask: Ask, defaults: dict[str, Any] | None = None
            ) -> tuple[list[int], SamplingParams]:
    """What every protocol's request comes down to: the prompt's token ids (from exactly one of prompt
    text, chat messages or token ids) and the sampling parameters, checked against the model. limit:
    characters of text accepted before tokenizing (prompt, or all messages); defaults: the server's values
    of SamplingParams fields a request leaves unset (RouterConfig: logprobs_mode, version_policy).
    ValueError says what is wrong."""
    if ask.session_id is not None and not 0 < len(ask.session_id) <= MAX_SESSION_ID:
        raise ValueError(f"session_id must have 1 to {MAX_SESSION_ID} characters, got {len(ask.session_id)}")
    ids = _prompt_ids(info, limit, ask)
    given = {k: v for k, v in ask.sampling.items() if v is not None}
    unknown = sorted(set(given) - SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling field {unknown[0]!r}")
    max_tokens = given.pop("max_tokens", None)
    if max_tokens is None:
        max_tokens = info.max_model_len - len(ids) if ask.default_max_tokens is None else ask.default_max_tokens
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(ids) + max_tokens > info.max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                         f"context of {info.max_model_len} tokens")
    params = SamplingParams(**{**(defaults or {}), **given, "max_tokens": max_tokens})
    vocab = info.config.vocab_size
    bad = [t for t in (*ids, *params.stop_token_ids) if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"unknown token ids (the vocabulary is [0, {vocab})): {bad[:5]}")
    return ids, params


def _prompt_ids(info: ModelInfo, limit: int, ask: Ask) -> list[int]:
    """The prompt's token ids from the request's one input; the text ones tokenized (chat: templated)."""
    tok = info.tokenizer
    inputs = (("prompt", ask.prompt), ("messages", ask.messages), ("token_ids", ask.token_ids))
    given = [name for name, v in inputs if v is not None]
    if not given:
        raise ValueError("the request has no input: set prompt, messages or token_ids")
    if len(given) > 1:
        raise ValueError(f"give one input, not {' and '.join(given)}")
    if ask.token_ids is not None:
        ids = list(ask.token_ids)
    elif tok is None:
        raise ValueError("this model has no tokenizer: send token_ids")
    elif ask.prompt is not None:
        if len(ask.prompt) > limit:
            raise ValueError(f"prompt has {len(ask.prompt)} characters; the limit is {limit}")
        if not ask.prompt:
            raise ValueError("prompt is empty")
        ids = tok.encode(ask.prompt)
    else:
        messages = ask.messages
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
    return ids


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
