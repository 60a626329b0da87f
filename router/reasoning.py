"""A reply's reasoning apart from its answer (--reasoning-parser): the text between `<think>` and `</think>`
is message.reasoning_content, what follows `</think>` (its leading whitespace dropped) the content, which
tools are then read from (router.tool_parsers).

- qwen3 (Qwen3, QwQ): the reply reasons if it begins with `<think>` or if the rendered prompt already opened
  the block (a template that ends its generation prompt with `<think>`); a prompt that closed it (Qwen3's
  enable_thinking false renders `<think>\\n\\n</think>`) and a reply without the tag are content.
- deepseek_r1 (DeepSeek-R1 and its distillations): the reply begins in its reasoning whether or not it writes
  `<think>` (R1's template opens the block; its replies often start without the tag), up to `</think>`.
A reply cut before `</think>` is all reasoning. Tags split across a stream's pieces are held back until
known, so a stream gives what the whole reply gives.
"""
from __future__ import annotations

from router.tool_parsers.base import held_prefix

PARSERS = ("none", "qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def opens_reasoning(parser: str, prompt_tail: str) -> bool:
    """Whether a reply to a prompt ending with `prompt_tail` (its last tokens' text, special tokens shown)
    begins inside the reasoning block."""
    return parser == "deepseek_r1" or prompt_tail.rstrip().endswith(START)


class ReasoningStream:
    """One reply split into reasoning and content as it streams (add per piece, then finish). in_reasoning:
    the reply begins inside the block (opens_reasoning); an opening tag it writes anyway is dropped."""

    def __init__(self, in_reasoning: bool):
        self._opened = in_reasoning
        self._state = "start"  # until the reply's beginning shows whether it writes the opening tag
        self._buf = ""
        self._content_started = False
        self.reasoning, self.content = "", ""

    def add(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that `text` adds; final: the reply ends with it."""
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            body = self._buf.lstrip()
            if body.startswith(START):
                self._state, self._buf = "reasoning", body[len(START):]
            elif START.startswith(body) and not final:
                return "", ""  # the tag may be coming
            else:
                self._state = "reasoning" if self._opened else "content"
        if self._state == "reasoning":
            end = self._buf.find(END)
            if end >= 0:
                reasoning, self._buf, self._state = self._buf[:end], self._buf[end + len(END):], "content"
            else:
                keep = 0 if final else held_prefix(self._buf, END)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        if self._state == "content":
            content, self._buf = self._buf, ""
            if not self._content_started:
                content = content.lstrip()
                self._content_started = bool(content)
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.add("", final=True)
