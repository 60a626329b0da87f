"""A chat reply read for what the API returns beside its text: its reasoning (router.reasoning), then, in the
content after it, its tool calls (router.tool_parsers; a forced tool choice's JSON here). Both doors read
replies through this module, streamed (Reply.add per piece of text) or whole (the same, then the totals).

A forced choice (router.chat_tools: "required" or a named function) makes the reply JSON under the grammar:
its calls are read from that JSON once the reply ends (a streamed reply gives them with its last piece), and a
reply that does not parse as such (cut by max_tokens) is content text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from router.chat_tools import ToolSet
from router.reasoning import ReasoningStream, opens_reasoning
from router.tool_parsers import ToolCall, ToolCallStream, call_from, family

PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens read for a reasoning block the template opened


@dataclass(frozen=True)
class ReplyPlan:
    """How one request's replies are read: the reasoning parser ("none", "qwen3", "deepseek_r1"), the tool
    call parser's family (the server's, --tool-call-parser resolved) and the request's tools (None: no calls
    read, tool_choice none included)."""

    reasoning: str
    tool_parser: str
    tools: ToolSet | None

    def reply(self, tokenizer, prompt: list[int]) -> Reply:
        """A sample's reply to `prompt` (its ids)."""
        tail = tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False) if tokenizer else ""
        return Reply(self, self.reasoning != "none" and opens_reasoning(self.reasoning, tail))


def plan(tools: ToolSet | None, tool_parser: str, reasoning: str) -> ReplyPlan | None:
    """The plan of a chat request, None where its replies are plain text (no reasoning parser, no calls read)."""
    if tools is not None and tools.choice == "none":
        tools = None
    if tools is None and reasoning == "none":
        return None
    return ReplyPlan(reasoning, tool_parser, tools)


@dataclass
class Piece:
    """What a piece of a reply's text adds: reasoning text, content text, complete calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class _ForcedCalls:
    """A forced choice's reply: JSON of the calls (required) or of the named function's arguments."""

    def __init__(self, tools: ToolSet):
        self.tools, self.text = tools, ""
        self.content, self.calls = "", []

    def add(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += text
        if not final:
            return "", []
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError:
            value = None
        if self.tools.choice == "function":
            calls = [ToolCall(self.tools.function, json.dumps(value, ensure_ascii=False))] \
                if isinstance(value, dict) else [None]
        else:
            calls = [call_from(c) for c in value] if isinstance(value, list) and value else [None]
        if None in calls:
            self.content = self.text
            return self.text, []
        self.calls = calls
        return "", calls


class Reply:
    """One sample's reply as it streams: add() each piece of text (final: the reply ends with it), the Piece
    it adds; reasoning, content and calls hold the totals."""

    def __init__(self, plan: ReplyPlan, in_reasoning: bool):
        self.plan = plan
        self._reasoning = ReasoningStream(in_reasoning) if plan.reasoning != "none" else None
        tools = plan.tools
        self._tools = None if tools is None else _ForcedCalls(tools) if tools.forced else \
            ToolCallStream(family(plan.tool_parser), None if tools.parallel else 1)
        self._content = ""

    def add(self, text: str, final: bool = False) -> Piece:
        piece = Piece()
        if self._reasoning is not None:
            piece.reasoning, text = self._reasoning.add(text, final)
        if self._tools is not None:
            text, piece.calls = self._tools.add(text, final)
        piece.content = text
        self._content += text
        return piece

    @property
    def reasoning(self) -> str | None:
        return (self._reasoning.reasoning or None) if self._reasoning is not None else None

    @property
    def content(self) -> str | None:
        """The content; None where calls were made and no text is left beside them."""
        return None if self.calls and not self._content else self._content

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._tools.calls) if self._tools is not None else []

    def finish_reason(self, finish: str | None) -> str | None:
        """The API's finish reason: "tool_calls" where the reply stopped on its own after making calls."""
        return "tool_calls" if finish == "stop" and self.calls else finish
