"""Routed experts (pdserve.engine.routed_experts) from the offline engine against transformers' router top-k
(output_router_logits) on the tiny seeded Qwen3-MoE (a dense first layer) and Mixtral checkpoints: every
position's ids, prompt and generated, in top-k order, with chunked prefill beside decodes and after a
preemption's recompute; one entry per token but the last; nothing captured for requests that did not ask; a
dense model refuses the field."""
from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.routed_experts import RoutedExperts, RoutedLog
from pdserve.engine.sampling import SamplingParams

from moe_models import assert_routed_like_hf, build
from test_model_parity import prompts

KINDS = ("qwen3_moe-mixed", "mixtral")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("r3")
    return {kind: build(root / kind, kind, packed=False) for kind in KINDS}


def engine(path, num_blocks: int = 128, **config) -> LLMEngine:
    # Small blocks and budget: prompts are chunked and share steps with other requests' decodes.
    return LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8), **config))


def assert_matches_hf(hf, completion) -> None:
    sequence = completion.prompt_token_ids + completion.token_ids
    got = completion.routed_experts
    assert got is not None and got.start == 0
    ties = assert_routed_like_hf(hf, sequence, got.ids)
    assert ties <= got.ids.shape[0] * got.ids.shape[1] // 20  # near-ties are rare: the rest compared exactly
    wrong = got.ids.copy()
    wrong[-1, -1] = wrong[-1, -1][::-1]  # the last row's two choices swapped: the check must see it
    with pytest.raises(AssertionError):
        assert_routed_like_hf(hf, sequence, wrong)


@pytest.mark.parametrize("kind", KINDS)
def test_every_position_matches_transformers_router_top_k(checkpoints, kind):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[kind], dtype=torch.float32).eval()
    with engine(checkpoints[kind]) as llm:
        batch = prompts(llm.model_config.vocab_size)
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_routed_experts=True)
        plain = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        # Every other request asks: those that do not get nothing, and share steps with those that do.
        done = llm.generate(batch, [greedy if i % 2 == 0 else plain for i in range(len(batch))])
        for i, c in enumerate(done):
            if i % 2:
                assert c.routed_experts is None
            else:
                assert_matches_hf(hf, c)
        assert llm.pool.num_used_blocks == 0
        # The same prompts again: their blocks are in the prefix cache now, but a request that asks for routed
        # experts computes its prompt whole (a cached position's experts are unknown) and gets the same entries.
        again = llm.generate(batch[:2], greedy)
        assert again[0].routed_experts.to_list() == done[0].routed_experts.to_list()
        assert_matches_hf(hf, again[1])


def test_a_preempted_request_keeps_the_experts_it_streamed(checkpoints):
    """A pool too small for the batch: requests are preempted and recomputed; each position's entry is sent
    once, and equals transformers'."""
    kind = "qwen3_moe-mixed"
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[kind], dtype=torch.float32).eval()
    with engine(checkpoints[kind], num_blocks=24) as llm:
        batch = prompts(llm.model_config.vocab_size)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, return_routed_experts=True)
        done = llm.generate(batch, params)
        assert llm.scheduler.num_preemptions > 0, "the test must preempt"
        for c in done:
            assert_matches_hf(hf, c)


def test_pipelined_decode_sends_the_same(checkpoints):
    """Pipelined decode (a step launched before the one before it resolves) records each step's experts at launch
    and sends them with the token they sampled, when it resolves: the same entries as one step at a time."""
    kind = "mixtral"
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    with engine(checkpoints[kind]) as llm:
        batch = prompts(llm.model_config.vocab_size)
        plain = llm.generate(batch, params)
    with engine(checkpoints[kind], pipelined_decode=True) as llm:
        assert llm.core.pipelined
        piped = llm.generate(batch, params)
    assert [c.token_ids for c in piped] == [c.token_ids for c in plain]
    assert [c.routed_experts.to_list() for c in piped] == [c.routed_experts.to_list() for c in plain]


def test_streamed_entries_are_consecutive_one_per_token_after_the_first(checkpoints):
    with engine(checkpoints["mixtral"]) as llm:
        prompt = prompts(llm.model_config.vocab_size)[0]
        llm.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                               return_routed_experts=True))
        parts = [(out.new_token_ids, out.routed_experts) for out in llm.stream()]
    assert [len(r) for _, r in parts] == [len(prompt)] + [1] * 4  # the last token is never an input
    assert [r.start for _, r in parts] == [0] + list(range(len(prompt), len(prompt) + 4))


def test_the_log_keeps_what_was_computed_first():
    log = RoutedLog()
    a = torch.arange(12, dtype=torch.int32).reshape(3, 2, 2).numpy()
    log.note(0, a)
    assert log.take(2).to_list() == a[:2].tolist()
    log.note(0, a * 0 + 99)  # a recompute from position 0: positions 0..2 are known, nothing new
    log.note(3, a[:1] + 100)
    got = log.take(10)
    assert got.start == 2 and got.to_list() == [a[2].tolist(), (a[0] + 100).tolist()]
    assert log.take(10) is None
    assert RoutedExperts(0, a).to_base64()  # int32 bytes, base64


def test_a_dense_model_refuses_routed_experts(tiny_checkpoints):
    with LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=4, num_blocks=32))) as llm:
        with pytest.raises(ValueError, match="return_routed_experts"):
            llm.add_request([1, 2, 3], SamplingParams(return_routed_experts=True))


def test_routed_experts_take_one_sample_a_request():
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(n=2, return_routed_experts=True)
