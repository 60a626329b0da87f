"""What the router checks before a request reaches the cluster: the gRPC wire format, a request as both doors
hand it over (Ask) and its fields turned into token ids and sampling parameters (prepare), and admission
(how many run, how many may wait); and what both doors count of a request's samples as they stream
(Samples)."""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from google.protobuf.message import DecodeError

from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling import MAX_N, SamplingParams
from pdserve.engine.structured import StructuredOutput
from pdserve.model.loader import ModelInfo
from pdserve.v1 import generation_pb2 as pb
from router.chat_tools import (FieldError, ToolSet, check_messages, check_template_kwargs, check_tools, message_chars,
                               render)
from router.config import REQUEST_ID_CHARS, FieldBounds

DEFAULT_MAX_TOKENS = 16
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")
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


def parser(message: type) -> Callable[[bytes], Any]:
    """A gRPC request deserializer for `message` that returns Malformed instead of raising: grpc answers INTERNAL
    when a deserializer raises, and a malformed request is the client's error (the handler answers
    INVALID_ARGUMENT)."""
    def parse(data: bytes):
        try:
            return message.FromString(data)
        except DecodeError as e:
            return Malformed(f"malformed request (text fields must be valid UTF-8): {e}")

    return parse


parse_wire = parser(pb.GenerateRequest)


@dataclass
class Ask:
    """A request as either door hands it to the front (router.frontend), its fields as the client gave them:
    exactly one input (prompt text, chat messages or token ids), SamplingParams' fields by their own names
    (absent or None: the default; pdserve.engine.sampling says what each does), and what is not sampling.
    A door translates its wire format into this and nothing more: a field the engine already has reaches it
    by being put in `sampling` under the engine's name."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None  # role, content; name, tool_calls, tool_call_id, reasoning_content
    token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS  # with no max_tokens; None: to the end of the context
    service_tier: str | None = None  # auto (or None), default, priority, flex (pdserve.tiers)
    request_id: str | None = None  # None: the router makes one
    session_id: str | None = None  # a conversation's turns under one key (router.dispatch keeps them together)
    # The request this is one prompt of has `prompts` of them (a completions request's list): they share its
    # bounds (the logprob entries).
    prompts: int = 1
    # The prompt alone (HTTP's echo with max_tokens 0): run for one token, which the front drops from every
    # output (text, ids, logprobs, counts), so that the response and the metrics have none.
    prompt_only: bool = False
    # A chat's tools (router.chat_tools says what each takes) and its template's own variables, as sent.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


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
        max_staleness=given(request, "max_staleness"), min_p=given(s, "min_p"),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=given(request, "skip_special_tokens"), structured=structured_from_grpc(request),
        return_routed_experts=request.return_routed_experts or None)
    return Ask(prompt=request.prompt if which == "prompt" else None,
               messages=[_grpc_message(m) for m in request.messages.messages] if which == "messages" else None,
               token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
               sampling=sampling, service_tier=request.service_tier, request_id=request.request_id or None,
               session_id=request.session_id or None, tools=[_grpc_tool(i, t) for i, t in enumerate(request.tools)],
               tool_choice=(request.tool_choice.mode if request.tool_choice.mode != "function" else
                            {"type": "function", "function": {"name": request.tool_choice.name}})
               if request.HasField("tool_choice") else None,
               parallel_tool_calls=given(request, "parallel_tool_calls"),
               chat_template_kwargs=_json_field("chat_template_kwargs", request.chat_template_kwargs or None))


def _grpc_message(m: pb.ChatMessage) -> dict[str, Any]:
    """A gRPC chat message as the HTTP door's (router.chat_tools reads both): empty fields left out."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, key):
            out[key] = getattr(m, key)
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type or "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    return out


def _grpc_tool(i: int, t: pb.Tool) -> dict[str, Any]:
    """A gRPC tool as OpenAI's tools entry (its schema's JSON text read)."""
    f = t.function
    function: dict[str, Any] = {"name": f.name, "description": f.description or None,
                                "parameters": _json_field(f"tools.{i}.function.parameters", f.parameters or None)}
    if f.HasField("strict"):
        function["strict"] = f.strict
    return {"type": t.type, "function": function}


def _json_field(name: str, text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FieldError(name, f"{name} must be JSON text: {e}") from None


def structured_from_grpc(request: pb.GenerateRequest) -> StructuredOutput | None:
    """GenerateRequest.structured_output as the engine's StructuredOutput (None: unset, or json_object false);
    ValueError naming the field if its spec is too long."""
    if not request.HasField("structured_output"):
        return None
    so = request.structured_output
    kind = so.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not so.json_object):
        return None
    if kind == "json_object":
        spec = ""
    elif kind == "choice":
        spec = json.dumps(list(so.choice.choices))
    else:
        spec = getattr(so, kind)
    try:
        return StructuredOutput(kind, spec)
    except ValueError as e:
        raise ValueError(f"structured_output.{kind}: {e}") from None


