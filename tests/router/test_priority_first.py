"""A priority request never starts later than a default one that arrived after it, under a prefill-bound
load with the fast lane full: on a real local Ray cluster, timed by the router's own clock (the test
process is the router: arrival is the call to Cluster.generate, the first token its first output)."""
from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.tiers import ServiceTier, TiersConfig
from router.cluster import Cluster

from conftest import build_tiny_checkpoint, wait_for

pytestmark = pytest.mark.slow

BUDGET = 64  # prefill tokens a step: a prompt of PROMPT_LEN takes two steps, so no two prompts end in one
PROMPT_LEN = 100
MAX_TOKENS = 8
# Arrival order: priority requests among defaults, each with defaults before and after it.
ORDER = "DDDPDDPDDDPD"


@pytest.fixture(scope="module")
def lane_full(ray_local, aloop, tmp_path_factory):
    # Context long enough that the lane's one request outlasts the test.
    model = build_tiny_checkpoint(tmp_path_factory.mktemp("long") / "llama", "llama", max_position_embeddings=4096)
    engine = EngineConfig(model=str(model), cache=CacheConfig(block_size=16, num_blocks=512))
    pool = dict(num_cpus=0.25, cache=engine.cache)
    config = ClusterConfig(
        engine=engine,
        prefill=PoolConfig(1, scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET), **pool),
        decode=PoolConfig(1, scheduler=SchedulerConfig(max_num_seqs=16), **pool),
        fast=PoolConfig(1, **pool),
        tiers=TiersConfig(fast_lane_max_running=1, fast_lane_when_full="wait", fast_lane_max_wait_s=1.0))
    cluster = Cluster(config)
    aloop.run(cluster.start(), timeout=600)
    yield cluster, LLMEngine(engine)
    aloop.run(cluster.shutdown())


def prompt(i: int) -> list[int]:
    return [(11 * i + 5 * j) % 300 + 1 for j in range(PROMPT_LEN + i)]


def test_priority_first_token_never_after_a_later_default(lane_full, aloop):
    cluster, offline = lane_full
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ref = [c.token_ids for c in offline.generate([prompt(i) for i in range(len(ORDER))], greedy)]

    async def run():
        occupant_started = asyncio.Event()

        async def occupy():  # the lane's one running request, for the whole test
            async for _ in cluster.generate([1, 2, 3, 4], SamplingParams(max_tokens=4000, temperature=0.0,
                                                                          ignore_eos=True), "occupant",
                                            tier=ServiceTier.PRIORITY):
                occupant_started.set()

        lane = asyncio.create_task(occupy())
        await occupant_started.wait()
        assert cluster.in_flight[ServiceTier.PRIORITY] == 1  # the lane is full from here on

        async def one(i: int, tier: ServiceTier):
            arrived, first, tokens, served = time.monotonic(), None, [], None
            async for out in cluster.generate(prompt(i), greedy, f"r{i}", tier=tier):
                first = first or time.monotonic()
                tokens += out.new_token_ids
                served = out.service_tier
            return arrived, first, tokens, served

        tasks = []
        for i, kind in enumerate(ORDER):
            tasks.append(asyncio.create_task(one(i, ServiceTier.PRIORITY if kind == "P" else ServiceTier.DEFAULT)))
            await asyncio.sleep(0.002)  # distinct arrivals, all while the first prompts are still in line
        results = await asyncio.gather(*tasks)
        lane.cancel()
        await asyncio.gather(lane, return_exceptions=True)
        return results

    downgrades = cluster.downgrades
    results = aloop.run(run(), timeout=300)
    assert [r[2] for r in results] == ref  # token-exact
    # Every priority request found the lane full: served as default, on the decode pool.
    assert [r[3] for r, kind in zip(results, ORDER) if kind == "P"] == ["default"] * ORDER.count("P")
    assert cluster.downgrades == downgrades + ORDER.count("P")
    late = [(i, j, round(results[i][1] - results[j][1], 3))
            for i, kind in enumerate(ORDER) if kind == "P"
            for j, other in enumerate(ORDER) if other == "D" and results[j][0] > results[i][0]
            and results[i][1] > results[j][1]]
    assert late == [], f"priority request i started after default j that arrived later (i, j, seconds): {late}"
    wait_for(lambda: sum(s.kv_blocks_used for s in aloop.run(cluster.stats())) == 0, timeout=30,
             what="every worker to report zero used KV blocks")
