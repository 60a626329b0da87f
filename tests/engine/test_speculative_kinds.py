"""Speculation keeps every request kind exact on SmolLM2 (pdserve.engine.scheduler_spec): penalties, min_tokens
below its count, structured output (JSON schema), groups (n > 1), stop strings, stop ids and max_tokens give
greedy output token-identical with speculation on and off at several forced acceptance lengths. The lengths are
forced by an oracle proposer: it drafts the next `accept` tokens of the output without speculation, then one
wrong token, so every verification keeps exactly what it must keep and each drafted position's processing
(penalties counting the drafts before it, min_tokens' ban, the grammar's mask after the drafts) decides a token
that plain decoding decided with the same history."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.speculative import SpeculativeConfig
from pdserve.engine.structured import StructuredOutput

from oracle import Oracle
from test_speculative_engine import CACHE, chat, smol  # noqa: F401  (smol: the module's model, a fixture)

SOURCE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
COPY = "Rewrite this file exactly, renaming {} to {}:\n" + SOURCE
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "colour"], "additionalProperties": False}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))
# Each kind's prompt is its own: the kinds run as one batch, and the oracle finds a request's reference by its
# prompt (two requests of one prompt whose replies begin alike could be drafted from each other's).
KINDS = {
    "penalties": (COPY.format("add", "plus"), SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.2,
                                                             presence_penalty=0.5, frequency_penalty=0.3)),
    "min_tokens": ("Say hi.", SamplingParams(max_tokens=28, temperature=0.0, min_tokens=24)),
    "json_schema": ("Describe a person as JSON: name, age, favourite colour.",
                    SamplingParams(max_tokens=48, temperature=0.0, structured=JSON)),
    "n=2": (COPY.format("sub", "minus"), SamplingParams(max_tokens=32, temperature=0.0, n=2, frequency_penalty=0.4)),
    "stops": (COPY.format("add", "total"), SamplingParams(max_tokens=40, temperature=0.0, min_tokens=6,
                                                          repetition_penalty=1.1)),
}
ACCEPT = (0, 1, 3)


def speculating(loaded, k: int = 4) -> LLMEngine:
    spec = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=64, prompt_lookup_min=1)
    return LLMEngine(EngineConfig(speculative=spec, cache=CACHE), loaded)


def run_with_oracle(monkeypatch, loaded, accept: int, prompts, params, reference):
    """A batch of prompts (lists of ids) with their params, each drafted by the oracle from the reference
    completions of its prompt (each completion names its prompt)."""
    oracle = Oracle(loaded.model.cfg.vocab_size, accept)
    oracle.refs = [(c.prompt_token_ids, c.token_ids) for c in reference]
    monkeypatch.setattr("pdserve.engine.scheduler_spec.propose", oracle)
    e = speculating(loaded)
    got = e.generate(prompts, params)
    return e, got


def assert_same(got, want) -> None:
    assert [(g.token_ids, g.text, g.finish_reason) for g in got] == \
        [(w.token_ids, w.text, w.finish_reason) for w in want]


@pytest.fixture(scope="module")
def plain(smol):
    return LLMEngine(EngineConfig(cache=CACHE), smol)


def test_every_kind_token_exact_at_forced_acceptance_lengths(smol, plain, monkeypatch):
    """The kinds as one batch, each its own request drafted from its own reference: the batch's output with
    speculation at each forced acceptance length is plain decoding's, request by request."""
    kinds = sorted(KINDS)
    prompts = [chat(smol, KINDS[kind][0]) for kind in kinds]
    params = [KINDS[kind][1] for kind in kinds]
    assert len(set(map(tuple, prompts))) == len(prompts)
    want = plain.generate(prompts, params)
    for accept in ACCEPT:
        e, got = run_with_oracle(monkeypatch, smol, accept, prompts, params, want)
        assert_same(got, want)
        lengths = e.scheduler.speculation.acceptance_lengths
        assert accept in lengths and max(lengths) <= accept, (accept, dict(lengths))
        assert e.pool.num_free_blocks == e.pool.num_blocks


