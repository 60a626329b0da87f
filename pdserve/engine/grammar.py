"""Structured output on a worker: each StructuredOutput compiled once, a matcher per sample, its token mask each step.

The grammar library is xgrammar, chosen by measuring it against llguidance on this machine
(bench.engine.grammar_mask, docs/benchmarks.md): its mask for 32 rows mid-document fills in a third of the time.

Grammars is a worker's compiler: the tokenizer's view the library needs is built once (on first use, from the
worker's own tokenizer, for the width of the model's logits, which may exceed the tokenizer's vocabulary: the
ids past it are never allowed), and each spec is compiled once, cached by value (bounded). A Matcher follows one
sample's output: the scheduler fills its mask when the sample's next token is to be drawn, and accepts each
token once it is on the host. A matcher is built from the tokens a request already has (a resumed attempt's, a
hand-off's first token): they are replayed, and one the grammar rejects is a GrammarError, never a silent
continuation in free text. When the grammar is complete only the end-of-sequence tokens are allowed; one of
them ends the matcher, and the request (finish reason "stop").
"""
from __future__ import annotations

import collections
import json
import threading
from collections.abc import Iterable, Sequence

import torch

from pdserve.engine.structured import StructuredOutput

# Compiled grammars kept per worker (and per router); a compiled JSON schema is tens of kilobytes.
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A spec the grammar library cannot compile, or a token a request's grammar does not allow."""


def bitmask_words(vocab_size: int) -> int:
    """32-bit words of a token bitmask over vocab_size ids (bit i of word w: token 32 w + i allowed)."""
    return (vocab_size + 31) // 32


class Grammars:
    """One worker's (or router's) compiler and compiled-grammar cache. Thread-safe: a worker compiles on the
    thread that takes a request in, so that its step thread finds the grammar compiled."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = CACHE_SIZE):
        """tokenizer: a pdserve.model.tokenizer.Tokenizer (its Hugging Face tokenizer is what the library reads);
        vocab_size: the model's logits' width; eos_token_ids: the tokens that end a complete output."""
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._cache: collections.OrderedDict[StructuredOutput, object] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._compiler = None

    def _compiler_of(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer.hf_tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self._eos)
                # Its own cache off: this one is bounded, keyed by the spec's value.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, structured: StructuredOutput):
        """The compiled grammar of a spec (cached); GrammarError saying what is wrong with one that does not compile."""
        with self._lock:
            hit = self._cache.get(structured)
            if hit is not None:
                self._cache.move_to_end(structured)
                return hit
        compiled = _compile(self._compiler_of(), structured)
        with self._lock:
            self._cache[structured] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, structured: StructuredOutput, tokens: Iterable[int] = ()) -> Matcher:
        """A new matcher for a sample of this spec, the sample's tokens so far replayed into it (GrammarError if
        the grammar rejects one)."""
        import xgrammar

        m = Matcher(xgrammar.GrammarMatcher(self.compile(structured)), self.words)
        m.replay(tokens)
        return m


def _compile(compiler, s: StructuredOutput):
    """A spec compiled by kind (pdserve.engine.structured.KINDS)."""
    try:
        # JSON without free whitespace between tokens (one space after ":" and ","): a small model offered any
        # whitespace can spend its whole output on it.
        if s.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if s.kind == "json_schema":
            json.loads(s.spec)  # a clear message for text that is not JSON at all
            return compiler.compile_json_schema(s.spec, any_whitespace=False)
        if s.kind == "regex":
            return compiler.compile_regex(s.spec)
        if s.kind == "choice":
            return compiler.compile_grammar(choice_grammar(s.spec))
        return compiler.compile_grammar(s.spec)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as e:  # the library's own errors say what is wrong
        raise GrammarError(f"{s.kind} does not compile: {_first_line(e)}") from None


def choice_grammar(spec: str) -> str:
    """The EBNF grammar of a choice spec (JSON text of a non-empty list of strings): exactly one of them."""
    try:
        options = json.loads(spec)
    except ValueError:
        raise GrammarError("choice must be JSON text of a list of strings") from None
    if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
        raise GrammarError("choice must be a non-empty list of strings")
    # A JSON string literal is an EBNF string literal (the same escapes).
    return "root ::= " + " | ".join(json.dumps(o) for o in dict.fromkeys(options))


def _first_line(e: BaseException) -> str:
    """The library's message without its source location prefix ("[time] file.cc:line: ")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    head, sep, rest = text.partition(": ")
    return rest if sep and ".cc:" in head else text


class Matcher:
    """One sample's place in its grammar."""

    def __init__(self, matcher, words: int):
        self._m = matcher
        self._words = words

    def accept(self, token: int) -> bool:
        """Advance by a token; False (and no change) if the grammar does not allow it."""
        return self._m.accept_token(token)

    def replay(self, tokens: Iterable[int]) -> None:
        """Accept tokens a sample already has; GrammarError naming the first the grammar rejects."""
        for i, t in enumerate(tokens):
            if not self._m.accept_token(t):
                raise GrammarError(f"output token {i} (id {t}) does not follow the request's structured output "
                                   "grammar")

    def rollback(self, tokens: int) -> None:
        """Undo the last `tokens` accepted (a verification's masks are made by accepting its drafts, then
        rolling them back: pdserve.engine.scheduler_spec.grammar_masks)."""
        self._m.rollback(tokens)

    def fork(self) -> Matcher:
        """A matcher at the same place, going on independently (a group's sample)."""
        return Matcher(self._m.fork(), self._words)

    @property
    def terminated(self) -> bool:
        """An end-of-sequence token completed the grammar: nothing more may follow."""
        return self._m.is_terminated()

    def mask(self, banned: Sequence[int] = ()) -> torch.Tensor:
        """The tokens allowed next, a bitmask [words] int32 (a new tensor). Banned ids (min_tokens holds EOS back)
        are taken out of it, unless that leaves nothing (a complete grammar allows only EOS: it ends)."""
        bitmask = torch.empty(1, self._words, dtype=torch.int32)
        self._m.fill_next_token_bitmask(bitmask, 0)
        row = bitmask[0]
        if not banned:
            return row
        words = row.tolist()
        for t in banned:
            w, b = divmod(t, 32)
            if w < len(words):
                v = words[w]
                words[w] = (v + (1 << 31) if v < 0 else v) if b == 31 else v & ~(1 << b)
        return torch.tensor(words, dtype=torch.int32) if any(words) else row


def advance(req, token: int) -> None:
    """A request's matcher (if it has one: pdserve.engine.request.Request.grammar) past a token of its output
    now on the host; GrammarError if its grammar does not allow it (a sampled token never fails: its mask allowed
    it; a token handed over from elsewhere may)."""
    if req.grammar is not None and not req.grammar.accept(token):
        raise GrammarError(f"request {req.request_id}: token id {token} does not follow its structured output "
                           "grammar")
