"""The OpenAI API's wire shapes for router.openai_api: the request bodies and the error.

The request bodies are pydantic models of /v1/completions and /v1/chat/completions. Fields of OpenAI's
API that change nothing here (user, ...) and those of other servers pass; what OpenAI's API has and
pdserve does not (echo, suffix, best_of, the legacy functions, logit bias, JSON mode), and fields that make no
sense together, each body lists in `refused()`, which the app answers with a 400 that names the field.

Beside OpenAI's fields (logprobs, top_logprobs, presence and frequency penalties, ...) both bodies take
these extensions, by vLLM's names: prompt_logprobs (k: the prompt tokens' logprobs and their top k),
logprobs_mode ("raw" or "processed"; absent: the server's), repetition_penalty, min_tokens and
return_token_ids (the generated token ids on each choice, the prompt's beside them).

HTTPError is an error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the gRPC
status code the router's metrics record for it.
"""
from __future__ import annotations

from typing import Any, ClassVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

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
                        logprobs=self.logprobs_k())
        return Ask(sampling=sampling, service_tier=self.service_tier, session_id=self.session_id, **self.inputs())

    def inputs(self) -> dict[str, Any]:
        """The request's input (prompt, messages or token_ids) and, beside it, the default for max_tokens."""
        raise NotImplementedError

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
    # A conversation with tools (router.chat_tools checks them): an assistant's calls, a tool's answer to one.
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant's reasoning, for templates that render it

    def turn(self, index: int) -> dict[str, Any]:
        """The message as router.admission.Ask holds it."""
        out: dict[str, Any] = {"role": self.role, "content": _text(self.content, index)}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(BaseCompletionRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None  # k, with logprobs: the k most likely tokens beside each generated one
    # Tools (router.chat_tools: what each takes, checked there for both doors) and the template's variables.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def ask(self) -> Ask:
        ask = super().ask()
        if self.max_completion_tokens is not None:
            ask.sampling["max_tokens"] = self.max_completion_tokens
        ask.tools, ask.tool_choice, ask.parallel_tool_calls = self.tools, self.tool_choice, self.parallel_tool_calls
        ask.chat_template_kwargs = self.chat_template_kwargs
        return ask

    def inputs(self) -> dict[str, Any]:
        # As OpenAI's chat API: with no limit given, up to the end of the context.
        return dict(messages=[m.turn(i) for i, m in enumerate(self.messages)], default_max_tokens=None)

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
        for name in ("functions", "function_call"):  # OpenAI's deprecated form of tools and tool_choice
            if getattr(self, name) is not None:
                out.append((name, f"{name} is not supported: send tools and tool_choice"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "only the text response format is supported"))
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
