"""The OpenAI API's wire shapes for router.openai_api: the request bodies and the error.

The request bodies are pydantic models of /v1/completions and /v1/chat/completions. Fields of OpenAI's
API that change nothing here (user, ...) and those of other servers pass; what OpenAI's API has and
pdserve does not (echo, suffix, best_of, tools, logit bias), and fields that make no sense together,
each body lists in `refused()`, which the app answers with a 400 that names the field.

Beside OpenAI's fields (logprobs, top_logprobs, presence and frequency penalties, ...) both bodies take
these extensions, by vLLM's names: prompt_logprobs (k: the prompt tokens' logprobs and their top k),
logprobs_mode ("raw" or "processed"; absent: the server's), repetition_penalty, min_tokens and
return_token_ids (the generated token ids on each choice, the prompt's beside them).

Structured output (pdserve.engine.structured): OpenAI's response_format ("json_object", "json_schema"), on
/v1/completions too, and the extensions guided_json, guided_regex, guided_choice, guided_grammar and
structured_outputs ({"json", "regex", "choice", "grammar", "json_object"}); one of them at most.

HTTPError is an error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the gRPC
status code the router's metrics record for it.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.structured import StructuredOutput
from router.admission import DEFAULT_MAX_TOKENS, Ask


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, grpc_code: str = "INVALID_ARGUMENT", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.grpc_code = status, kind, param, code, grpc_code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


# -- request bodies -------------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema: the schema the output validates against (name, description and strict are
    OpenAI's; the schema is enforced whatever strict says)."""

    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """The structured_outputs extension: one of its fields."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# The extensions that ask for a structured output on their own, by field: the kind each gives.
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _spec(value: Any) -> str:
    """A structured output's spec as text (pdserve.engine.structured): a schema or a choice list as JSON text."""
    return value if isinstance(value, str) else json.dumps(value)


