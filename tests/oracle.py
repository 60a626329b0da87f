"""A proposer that forces speculation's acceptance lengths: the tests of exactness at every acceptance length
(tests/engine/test_speculative_kinds.py, tests/parallel/test_tensor_parallel.py) draft with it."""
from __future__ import annotations


class Oracle:
    """A proposer (pdserve.engine.speculative.propose's signature) that drafts, for a sequence that follows one
    of its references so far, the reference's next `accept` tokens and then a token it does not have next."""

    def __init__(self, vocab: int, accept: int):
        self.vocab, self.accept = vocab, accept
        self.refs: list[tuple[list[int], list[int]]] = []

    def __call__(self, tokens, k, lookup_min, lookup_max) -> list[int]:
        tokens = list(tokens)
        for prompt, out in self.refs:
            n = len(prompt)
            if tokens[:n] == prompt and tokens[n:] == out[:len(tokens) - n]:
                m = len(tokens) - n
                right = out[m:m + self.accept]
                wrong = [(out[m + self.accept] + 1) % self.vocab] if m + self.accept < len(out) else []
                return (right + wrong)[:k]
        return []
