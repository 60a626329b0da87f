"""A request's choices in the OpenAI API's shape: each sample's text, finish reason, logprobs (chat's content
entries, completions' tokens / token_logprobs / top_logprobs / text_offset) and token ids, streamed piece by
piece or gathered whole; the prompt's fields (prompt_token_ids, prompt_logprobs) once; with echo, the prompt's
text and logprobs before the sample's. Token strings are the tokenizer's text of each id alone (special tokens
shown), bytes their raw bytes where the tokenizer is byte-level; a model without a tokenizer, or a request
that asks for return_tokens_as_token_ids, names a token "token_id:<id>". A logprob of -inf (a token the
"processed" distribution masked out) is written as MIN_LOGPROB, JSON having no -inf. A chat reply read for
reasoning and tool calls (router.chat_reply) gives message.reasoning_content and message.tool_calls beside its
content (streamed: delta.reasoning_content, delta.tool_calls, each call whole in one delta with its index),
and finishes "tool_calls" where it stopped after making calls."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pdserve.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import FinishReason
from pdserve.engine.routed_experts import RoutedExperts, join
from pdserve.engine.sampling import SamplingParams
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from router.chat_reply import Reply

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
MIN_LOGPROB = -9999.0  # what a logprob of -inf is written as: JSON has no -inf


def _logprob(x: float) -> float:
    return max(x, MIN_LOGPROB)


class Vocab:
    """Token ids as logprobs show them: each id's text (the tokenizer's decode of it alone, special tokens
    shown) and its bytes, made once per id. A byte-level BPE token gives its raw bytes, so a token holding
    part of a UTF-8 character (whose text is U+FFFD) still gives exact bytes; a byte-fallback piece
    (<0xE6>) gives its byte; other tokens the UTF-8 of their text. Without a tokenizer: "token_id:<id>"."""

    _BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer: Tokenizer | None):
        self._tok = tokenizer
        self._known: dict[int, tuple[str, list[int]]] = {}
        self._byte_level: dict[str, int] | None = None
        self._added: dict[int, str] = {}
        if tokenizer is not None:
            from tokenizers.decoders import ByteLevel

            hf = tokenizer.hf_tokenizer
            self._added = {int(i): t.content for i, t in hf.added_tokens_decoder.items()}
            backend = getattr(hf, "backend_tokenizer", None)
            if backend is not None and isinstance(backend.decoder, ByteLevel):
                self._byte_level = _byte_level_alphabet()

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of a token id."""
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._make(token_id)
        return known

    def text(self, token_id: int) -> str:
        return self(token_id)[0]

    def _make(self, token_id: int) -> tuple[str, list[int]]:
        if self._tok is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if token_id in self._added:
            return text, list(self._added[token_id].encode())
        piece = self._tok.hf_tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level is not None and all(c in self._byte_level for c in piece):
                return text, [self._byte_level[c] for c in piece]
            if (m := self._BYTE_PIECE.fullmatch(piece)) is not None:
                return text, [int(m[1], 16)]
        return text, list(text.encode())


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: printable bytes stand for themselves, the other
    68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


@dataclass(frozen=True)
class Shape:
    """What a request asks of its choices beyond what it samples: token_ids (return_token_ids), echo (the
    prompt's text, and logprobs if asked, before the sample's: completions), prompt_logprobs (the client's k
    of the prompt_logprobs field; None: not asked; the engine may compute more for the echo)."""

    token_ids: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None


