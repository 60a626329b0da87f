"""Tool calls in a model's reply, one parser per model family's format, streamed or whole.

A chat request with tools (router.chat_tools) has its reply's content (after any reasoning, router.reasoning)
read by the parser of the served model's family, chosen by the serve flag --tool-call-parser:
- hermes (router.tool_parsers.hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several in
  a row (Qwen2.5, Qwen3, SmolLM3, Hermes, and pdserve's own prompt for templates that know no tools),
- llama3_json (router.tool_parsers.llama3_json): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;` (Llama 3.1 to 3.3),
- mistral (router.tool_parsers.mistral): `[TOOL_CALLS]` then a JSON list of calls, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` once per call.
"auto" picks one from the chat template's text and the special tokens the vocabulary holds (detect), hermes
when nothing says otherwise.

A family's parser reads one segment at a time from the front of the text not yet read (Family.step): content
text, or complete calls; it asks for more text while what it holds could still become a call, so a stream
cut anywhere gives the segments the whole text gives (ToolCallStream). A call whose JSON does not parse stays
content text. The content is the text outside the calls with its leading and trailing whitespace trimmed
(whitespace is held back until text follows it), None where nothing is left.
"""
from __future__ import annotations

from router.tool_parsers.base import Family, Segment, ToolCall, ToolCallStream, call_from, held_prefix, parse
from router.tool_parsers.hermes import Hermes
from router.tool_parsers.llama3_json import Llama3Json
from router.tool_parsers.mistral import Mistral

__all__ = ["Family", "Segment", "ToolCall", "ToolCallStream", "call_from", "held_prefix", "parse", "family", "detect",
           "PARSERS"]
PARSERS = ("auto", "hermes", "llama3_json", "mistral")
# Families whose markers are special tokens the parser needs in the text, which leaves special tokens out
# unless asked (SamplingParams.skip_special_tokens). llama3_json's <|python_tag|> is not needed: its calls are
# the JSON.
KEEPS_SPECIAL_TOKENS = frozenset({"mistral"})
_FAMILIES = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral}


def family(name: str) -> Family:
    """A new parser of the family `name` (one per reply: a parser keeps state)."""
    if name not in _FAMILIES:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return _FAMILIES[name]()


def detect(chat_template: str | None, special_tokens: set[str]) -> str:
    """The family of a model from its chat template's text and its vocabulary's special tokens: the
    template's own call format first, then the family's marker tokens. A template that renders no tools
    gets pdserve's own prompt for Hermes calls (router.chat_tools): hermes, as when nothing says otherwise."""
    template = chat_template or ""
    if "tools" not in template:
        return "hermes"
    for marker, name in MARKERS:
        if marker in template:
            return name
    if "ipython" in template:  # Llama 3.1's role for a tool's answer
        return "llama3_json"
    for marker, name in MARKERS:
        if marker in special_tokens:
            return name
    return "hermes"


MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))