def test_the_processing_matters_for_each_kind(smol, plain):
    """The kinds above test something: without its penalties, min_tokens or schema each request's greedy output
    differs (so a verification that skipped them at a drafted position would not give the plain output)."""
    kinds = ("penalties", "min_tokens", "json_schema")
    prompts = [chat(smol, KINDS[kind][0]) for kind in kinds]
    params = [KINDS[kind][1] for kind in kinds]
    bare = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0) for p in params]
    got = plain.generate(prompts * 2, params + bare)  # one batch: each kind with its processing and without
    for kind, p, with_it, without in zip(kinds, params, got[:3], got[3:]):
        assert with_it.token_ids != without.token_ids, kind
        if kind == "min_tokens":  # its EOS would have come at an output index below min_tokens
            assert without.finish_reason == FinishReason.STOP and len(without.token_ids) <= p.min_tokens
        if kind == "json_schema":
            assert with_it.token_ids[:12] != without.token_ids[:12]


def test_stops_and_max_tokens_cut_every_forced_acceptance_length(smol, plain, monkeypatch):
    """Stop strings, stop ids (held back by min_tokens for the first six tokens) and max_tokens placed along a
    penalized reply: speculation ends where plain decoding ends, at each forced acceptance length."""
    text, base = KINDS["stops"]
    prompt = chat(smol, text)
    ref = plain.generate([prompt], base)[0]
    cases = [SamplingParams(**{**base.__dict__, "max_tokens": m, "min_tokens": min(m, base.min_tokens)})
             for m in (3, 7, 12)]
    cases += [SamplingParams(**{**base.__dict__, "stop": (ref.text[c:c + 3],)}) for c in (4, 13, 22)]
    cases += [SamplingParams(**{**base.__dict__, "stop_token_ids": (ref.token_ids[j],)}) for j in (8, 14)]
    # The cases run as one batch (each its own request, the oracle drafting each from the same reply).
    want = plain.generate([prompt] * len(cases), cases)
    assert all(len(w.token_ids) < len(ref.token_ids) for w in want)  # each does cut the reply
    for accept in (1, 3):
        e, got = run_with_oracle(monkeypatch, smol, accept, [prompt] * len(cases), cases, [ref])
        assert_same(got, want)
        assert e.pool.num_free_blocks == e.pool.num_blocks


def test_sampled_structured_and_penalized_requests_speculate_validly(smol):
    """Sampled: a JSON schema request's speculated output validates, a penalized one is reproducible by its
    seed; both drafted (by prompt lookup) and verified."""
    e = speculating(smol)
    text, params = KINDS["json_schema"]
    prompt = chat(smol, text)
    sampled = SamplingParams(max_tokens=96, temperature=0.8, seed=3, structured=JSON, n=3)
    for c in e.generate([prompt], sampled):
        assert c.finish_reason == FinishReason.STOP, c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    # Mild penalties: at repetition 1.2 and frequency 0.5 the sampled reply leaves the source at once (it
    # repeats none of its tokens, so prompt lookup has nothing to draft: measured 0 drafted for seeds 1, 2, 9).
    pen = SamplingParams(max_tokens=32, temperature=0.7, seed=9, repetition_penalty=1.05, frequency_penalty=0.1)
    assert e.scheduler.speculation.drafted > 0  # JSON repeats its quotes and keys: prompt lookup drafts
    copy = chat(smol, KINDS["penalties"][0])
    again = speculating(smol)
    a, b = again.generate([copy], pen)[0], speculating(smol).generate([copy], pen)[0]
    assert a.token_ids == b.token_ids and a.token_ids
    assert again.scheduler.speculation.drafted > 0  # verified (a penalized sampled reply may keep none)
