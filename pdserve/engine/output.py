"""Per-request text output: incremental detokenization and stop strings.

Text that could still turn out to be the start of a stop string is held back, so a client never
receives characters that a later token retracts. When a stop string completes, the text is cut where
it begins (the stop string is not returned; with SamplingParams.include_stop_str_in_output, where it ends)
and the request finishes with reason STOP. Special tokens are left out of the text unless the request's
skip_special_tokens is False.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.engine.request import NO_TOKEN, FinishReason, Request
from pdserve.engine.routed_experts import RoutedExperts
from pdserve.engine.sampling import SamplingParams
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # with finish_reason ERROR
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    placement: tuple[str, ...] = ()  # workers that ran the request (prefill, decode), on the last output
    service_tier: str = "default"  # the tier it is served at (pdserve.tiers): lower than asked if downgraded
    # With params.logprobs: one per new token, in order. With params.prompt_logprobs: the prompt's, on the
    # output that carries the first token.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    index: int = 0  # which sample of the request (SamplingParams.n) the tokens are
    # The weight version (pdserve.weights) that sampled each new token, in order.
    weight_versions: list[int] = field(default_factory=list)
    # With params.return_routed_experts: the routed experts of the positions computed since the last output,
    # up to the one that sampled its last new token (pdserve.engine.routed_experts); None when none are new.
    routed_experts: RoutedExperts | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class TextDelta:
    text: str
    stopped: bool  # a stop string completed: the request must finish with FinishReason.STOP


class TextOutput:
    """A request's output text, token by token. Whoever streams the tokens holds one: the worker that
    samples them in a cluster (pdserve.serving.worker), the offline engine's loop otherwise."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], stop: tuple[str, ...],
                 include_stop: bool = False, skip_special_tokens: bool = True):
        """include_stop: a stop string (or stop token) that ends the text is part of it."""
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model was loaded without one")
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens) \
            if tokenizer is not None else None
        self._stop = stop
        self.include_stop = include_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""
        self._emitted = 0

    @classmethod
    def of(cls, tokenizer: Tokenizer | None, prompt_token_ids: list[int], params: SamplingParams) -> TextOutput:
        """The text of a request with these parameters (its stop strings and text options)."""
        return cls(tokenizer, prompt_token_ids, params.stop, **text_options(params))

    @classmethod
    def resume(cls, tokenizer: Tokenizer | None, prompt_token_ids: list[int], output_token_ids: list[int],
               stop: tuple[str, ...], emitted: int, **options) -> TextOutput:
        """The text of a request continued elsewhere: its output tokens so far are decoded without being
        emitted, and `emitted` characters of their text count as already sent (the router's count). The
        next add() returns what a TextOutput that had seen every token would have returned: text held
        back there (a possible stop string's start, an incomplete character) comes out here."""
        text = cls(tokenizer, prompt_token_ids, stop, **options)
        if output_token_ids and text._detok is not None:
            text._text = text._detok.add(output_token_ids)
        text._emitted = emitted
        return text

    @property
    def text(self) -> str:
        return self._text

    @property
    def emitted(self) -> int:
        """Characters of text returned so far (those counted as sent by resume() included)."""
        return self._emitted

    def add(self, token_ids: list[int], finish_reason: FinishReason | None) -> TextDelta:
        """Feed newly generated tokens; finish_reason says if the request ends with them."""
        if self._detok is None:
            return TextDelta("", False)
        searched_from = max(0, len(self._text) - self._hold)
        self._text += self._detok.add(token_ids)
        if finish_reason is not None:
            self._text += self._detok.flush()
        stopped = False
        for s in self._stop:
            at = self._text.find(s, searched_from)
            if at != -1:
                self._text = self._text[:at + len(s) if self.include_stop else at]
                stopped = True
                searched_from = min(searched_from, at)
        end = len(self._text) if (stopped or finish_reason is not None) else max(self._emitted, len(self._text) - self._hold)
        delta = self._text[self._emitted:end]
        self._emitted = end
        return TextDelta(delta, stopped)


def text_options(params: SamplingParams) -> dict[str, bool]:
    """TextOutput's options of a request's parameters."""
    return dict(include_stop=params.include_stop_str_in_output, skip_special_tokens=params.skip_special_tokens)


def token_text(text: TextOutput, token: int, reason: FinishReason | None) -> tuple[str, FinishReason | None]:
    """A token's text and its finish reason, a completed stop string included (the caller must then end
    the request if it is still running). EOS and stop ids end the stream but are not text, unless the text
    includes what stopped it (then a special one still shows only if special tokens are not skipped)."""
    ends = reason is FinishReason.STOP and not text.include_stop
    delta = text.add([] if ends or token == NO_TOKEN else [token], reason)
    return delta.text, FinishReason.STOP if delta.stopped else reason


def token_output(req: Request, text: TextOutput, token: int, reason: FinishReason | None,
                 num_output_tokens: int | None = None) -> RequestOutput:
    """The output for a token just appended to req; reason is what the token-level rules said;
    num_output_tokens: the output's length with this token (default: req's, which pipelined decode may
    already have extended with tokens in flight).

    EOS and stop ids end the stream but are not text. A completed stop string turns the reason into
    STOP: the caller must then end the request if it is still running.
    """
    new_text, reason = token_text(text, token, reason)
    n = req.num_output_tokens if num_output_tokens is None else num_output_tokens
    return RequestOutput(req.request_id, [] if token == NO_TOKEN else [token], new_text, reason, req.num_prompt_tokens, n)
