"""The simulated engine (`load_format="sim"`, pdserve.engine.sim_runner): the real engine around a clock.

Its tokens follow from the seed (and, for greedy requests, from the context), its steps take the GPU
roofline's time, and its KV cache has the real GPU's blocks at a fraction of the real bytes. The oracle for
step times and sizes is the planner's cost model (pdserve.perf.hardware), not the runner's own plan.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, kv_bytes_per_token
from pdserve.engine.chunk import Chunk
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sim_runner import PACE_S, SimRunner
from pdserve.perf.costs import attention_pairs
from pdserve.perf.hardware import gpu, kv_budget_bytes, resolve_model, roofline

SIM = EngineConfig(load_format="sim", model="llama3-8b", dtype="bfloat16",
                   scheduler=SchedulerConfig(max_num_batched_tokens=512))
PROMPTS = [[(7 * i + 3 * j) % 40000 + 20 for j in range(n)] for i, n in enumerate([5, 40, 130, 17])]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(SIM)


def tokens(engine, prompts, params) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, params)]


def test_tokens_follow_the_seed(engine):
    seeded = [SamplingParams(max_tokens=12, seed=s) for s in (1, 2, 1, 3)]
    first = tokens(engine, PROMPTS, seeded)
    # Again, and each alone: the same seed gives the same tokens whatever the batch.
    assert tokens(engine, PROMPTS, seeded) == first
    assert [tokens(engine, [p], sp)[0] for p, sp in zip(PROMPTS, seeded)] == first
    # Another seed, other tokens.
    other = tokens(engine, PROMPTS, [SamplingParams(max_tokens=12, seed=s + 100) for s in (1, 2, 1, 3)])
    assert all(a != b for a, b in zip(first, other))
    # Greedy: the context alone decides, as with a real model; different prompts, different tokens.
    greedy = [tokens(engine, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, seed=s)) for s in (5, 6)]
    assert greedy[0] == greedy[1] and len({tuple(t) for t in greedy[0]}) == len(PROMPTS)
    # Within the vocabulary both the shape and the tokenizer know, never an end-of-sequence or special id.
    tok = engine.tokenizer
    special = {i for i, t in tok.hf_tokenizer.added_tokens_decoder.items() if t.special}
    every = {t for ts in first + other + greedy[0] for t in ts}
    assert max(every) < min(tok.vocab_size, engine.model_config.vocab_size) == 49152
    assert not every & (special | set(engine.eos_token_ids))


def test_max_tokens_ends_every_request(engine):
    params = [SamplingParams(max_tokens=n, seed=n) for n in (1, 5, 33, 2)]  # ignore_eos is not set: no EOS comes
    out = engine.generate(PROMPTS, params)
    assert [len(c.token_ids) for c in out] == [1, 5, 33, 2]
    assert {c.finish_reason for c in out} == {FinishReason.LENGTH}
    assert all(c.text for c in out)  # the default model's tokenizer makes text of them


def test_a_changed_block_changes_the_tokens(engine):
    """A token reads the KV of its context: a block the hand-off moved wrong would show in the tokens."""
    prompt, params = list(range(900, 950)), SamplingParams(max_tokens=6, temperature=0.0)
    want = tokens(engine, [prompt], params)[0]
    rid = engine.add_request(prompt, params)
    got = []
    while not got:  # the prompt's step: its first token
        got += [t for o in engine.step() for t in o.new_token_ids]
    block = engine.scheduler.requests[rid].block_ids[0]  # the cached prefix's: the first request's too
    engine.runner.kv_cache[:, :, :, block] += 1  # positions 0 to 15, K and V, every layer
    for out in engine.stream():
        got += out.new_token_ids
    engine.runner.kv_cache[:, :, :, block] -= 1
    assert got[0] == want[0] and got[1:] != want[1:]
    assert tokens(engine, [prompt], params)[0] == want


def test_pipelined_decode_gives_the_same_tokens(engine):
    params = [SamplingParams(max_tokens=9, seed=s) for s in range(4)]
    pipelined = LLMEngine(replace(SIM, pipelined_decode=True))
    assert pipelined.core.pipelined
    assert tokens(pipelined, PROMPTS, params) == tokens(engine, PROMPTS, params)


def timed_steps(engine, n: int):
    """(scheduled step, seconds of its forward) for the next n steps, as EngineCore.step runs them."""
    out = []
    for _ in range(n):
        step = engine.scheduler.schedule()
        t = time.perf_counter()
        result = engine.core.execute(step)
        out.append((step, time.perf_counter() - t))
        engine.process(engine.core.account(step, result))
    return out


def predicted(chunks) -> float:
    """The planner's roofline of an H100 running Llama-3-8B in bf16, for these chunks."""
    costs = roofline(resolve_model("llama3-8b")[1], gpu("H100"), 2)
    pt = sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)
    pairs = sum(attention_pairs(c.start, len(c.token_ids)) for c in chunks if len(c.token_ids) > 1)
    seqs = sum(c.sample is not None for c in chunks if len(c.token_ids) > 1)
    decodes = [c for c in chunks if len(c.token_ids) == 1]
    return costs.step_time(pt, pairs, seqs, len(decodes), sum(c.start + 1 for c in decodes))


