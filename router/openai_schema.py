"""The OpenAI API's wire shapes for router.openai_api: the request bodies and the error.

The request bodies are pydantic models of /v1/completions and /v1/chat/completions. A body takes the
fields declared here and no other: a field it does not declare is a 400 naming it (NOT_SUPPORTED says why
for those of OpenAI's API, and of other servers' extensions, that pdserve does not do), never ignored.
What a declared field asks that pdserve does not do (suffix, best_of, the legacy functions, logit bias,
store: true, ...), and fields that make no sense together, each body lists in `refused()`, which the app
answers with a 400 that names the field. docs/serving.md lists what each body accepts.

Beside OpenAI's fields (logprobs, top_logprobs, presence and frequency penalties, ...) both bodies take
these extensions, by vLLM's names: prompt_logprobs (k: the prompt tokens' logprobs and their top k),
logprobs_mode ("raw" or "processed"; absent: the server's), repetition_penalty, min_tokens, min_p,
return_token_ids (the generated token ids on each choice, the prompt's beside them),
return_tokens_as_token_ids (every token string of the logprobs is "token_id:<id>"),
include_stop_str_in_output and skip_special_tokens (the text), spaces_between_special_tokens (what the
tokenizer does: false, or true where no special token is shown) and priority (0 alone: the tiers are
service_tier's); and, by SGLang's name, return_routed_experts (each choice's routed_experts: every token's top-k
experts in each MoE layer, pdserve.engine.routed_experts; a mixture-of-experts model only).

Structured output (pdserve.engine.structured): OpenAI's response_format ("json_object", "json_schema"), on
/v1/completions too, and the extensions guided_json, guided_regex, guided_choice, guided_grammar and
structured_outputs ({"json", "regex", "choice", "grammar", "json_object"}); one of them at most.

HTTPError is an error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the gRPC
status code the router's metrics record for it.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.structured import StructuredOutput
from router.admission import DEFAULT_MAX_TOKENS, Ask
from router.config import MAX_PROMPTS


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

# Fields a body does not declare, by why: OpenAI's that pdserve does not do, and other servers' extensions that
# clients send. Any other undeclared field is refused as unknown.
NOT_SUPPORTED = {
    "audio": "only text output is supported",
    "metadata": "metadata is kept with stored completions; pdserve stores none",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning effort is not supported (the served model has no reasoning setting)",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
    **dict.fromkeys(("prompt_cache_retention", "prompt_cache_options"),
                    "the prefix cache's retention is the server's (prompt_cache_key is taken)"),
    **dict.fromkeys(("use_beam_search", "length_penalty", "early_stopping"), "beam search is not supported"),
    "truncate_prompt_tokens": "prompts are not truncated: send one that fits the context",
}


def unknown_field(name: str) -> str:
    """The 400's message for a field a body does not declare."""
    why = NOT_SUPPORTED.get(name)
    if why is not None:
        return f"{name}: {why}"
    return f"{name} is not a field of this request (docs/serving.md lists the fields each body takes)"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # false (or absent) alone: no chunk is padded


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema: the schema the output validates against (name, description and strict are
    OpenAI's; the schema is enforced whatever strict says)."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
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
    # Every field is declared: an undeclared one is refused by name (unknown_field), never ignored.
    model_config = ConfigDict(extra="forbid")

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
    # The end user, as OpenAI's: it changes no output there either (OpenAI's abuse monitoring reads it); taken
    # and not kept.
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions, by vLLM's names (the module's docstring says what they do); None: the default.
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    min_p: float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = False
    priority: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str | None = None
    return_token_ids: bool | None = False
    return_routed_experts: bool | None = None
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
                "version_policy", "max_staleness", "min_p", "include_stop_str_in_output", "skip_special_tokens",
                "return_routed_experts")

    def ask(self) -> Ask:
        """The request as the front takes it (router.admission.Ask)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        sampling = {name: getattr(self, name) for name in self.SAMPLING}
        sampling.update(stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()), max_tokens=self.max_tokens,
                        logprobs=self.logprobs_k(), structured=self.structured())
        return Ask(sampling=sampling, service_tier=self.service_tier, session_id=self.session_id, **self.inputs())

    def asks(self) -> list[Ask]:
        """One Ask per prompt: a completions request may send several, each admitted and run as a request of
        its own."""
        return [self.ask()]

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
        if self.priority not in (None, 0):
            out.append(("priority", "priority is not supported: pdserve's priorities are service_tier's "
                                    "(\"priority\", \"default\", \"flex\")"))
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            out.append(("stream_options.include_obfuscation", "chunks are not padded (include_obfuscation: true "
                                                              "is not supported)"))
        if self.spaces_between_special_tokens and self.skip_special_tokens is False:
            out.append(("spaces_between_special_tokens", "special tokens are shown as the tokenizer decodes them, "
                                                          "without spaces added between them (true is not supported "
                                                          "with skip_special_tokens false)"))
        return out


class CompletionRequest(BaseCompletionRequest):
    # One prompt (text or token ids) or several (a list of either): each is a request of its own, its n
    # samples choices prompt_index * n + sample_index; at most MAX_PROMPTS.
    prompt: str | list[str] | list[int] | list[list[int]]
    # The choice's text (and logprobs) begin with the prompt's; with max_tokens 0, the prompt alone.
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None  # k: each generated token's logprob and the k most likely beside it
    best_of: int | None = None

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[dict[str, Any]]:
        """Each prompt as Ask's input: {"prompt": text} or {"token_ids": ids}."""
        prompt = self.prompt
        many = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        return [dict(prompt=None, token_ids=list(p)) if isinstance(p, list) else dict(prompt=p, token_ids=None)
                for p in many]

    def inputs(self) -> dict[str, Any]:
        first = {k: v for k, v in self.prompts()[0].items() if v is not None}
        return dict(first, default_max_tokens=DEFAULT_MAX_TOKENS)

    def ask(self) -> Ask:
        ask = super().ask()
        if self.echo and self.logprobs is not None:  # the prompt's logprobs, which the echo's begin with
            ask.sampling["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        if self.echo and self.max_tokens == 0:  # computed for one token, which the router drops
            ask.sampling["max_tokens"], ask.prompt_only = 1, True
        return ask

    def asks(self) -> list[Ask]:
        ask, prompts = self.ask(), self.prompts()
        return [replace(ask, sampling=dict(ask.sampling), prompts=len(prompts), **p) for p in prompts]

    def refused(self) -> list[tuple[str, str]]:
        out = super().refused()
        for name, bad in (("suffix", self.suffix), ("best_of", self.best_of not in (None, 1))):
            if bad:
                out.append((name, f"{name} is not supported"))
        if self.max_tokens == 0 and not self.echo:
            out.append(("max_tokens", "max_tokens must be >= 1 (0 only with echo: the prompt alone), got 0"))
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)) and \
                not 1 <= len(self.prompt) <= MAX_PROMPTS:
            out.append(("prompt", f"prompt has {len(self.prompt)} prompts; the most is {MAX_PROMPTS}"))
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
    # OpenAI's, with the meaning they have here: nothing is stored (store: false or absent); text is the one
    # modality (modalities ["text"] or absent); prompt_cache_key keeps requests that share a prefix together,
    # as session_id does (which it stands for when session_id is absent); safety_identifier, as user: taken,
    # not kept.
    store: bool | None = None
    modalities: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def ask(self) -> Ask:
        ask = super().ask()
        if self.max_completion_tokens is not None:
            ask.sampling["max_tokens"] = self.max_completion_tokens
        ask.session_id = ask.session_id or self.prompt_cache_key
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
        if self.store:
            out.append(("store", "completions are not stored (store: true is not supported)"))
        if self.modalities is not None and self.modalities != ["text"]:
            out.append(("modalities", "only text output is supported"))
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