@dataclass(frozen=True)
class Checked:
    """A request checked as far as it can be before its text is tokenized: its input, its request id and
    every sampling field (params: as given, max_tokens provisional where its default depends on the prompt's
    length); the rest (the context, the logprob entries) once the prompt's ids are known (finish)."""

    ask: Ask
    bounds: FieldBounds
    sampling: dict[str, Any]  # the fields given, over the server's defaults, without max_tokens
    params: SamplingParams
    tools: ToolSet | None = None  # a chat's tools, checked


def prepare(info: ModelInfo, limit: int, ask: Ask, defaults: dict[str, Any] | None = None
            ) -> tuple[list[int], SamplingParams]:
    """What every protocol's request comes down to: the prompt's token ids (from exactly one of prompt
    text, chat messages or token ids) and the sampling parameters, checked against the model (the bounds
    of router.config.FieldBounds). limit: characters of text accepted before tokenizing (prompt, or all
    messages); defaults: the server's values of SamplingParams fields a request leaves unset (RouterConfig:
    logprobs_mode, version_policy). ValueError says what is wrong, naming the field and its bound.

    In three parts, which the router's front (router.frontend) runs apart: check (cheap, before admission),
    tokenize (the slow part: after admission, off the event loop), finish."""
    checked = check(info, limit, ask, defaults)
    return finish(info, checked, tokenize(info, ask, checked.tools))


def check(info: ModelInfo, limit: int, ask: Ask, defaults: dict[str, Any] | None = None) -> Checked:
    """Everything about a request that needs no tokenizing (prepare's arguments; ValueError)."""
    bounds = FieldBounds(info.config.vocab_size, info.max_model_len, limit)
    check_request_id(ask.request_id)
    if ask.session_id is not None and not 0 < len(ask.session_id) <= MAX_SESSION_ID:
        raise ValueError(f"session_id must have 1 to {MAX_SESSION_ID} characters, got {len(ask.session_id)}")
    _check_input(info, bounds, ask)
    given = {k: v for k, v in ask.sampling.items() if v is not None}
    unknown = sorted(set(given) - SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling field {unknown[0]!r}")
    tools = _check_chat(ask, bounds)
    if tools is not None and tools.forced:  # the reply is the calls' JSON, held to their schema
        if given.get("structured") is not None:
            raise FieldError("tool_choice", f"tool_choice {tools.choice!r} makes the reply JSON of the tools' schema: "
                                            "it cannot be combined with another structured output (response_format)")
        given["structured"] = tools.structured()
    max_tokens = given.pop("max_tokens", None)
    if max_tokens is None:  # chat's default, the rest of the context, is known once the prompt is
        max_tokens = info.max_model_len if ask.default_max_tokens is None else ask.default_max_tokens
    _check_max_tokens(max_tokens)
    sampling = {**(defaults or {}), **given}
    params = SamplingParams(**sampling, max_tokens=max_tokens)
    if params.return_routed_experts and not info.config.is_moe:
        raise FieldError("return_routed_experts", "return_routed_experts needs a mixture-of-experts model; "
                                                  "the model served is dense (it routes no experts)")
    _check_vocab(bounds, ask.token_ids or [], params)
    return Checked(ask, bounds, sampling, params, tools)


def _check_chat(ask: Ask, bounds: FieldBounds) -> ToolSet | None:
    """A chat's tools, its messages' tool fields and its template's variables (FieldError naming the field)."""
    check_template_kwargs(ask.chat_template_kwargs)
    tools = check_tools(ask.tools, ask.tool_choice, ask.parallel_tool_calls)
    if ask.messages is None:
        for name in ("tools", "chat_template_kwargs"):
            if getattr(ask, name):
                raise FieldError(name, f"{name} needs messages (a chat)")
        return tools
    check_messages(ask.messages)
    if tools is not None and len(json.dumps(ask.tools)) > bounds.max_input_chars:
        raise FieldError("tools", f"tools exceed {bounds.max_input_chars} characters")
    return tools


def finish(info: ModelInfo, checked: Checked, ids: list[int]) -> tuple[list[int], SamplingParams]:
    """The prompt's ids and the request's final parameters (its max_tokens default), checked against the
    context and the model."""
    ask = checked.ask
    max_tokens = ask.sampling.get("max_tokens")
    if max_tokens is None:
        max_tokens = info.max_model_len - len(ids) if ask.default_max_tokens is None else ask.default_max_tokens
    _check_max_tokens(max_tokens)
    if len(ids) + max_tokens > info.max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                         f"context of {info.max_model_len} tokens")
    params = checked.params if max_tokens == checked.params.max_tokens else \
        SamplingParams(**checked.sampling, max_tokens=max_tokens)
    _check_vocab(checked.bounds, ids, params)
    _check_entries(checked.bounds, ids, params, ask.prompts)
    return ids, params


