"""Llama 3.x JSON tool calls (Llama 3.1 to 3.3): the reply is the calls, each a JSON object
{"name": ..., "parameters": {...}} ("arguments" taken too), optionally after `<|python_tag|>`, several
separated by `;`. Whatever does not read as a call, from where it starts, is content: a reply that does not
begin with a call is all content."""
from __future__ import annotations

import json

from router.tool_parsers.base import Family, JsonWait, Segment, call_from

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3Json(Family):
    name = "llama3_json"

    def __init__(self):
        self.calls = 0
        self.content = False  # past the calls: the rest is content
        self._wait = JsonWait()

    def step(self, text: str, final: bool) -> tuple[list[Segment], int] | None:
        if self.content:
            return [text], len(text)
        body = text.lstrip()
        skipped = len(text) - len(body)
        if not body:
            return ([text], len(text)) if final else None
        if self.calls and body[0] == ";":  # between two calls
            return [], skipped + 1
        if body.startswith(PYTHON_TAG):
            return [], skipped + len(PYTHON_TAG)
        if PYTHON_TAG.startswith(body) and not final:
            return None
        if body[0] == "{":
            if not final and not self._wait.worth(text):
                return None
            try:
                obj, end = _DECODER.raw_decode(body)
            except json.JSONDecodeError:
                if not final:
                    self._wait.failed(text)
                    return None  # an object still being written (or not JSON: known at the end)
                obj = None
            self._wait.done()
            call = call_from(obj)
            if call is not None:
                self.calls += 1
                return [call], skipped + end
        self.content = True
        return [text], len(text)