def test_step_time_is_the_rooflines(engine):
    # A 1000-token prompt in chunks of the 512-token budget: compute-bound prefill steps.
    engine.add_request(list(range(100, 1100)), SamplingParams(max_tokens=1))
    (s1, t1), (s2, t2) = timed_steps(engine, 2)
    assert [len(c.token_ids) for c in s1.chunks + s2.chunks] == [512, 488]
    # A decode batch of 8 requests, contexts of 20 to 60 tokens: memory-bound steps.
    for i in range(8):
        engine.add_request([300 + i] * (20 + 5 * i), SamplingParams(max_tokens=12, seed=i))
    timed_steps(engine, 1)  # the prompts, in one step
    decodes = timed_steps(engine, 8)
    assert all(len(s.chunks) == 8 and all(len(c.token_ids) == 1 for c in s.chunks) for s, _ in decodes)
    list(engine.stream())
    late = [seconds - predicted(step.chunks) for step, seconds in [(s1, t1), (s2, t2), *decodes]]
    assert 0 <= min(late) and max(late) < 0.010, late  # never early; no step 10 ms late, even on a busy host
    assert statistics.median(late) < 0.0015, late
    print(f"prefill 512: {t1 * 1e3:.2f} ms (roofline {predicted(s1.chunks) * 1e3:.2f}); prefill 488 after 512: "
          f"{t2 * 1e3:.2f} ms ({predicted(s2.chunks) * 1e3:.2f}); decode x8: "
          + ", ".join(f"{s * 1e3:.2f} ({predicted(st.chunks) * 1e3:.2f})" for st, s in decodes) + " ms")


def test_time_scale_stretches_every_step():
    slow = LLMEngine(replace(SIM, sim_time_scale=3.0))
    slow.add_request(list(range(100, 400)), SamplingParams(max_tokens=1))
    (step, seconds), = timed_steps(slow, 1)
    want = 3 * predicted(step.chunks)
    assert want <= seconds < want + 0.010


def test_layers_are_announced_as_the_step_goes():
    """With layer-wise pushes, layer i's KV is written and announced once i + 1 layers' share of the step has
    passed (PACE_S early at most), and not before its own layer's turn."""
    runner = SimRunner(replace(SIM, cache=CacheConfig(num_blocks=64)))
    chunk = Chunk(list(range(1000, 1300)), 0, list(range(19)), SamplingParams(max_tokens=1), seed=1)
    layers, duration = runner.cfg.num_layers, predicted([chunk])
    seen = []

    def layer_done(i):
        kv = runner.kv_cache[:, :, 0, 0, 0, 0]  # [layers, 2]: position 0
        assert kv[i].ne(0).all() and (i + 1 == layers or kv[i + 1].eq(0).all())
        seen.append((i, time.perf_counter()))

    t0 = time.perf_counter()
    result = runner.execute([chunk], layer_done)
    end = time.perf_counter()
    assert [i for i, _ in seen] == list(range(layers)) and result.sampling_chunks == [0]
    for i, t in seen:
        due = t0 + duration * (i + 1) / layers
        assert due - PACE_S <= t < due + 0.010, (i, t - t0, due - t0)
    assert duration <= end - t0 < duration + 0.010
    assert runner.late_steps == 0  # on time (its last layer is written once the step's time has passed)


def test_a_step_whose_host_work_outlasts_it_is_counted_late():
    runner = SimRunner(replace(SIM, cache=CacheConfig(num_blocks=64)))
    chunk = Chunk(list(range(1000, 1300)), 0, list(range(19)), SamplingParams(max_tokens=1), seed=1)
    duration = predicted([chunk])
    runner.execute([chunk], lambda i: time.sleep(2 * duration + PACE_S) if i == 0 else None)  # host work: 2 steps
    assert runner.late_steps == 1
    runner.execute([chunk])
    assert runner.late_steps == 1


def test_the_cache_has_the_gpus_blocks_at_a_fraction_of_the_bytes(engine):
    shape = engine.model_config
    real = kv_bytes_per_token(shape, torch.bfloat16)
    assert real == 131072 == roofline(shape, gpu("H100"), 2).kv_bytes_per_token
    blocks = kv_budget_bytes(gpu("H100"), roofline(shape, gpu("H100"), 2).resident_weight_bytes) // (real * 16)
    assert engine.pool.num_blocks == engine.runner.num_blocks == blocks == 26674
    kv = engine.runner.kv_cache
    assert kv.nbytes == blocks * 16 * real // 1024  # 128 B a token instead of 128 KiB: 52 MiB
    assert kv.shape == (32, 2, 1, blocks, 16, 1)
    # A scale that does not divide a layer's K width rounds up to whole elements.
    plan = SimRunner(replace(SIM, sim_kv_scale=3)).plan
    assert plan.kv_width == 342 and plan.held_kv_bytes_per_token == 2 * 32 * 342 * 2


def test_the_memory_budget_caps_the_blocks():
    capped = SimRunner(replace(SIM, cache=CacheConfig(memory_bytes=8 << 20)))
    assert capped.num_blocks == (8 << 20) // (128 * 16) < capped.plan.gpu_blocks
    assert "capped by the KV memory budget" in capped.plan.describe()
    given = SimRunner(replace(SIM, cache=CacheConfig(num_blocks=64)))
    assert given.num_blocks == 64 and given.kv_cache.shape[3] == 64


def test_the_startup_line_says_what_is_simulated(engine):
    line = engine.runner.plan.describe()
    for part in ("simulated engine", "H100", "llama3-8b", "roofline", "131072 B a token real", "128 B held",
                 "scale 1024", "26674 blocks"):
        assert part in line, part


@pytest.mark.parametrize("change, error", [
    (dict(dtype="float32"), "16 bits"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size must be 1"),
    (dict(device="cuda"), "device must be cpu"),
    (dict(sim_kv_scale=0), "sim_kv_scale"),
    (dict(sim_time_scale=0.0), "sim_time_scale"),
])
def test_what_a_simulated_engine_refuses(change, error):
    with pytest.raises(ValueError, match=error):
        replace(SIM, **change)


def test_an_unknown_gpu_is_named():
    with pytest.raises(ValueError, match="unknown GPU 'B300'"):
        SimRunner(replace(SIM, sim_gpu="B300"))
