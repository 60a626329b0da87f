"""A chat request's tools, as both doors take them (router.admission checks them, renders them, and the reply
is read for calls by router.chat_reply).

tools: up to MAX_TOOLS functions, each {"type": "function", "function": {"name", "description", "parameters"
(a JSON schema of an object; absent: no arguments), "strict"}}, names unique. tool_choice: "none" (the tools
are rendered, the reply is not read for calls), "auto" (the default with tools: the reply is read for calls in
the model family's format, router.tool_parsers), "required" (at least one call) or {"type": "function",
"function": {"name": ...}} (that function). The last two are enforced by the grammar: the reply must be JSON
of a schema built here (forced_schema), SamplingParams.structured, and is read as calls from that JSON.
parallel_tool_calls false: at most one call (enforced by the schema; under auto, calls after the first are
dropped).

Rendering: a template that renders `tools` (its text uses them) gets them and the conversation as
transformers' templates take it (an assistant's tool_calls with their arguments as objects, a None content as
""). A template that does not (SmolLM2's plain ChatML) gets pdserve's own prompt in the Hermes convention
(hermes_prompt) in the system message, the assistant's calls written as <tool_call> blocks and the tools'
answers as <tool_response> blocks, and the reply is read as Hermes calls.
"""
from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured import StructuredOutput
from pdserve.model.tokenizer import Tokenizer

MAX_TOOLS = 128
# The most calls a forced reply (tool_choice "required") may make with parallel calls allowed. Each further
# call is the model's choice of "," over "]" after a complete one; greedy decoding of a small model keeps taking
# "," (SmolLM2-135M wrote calls until max_tokens on 10 prompts of 10 without a bound), so the list is bounded.
MAX_FORCED_CALLS = 4
CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TOOL_KEYS, _FUNCTION_KEYS = {"type", "function"}, {"name", "description", "parameters", "strict"}
_NO_ARGUMENTS = {"type": "object", "properties": {}}


