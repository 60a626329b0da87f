"""KV tiers on the decode pool of a disaggregated cluster (1P1D, real Ray workers, a tiny checkpoint): a decode
worker holding a session's KV on its disk tier is SIGKILLed; its replacement, started with the same
--kv-offload-dir, announces the blocks, and the session's next turn is computed on it (a local prefill) loading
them from disk. That load is held at the worker's tier_load fault point: meanwhile another request runs to its
end on the same worker; once released, the turn is answered token-exact."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import signal

import pytest
import ray
import torch

from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.sampling import SamplingParams
from router.cluster import Cluster

from conftest import wait_for
from served import a_turn_pushed_out, tier_stats, tokens_of

BS = 4
BLOCKS = 48
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONGER = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def decode_tier_cluster(tiny_checkpoints, ray_local, aloop, tmp_path_factory):
    cache = CacheConfig(block_size=BS, num_blocks=BLOCKS)
    # peak_flops: the tiny model computes a block faster than the cost rule prices a disk read; at this peak it is
    # priced as a real model's would be, so tier hits are loaded.
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=cache, peak_flops=1e6,
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    offline = LLMEngine(engine)
    kv = offline.core.runner.kv_cache
    block_bytes = kv[:, :, :, 0].numel() * kv.element_size()
    tiers = dataclasses.replace(cache, offload_bytes=block_bytes, offload_dir=str(tmp_path_factory.mktemp("kvtier")),
                                offload_disk_bytes=256 * block_bytes)  # host: one block; the rest goes to disk
    cfg = ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.25),
                        decode=PoolConfig(1, num_cpus=0.25, cache=tiers))  # the decode worker's tiers only
    cluster = Cluster(cfg)
    aloop.run(cluster.start(), timeout=600)
    yield cluster, offline
    aloop.run(cluster.shutdown())


def test_a_replaced_decode_worker_loads_its_predecessors_disk_tier_while_its_batch_steps(decode_tier_cluster, aloop):
    cluster, offline = decode_tier_cluster
    # 5 x 60 tokens through the decode worker's 192-slot cache: the conversation leaves it
    conversation, reply, g = a_turn_pushed_out(aloop, cluster, offline, GREEDY, seed=11, fillers=5)
    (dead,) = [w.worker_id for w in cluster.pools["decode"]]
    held = hash_prompt_blocks(conversation + reply, BS)[:10]
    wait_for(lambda: tier_stats(aloop, cluster)[dead].get("written_disk_blocks", 0) >= 20, timeout=30,
             what="the decode worker's evicted blocks written to disk")
    os.kill(ray.get(cluster.pools["decode"][0].handle.rank_pids.remote(), timeout=30)[0], signal.SIGKILL)
    wait_for(lambda: [w.worker_id for w in cluster.pools["decode"]] not in ([], [dead]), timeout=180,
             what="a replacement decode worker")
    (new,) = cluster.pools["decode"]
    index = cluster.scaling.kv_index
    wait_for(lambda: index.match_tiers(new.worker_id, held) == (0, len(held)), timeout=60,
             what="the replacement's first KV events to announce the disk tier")

    ray.get(new.handle.inject_fault.remote("tier_load", math.inf), timeout=30)
    try:
        conversation = conversation + reply + torch.randint(0, 320, (5,), generator=g).tolist()
        returning = asyncio.run_coroutine_threadsafe(tokens_of(cluster, conversation, GREEDY), aloop.loop)
        assert ray.get(new.handle.fault_reached.remote("tier_load", 60), timeout=70), "no load from the tier"
        # The load is held: another request comes and goes on the same worker, every token of it.
        other = torch.randint(0, 320, (8,), generator=g).tolist()
        want = offline.generate([other], LONGER)[0].token_ids
        assert aloop.run(tokens_of(cluster, other, LONGER), timeout=120) == want
        assert not returning.done()  # still waiting for its blocks, queued
    finally:
        ray.get(new.handle.release_fault.remote("tier_load"), timeout=30)
    assert returning.result(120) == offline.generate([conversation], GREEDY)[0].token_ids
    stats = tier_stats(aloop, cluster)[new.worker_id]
    assert stats["loaded_disk_blocks"] >= len(held) and stats["hits_disk_blocks"] >= len(held)
    (s,) = [s for s in aloop.run(cluster.stats()) if s.worker_id == new.worker_id]
    assert s.kv_blocks_used == 0  # every block given back: nothing pinned, nothing held
