"""KV tiers in the router's view (router.kv_index) and in placement (router.placement.cached_score): a prefix in a
worker's host or disk tier scores above none and below a resident one."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdserve.config import ClusterConfig
from pdserve.engine.block_pool import KVEvents, hash_prompt_blocks
from pdserve.tiers import ServiceTier
from router.dispatch import Dispatch
from router.kv_index import KVIndex
from router.line import Entry
from router.placement import cached_score
from router.workers import Worker

PROMPT = list(range(1000, 1096))  # 6 blocks of 16
HASHES = tuple(hash_prompt_blocks(PROMPT, 16))


def test_the_index_counts_tiered_blocks_past_the_resident_prefix():
    idx = KVIndex()
    idx.apply("w", KVEvents(stored=HASHES[:2], offloaded=HASHES[1:5]))
    assert idx.match_tiers("w", HASHES) == (2, 3)  # blocks 0-1 resident, 2-4 in a tier, 5 nowhere
    idx.apply("w", KVEvents(removed=HASHES[:1], dropped=HASHES[3:4]))
    assert idx.match_tiers("w", HASHES) == (0, 0)  # block 0 gone from both
    idx.apply("w", KVEvents(offloaded=HASHES[:1]))
    assert idx.match_tiers("w", HASHES) == (0, 3) and idx.tiered_blocks("w") == 4
    idx.forget("w")
    assert idx.match_tiers("w", HASHES) == (0, 0) and idx.tiered_blocks("w") == 0


def test_merged_events_keep_the_tiers_changes_in_order():
    a = KVEvents(stored=HASHES[:1], offloaded=HASHES[1:3])
    b = KVEvents(removed=HASHES[:1], offloaded=HASHES[:1], dropped=HASHES[2:3])
    m = a.merged(b)
    assert m.stored == () and m.removed == HASHES[:1]
    assert set(m.offloaded) == set(HASHES[:2]) and m.dropped == HASHES[2:3]
    c = a.merged(KVEvents(cleared=True, dropped=HASHES[1:2]))
    assert c.cleared and c.offloaded == HASHES[2:3] and c.dropped == HASHES[1:2]


def test_cached_score_is_between_recompute_and_residence():
    assert cached_score(0, 0) < cached_score(0, 96) < cached_score(96, 0)
    assert cached_score(32, 64) == 32 + 32


def test_dispatch_prefers_resident_then_tiered_then_nothing():
    """Three decode workers: d0 holds the prompt in its cache, d1 in its tiers, d2 nothing. exact routing picks d0;
    d0 avoided, d1; for the prefill pool likewise, p1 (tiered) over p0 (nothing)."""

    async def place(dispatch: Dispatch, avoid: tuple[str, ...] = ()):
        e = Entry(f"r{len(dispatch._counted)}", len(PROMPT), "decode", avoid, PROMPT, ServiceTier.DEFAULT,
                  local_ok=False)
        dispatch.line.add(e)
        dispatch.dispatch()
        p, d = e.placed.result()
        dispatch.unplace(e, p, d)
        return p.worker_id, d.worker_id

    async def run():
        p0, p1 = Worker("p0", None, "prefill", 0), Worker("p1", None, "prefill", 1)
        d0, d1, d2 = (Worker(f"d{i}", None, "decode", i) for i in range(3))
        pools = SimpleNamespace(by_name={"prefill": [p0, p1], "decode": [d2, d1, d0]}, kv_index=KVIndex(),
                                listeners=[])
        dispatch = Dispatch(ClusterConfig(prefix_routing="exact"), pools, block_size=16)
        pools.kv_index.apply("d0", KVEvents(stored=HASHES))
        for w in ("d1", "p1"):
            pools.kv_index.apply(w, KVEvents(offloaded=HASHES))
        return await place(dispatch), await place(dispatch, avoid=("d0",))

    first, second = asyncio.run(run())
    assert first == ("p1", "d0")
    assert second == ("p1", "d1")
