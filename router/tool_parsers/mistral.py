"""Mistral tool calls: `[TOOL_CALLS]` then a JSON list of {"name": ..., "arguments": {...}} (Mistral 7B v0.3,
Mixtral, Nemo), or, from the v11 tokenizers on, `[TOOL_CALLS]name[ARGS]{...}` once per call (an id between
`[CALL_ID]` and `[ARGS]` is read and dropped: pdserve gives every call its own). The text before the first
`[TOOL_CALLS]` is content, and so is a call that does not parse."""
from __future__ import annotations

import json
import re

from router.tool_parsers.base import Family, JsonWait, Segment, call_from, held_prefix

START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_NAME_PART = re.compile(r"[A-Za-z0-9_.\-\[\]]*")  # what may stand between START and the arguments' JSON
_DECODER = json.JSONDecoder()


class Mistral(Family):
    name = "mistral"

    def __init__(self):
        self._wait = JsonWait()

    def step(self, text: str, final: bool) -> tuple[list[Segment], int] | None:
        at = text.find(START)
        if at > 0:
            return [text[:at]], at
        if at < 0:
            keep = 0 if final else held_prefix(text, START)
            return ([text[:len(text) - keep]], len(text) - keep) if keep < len(text) else None
        rest = text[len(START):]
        body = rest.lstrip()
        if not body:
            return ([text], len(text)) if final else None
        skipped = len(START) + len(rest) - len(body)
        if not final and not self._wait.worth(text):
            return None
        got = self._list(body, final) if body[0] == "[" else self._named(body, final)
        if got is None:
            self._wait.failed(text)
            return None
        self._wait.done()
        calls, used = got
        return (calls, skipped + used) if calls else ([START], len(START))  # not a call: the marker is content

    @staticmethod
    def _list(body: str, final: bool):
        try:
            obj, end = _DECODER.raw_decode(body)
        except json.JSONDecodeError:
            return None if not final else ([], 0)
        calls = [call_from(c) for c in obj] if isinstance(obj, list) and obj else [None]
        return (calls, end) if all(c is not None for c in calls) else ([], 0)

    @staticmethod
    def _named(rest: str, final: bool):
        head = _NAME_PART.match(rest)[0]
        at = head.find(ARGS)
        if at < 0:
            # still writing the name (or the id), unless something else came or the reply ended
            return None if not final and len(head) == len(rest) and len(head) < 256 else ([], 0)
        name = head[:at].split(CALL_ID)[0]
        args = rest[at + len(ARGS):]
        body = args.lstrip()
        if not _NAME.fullmatch(name) or (body and body[0] != "{"):
            return [], 0
        try:
            obj, end = _DECODER.raw_decode(body)
        except json.JSONDecodeError:
            return None if not final else ([], 0)
        call = call_from({"name": name, "arguments": obj})
        return ([call], at + len(ARGS) + len(args) - len(body) + end) if call is not None else ([], 0)
