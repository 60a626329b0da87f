"""The OpenAI API's wire shapes for router.openai_api: the request bodies and the error.

The request bodies are pydantic models of /v1/completions and /v1/chat/completions. Fields of OpenAI's
API that change nothing here (user, ...) and those of other servers pass; what OpenAI's API has and
pdserve does not (n > 1, logprobs, echo, suffix, tools, penalties, logit bias, JSON mode) each body
lists in `unsupported()`, which the app answers with a 400 that names the field.

HTTPError is an error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the gRPC
status code the router's metrics record for it.
"""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict


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
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # auto (or absent), default, priority or flex (pdserve.tiers); the tier served is in the response.
    service_tier: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for everything asked that pdserve does not do."""
        out = []
        if self.n not in (None, 1):
            out.append(("n", "n > 1 is not supported: send n requests"))
        if self.presence_penalty or self.frequency_penalty:
            out.append(("presence_penalty" if self.presence_penalty else "frequency_penalty",
                        "presence and frequency penalties are not supported"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        return out


class CompletionRequest(BaseCompletionRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        for name, bad in (("echo", self.echo), ("suffix", self.suffix), ("logprobs", self.logprobs is not None),
                          ("best_of", self.best_of not in (None, 1))):
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
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs", "logprobs are not supported"))
        for name in ("tools", "functions"):
            if getattr(self, name):
                out.append((name, "tool and function calling are not supported"))
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            out.append(("tool_choice", "tool and function calling are not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "only the text response format is supported"))
        return out

