"""Multi-turn traffic on a real 1P2D cluster: each turn resends the conversation, and the router places it where
its KV is (router.kv_index, from the workers' events). A later turn goes to the decode worker that served the
last one and holds all of the conversation but the newest tokens: that worker computes them itself, with no
prefill worker and no hand-off (local prefill), and every reply equals the offline engine's."""
from __future__ import annotations

import contextlib
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

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def session_cluster(tiny_checkpoints, ray_local, aloop):
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=BS, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    pool = PoolConfig(1, num_cpus=0.25)
    cfg = ClusterConfig(engine=engine, prefill=pool, decode=PoolConfig(2, num_cpus=0.25), transfer_timeout_s=20.0,
                        local_prefill_max_tokens=24)
    cluster = Cluster(cfg)
    aloop.run(cluster.start(), timeout=600)
    yield cluster, LLMEngine(engine)
    aloop.run(cluster.shutdown())


async def turn(cluster: Cluster, prompt: list[int], cached: list[int] | None = None, session: str | None = None
               ) -> tuple[list[int], tuple[str, ...]]:
    """The reply's tokens and where it was served; `cached` gets the prompt tokens the prefix cache served."""
    tokens, placement = [], ()
    async for out in cluster.generate(prompt, GREEDY, session=session):
        assert out.error is None, out.error
        tokens += out.new_token_ids
        placement = out.placement or placement
        if cached is not None:
            cached[:] = [out.num_cached_tokens]
    return tokens, placement


def stat(aloop, cluster, pool: str, name: str) -> dict[str, int]:
    return {s.worker_id: getattr(s, name) for s in aloop.run(cluster.stats()) if s.pool == pool}


def test_later_turns_go_to_the_decode_worker_holding_the_conversation(session_cluster, aloop):
    cluster, offline = session_cluster
    g = torch.Generator().manual_seed(3)
    conversation = torch.randint(0, 320, (30,), generator=g).tolist()
    decode_ids = {w.worker_id for w in cluster.pools["decode"]}
    for n in range(4):
        prefilled = stat(aloop, cluster, "prefill", "prompt_tokens_computed")
        moved = sum(t.get("bytes", 0) for s in aloop.run(cluster.stats()) for t in [s.transfer or {}])
        cached: list[int] = []
        reply, placement = aloop.run(turn(cluster, conversation, cached))
        assert reply == offline.generate([conversation], GREEDY)[0].token_ids, f"turn {n}"
        served_by = placement[-1]
        assert served_by in decode_ids
        if n == 0:
            assert len(placement) == 2  # the first turn: a prefill worker, then the decode worker
        else:
            # Its decode worker held all of it but the newest tokens: it computed those itself.
            assert placement == (served_by,) == (last,), placement
            assert cached == [len(held) * BS]  # the usage's cached tokens: the blocks it held
            assert stat(aloop, cluster, "prefill", "prompt_tokens_computed") == prefilled  # no prefill work
            assert sum(t.get("bytes", 0) for s in aloop.run(cluster.stats()) for t in [s.transfer or {}]) == moved
        last = served_by
        conversation = conversation + reply + torch.randint(0, 320, (9,), generator=g).tolist()
        # What the next turn is placed by: the decode worker's prefix cache, as its events told the router.
        held = hash_prompt_blocks(conversation[:len(conversation) - 9 - 1], BS)
        wait_for(lambda: cluster.scaling.kv_index.match(served_by, held) == len(held), timeout=30,
                 what="the decode worker's KV events to reach the router")


def test_a_prompt_no_decode_worker_holds_goes_the_disaggregated_way(session_cluster, aloop):
    cluster, offline = session_cluster
    prompt = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(4)).tolist()  # short, uncached
    reply, placement = aloop.run(turn(cluster, prompt))
    assert reply == offline.generate([prompt], GREEDY)[0].token_ids
    assert len(placement) == 2