class Choice:
    """A request's choice (the sample of its index) in the API's shape, built from that sample's outputs:
    streamed (piece() per output) or whole (add() per output, then whole()). Beside the text: logprobs
    (when asked), the token ids (return_token_ids), and, each prompt's sample 0 alone, the prompt's fields
    once (prompt_token_ids, prompt_logprobs), which chat puts on the response and completions on the choice.
    index: the choice's in the response (prompt_index * n + sample); sample: its sample of the prompt.
    echo_text: the prompt's text, which the choice's text begins with (Shape.echo)."""

    def __init__(self, chat: bool, vocab: Vocab, tokenizer: Tokenizer | None, prompt: list[int],
                 params: SamplingParams, shape: Shape, index: int = 0, sample: int = 0, echo_text: str = "",
                 reply: Reply | None = None):
        self.chat, self.vocab, self.prompt, self.index = chat, vocab, prompt, index
        self.token_ids = shape.token_ids
        self.reply = reply  # a chat reply read for reasoning and tool calls; None: its text as it comes
        self._calls = 0  # calls given out in a stream: the next one's index
        self.logprobs = params.logprobs is not None
        self.k = params.logprobs or 0
        self.prompt_k = shape.prompt_logprobs
        self.prompt_logprobs = shape.prompt_logprobs is not None
        self._echo: str | None = echo_text if shape.echo and not chat else None
        self._tokenizer = tokenizer
        # Completions' text_offset: each token's offset is the length of the text of the tokens before it,
        # decoded as the completion's text is (with the prompt's last tokens as context). A token that ends
        # within a character the next completes is at that character's offset.
        self._offsets = (IncrementalDetokenizer(tokenizer, prompt)
                         if self.logprobs and not chat and tokenizer is not None else None)
        self._offset = len(self._echo or "")  # characters of that text so far
        self._prompt_sent = sample > 0 or not (self.token_ids or self.prompt_logprobs)
        self.text, self.finish = "", None
        # What add() gathers: the choice's fields, in their shape even if no token comes; the prompt's.
        empty = {"content": []} if chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self._fields: dict[str, Any] = {"logprobs": empty if self.logprobs else None}
        if self.token_ids:
            self._fields["token_ids"] = []
            self._fields["weight_versions"] = []
        self._prompt: dict[str, Any] = {}
        # Routed experts (return_routed_experts): each piece's new positions; whole() joins what add() gathered.
        self.routed = params.return_routed_experts
        self._routed: list[RoutedExperts] = []

    @property
    def extras(self) -> bool:
        """Whether an output without text still has something to send (its tokens' logprobs or ids)."""
        return self.logprobs or self.token_ids or self.routed

    def piece(self, out: RequestOutput, prompt_logprobs: PromptLogprobs | None = None
              ) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """What `out` adds: its text, the choice's fields (logprobs, token_ids) and the prompt's, the latter
        once: on the output that carries the prompt's logprobs if they were asked, else on the first (on the
        last at the latest). With echo, the first piece begins with the prompt's text and logprobs (those of
        `out`, or prompt_logprobs: the request's, which another sample's output carried)."""
        fields: dict[str, Any] = {"logprobs": None}
        text = out.new_text
        echo = None
        if self._echo is not None:
            text, echo, self._echo = self._echo + text, self._echo, None
        if self.logprobs:
            fields["logprobs"] = self._chat_logprobs(out.logprobs) if self.chat else self._completion_logprobs(out)
            if echo is not None:
                given = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_logprobs
                assert given is not None, "an echo with logprobs before the prompt's logprobs came"
                head = self._echo_logprobs(given)
                fields["logprobs"] = {key: head[key] + items for key, items in fields["logprobs"].items()}
        if self.token_ids:
            fields["token_ids"] = list(out.new_token_ids)
            fields["weight_versions"] = list(out.weight_versions)  # each token's (router.weights)
        if self.routed:
            fields["routed_experts"] = None if out.routed_experts is None else out.routed_experts.json()
        return text, fields, self.prompt_fields(out, last=out.finished)

    def delta(self, text: str, out: RequestOutput) -> dict[str, Any]:
        """A chat chunk's delta fields beside the role (content, reasoning_content, tool_calls), those that have
        something, of `text` (the piece of `out`)."""
        if self.reply is None:
            return {"content": text} if text else {}
        piece = self.reply.add(text, out.finished)
        delta: dict[str, Any] = {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.content:
            delta["content"] = piece.content
        if piece.calls:
            delta["tool_calls"] = [{"index": self._calls + i, **c.openai()} for i, c in enumerate(piece.calls)]
            self._calls += len(piece.calls)
        return delta

    def finish_of(self, out: RequestOutput) -> str | None:
        """The finish reason of `out` in the API's words (None while the sample runs)."""
        finish = FINISH.get(out.finish_reason) if out.finished else None
        return self.reply.finish_reason(finish) if self.reply is not None else finish

    @property
    def first_content(self) -> str | None:
        """The content of a chat stream's first delta (the role's): None where the reply may be calls alone
        (its content then stays None, as the whole reply's)."""
        return None if self.reply is not None and self.reply.plan.tools is not None else ""

    def no_tokens(self) -> dict[str, Any]:
        """The choice's fields of a chunk without tokens (chat's first, which says the role)."""
        return {"logprobs": None, **({"token_ids": [], "weight_versions": []} if self.token_ids else {})}

    def prompt_fields(self, out: RequestOutput | None, last: bool = False) -> dict[str, Any]:
        """The prompt's fields if they are due with `out` (or, `last`, due at all) and not yet given."""
        if self._prompt_sent or not last and (out is None or self.prompt_logprobs and out.prompt_logprobs is None):
            return {}
        self._prompt_sent = True
        fields: dict[str, Any] = {}
        if self.token_ids:
            fields["prompt_token_ids"] = list(self.prompt)
        if self.prompt_logprobs:
            given = out.prompt_logprobs if out is not None else None
            fields["prompt_logprobs"] = None if given is None else self._prompt_logprobs(given)
        return fields

    def add(self, out: RequestOutput, prompt_logprobs: PromptLogprobs | None = None) -> None:
        text, fields, prompt = self.piece(out, prompt_logprobs)
        self.text += text
        if self.reply is not None:
            self.reply.add(text, out.finished)
        if out.finished:
            self.finish = self.finish_of(out)
        if fields.pop("routed_experts", None) is not None:
            self._routed.append(out.routed_experts)
        for name, value in fields.items():
            if isinstance(value, list):  # token_ids, weight_versions
                self._fields[name].extend(value)
            elif isinstance(value, dict):  # logprobs: each of its lists grows
                for key, items in value.items():
                    self._fields[name][key].extend(items)
        self._prompt.update(prompt)

    def whole(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the choice, the response's own fields) once every output is in."""
        self._prompt.update(self.prompt_fields(None, last=True))
        choice: dict[str, Any] = {"index": self.index, "finish_reason": self.finish, **self._fields}
        if self.routed:
            choice["routed_experts"] = join(self._routed).json() if self._routed else None
        if self.chat:
            choice["message"] = self._message()
            return choice, self._prompt
        return {**choice, "text": self.text, **self._prompt}, {}

    def _message(self) -> dict[str, Any]:
        reply = self.reply
        if reply is None:
            return {"role": "assistant", "content": self.text}
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.plan.reasoning != "none":
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [c.openai() for c in reply.calls]
        return message

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.vocab(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": raw}

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, x) for t, x in lp.top]} for lp in logprobs or ()]}

    def _completion_logprobs(self, out: RequestOutput) -> dict[str, Any]:
        offsets = []
        for token_id in out.new_token_ids:
            offsets.append(self._offset)
            if self._offsets is not None:
                self._offset += len(self._offsets.add([token_id]))
        tokens, token_logprobs, tops = [], [], []
        for lp in out.logprobs or ():
            tokens.append(self.vocab.text(lp.token_id))
            token_logprobs.append(_logprob(lp.logprob))
            tops.append(self._top(lp, self.k))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets[:len(tokens)]}

    def _top(self, lp: TokenLogprob, k: int) -> dict[str, float]:
        """The k most likely and the chosen token, by text (ids of the same text: the likelier one's)."""
        top: dict[str, float] = {}
        for t, x in (*lp.top[:k], (lp.token_id, lp.logprob)):
            top.setdefault(self.vocab.text(t), _logprob(x))
        return top

    def _echo_logprobs(self, given: PromptLogprobs) -> dict[str, list]:
        """The prompt's tokens in the completions logprobs' shape (the first token's logprob and top None),
        each at its offset in the prompt's text as decoded token by token."""
        detok = IncrementalDetokenizer(self._tokenizer, []) if self._tokenizer is not None else None
        offset, offsets = 0, []
        for token_id in self.prompt:
            offsets.append(offset)
            if detok is not None:
                offset += len(detok.add([token_id]))
        tokens, token_logprobs, tops = [], [], []
        for token_id, lp in zip(self.prompt, given):
            tokens.append(self.vocab.text(token_id))
            token_logprobs.append(None if lp is None else _logprob(lp.logprob))
            tops.append(None if lp is None else self._top(lp, self.k))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_logprobs(self, logprobs: PromptLogprobs) -> list[dict[str, Any] | None]:
        """Per prompt token (None for the first) {"<id>": {logprob, rank, decoded_token}} for the token itself
        and the k most likely there."""
        out: list[dict[str, Any] | None] = []
        for lp in logprobs:
            if lp is None:
                out.append(None)
                continue
            ranked = {str(lp.token_id): {"logprob": _logprob(lp.logprob), "rank": lp.rank,
                                         "decoded_token": self.vocab.text(lp.token_id)}}
            higher = 0  # of the top entries before this one, those strictly likelier (ties share a rank)
            top = lp.top[:self.prompt_k]  # the engine's may be more (an echo's logprobs asked for more)
            for i, (t, x) in enumerate(top):
                if i and top[i - 1][1] > x:
                    higher = i
                ranked.setdefault(str(t), {"logprob": _logprob(x), "rank": higher + 1,
                                           "decoded_token": self.vocab.text(t)})
            out.append(ranked)
        return out