class BaseCompletionRequest(BaseModel):
    # Fields of OpenAI's API that change nothing here (user, ...) and those of other servers pass.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM and others take it too)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension: load generators use it for fixed output lengths
    n: int | None = 1  # samples of the prompt, the response's choices: in [1, 128] (router.admission.prepare checks)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions, by vLLM's names (the module's docstring says what they do); None: the default.
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str | None = None
    return_token_ids: bool | None = False
    # Weights that change under the cluster (router.weights): what this request does if they change while it
    # holds KV of older ones ("recompute", "keep", "abort"; absent: the server's), and keep's bound.
    version_policy: str | None = None
    max_staleness: int | None = None
    logit_bias: dict[str, float] | None = None
    # auto (or absent), default, priority or flex (pdserve.tiers); the tier served is in the response.
    service_tier: str | None = None
    # A conversation's turns under one key (an extension; the header x-session-id says the same): they go to the
    # decode worker that served the session's last turn while it has room. OpenAI's `user` is not it.
    session_id: str | None = None
    # Structured output (the module's docstring): one of these at most.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    # Fields passed to SamplingParams under their own names (pdserve.engine.sampling says what each does): a
    # new one the engine has is declared above and named here, and reaches the engine as it is.
    SAMPLING: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "n", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "min_tokens", "prompt_logprobs", "logprobs_mode",
                "version_policy", "max_staleness")

    def ask(self) -> Ask:
        """The request as the front takes it (router.admission.Ask)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        sampling = {name: getattr(self, name) for name in self.SAMPLING}
        sampling.update(stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()), max_tokens=self.max_tokens,
                        logprobs=self.logprobs_k(), structured=self.structured())
        return Ask(sampling=sampling, service_tier=self.service_tier, session_id=self.session_id, **self.inputs())

    def inputs(self) -> dict[str, Any]:
        """The request's input (prompt, messages or token_ids) and, beside it, the default for max_tokens."""
        raise NotImplementedError

    def structured_asks(self) -> list[tuple[str, StructuredOutput]]:
        """Each structured output the body asks for, with the field that asks (structured_outputs.KEY for one of
        that extension's keys); HTTPError naming the field whose value is not one."""
        asks: list[tuple[str, tuple[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asks.append(("response_format", ("json_object", "")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise HTTPError(400, "response_format of type json_schema needs its json_schema",
                                param="response_format")
            asks.append(("response_format", ("json_schema", rf.json_schema.schema_)))
        asks += [(name, (kind, getattr(self, name))) for name, kind in GUIDED.items()
                 if getattr(self, name) is not None]
        so = self.structured_outputs
        if so is not None:
            given = {"json": ("json_schema", so.json_), "regex": ("regex", so.regex), "choice": ("choice", so.choice),
                     "grammar": ("grammar", so.grammar), "json_object": ("json_object", "" if so.json_object else None)}
            asks += [(f"structured_outputs.{key}", (kind, v)) for key, (kind, v) in given.items() if v is not None]
        out = []
        for name, (kind, value) in asks:
            try:
                out.append((name, StructuredOutput(kind, _spec(value))))
            except ValueError as e:
                raise HTTPError(400, f"{name}: {e}", param=name) from None
        return out

    def structured(self) -> StructuredOutput | None:
        """SamplingParams.structured: what the output must match, if the body asks (one field at most)."""
        asks = self.structured_asks()
        if len(asks) > 1:
            names = [name for name, _ in asks]
            raise HTTPError(400, f"give one structured output, not {' and '.join(names)}", param=names[0])
        return asks[0][1] if asks else None

    def structured_param(self) -> str | None:
        """The field that asks for the structured output (an error about its spec names it)."""
        asks = self.structured_asks()
        return asks[0][0] if asks else None

    def logprobs_k(self) -> int | None:
        """SamplingParams.logprobs: how many alternatives each generated token's logprob comes with; None:
        no logprobs."""
        raise NotImplementedError

    def param(self, name: str) -> str:
        """The body's field that sets SamplingParams' field `name` (an error about it names this one)."""
        return name

    def refused(self) -> list[tuple[str, str]]:
        """(field, why) for everything asked that pdserve does not do or that makes no sense."""
        out = []
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        return out


class CompletionRequest(BaseCompletionRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None  # k: each generated token's logprob and the k most likely beside it
    best_of: int | None = None

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def inputs(self) -> dict[str, Any]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise HTTPError(400, "a batch of prompts is not supported: send one prompt per request", param="prompt")
            prompt = prompt[0]
        given = dict(token_ids=list(prompt)) if isinstance(prompt, list) else dict(prompt=prompt)
        return dict(given, default_max_tokens=DEFAULT_MAX_TOKENS)

    def refused(self) -> list[tuple[str, str]]:
        out = super().refused()
        for name, bad in (("echo", self.echo), ("suffix", self.suffix), ("best_of", self.best_of not in (None, 1))):
            if bad:
                out.append((name, f"{name} is not supported"))
        return out


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseCompletionRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None  # k, with logprobs: the k most likely tokens beside each generated one
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def ask(self) -> Ask:
        ask = super().ask()
        if self.max_completion_tokens is not None:
            ask.sampling["max_tokens"] = self.max_completion_tokens
        return ask

    def inputs(self) -> dict[str, Any]:
        # As OpenAI's chat API: with no limit given, up to the end of the context.
        return dict(messages=[{"role": m.role, "content": _text(m.content, i)} for i, m in enumerate(self.messages)],
                    default_max_tokens=None)

    def param(self, name: str) -> str:
        if name == "logprobs":  # the count is top_logprobs; logprobs only turns them on
            return "top_logprobs"
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return name

    def refused(self) -> list[tuple[str, str]]:
        out = super().refused()
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs set to true"))
        for name in ("tools", "functions"):
            if getattr(self, name):
                out.append((name, "tool and function calling are not supported"))
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            out.append(("tool_choice", "tool and function calling are not supported"))
        return out


def _text(content, index: int) -> str:
    """A chat message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise HTTPError(400, f"messages[{index}]: only text content is supported, got {part.get('type')!r}",
                            param=f"messages.{index}.content")
        parts.append(str(part.get("text", "")))
    return "".join(parts)