def test_the_workers_count_local_prefills_cache_hits_and_the_kv_not_moved(session_cluster, aloop):
    """The sessions' counters (WorkerStats, exported as pdserve_worker_prefix_cache_hit_tokens_total and its
    kin): the first turn's prompt is computed by the prefill worker and its blocks handed off; each later turn
    is a local prefill on its decode worker, its prompt's tokens served by the cache or computed there, and its
    blocks counted as not moved."""
    cluster, _ = session_cluster
    g = torch.Generator().manual_seed(11)
    conversation = torch.randint(0, 320, (26,), generator=g).tolist()
    blocks = lambda n: -(-n // BS)  # noqa: E731

    def counters() -> dict[str, dict]:
        return {s.worker_id: dict(s.hop_tokens, local=s.local_prefills, moved=s.handoff_blocks,
                                  avoided=s.handoff_avoided_blocks) for s in aloop.run(cluster.stats())}

    held: list[bytes] = []
    for n in range(3):
        before = counters()
        reply, placement = aloop.run(turn(cluster, conversation))
        after = counters()
        delta = {w: {k: after[w].get(k, 0) - before[w].get(k, 0) for k in after[w]} for w in after}
        served_by = placement[-1]
        if n == 0:
            p = delta[placement[0]]
            assert p.get("prefill/cached", 0) + p["prefill/computed"] == len(conversation)
            assert delta[served_by]["moved"] == blocks(len(conversation))
            assert delta[served_by]["local"] == delta[served_by]["avoided"] == 0
        else:
            d = delta[served_by]
            assert d["local"] == 1 and d["moved"] == 0
            assert d["avoided"] == blocks(len(conversation))
            assert d["local_prefill/cached"] + d["local_prefill/computed"] == len(conversation)
            assert d["local_prefill/cached"] >= len(held) * BS  # the earlier turns, from its cache
            assert not any(v for w, dw in delta.items() if w != served_by for v in dw.values())
        conversation = conversation + reply + torch.randint(0, 320, (9,), generator=g).tolist()
        held = hash_prompt_blocks(conversation[:len(conversation) - 9 - 1], BS)
        wait_for(lambda: cluster.scaling.kv_index.match(served_by, held) == len(held), timeout=30,
                 what="the decode worker's KV events to reach the router")


def whole(cluster: Cluster) -> None:
    """Both decode workers and the prefill worker ready (a killed one's replacement included)."""
    wait_for(lambda: len(cluster.pools["decode"]) == 2 and len(cluster.pools["prefill"]) == 1, timeout=120,
             what="the pools back to size")


def forgotten(cluster: Cluster, dead: str, held: list[bytes]) -> None:
    """The dead worker is out of its pool and its blocks out of the router's index."""
    index = cluster.scaling.kv_index
    wait_for(lambda: dead not in {w.worker_id for w in cluster.pools["decode"]}
             and index.blocks(dead) == 0 and index.match(dead, held) == 0, timeout=60,
             what=f"{dead} to leave its pool and the router's KV index")


def test_a_session_goes_on_token_exact_when_its_decode_worker_is_killed_between_turns(session_cluster, aloop):
    """SIGKILL of the decode worker holding a session's KV between two turns: the router drops its blocks from
    the index, the next turn goes elsewhere (the conversation computed again) and equals the offline engine's,
    and the turn after stays on the new worker (local prefill, its KV there now)."""
    cluster, offline = session_cluster
    whole(cluster)
    g = torch.Generator().manual_seed(11)
    conversation = torch.randint(0, 320, (30,), generator=g).tolist()
    served = []
    for n in range(4):
        reply, placement = aloop.run(turn(cluster, conversation, session="killed-between"))
        assert reply == offline.generate([conversation], GREEDY)[0].token_ids, f"turn {n}"
        served.append(placement)
        conversation = conversation + reply + torch.randint(0, 320, (9,), generator=g).tolist()
        held = hash_prompt_blocks(conversation[:len(conversation) - 9 - 1], BS)
        if n == 1:  # the session's KV is on its decode worker, as the router knows: kill it
            dead = placement[-1]
            wait_for(lambda: cluster.scaling.kv_index.match(dead, held) == len(held), timeout=30,
                     what="the decode worker's KV events to reach the router")
            victim = next(w for w in cluster.pools["decode"] if w.worker_id == dead)
            os.kill(ray.get(victim.handle.rank_pids.remote(), timeout=30)[0], signal.SIGKILL)
            forgotten(cluster, dead, held)
    assert served[1] == (served[0][-1],)  # turn 1: local on the worker of turn 0
    assert served[2][-1] != dead  # turn 2: elsewhere
    assert served[3] == (served[2][-1],)  # turn 3: local on the new worker, which holds the conversation now


def test_a_session_goes_on_token_exact_when_its_decode_worker_is_killed_mid_stream(session_cluster, aloop):
    """ray.kill of the decode worker streaming a session's turn: the turn resumes on another decode worker from
    the tokens streamed, equal to the offline engine's; the killed worker's blocks leave the index; the next
    turn is token-exact too, on the worker that finished the last one (local prefill)."""
    cluster, offline = session_cluster
    whole(cluster)
    g = torch.Generator().manual_seed(12)
    conversation = torch.randint(0, 320, (30,), generator=g).tolist()
    reply, first = aloop.run(turn(cluster, conversation, session="killed-mid"))
    assert reply == offline.generate([conversation], GREEDY)[0].token_ids
    conversation = conversation + reply + torch.randint(0, 320, (9,), generator=g).tolist()
    long = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    lost = cluster.retries["decode_lost"]

    async def killed_midway() -> tuple[list[int], str, tuple[str, ...]]:
        tokens, dead, placement = [], None, ()
        async with contextlib.aclosing(cluster.generate(conversation, long, "mid", session="killed-mid")) as gen:
            async for out in gen:
                assert out.error is None, out.error
                tokens += out.new_token_ids
                placement = out.placement or placement
                if dead is None and len(tokens) >= 3:
                    victim = next(w for w in cluster.pools["decode"] if "mid#0" in w.requests)
                    dead = victim.worker_id
                    ray.kill(victim.handle, no_restart=True)
        return tokens, dead, placement

    tokens, dead, placement = aloop.run(killed_midway(), timeout=300)
    assert tokens == offline.generate([conversation], long)[0].token_ids
    assert cluster.retries["decode_lost"] == lost + 1  # it was killed with the stream unfinished
    assert dead == first[-1]  # the session's worker, which held its KV
    assert placement[-1] != dead
    forgotten(cluster, dead, hash_prompt_blocks(conversation, BS))
    conversation = conversation + tokens + torch.randint(0, 320, (9,), generator=g).tolist()
    reply, after = aloop.run(turn(cluster, conversation, session="killed-mid"))
    assert reply == offline.generate([conversation], GREEDY)[0].token_ids
    assert after == (placement[-1],)  # local, on the worker that finished the killed turn
