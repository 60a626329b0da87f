"""Structured output in the offline engine with the real SmolLM2 weights: JSON that validates against its schema
(greedy and sampled, n samples), regex and choice outputs that match, pipelined decode giving the plain loop's
tokens with free-text rows beside (the launched step resolved before a structured row's next mask), preemption and
recompute keeping each matcher right, and "processed" logprobs seeing the mask."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.structured import StructuredOutput
from pdserve.model.loader import load

from conftest import smol_1p1d_engine_config

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))


def config(pipelined: bool = False, blocks: int = 512) -> EngineConfig:
    smol_1p1d_engine_config()  # skips where SmolLM2 is not installed
    return EngineConfig(pipelined_decode=pipelined, cache=CacheConfig(block_size=16, num_blocks=blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64))


@pytest.fixture(scope="module")
def loaded():
    return load(config())


@pytest.fixture(scope="module")
def engine(loaded):
    return LLMEngine(config(), loaded)


def chats(engine: LLMEngine, n: int) -> list[list[int]]:
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": f"Describe person number {i} as JSON: "
                                                   "name, age, favourite colour, tags."}]) for i in range(n)]


def assert_valid(text: str, reason: FinishReason) -> None:
    assert reason is FinishReason.STOP, (reason, text)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_greedy_and_sampled(engine):
    prompts = chats(engine, 6)
    params = [SamplingParams(max_tokens=160, temperature=0.0 if i < 2 else 1.0, seed=i, structured=JSON)
              for i in range(6)]
    outs = engine.generate(prompts, params)
    for c in outs:
        assert_valid(c.text, c.finish_reason)
        assert c.token_ids[-1] in engine.eos_token_ids  # complete: only EOS could follow
    free = engine.generate(prompts[:1], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert free.text != outs[0].text  # the mask changed what greedy chose


def test_regex_choice_and_json_object(engine):
    prompts = chats(engine, 3)
    regex, choice, obj = engine.generate(prompts, [
        SamplingParams(max_tokens=20, temperature=1.0, seed=4, structured=StructuredOutput("regex", r"[A-Z]{2}\d{3}")),
        SamplingParams(max_tokens=20, temperature=0.0, structured=StructuredOutput("choice", '["yes", "no"]')),
        SamplingParams(max_tokens=120, temperature=0.0, structured=StructuredOutput("json_object"))])
    assert re.fullmatch(r"[A-Z]{2}\d{3}", regex.text) and regex.finish_reason is FinishReason.STOP
    assert choice.text in ("yes", "no") and choice.finish_reason is FinishReason.STOP
    if obj.finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


def test_n_samples_each_valid(engine):
    outs = engine.generate(chats(engine, 1), SamplingParams(max_tokens=160, temperature=1.0, seed=9, n=3,
                                                            structured=JSON))
    assert len(outs) == 3 and len({c.text for c in outs}) > 1
    for c in outs:
        assert_valid(c.text, c.finish_reason)


def mixed(engine: LLMEngine) -> tuple[list[list[int]], list[SamplingParams]]:
    """Structured rows beside free-text ones, greedy and sampled."""
    prompts = chats(engine, 6)
    params = [SamplingParams(max_tokens=120, temperature=0.0 if i % 3 == 0 else 0.9, seed=i,
                             structured=JSON if i % 2 == 0 else None, ignore_eos=i % 2 == 1) for i in range(6)]
    return prompts, params


@pytest.fixture(scope="module")
def mixed_plain(engine) -> list[list[int]]:
    """The mixed batch's tokens from the plain loop with room for every request: what the pipelined loop and
    the preempting one must give."""
    return [c.token_ids for c in engine.generate(*mixed(engine))]


def test_pipelined_decode_gives_the_plain_loops_tokens(loaded, engine, mixed_plain):
    prompts, params = mixed(engine)
    piped = LLMEngine(config(pipelined=True), loaded)
    got = piped.generate(prompts, params)
    assert [c.token_ids for c in got] == mixed_plain
    for c, p in zip(got, params):
        if p.structured is not None:
            assert_valid(c.text, c.finish_reason)
    assert not piped.scheduler.requests and piped.pool.num_used_blocks == 0


def test_preemption_and_recompute_keep_the_matchers(loaded, engine, mixed_plain):
    """A cache too small for the batch: requests are preempted, recomputed, and go on from their matcher's place."""
    small = LLMEngine(config(blocks=24), loaded)
    got = small.generate(*mixed(engine))
    assert small.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got] == mixed_plain


def test_processed_logprobs_see_the_mask(engine):
    prompt = chats(engine, 1)
    so = StructuredOutput("choice", '["yes", "no"]')
    raw, processed = engine.generate(prompt * 2, [
        SamplingParams(max_tokens=4, temperature=0.0, structured=so, logprobs=10, logprobs_mode=mode)
        for mode in ("raw", "processed")])
    assert raw.token_ids == processed.token_ids
    first_raw, first_processed = raw.logprobs[0], processed.logprobs[0]
    assert first_processed.logprob > first_raw.logprob  # the mass of the masked tokens went to the allowed ones
    finite = [engine.tokenizer.decode([t]) for t, lp in first_processed.top if lp > float("-inf")]
    assert finite and all("yes".startswith(w) or "no".startswith(w) for w in finite), finite  # any tokenization
    assert any(lp == float("-inf") for _, lp in first_processed.top)  # past the allowed ones: masked out
