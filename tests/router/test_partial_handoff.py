"""The partial hand-off on a real 1P2D cluster: a turn that adds more than local_prefill_max_tokens goes the
disaggregated way, to the decode worker holding the conversation's earlier turns, and the KV moved is only the
blocks that worker lacks; if it has lost them by the time it reserves, the request is tried again as a full
hand-off. Every reply equals the offline engine's."""
from __future__ import annotations

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
LOCAL_MAX = 8  # a turn adding more than this goes the disaggregated way
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def partial_cluster(tiny_checkpoints, ray_local, aloop):
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=BS, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    cfg = ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.25), decode=PoolConfig(2, num_cpus=0.25),
                        transfer_timeout_s=20.0, local_prefill_max_tokens=LOCAL_MAX, kv_checksum=True)
    cluster = Cluster(cfg)
    aloop.run(cluster.start(), timeout=600)
    offline = LLMEngine(engine)
    kv = offline.core.runner.kv_cache  # [layers, 2, kv heads, blocks, block size, head dim]
    yield cluster, offline, kv[:, :, :, 0].nbytes
    aloop.run(cluster.shutdown())


async def turn(cluster: Cluster, prompt: list[int], request_id: str | None = None):
    tokens, placement = [], ()
    async for out in cluster.generate(prompt, GREEDY, request_id=request_id):
        assert out.error is None, out.error
        tokens += out.new_token_ids
        placement = out.placement or placement
    return tokens, placement


async def group_turn(cluster: Cluster, prompt: list[int], params: SamplingParams, request_id: str | None = None):
    """A group's turn: each sample's tokens, by index, and the placement."""
    samples, placement = [[] for _ in range(params.n)], ()
    async for out in cluster.generate(prompt, params, request_id=request_id):
        assert out.error is None, out.error
        samples[out.index] += out.new_token_ids
        placement = out.placement or placement
    return samples, placement


def received(aloop, cluster, worker_id: str) -> int:
    """KV bytes a decode worker has received."""
    return next((s.transfer or {}).get("bytes", 0) for s in aloop.run(cluster.stats()) if s.worker_id == worker_id)


def first_turn(aloop, cluster, offline, prompt: list[int]) -> tuple[list[int], str]:
    """A new conversation's first turn (a full hand-off), and the decode worker that holds it afterwards."""
    reply, placement = aloop.run(turn(cluster, prompt))
    assert reply == offline.generate([prompt], GREEDY)[0].token_ids
    assert len(placement) == 2
    served_by = placement[-1]
    held = hash_prompt_blocks((prompt + reply)[:-1], BS)  # the last token's KV is never computed
    wait_for(lambda: cluster.scaling.kv_index.match(served_by, held) == len(held), timeout=30,
             what="the decode worker's KV events to reach the router")
    return reply, served_by


