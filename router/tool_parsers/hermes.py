"""Hermes tool calls (Qwen2.5, Qwen3, SmolLM3, Hermes 2/3, and pdserve's own prompt for templates without
tools): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with any whitespace inside
the tags, several in a row; the text around them is content."""
from __future__ import annotations

import json

from router.tool_parsers.base import Family, Segment, call_from, held_prefix

START, END = "<tool_call>", "</tool_call>"


class Hermes(Family):
    name = "hermes"

    def __init__(self):
        self._searched = 0  # how far an open call's text has been searched for END (a long call is not rescanned)

    def step(self, text: str, final: bool) -> tuple[list[Segment], int] | None:
        at = text.find(START)
        if at > 0:
            return [text[:at]], at
        if at < 0:  # content, but a partial START at the end waits
            keep = 0 if final else held_prefix(text, START)
            return ([text[:len(text) - keep]], len(text) - keep) if keep < len(text) else None
        end = text.find(END, max(len(START), self._searched - len(END) + 1))
        if end < 0:  # an open call: more text, or (the reply has ended) content
            self._searched = len(text)
            return ([text], len(text)) if final else None
        self._searched = 0
        end_all = end + len(END)
        try:
            call = call_from(json.loads(text[len(START):end]))
        except json.JSONDecodeError:
            call = None
        return [call if call is not None else text[:end_all]], end_all