class FieldError(ValueError):
    """A request's field is wrong: param names it as the HTTP API does (tools.0.function.name)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSet:
    """A request's checked tools: each in the API's shape (parameters filled in), the choice ("none", "auto",
    "required" or "function", the one named `function`) and whether several calls may come."""

    tools: tuple[dict[str, Any], ...]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def forced(self) -> bool:
        """Whether the reply is JSON the grammar holds to (required, or a named function)."""
        return self.choice in ("required", "function")

    def parameters(self, name: str) -> dict[str, Any]:
        return next(t["function"]["parameters"] for t in self.tools if t["function"]["name"] == name)

    def forced_schema(self) -> dict[str, Any] | None:
        """The JSON schema of a forced reply: a named function's arguments; for required, a list of calls
        (MAX_FORCED_CALLS at most; one without parallel calls), each {"name": a function's, "arguments": that function's
        arguments} (one alternative per function, so a name goes with its own schema)."""
        if self.choice == "function":
            return self.parameters(self.function)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": t["function"]["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        return {"type": "array", "minItems": 1, "maxItems": MAX_FORCED_CALLS if self.parallel else 1,
                "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}

    def structured(self) -> StructuredOutput | None:
        schema = self.forced_schema()
        if schema is None:
            return None
        try:
            return StructuredOutput("json_schema", json.dumps(schema))
        except ValueError as e:
            raise FieldError("tools", f"tools: the schema tool_choice {self.choice!r} makes of them is too "
                                      f"large ({e})") from None


def check_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolSet | None:
    """The request's tools checked (FieldError naming the field); None without tools."""
    if not tools:
        if tool_choice is not None:
            raise FieldError("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise FieldError("tools", "tools must be a list of functions")
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"tools has {len(tools)} functions; the most is {MAX_TOOLS}")
    checked: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        checked.append(_check_tool(i, tool, {t["function"]["name"] for t in checked}))
    names = [t["function"]["name"] for t in checked]
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise FieldError("parallel_tool_calls", "parallel_tool_calls must be true or false")
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in CHOICES:
        return ToolSet(tuple(checked), tool_choice or "auto", None, parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type") != "function" or set(tool_choice) != _TOOL_KEYS \
            or not isinstance(function.get("name"), str) or set(function) != {"name"}:
        raise FieldError("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                        '"function": {"name": ...}}')
    if function["name"] not in names:
        raise FieldError("tool_choice", f"tool_choice names the function {function['name']!r}, which tools does "
                                        f"not have")
    return ToolSet(tuple(checked), "function", function["name"], parallel)


def _check_tool(i: int, tool: Any, seen: set[str]) -> dict[str, Any]:
    where = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise FieldError(where, f'{where}: a tool is {{"type": "function", "function": {{...}}}}')
    if set(tool) - _TOOL_KEYS:
        raise FieldError(where, f"{where}: unknown field {sorted(set(tool) - _TOOL_KEYS)[0]!r}")
    function = tool["function"]
    if set(function) - _FUNCTION_KEYS:
        raise FieldError(f"{where}.function", f"{where}.function: unknown field "
                                              f"{sorted(set(function) - _FUNCTION_KEYS)[0]!r}")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FieldError(f"{where}.function.name", f"{where}.function.name must be 1 to 64 characters of a-z, A-Z, "
                                                   f"0-9, '_', '.' and '-', got {str(name)[:80]!r}")
    if name in seen:
        raise FieldError(f"{where}.function.name", f"tools has two functions named {name!r}")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise FieldError(f"{where}.function.description", f"{where}.function.description must be text")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise FieldError(f"{where}.function.strict", f"{where}.function.strict must be true or false")
    parameters = function.get("parameters")
    parameters = dict(_NO_ARGUMENTS) if parameters is None else parameters
    _check_schema(f"{where}.function.parameters", parameters)
    return {"type": "function", "function": {**{k: v for k, v in function.items() if v is not None},
                                             "parameters": parameters}}


def _check_schema(where: str, schema: Any) -> None:
    """A function's parameters: a valid JSON schema (jsonschema's meta-schema check) of an object."""
    import jsonschema

    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise FieldError(where, f"{where} must be the JSON schema of an object ({{\"type\": \"object\", ...}})")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise FieldError(where, f"{where} is not a valid JSON schema: {e.message}") from None


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Each message's tool fields: an assistant's tool_calls ({"id", "type": "function", "function": {"name",
    "arguments": JSON text of an object}}), a tool message's tool_call_id (FieldError naming the field)."""
    for i, m in enumerate(messages):
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise FieldError(f"messages.{i}.{key}", f"messages[{i}].{key} must be text")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise FieldError(f"messages.{i}.tool_calls", f"messages[{i}].tool_calls: a list, on an assistant's "
                                                         f"message only")
        for j, call in enumerate(calls):
            where = f"messages.{i}.tool_calls.{j}"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                    or not isinstance(function.get("arguments"), str) or call.get("type", "function") != "function":
                raise FieldError(where, f'{where}: a call is {{"id", "type": "function", "function": {{"name", '
                                        f'"arguments"}}}}, the arguments JSON text')
            try:
                if not isinstance(json.loads(function["arguments"]), dict):
                    raise ValueError
            except ValueError:
                raise FieldError(f"{where}.function.arguments", f"{where}.function.arguments must be JSON text of "
                                                                f"an object") from None


def message_chars(m: dict[str, Any]) -> int:
    """A message's characters as the input bound counts them (its calls' names and arguments included)."""
    n = len(m.get("content") or "") + len(m["role"])
    for call in m.get("tool_calls") or ():
        n += len(call["function"]["name"]) + len(call["function"]["arguments"])
    return n + sum(len(m.get(k) or "") for k in ("name", "tool_call_id", "reasoning_content"))


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """chat_template_kwargs: an object of the template's own variables (enable_thinking, ...); the arguments
    of rendering itself (tools, add_generation_prompt, tokenize, ...) are not among them."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise FieldError("chat_template_kwargs", "chat_template_kwargs must be a JSON object")
    reserved = sorted(set(kwargs) & _render_arguments())
    if reserved:
        raise FieldError("chat_template_kwargs", f"chat_template_kwargs may not set {reserved[0]!r}: it is an "
                                                 f"argument of the rendering itself")
    return kwargs


def _render_arguments() -> set[str]:
    from transformers import PreTrainedTokenizerBase

    names = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    return names | {"messages", "add_special_tokens"}


# -- rendering ----------------------------------------------------------------------------------------

def render(tok: Tokenizer, messages: list[dict[str, Any]], tools: ToolSet | None,
           template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The conversation's token ids, the tools rendered as the template takes them or, for a template without
    tools, in pdserve's Hermes prompt (the module's docstring)."""
    kwargs = template_kwargs or {}
    if tok.renders_tools:
        return tok.apply_chat_template([_for_template(m) for m in messages],
                                       tools=list(tools.tools) if tools else None, **kwargs)
    return tok.apply_chat_template(hermes_messages(messages, tools), **kwargs)


def _for_template(m: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers' templates take it: content "" for None, a call's arguments as an object."""
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = m.get("content") or ""
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "type": "function", "function": {**c["function"], "arguments": json.loads(
            c["function"]["arguments"])}} for c in m["tool_calls"]]
    return out


def hermes_prompt(tools: ToolSet) -> str:
    """The system prompt's part that describes the tools, for a template that renders none."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
    lines = ["# Tools", "",
             "You may call functions to answer. Each function is described by a JSON schema, one a line, between "
             "<tools> and </tools>:", "<tools>", listed, "</tools>", "",
             "To call a function, write a JSON object with its name and its arguments between <tool_call> and "
             "</tool_call>, one such block per call:", "<tool_call>",
             '{"name": "<function name>", "arguments": {<its arguments, as its schema says>}}', "</tool_call>"]
    if tools.choice == "required":
        lines.append("Call at least one of the functions now.")
    elif tools.choice == "function":
        lines.append(f"Call the function {tools.function} now.")
    if not tools.parallel:
        lines.append("Call one function at most.")
    return "\n".join(lines)


def hermes_messages(messages: list[dict[str, Any]], tools: ToolSet | None) -> list[dict[str, Any]]:
    """The conversation in the Hermes convention, as text for a template that knows only roles and content:
    the tools' prompt in the system message (first if there is none), an assistant's calls as <tool_call>
    blocks after its content, a tool's answer inside <tool_response> and </tool_response>."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
                                ensure_ascii=False) for c in m["tool_calls"]]
            content = "\n".join([content] * bool(content) + [f"<tool_call>\n{c}\n</tool_call>" for c in calls])
        elif m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools is not None:
        prompt = hermes_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