def test_a_long_turn_moves_only_the_blocks_its_decode_worker_lacks(partial_cluster, aloop):
    cluster, offline, block_bytes = partial_cluster
    g = torch.Generator().manual_seed(7)
    conversation = torch.randint(0, 320, (30,), generator=g).tolist()
    reply, last = first_turn(aloop, cluster, offline, conversation)
    for n in range(2):
        conversation = conversation + reply + torch.randint(0, 320, (LOCAL_MAX + 13,), generator=g).tolist()
        held = cluster.scaling.kv_index.match(last, hash_prompt_blocks(conversation[:-1], BS))
        assert held >= 8, held  # the earlier turns, the model's replies included
        before = received(aloop, cluster, last)
        reply, placement = aloop.run(turn(cluster, conversation))
        assert reply == offline.generate([conversation], GREEDY)[0].token_ids, f"turn {n + 1}"
        assert placement == (placement[0], last), placement  # disaggregated, to the worker holding the rest
        moved = received(aloop, cluster, last) - before
        missing = -(-len(conversation) // BS) - held
        # The missing blocks and the trailer (first token, time, checksum): not one block more.
        assert missing * block_bytes <= moved < (missing + 1) * block_bytes, (moved, missing, held)
        assert cluster.retries["prefix_missed"] == 0
        held_now = hash_prompt_blocks((conversation + reply)[:-1], BS)
        wait_for(lambda: cluster.scaling.kv_index.match(last, held_now) == len(held_now), timeout=30,
                 what="the decode worker's KV events to reach the router")


def test_a_prefix_evicted_before_the_reservation_falls_back_to_a_full_hand_off(partial_cluster, aloop):
    cluster, offline, block_bytes = partial_cluster
    g = torch.Generator().manual_seed(8)
    conversation = torch.randint(0, 320, (30,), generator=g).tolist()
    reply, last = first_turn(aloop, cluster, offline, conversation)
    conversation = conversation + reply + torch.randint(0, 320, (LOCAL_MAX + 13,), generator=g).tolist()
    rid = "evicted-turn"
    for w in cluster.pools["decode"]:  # whichever takes it: its cache drops the prefix as it reserves
        ray.get(w.handle.inject_fault.remote("evict_prefix", 0.0, 1, 0, f"{rid}#"))
    missed = cluster.retries["prefix_missed"]
    before = received(aloop, cluster, last)
    reply, placement = aloop.run(turn(cluster, conversation, request_id=rid))
    assert reply == offline.generate([conversation], GREEDY)[0].token_ids
    assert cluster.retries["prefix_missed"] == missed + 1  # tried again at once, whole
    assert cluster.retries["decode_lost"] == cluster.retries["transfer_failed"] == 0
    if placement[-1] == last:  # the retry moved the whole prompt and its first token's place
        assert received(aloop, cluster, last) - before >= (len(conversation) + 1) // BS * block_bytes


@pytest.mark.parametrize("evicted", [False, True], ids=["held", "evicted"])
def test_a_group_turn_moves_only_the_blocks_its_decode_worker_lacks(partial_cluster, aloop, evicted):
    """An RL group (n samples of one prompt, seeded) on a conversation's next turn: one prefill, the missing blocks
    moved once, each sample forked on the decode worker from the pinned prefix and the blocks that came; every
    sample equals the offline engine's. If the prefix is gone when the decode worker reserves, the group is tried
    again at once as a full hand-off, as one request is."""
    cluster, offline, block_bytes = partial_cluster
    g = torch.Generator().manual_seed(9 + evicted)
    conversation = torch.randint(0, 320, (30,), generator=g).tolist()
    reply, last = first_turn(aloop, cluster, offline, conversation)
    conversation = conversation + reply + torch.randint(0, 320, (LOCAL_MAX + 13,), generator=g).tolist()
    held = cluster.scaling.kv_index.match(last, hash_prompt_blocks(conversation[:-1], BS))
    assert held >= 8, held
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    want = offline.generate([conversation], params)
    rid = f"group-turn-{evicted}"
    if evicted:
        for w in cluster.pools["decode"]:
            ray.get(w.handle.inject_fault.remote("evict_prefix", 0.0, 1, 0, f"{rid}#"))
    before, missed = received(aloop, cluster, last), cluster.retries["prefix_missed"]

    samples, placement = aloop.run(group_turn(cluster, conversation, params, rid))
    assert samples == [w.token_ids for w in want]
    assert cluster.retries["prefix_missed"] == missed + evicted
    assert cluster.retries["decode_lost"] == cluster.retries["transfer_failed"] == 0
    moved = received(aloop, cluster, last) - before
    if evicted:
        if placement[-1] == last:  # the retry moved the whole prompt
            assert moved >= (len(conversation) + 1) // BS * block_bytes
        return
    assert placement == (placement[0], last), placement
    missing = -(-len(conversation) // BS) - held
    # The missing blocks and the trailer (the samples' first tokens, time, checksum): not one block more.
    assert missing * block_bytes <= moved < (missing + 1) * block_bytes, (moved, missing, held)


def test_a_short_group_turn_is_prefilled_on_its_decode_worker(partial_cluster, aloop):
    """A group whose turn adds no more than local_prefill_max_tokens: its decode worker computes the rest of the
    prompt itself (no prefill worker, no KV moved) and forks the n samples there; each equals the offline
    engine's."""
    cluster, offline, _ = partial_cluster
    g = torch.Generator().manual_seed(12)
    conversation = torch.randint(0, 320, (30,), generator=g).tolist()
    reply, last = first_turn(aloop, cluster, offline, conversation)
    conversation = conversation + reply + torch.randint(0, 320, (3,), generator=g).tolist()  # 7 tokens uncached
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=13, n=3, ignore_eos=True)
    want = offline.generate([conversation], params)
    before = received(aloop, cluster, last)

    samples, placement = aloop.run(group_turn(cluster, conversation, params))
    assert samples == [w.token_ids for w in want]
    assert placement == (last,), placement
    assert received(aloop, cluster, last) == before
