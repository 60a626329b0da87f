"""The hand-off's wait-for cycle on a real 1P1D cluster, and that it cannot form.

The cycle (found with SmolLM2 on 2P2D, docs/benchmarks.md): a prefill worker holds computed prompts whose KV waits
for room on the decode worker, while that room is held for KV the prefill worker has no room left to compute (or for
a request queued behind the one waiting). Here: a decode worker with 64 blocks of 4 tokens holds a conversation's
first turn in its prefix cache (11 blocks) and streams one request. While it is held inside a step (its stats to the
router frozen, so the router places on what it last saw), a 212-token prompt H (54 blocks with its next token) and
the conversation's next turn X (a partial hand-off: its 11 blocks pinned on arrival, 6 more to receive) are placed on
it. Before the fix, X's pin (taken on arrival, behind H) left H 53 blocks at most, and H's reservation waited
forever; X waited behind H; the prefill worker held H's KV for a reservation that never came, and, with a 60-block
cache, had no room to compute X. Now the prefill worker computes X only once H's KV is gone, the decode worker
reserves only for a prompt the prefill worker has admitted, and a pin behind the head gives way to it (X is then tried
again whole). Every reply equals the offline engine's."""
from __future__ import annotations

import asyncio
import math

import pytest
import ray
import torch

from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.sampling import SamplingParams
from router.cluster import Cluster

from conftest import wait_for

BS = 4
DECODE_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
STREAM = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
HUNG_S = 60  # the three requests end well within this once nothing waits on anything (seconds on a loaded 2-core box)


@pytest.fixture(scope="module", params=[60, 256], ids=["prefill-full", "prefill-room"])
def cluster(request, tiny_checkpoints, ray_local, aloop):
    """1P1D; the prefill worker's cache holds H but not H and X at once (60 blocks), or both (256)."""
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=BS, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256))
    cfg = ClusterConfig(engine=engine,
                        prefill=PoolConfig(1, num_cpus=0.25, cache=CacheConfig(block_size=BS,
                                                                               num_blocks=request.param)),
                        decode=PoolConfig(1, num_cpus=0.25, cache=CacheConfig(block_size=BS,
                                                                              num_blocks=DECODE_BLOCKS)),
                        transfer_timeout_s=20.0, local_prefill_max_tokens=0)
    c = Cluster(cfg)
    aloop.run(c.start(), timeout=600)
    yield c, LLMEngine(engine), request.param
    aloop.run(c.shutdown())


async def tokens_of(c: Cluster, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens = []
    async for out in c.generate(prompt, params):
        assert out.error is None, out.error
        tokens += out.new_token_ids
    return tokens


def prefill_stats(worker):
    return ray.get(worker.handle.stats.remote(), timeout=30)


def test_a_prompt_near_the_decode_cache_beside_a_pinned_turn_does_not_hang(cluster, aloop):
    c, offline, prefill_blocks = cluster
    prefill, decode = c.pools["prefill"][0], c.pools["decode"][0]
    g = torch.Generator().manual_seed(prefill_blocks)
    conversation = torch.randint(1, 320, (40,), generator=g).tolist()
    reply = aloop.run(tokens_of(c, conversation, GREEDY))
    assert reply == offline.generate([conversation], GREEDY)[0].token_ids
    held = hash_prompt_blocks((conversation + reply)[:-1], BS)  # 11 blocks in the decode worker's prefix cache
    wait_for(lambda: c.scaling.kv_index.match(decode.worker_id, held) == len(held), timeout=30,
             what="the decode worker's KV events to reach the router")
    x = conversation + reply + torch.randint(1, 320, (20,), generator=g).tolist()  # 66 tokens, 11 blocks held
    h = torch.randint(1, 320, (212,), generator=g).tolist()  # 54 blocks with its next token: > 64 - 11
    r = torch.randint(1, 320, (8,), generator=g).tolist()
    batch = [(r, STREAM), (h, GREEDY), (x, GREEDY)]
    want = [offline.generate([p], sp)[0].token_ids for p, sp in batch]

    ray.get(decode.handle.inject_fault.remote("step", math.inf, skip=3))
    held_step = True
    loop = aloop.loop
    try:
        stream = asyncio.run_coroutine_threadsafe(tokens_of(c, r, STREAM), loop)
        assert ray.get(decode.handle.fault_reached.remote("step", 60)), "the decode worker never reached its 4th step"
        before = prefill_stats(prefill).prompt_tokens_requested
        first = asyncio.run_coroutine_threadsafe(tokens_of(c, h, GREEDY), loop)
        wait_for(lambda: prefill_stats(prefill).prompt_tokens_requested >= before + len(h), timeout=30,
                 what="H to reach the prefill worker")
        turn = asyncio.run_coroutine_threadsafe(tokens_of(c, x, GREEDY), loop)
        wait_for(lambda: prefill_stats(prefill).prompt_tokens_requested >= before + len(h) + len(x), timeout=30,
                 what="X to reach the prefill worker")
        # The prefill worker has computed what its cache takes (H; with room, X too) and holds it for the decode worker.
        wait_for(lambda: prefill_stats(prefill).running >= (1 if prefill_blocks < 100 else 2), timeout=30,
                 what="the prefill worker to hold the computed prompts")
        ray.get(decode.handle.release_fault.remote("step"))
        held_step = False
        got = []
        for name, fut in (("the stream", stream), ("H", first), ("X", turn)):
            try:
                got.append(fut.result(HUNG_S))
            except TimeoutError:
                fut.cancel()
                pytest.fail(f"{name} hung: no reply within {HUNG_S} s (prefill worker: {prefill_stats(prefill)})")
    finally:
        if held_step:
            ray.get(decode.handle.release_fault.remote("step"), timeout=10)
    assert got == want
    assert c.retries["decode_lost"] == c.retries["transfer_failed"] == 0
    wait_for(lambda: sum(s.kv_blocks_used for s in aloop.run(c.stats())) == 0, timeout=30,
             what="zero used KV blocks on both workers")
