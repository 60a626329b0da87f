"""Offline engine behaviour on a tiny checkpoint: batching, seeds, preemption, prefix reuse, limits."""
from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams

LENS = [3, 9, 21, 40, 6, 13, 2, 30]


def make_engine(path, num_blocks=256, block_size=4, budget=32, seqs=16, prefix=True) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                                     enable_prefix_caching=prefix),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs)))


def make_prompts(n=len(LENS), vocab=320, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (LENS[i % len(LENS)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints["llama"]


def one_at_a_time(path, prompts, params):
    return [make_engine(path).generate([p], params[i] if isinstance(params, list) else params)[0].token_ids
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True) for i in range(8)],
], ids=["greedy", "seeded"])
def test_batched_equals_one_at_a_time(ckpt, params):
    prompts = make_prompts()
    batched = [c.token_ids for c in make_engine(ckpt).generate(prompts, params)]
    assert batched == one_at_a_time(ckpt, prompts, params)
    assert all(len(t) == 24 for t in batched)


def test_seeded_sampling_is_reproducible_and_seed_dependent(ckpt):
    prompts = make_prompts(4)
    p = lambda seed: SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)  # noqa: E731
    a = [c.token_ids for c in make_engine(ckpt).generate(prompts, p(7))]
    b = [c.token_ids for c in make_engine(ckpt).generate(prompts, p(7))]
    c = [c.token_ids for c in make_engine(ckpt).generate(prompts, p(8))]
    assert a == b
    assert a != c
    # Sampling really samples: at temperature 1 the tokens are not simply the greedy ones.
    g = [c.token_ids for c in make_engine(ckpt).generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))]
    assert a != g


def test_tiny_cache_preempts_and_still_matches(ckpt):
    prompts = make_prompts(8)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref = [c.token_ids for c in make_engine(ckpt).generate(prompts, params)]
    # 24 blocks of 4 tokens hold at most ~one long request with its output at a time.
    eng = make_engine(ckpt, num_blocks=24)
    got = [c.token_ids for c in eng.generate(prompts, params)]
    assert got == ref
    assert eng.scheduler.num_preemptions > 0
    assert eng.pool.num_used_blocks == 0
    eng.pool.check_integrity()


def test_request_larger_than_cache_is_rejected(ckpt):
    eng = make_engine(ckpt, num_blocks=4)
    with pytest.raises(ValueError, match="more KV blocks than the cache has"):
        eng.add_request(list(range(20)), SamplingParams(max_tokens=4))


def test_prefix_cache_reuses_blocks_with_identical_output(ckpt):
    eng = make_engine(ckpt)
    prompt = make_prompts(1, seed=5)[0] + make_prompts(1, seed=6)[0]  # 3 + 3: make it longer
    prompt = (prompt * 10)[:37]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = eng.generate([prompt], params)[0].token_ids
    rid = eng.add_request(prompt, params)
    req = eng._requests[rid]
    second = [t for o in eng.stream() for t in o.new_token_ids]
    assert second == first
    assert req.num_cached_tokens == 36  # 9 full blocks of 4; the last token is always recomputed
    assert eng.pool.prefix_hits >= 9
    eng2 = make_engine(ckpt, prefix=False)
    assert eng2.generate([prompt], params)[0].token_ids == first


def test_stop_token_ids_and_max_tokens(ckpt):
    eng = make_engine(ckpt)
    prompt = make_prompts(1)[0]
    free = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 12
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    stopped = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=(stop_at,)))[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free.token_ids[:first + 1]


def test_eos_stops_unless_ignored(ckpt):
    eng = make_engine(ckpt)
    prompt = make_prompts(1)[0]
    free = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    eng.scheduler.eos_token_ids = (free.token_ids[3],)  # pretend this token is the model's EOS
    first = free.token_ids.index(free.token_ids[3])
    out = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.finish_reason is FinishReason.STOP and out.token_ids == free.token_ids[:first + 1]
    out = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == free.token_ids


def test_context_limit_finishes_with_length(tiny_checkpoints):
    eng = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), max_model_len=20,
                                 cache=CacheConfig(block_size=4, num_blocks=64)))
    out = eng.generate([list(range(15))], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 5
    with pytest.raises(ValueError, match="context"):
        eng.add_request(list(range(20)), SamplingParams())


def test_abort_frees_blocks_midway(ckpt):
    eng = make_engine(ckpt)
    prompts = make_prompts(4)
    rids = [eng.add_request(p, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)) for p in prompts]
    for _ in range(6):
        eng.step()
    assert eng.pool.num_used_blocks > 0
    out = eng.abort(rids[1])
    assert out.finish_reason is FinishReason.CANCELLED
    assert eng.abort(rids[1]) is None
    done = {o.request_id for o in eng.stream() if o.finished}
    assert done == set(rids) - {rids[1]}
    assert eng.pool.num_used_blocks == 0
    eng.pool.check_integrity()


@pytest.mark.parametrize("prompt,match", [([], "empty"), ([1, 2, 10_000], "outside the vocabulary"),
                                          ([-1], "outside the vocabulary")])
def test_bad_prompts(ckpt, prompt, match):
    with pytest.raises(ValueError, match=match):
        make_engine(ckpt).add_request(prompt, SamplingParams())


def test_duplicate_request_id_rejected(ckpt):
    eng = make_engine(ckpt)
    eng.add_request([1, 2], SamplingParams(), request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([1, 2], SamplingParams(), request_id="a")


def test_stop_strings_need_a_tokenizer(ckpt):
    with pytest.raises(ValueError, match="tokenizer"):
        make_engine(ckpt).add_request([1, 2], SamplingParams(stop=("x",)))


def test_dummy_load_format_builds_configured_shape(ckpt):
    eng = LLMEngine(EngineConfig(model=str(ckpt / "config.json"), load_format="dummy",
                                 cache=CacheConfig(block_size=4, num_blocks=32)))
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    assert eng.model_config.hidden_size == 64


def test_core_cancel_all_frees_everything_and_keeps_serving(ckpt):
    eng = make_engine(ckpt, budget=16)
    prompts = make_prompts(4)
    rids = [eng.add_request(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)) for p in prompts]
    eng.step()
    assert eng.pool.num_used_blocks > 0 and eng.scheduler.waiting  # some running, some still queued
    assert sorted(eng.core.cancel_all()) == sorted(rids)
    assert eng.pool.num_used_blocks == 0 and not eng.scheduler.has_work
    eng.pool.check_integrity()
    ref = make_engine(ckpt).generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    out = eng.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == ref[0].token_ids and eng.pool.num_used_blocks == 0


def test_prompt_tokens_requested_and_computed(ckpt):
    """The counters behind pdserve_worker_prompt_tokens_{requested,computed}: a repeated prompt is computed
    in part (the prefix cache serves its full blocks), unless it asks for prompt logprobs (every position
    is then computed); requested counts every prompt token either way."""
    prompt = make_prompts(1)[0] * 3  # long enough for several full blocks
    engine = make_engine(ckpt)
    core = engine.core
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    engine.generate([prompt], greedy)
    assert (core.scheduler.prompt_tokens_requested, core.prompt_tokens_computed) == (len(prompt), len(prompt))
    engine.generate([prompt], greedy)
    assert core.scheduler.prompt_tokens_requested == 2 * len(prompt)
    hit = engine.pool.block_size * ((len(prompt) - 1) // engine.pool.block_size)
    assert core.prompt_tokens_computed == 2 * len(prompt) - hit
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))
    assert core.scheduler.prompt_tokens_requested == 3 * len(prompt)
    assert core.prompt_tokens_computed == 3 * len(prompt) - hit
