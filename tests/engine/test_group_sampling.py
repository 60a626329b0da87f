"""n samples of one prompt (SamplingParams.n) in the offline engine, on a tiny checkpoint: the prompt is
computed once, its blocks shared by the samples (each with its own copy of the partial last block), and
sample i equals the n=1 request seeded sample_seed(seed, i), token for token and logprob for logprob."""
from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams, sample_seed

BLOCK = 4


def make_engine(path, num_blocks=256, budget=32, pipelined=False, prefix=True) -> LLMEngine:
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=prefix)
    return LLMEngine(EngineConfig(model=str(path), pipelined_decode=pipelined, cache=cache,
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=32)))


def prompt(n: int, seed: int = 4) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints["llama"]


def group(seed: int, n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=seed, n=n, logprobs=2, ignore_eos=True, **kw)


def assert_samples_are_single_requests(ckpt, p, params, got):
    """Sample i equals the n=1 request seeded sample_seed(seed, i), run alone on a fresh engine."""
    assert [c.finish_reason for c in got] == [FinishReason.LENGTH] * params.n
    for i, c in enumerate(got):
        one = make_engine(ckpt).generate([p], SamplingParams(**{**params.__dict__, "n": 1,
                                                                "seed": sample_seed(params.seed, i)}))[0]
        assert c.token_ids == one.token_ids, i
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(c.logprobs, one.logprobs)) < 1e-5
    assert len({tuple(c.token_ids) for c in got}) > 1, "seeded samples should differ"


@pytest.mark.parametrize("length", [13, 16], ids=["partial-last-block", "full-blocks"])
def test_samples_equal_single_requests_and_the_prompt_is_computed_once(ckpt, length):
    p = prompt(length)
    engine = make_engine(ckpt)
    params = group(seed=77)
    got = engine.generate([p], params)
    assert_samples_are_single_requests(ckpt, p, params, got)
    assert engine.core.prompt_tokens_computed == length
    assert engine.pool.num_used_blocks == 0


def test_samples_share_the_prompt_blocks(ckpt):
    """Right after the prompt's step: the prompt's full blocks are referenced by every sample, and each
    sample but the first holds one block of its own, its copy of the partial last block."""
    p = prompt(13)
    engine = make_engine(ckpt, prefix=False)
    engine.add_request(p, group(seed=5, n=4), request_id="g")
    outs = engine.step()
    assert sorted(o.index for o in outs) == [0, 1, 2, 3] and {o.request_id for o in outs} == {"g"}
    full, partial = divmod(len(p), BLOCK)
    assert engine.pool.num_used_blocks == full + 1 + 3 * (partial > 0)
    samples = [r for r in engine.scheduler.requests.values()]
    shared = samples[0].block_ids[:full]
    assert all(r.block_ids[:full] == shared for r in samples)
    assert all(engine.pool.ref_count(b) == 4 for b in shared)
    assert len({r.block_ids[full] for r in samples}) == 4  # the partial block: one each
    engine.abort("g")
    assert engine.pool.num_used_blocks == 0 and not engine.scheduler.requests


def test_without_block_copies_the_partial_block_is_computed_again(ckpt):
    """Where the runner cannot copy blocks (a tensor-parallel engine), each forked sample computes the
    prompt's partial last block again: same tokens, that much more prompt computed."""
    p = prompt(13)
    engine = make_engine(ckpt)
    engine.core.scheduler.can_copy_blocks = False
    params = group(seed=77)
    got = engine.generate([p], params)
    assert [c.token_ids for c in got] == [c.token_ids for c in make_engine(ckpt).generate([p], params)]
    assert engine.core.prompt_tokens_computed == len(p) + (params.n - 1) * (len(p) % BLOCK)


def test_pipelined_samples_equal_plain_ones(ckpt):
    p = prompt(13)
    params = group(seed=9, repetition_penalty=1.2)
    plain = make_engine(ckpt).generate([p, prompt(7, 1)], [params, group(seed=3, n=2)])
    piped = make_engine(ckpt, pipelined=True).generate([p, prompt(7, 1)], [params, group(seed=3, n=2)])
    assert [c.token_ids for c in piped] == [c.token_ids for c in plain]
    assert len(piped) == params.n + 2


def test_a_small_cache_preempts_samples_and_they_still_match(ckpt):
    """Twelve blocks for a prompt of 13 tokens and 5 samples of 10: samples are preempted and computed
    again (prompt + their own tokens) and every one still equals its single request."""
    p = prompt(13)
    engine = make_engine(ckpt, num_blocks=12)
    params = group(seed=21, n=5)
    got = engine.generate([p], params)
    assert engine.scheduler.num_preemptions > 0
    assert_samples_are_single_requests(ckpt, p, params, got)
    assert engine.pool.num_used_blocks == 0


def test_greedy_samples_are_equal_and_each_carries_its_index(ckpt):
    p = prompt(9)
    got = make_engine(ckpt).generate([p], SamplingParams(max_tokens=6, temperature=0.0, n=3, ignore_eos=True))
    assert len(got) == 3 and len({tuple(c.token_ids) for c in got}) == 1


def test_n_is_checked():
    for bad in (0, 129, 1.5):
        with pytest.raises(ValueError, match="n must be"):
            SamplingParams(n=bad)
