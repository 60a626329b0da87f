"""KV tiers in the offline engine on a tiny checkpoint: a session's returning turn, its blocks evicted from a cache
too small to keep them, is served from the host tier (or the disk tier) token-exact, computing fewer prompt tokens."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams

BS = 4
BLOCKS = 24
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(path, peak_flops=None, **tiers) -> LLMEngine:
    cache = CacheConfig(block_size=BS, num_blocks=BLOCKS, **tiers)
    return LLMEngine(EngineConfig(model=str(path), cache=cache, peak_flops=peak_flops,
                                  scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def session(eng: LLMEngine) -> tuple[list[list[int]], int]:
    """Two sessions' first turns, fillers that evict them, then their second turns: (replies, prompt tokens
    computed by the second turns)."""
    firsts = [tokens(37, 1), tokens(41, 2)]
    replies = [o.token_ids for o in eng.generate(firsts, PARAMS)]
    for seed in range(10, 13):  # 3 x 60 tokens through a 96-slot cache: the first turns' blocks are evicted
        eng.generate([tokens(60, seed)], PARAMS)
    seconds = [f + r + tokens(5, 20 + i) for i, (f, r) in enumerate(zip(firsts, replies))]
    before = eng.core.prompt_tokens_computed
    replies += [eng.generate([s], PARAMS)[0].token_ids for s in seconds]
    return replies, eng.core.prompt_tokens_computed - before


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def baseline(ckpt):
    eng = make_engine(ckpt)
    replies, computed = session(eng)
    block_bytes = eng.core.runner.kv_cache[:, :, :, 0].numel() * eng.core.runner.kv_cache.element_size()
    eng.close()
    return replies, computed, block_bytes


def test_host_tier_is_token_exact_and_recomputes_less(ckpt, baseline):
    replies, computed, _ = baseline
    eng = make_engine(ckpt, peak_flops=1e6, offload_bytes=1 << 20)  # loads priced below recompute
    got, tier_computed = session(eng)
    stats = eng.core.kv.tier.stats
    eng.close()
    assert got == replies
    assert stats.loaded["host"] >= 18  # the two first turns' 9 + 10 full blocks, less the last token's
    assert tier_computed * 4 <= computed, (tier_computed, computed)


def test_disk_tier_under_a_small_host_tier_is_token_exact(ckpt, baseline, tmp_path):
    replies, computed, block_bytes = baseline
    # The tiny model recomputes a block faster than the cost rule prices a disk read; a slow peak prices
    # recompute as a real model's would.
    eng = make_engine(ckpt, peak_flops=1e6, offload_bytes=2 * block_bytes, offload_dir=str(tmp_path),
                      offload_disk_bytes=256 * block_bytes)
    got, tier_computed = session(eng)
    stats = eng.core.kv.tier.stats
    eng.close()
    assert got == replies
    assert stats.loaded["disk"] > 0 and stats.written["disk"] > 0
    assert tier_computed < computed


def test_recompute_wins_where_the_cost_rule_says_so(ckpt, baseline):
    """At a peak of 10^18 FLOP/s recomputing is priced below any copy: nothing is loaded, replies unchanged."""
    replies, computed, _ = baseline
    eng = make_engine(ckpt, peak_flops=1e18, offload_bytes=1 << 20)
    got, tier_computed = session(eng)
    stats = eng.core.kv.tier.stats
    eng.close()
    assert got == replies and tier_computed == computed
    assert stats.hits["host"] > 0 and stats.loaded.total() == 0


def test_a_weight_update_loads_no_block_of_the_old_version(ckpt, baseline):
    eng = make_engine(ckpt, peak_flops=1e6, offload_bytes=1 << 20)  # loads priced below recompute
    first = tokens(37, 1)
    eng.generate([first], PARAMS)
    for seed in range(10, 13):
        eng.generate([tokens(60, seed)], PARAMS)
    assert eng.core.kv.tier.stats.written["host"] >= 9
    eng.core.kv.version = 1  # what a weight update does to the cache's keys (EngineCore.update_weights)
    eng.generate([first], PARAMS)
    assert eng.core.kv.tier.stats.loaded.total() == 0 and eng.core.kv.tier.stats.hits.total() == 0
    eng.close()


def evicted_session(eng: LLMEngine) -> list[int]:
    """A session's first turn, fillers that evict its blocks from the cache, and its second turn's prompt."""
    first = tokens(37, 1)
    reply = eng.generate([first], PARAMS)[0].token_ids
    for seed in range(10, 13):
        eng.generate([tokens(60, seed)], PARAMS)
    return first + reply + tokens(5, 20)


def held_loads(eng: LLMEngine) -> tuple[threading.Event, threading.Event]:
    """Every load from the tiers waits on the load thread until `release` is set; `reached` says one does."""
    reached, release = threading.Event(), threading.Event()
    eng.core.kv.tier.before_load = lambda: (reached.set(), release.wait(60))
    return reached, release


def test_a_slow_load_stalls_neither_the_batch_nor_its_answer(ckpt, baseline):
    """While a returning turn's blocks load (held on the load thread), a running request receives a token every
    step; once the load is over the turn is answered token-exact, having computed only what no tier held."""
    replies, _, _ = baseline
    eng = make_engine(ckpt, peak_flops=1e6, offload_bytes=1 << 20)
    second = evicted_session(eng)
    reached, release = held_loads(eng)
    other = eng.add_request(tokens(6, 40), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    eng.step()  # the other one runs
    turn = eng.add_request(second, PARAMS)
    got: dict[str, list[int]] = {other: [], turn: []}
    for _ in range(8):  # eight steps while the load is held
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    # The load thread takes the load up when it is scheduled: on a loaded machine that may be after the steps.
    assert reached.wait(30) and eng.core.kv.tier.stats.loaded.total() == 0
    assert len(got[other]) >= 8 and got[turn] == []  # a token a step for the other; the turn waits, queued
    computed = eng.core.prompt_tokens_computed
    release.set()
    for out in eng.stream():
        got[out.request_id] += out.new_token_ids
    assert got[turn] == replies[2]  # the offline engine's (no tier) second turn
    assert eng.core.kv.tier.stats.loaded["host"] >= 9
    assert eng.core.prompt_tokens_computed - computed < len(second) - 9 * BS + 1
    eng.core.pool.check_integrity()
    assert eng.core.pool.num_free_blocks == BLOCKS
    eng.close()


def test_a_request_cancelled_mid_load_leaks_no_block(ckpt):
    eng = make_engine(ckpt, peak_flops=1e6, offload_bytes=1 << 20)
    second = evicted_session(eng)
    reached, release = held_loads(eng)
    turn = eng.add_request(second, PARAMS)
    eng.step()
    assert reached.wait(10)
    assert eng.core.pool.num_free_blocks < BLOCKS  # the load's blocks, pinned
    eng.abort(turn)
    eng.step()
    assert eng.core.pool.num_free_blocks < BLOCKS  # still written into: not given back yet
    release.set()
    deadline = time.monotonic() + 10
    while eng.core.pool.num_free_blocks < BLOCKS and time.monotonic() < deadline:
        eng.core.kv.tier.wait_load(0.05)
        eng.core.scheduler.schedule()  # reaps the loads that have stopped
    assert eng.core.pool.num_free_blocks == BLOCKS and not eng.core.kv.tier._pinned
    assert not eng.has_unfinished
    eng.core.pool.check_integrity()
    eng.close()


def test_a_loaded_request_behind_a_preempted_one_gives_its_blocks_back(ckpt):
    """A long request runs while a returning turn's blocks load (held): it outgrows what the load leaves of the
    24-block cache, is preempted and goes back to the queue ahead of the turn, and needs blocks the loaded turn
    holds. The turn gives them back (it finds them in the prefix cache later) instead of both waiting forever:
    every request ends, token-exact."""
    eng = make_engine(ckpt, peak_flops=1e6, offload_bytes=1 << 20)
    second = evicted_session(eng)
    long_params = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
    long_prompt = tokens(6, 50)
    want = {"long": make_engine(ckpt).generate([long_prompt], long_params)[0].token_ids}
    reached, release = held_loads(eng)
    eng.add_request(long_prompt, long_params, request_id="long")
    got: dict[str, list[int]] = {"long": [o for out in eng.step() for o in out.new_token_ids], "turn": []}
    eng.add_request(second, PARAMS, request_id="turn")
    for _ in range(80):
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
        if eng.scheduler.num_preemptions:
            break
    assert reached.is_set() and eng.scheduler.num_preemptions  # the long one outgrew the room the load left
    release.set()
    for _ in range(400):
        if not eng.has_unfinished:
            break
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert not eng.has_unfinished, "requests left waiting for each other's blocks"
    assert got["long"] == want["long"]
    assert got["turn"] == make_engine(ckpt).generate([second], PARAMS)[0].token_ids
    assert eng.core.pool.num_free_blocks == BLOCKS
    eng.close()
