"""What every family's parser shares (router.tool_parsers says what they read): a call, a family's step, and
the stream that runs the steps over a reply's pieces."""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

CALL_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A call's id, as OpenAI's API writes them: call_ and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(CALL_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict[str, Any]:
        """The call in the API's shape (message.tool_calls' entries)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Segment = str | ToolCall  # content text, or a complete call


def call_from(obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from a parsed JSON value {"name": str, <argument key>: object (or JSON text of one)}; None if it
    is not one. A call without arguments has {}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # arguments written as JSON text inside the JSON
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (held back until known)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class Family:
    """A model family's format. step() reads the front of `text` (the reply's content not yet read): the
    segments it makes and the characters they take; None where more text is needed to decide (never when
    `final`: the reply has ended). A family parser keeps state between steps (one per reply)."""

    name = ""

    def step(self, text: str, final: bool) -> tuple[list[Segment], int] | None:
        raise NotImplementedError


class JsonWait:
    """Whether a JSON value still being written is worth decoding again: only once text that can end one ("}"
    or "]") has come since the last try, so a long value is not decoded again for every piece of it."""

    def __init__(self):
        self._tried = -1  # the text's length at the last failed try; -1: none

    def worth(self, text: str) -> bool:
        return self._tried < 0 or any(c in text[self._tried:] for c in "}]")

    def failed(self, text: str) -> None:
        self._tried = len(text)

    def done(self) -> None:
        self._tried = -1


class _Trim:
    """Content text with its leading and trailing whitespace trimmed, as it streams: whitespace is held back
    until text follows it, and dropped if none does."""

    def __init__(self):
        self.started, self.held = False, ""

    def add(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body


class ToolCallStream:
    """One reply's content split into content text and tool calls as it streams (add per piece, then finish),
    or whole (parse). max_calls: calls past it are dropped (parallel_tool_calls false: one)."""

    def __init__(self, family: Family, max_calls: int | None = None):
        self.family, self.max_calls = family, max_calls
        self._buf = ""
        self._trim = _Trim()
        self.content = ""  # all content text given out
        self.calls: list[ToolCall] = []

    def add(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The content text and the calls that `text` completes (final: the reply ends with it)."""
        self._buf += text
        content, calls = [], []
        while self._buf:
            got = self.family.step(self._buf, final)
            if got is None:
                assert not final, f"{self.family.name}: a step asked for more text after the reply ended"
                break
            segments, used = got
            assert used > 0, f"{self.family.name}: a step read nothing"
            self._buf = self._buf[used:]
            for seg in segments:
                if isinstance(seg, ToolCall):
                    if self.max_calls is None or len(self.calls) < self.max_calls:
                        self.calls.append(seg)
                        calls.append(seg)
                else:
                    content.append(self._trim.add(seg))
        new = "".join(content)
        self.content += new
        return new, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self.add("", final=True)


def parse(family: Family, text: str, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None if nothing is left outside the calls) and its calls."""
    stream = ToolCallStream(family, max_calls)
    stream.add(text, final=True)
    return stream.content or None, stream.calls
