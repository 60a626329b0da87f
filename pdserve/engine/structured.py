"""Structured output: what a request's generated text must match, enforced by a token mask each step.

A request carries a StructuredOutput in SamplingParams.structured; the engine compiles it once per worker
(by value) and keeps one matcher per sample, which masks the logits before sampling and accepts each token
sampled. The kinds, by what the spec holds:
- "json_object": any JSON object (spec empty),
- "json_schema": JSON text of a JSON schema the output must validate against,
- "regex": a regular expression the whole output matches,
- "choice": JSON text of a list of strings, the output exactly one of them,
- "grammar": a context-free grammar (EBNF / Lark syntax) the output is a sentence of.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# A spec is compiled on the worker's step thread's side (once per value per worker): bounded like every
# other field a request may send that work grows with.
MAX_SPEC_CHARS = 64 * 1024


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"a structured output spec is text of at most {MAX_SPEC_CHARS} characters")
