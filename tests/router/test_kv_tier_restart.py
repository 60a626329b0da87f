"""The disk tier outlives its worker, on a real cluster: a colocated worker (it decodes) holding a session's KV on
its disk tier is SIGKILLed; its replacement, started with the same --kv-offload-dir, announces the blocks in its
first KV events, and the session's next turn loads them from disk instead of computing them, token-exact."""
from __future__ import annotations

import dataclasses
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
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tier_cluster(tiny_checkpoints, ray_local, aloop, tmp_path_factory):
    cache = CacheConfig(block_size=BS, num_blocks=24)
    # peak_flops: the tiny model computes a block faster than the cost rule prices a disk read; at this peak it is
    # priced as a real model's would be, so tier hits are loaded.
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=cache, peak_flops=1e6,
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    offline = LLMEngine(engine)
    kv = offline.core.runner.kv_cache
    block_bytes = kv[:, :, :, 0].numel() * kv.element_size()
    tiers = dataclasses.replace(cache, offload_bytes=block_bytes, offload_dir=str(tmp_path_factory.mktemp("kvtier")),
                                offload_disk_bytes=256 * block_bytes)  # host: one block; the rest goes to disk
    cfg = ClusterConfig(engine=dataclasses.replace(engine, cache=tiers), mode="colocated",
                        colocated=PoolConfig(1, num_cpus=0.25))
    cluster = Cluster(cfg)
    aloop.run(cluster.start(), timeout=600)
    yield cluster, offline
    aloop.run(cluster.shutdown())


def test_a_replacement_worker_finds_its_predecessors_disk_tier(tier_cluster, aloop):
    cluster, offline = tier_cluster
    # 3 x 60 tokens through a 96-slot cache: the conversation's blocks leave it, for disk
    conversation, reply, g = a_turn_pushed_out(aloop, cluster, offline, GREEDY, seed=7, fillers=3)
    (dead,) = [w.worker_id for w in cluster.pools["colocated"]]
    held = hash_prompt_blocks(conversation + reply, BS)[:10]
    wait_for(lambda: tier_stats(aloop, cluster)[dead].get("written_disk_blocks", 0) >= 20, timeout=30,
             what="the evicted blocks written to disk")
    victim = cluster.pools["colocated"][0]
    os.kill(ray.get(victim.handle.rank_pids.remote(), timeout=30)[0], signal.SIGKILL)
    wait_for(lambda: [w.worker_id for w in cluster.pools["colocated"]] not in ([], [dead]), timeout=180,
             what="a replacement worker")
    (new,) = [w.worker_id for w in cluster.pools["colocated"]]
    index = cluster.scaling.kv_index
    wait_for(lambda: index.match_tiers(new, held) == (0, len(held)), timeout=60,
             what="the replacement's first KV events to announce the disk tier")
    conversation = conversation + reply + torch.randint(0, 320, (5,), generator=g).tolist()
    assert aloop.run(tokens_of(cluster, conversation, GREEDY)) == offline.generate([conversation], GREEDY)[0].token_ids
    stats = tier_stats(aloop, cluster)[new]
    assert stats["loaded_disk_blocks"] >= len(held) and stats["hits_disk_blocks"] >= len(held)