def _check_max_tokens(max_tokens) -> None:
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")


def _check_vocab(bounds: FieldBounds, ids: list[int], params: SamplingParams) -> None:
    """The bounds that depend on the model's vocabulary."""
    vocab = bounds.vocab_size
    bad = [t for t in (*ids, *params.stop_token_ids) if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"unknown token ids (the vocabulary is [0, {vocab})): {bad[:5]}")
    if params.top_k > bounds.max_top_k:
        raise ValueError(f"top_k must be at most {bounds.max_top_k} (the vocabulary's size), got {params.top_k}")


def _check_entries(bounds: FieldBounds, ids: list[int], params: SamplingParams, prompts: int = 1) -> None:
    """The logprob entries a request asks for, against the context; one of `prompts` prompts of a request has
    that share of the bound."""
    entries = 0
    if params.logprobs is not None:
        entries += params.n * params.max_tokens * (params.logprobs + 1)
    if params.prompt_logprobs is not None:
        entries += len(ids) * (params.prompt_logprobs + 1)
    most = bounds.max_logprob_entries // prompts
    if entries > most:
        share = f", shared by the request's {prompts} prompts" if prompts > 1 else ""
        raise ValueError(f"logprobs asks for {entries} entries (n x max_tokens x (logprobs + 1), with the prompt's); "
                         f"the most is {most} ({MAX_N} samples of the model's context{share})")


def check_request_id(rid: str | None) -> None:
    """A client's request id: None (the router makes one) or 1 to REQUEST_ID_CHARS of [A-Za-z0-9._:-]."""
    if rid is not None and (len(rid) > REQUEST_ID_CHARS or not _REQUEST_ID.fullmatch(rid)):
        raise ValueError(f"request_id must be 1 to {REQUEST_ID_CHARS} characters of A-Z, a-z, 0-9, '.', '_', ':' "
                         f"and '-', got {rid[:40]!r}{'...' if len(rid) > 40 else ''}")


def _check_input(info: ModelInfo, bounds: FieldBounds, ask: Ask) -> None:
    """The request's one input: given, within its bounds, and something this model can tokenize."""
    tok, limit = info.tokenizer, bounds.max_input_chars
    inputs = (("prompt", ask.prompt), ("messages", ask.messages), ("token_ids", ask.token_ids))
    given = [name for name, v in inputs if v is not None]
    if not given:
        raise ValueError("the request has no input: set prompt, messages or token_ids")
    if len(given) > 1:
        raise ValueError(f"give one input, not {' and '.join(given)}")
    if ask.messages is not None and len(ask.messages) > bounds.max_messages:
        raise ValueError(f"messages has {len(ask.messages)} messages; the most is {bounds.max_messages} (the model's "
                         "context: each takes at least one of its tokens)")
    if ask.token_ids is not None:
        if not ask.token_ids:
            raise ValueError("prompt is empty")
    elif tok is None:
        raise ValueError("this model has no tokenizer: send token_ids")
    elif ask.prompt is not None:
        if len(ask.prompt) > limit:
            raise ValueError(f"prompt has {len(ask.prompt)} characters; the limit is {limit}")
        if not ask.prompt:
            raise ValueError("prompt is empty")
    else:
        messages = ask.messages
        if not messages:
            raise ValueError("messages is empty")
        if sum(message_chars(m) for m in messages) > limit:
            raise ValueError(f"messages exceed {limit} characters in all")
        if any(not m["role"] for m in messages):
            raise ValueError("every message needs a role")
        if not tok.has_chat_template:
            raise ValueError("this model has no chat template: send a prompt or token_ids")


def tokenize(info: ModelInfo, ask: Ask, tools: ToolSet | None = None) -> list[int]:
    """The prompt's token ids from a checked request's one input: the text ones tokenized (chat: templated, with
    its checked tools, router.chat_tools.render). Up to --max-input-chars characters: the router runs it off its
    event loop (router.frontend)."""
    if ask.token_ids is not None:
        return list(ask.token_ids)
    tok = info.tokenizer
    ids = tok.encode(ask.prompt) if ask.prompt is not None else \
        render(tok, ask.messages, tools, ask.chat_template_kwargs)
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
