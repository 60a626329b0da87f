"""KV tiers beneath the paged cache (pdserve.engine.kv_offload): evicted blocks kept in host memory then on disk,
loaded back on a prefix hit with their exact bytes, never across weight versions, and found by a successor."""
from __future__ import annotations

import threading

import pytest
import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.kv_offload import KVTierStore
from pdserve.engine.request import Request
from pdserve.engine.sampling import SamplingParams

BS = 4
SHAPE = (2, 2, 1, 6, BS, 8)  # [layers, K/V, kv_heads, blocks, block_size, head_dim]: 6 cache blocks
BLOCK_BYTES = 2 * 2 * 1 * BS * 8 * 4
PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def setup(host_blocks: int, disk_dir=None, disk_blocks: int = 0, meta=None):
    cache = torch.zeros(SHAPE)
    pool = BlockPool(SHAPE[3], BS)
    kv = KVCacheManager(pool)
    kv.tier = KVTierStore(cache, host_blocks * BLOCK_BYTES, disk_dir, disk_blocks * BLOCK_BYTES, meta or {"m": 1})
    pool.on_evict = kv.tier.save
    pool.tier_events = kv.tier.take_events
    pool.record_events()
    kv.recompute_s_per_token = 1.0  # loading always wins
    return cache, pool, kv


def admit(kv: KVCacheManager, req: Request) -> int:
    """admit_cached_prefix, and the tier load it started (if any) waited for and taken in: tokens reused."""
    kv.admit_cached_prefix(req)
    if req.tier_load is not None:
        assert req.tier_load.done.wait(10)
        assert kv.loaded(req)
    return req.num_computed_tokens


def compute(cache: torch.Tensor, kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """A request admitted, its prompt 'computed' (each block's KV a function of its tokens), cached, freed."""
    req = Request(rid, tokens, PARAMS, 0)
    kv.start(req)
    admit(kv, req)
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    kv.fence()  # what a step does before it writes: the blocks' evicted contents are in the host tier
    for i in range(req.num_computed_tokens // BS, req.num_tokens // BS):
        cache[:, :, :, req.block_ids[i]] = float(sum(tokens[: (i + 1) * BS]))
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    kv.free(req)
    return req


def kv_of(tokens: list[int], i: int) -> float:
    return float(sum(tokens[: (i + 1) * BS]))


def test_evicted_blocks_come_back_from_host_with_their_bytes():
    cache, pool, kv = setup(host_blocks=8)
    a = list(range(1, 13)) + [99]  # 3 full blocks and one token
    compute(cache, kv, "a", a)
    b = compute(cache, kv, "b", list(range(50, 74)))  # 6 blocks: the whole cache, evicting a's 3
    assert pool.peek_cached_prefix(b.block_hashes) == 6
    assert kv.tier.stats.written["host"] >= 3
    req = Request("a2", a, PARAMS, 0)
    kv.start(req)
    assert admit(kv, req) == 12  # all 3 blocks loaded, not recomputed
    for i, b in enumerate(req.block_ids):
        assert torch.all(cache[:, :, :, b] == kv_of(a, i))
    assert kv.tier.stats.loaded["host"] == 3 and kv.tier.stats.hits["host"] == 3
    ev = pool.take_events()
    assert set(req.block_hashes[:3]) <= set(ev.offloaded) and set(req.block_hashes[:3]) <= set(ev.stored)
    assert pool.peek_cached_prefix(req.block_hashes) == 3  # registered: the next request shares them
    kv.free(req)
    pool.check_integrity()


def test_a_newer_weight_version_never_loads_an_older_block():
    cache, pool, kv = setup(host_blocks=8)
    a = list(range(1, 13)) + [99]
    compute(cache, kv, "a", a)
    compute(cache, kv, "b", list(range(50, 74)))
    kv.version = 1
    req = Request("a2", a, PARAMS, 0)
    kv.start(req)
    assert admit(kv, req) == 0
    assert kv.tier.stats.loaded.total() == 0 and kv.tier.stats.hits.total() == 0
    kv.free(req)


def test_recompute_wins_when_it_is_cheaper():
    cache, pool, kv = setup(host_blocks=8)
    kv.recompute_s_per_token = 0.0
    req = a_returning(cache, kv)
    assert admit(kv, req) == 0 and kv.tier.stats.loaded.total() == 0
    kv.free(req)


def test_host_overflow_goes_to_disk_and_a_successor_finds_it(tmp_path):
    cache, pool, kv = setup(host_blocks=1, disk_dir=str(tmp_path), disk_blocks=16)
    a = list(range(1, 13)) + [99]
    compute(cache, kv, "a", a)
    compute(cache, kv, "b", list(range(50, 74)))  # a's 3 blocks out of the cache; 2 of them on to disk
    compute(cache, kv, "c", list(range(200, 224)))  # and the last out of host too
    kv.tier.close()
    assert kv.tier.stats.written["disk"] >= 3
    # A new worker, same directory and meta, fresh cache: a's blocks are disk hits with their bytes.
    cache2, pool2, kv2 = setup(host_blocks=1, disk_dir=str(tmp_path), disk_blocks=16)
    hashes = Request("x", a, PARAMS, 0)
    kv2.start(hashes)
    kv2._extend_hashes(hashes, 3)
    assert set(hashes.block_hashes) <= set(kv2.tier.disk_hashes())
    first = pool2.take_events()  # the successor's first KV events announce its disk tier
    assert set(hashes.block_hashes) <= set(first.offloaded) and first.stored == ()
    req = Request("a2", a, PARAMS, 0)
    kv2.start(req)
    assert admit(kv2, req) == 12
    for i, b in enumerate(req.block_ids):
        assert torch.all(cache2[:, :, :, b] == kv_of(a, i))
    assert kv2.tier.stats.loaded["disk"] == 3
    kv2.tier.close()


def test_a_disk_tier_of_another_model_is_refused(tmp_path):
    _, _, kv = setup(host_blocks=1, disk_dir=str(tmp_path), disk_blocks=4, meta={"m": 1})
    kv.tier.close()
    with pytest.raises(ValueError, match="holds KV of"):
        setup(host_blocks=1, disk_dir=str(tmp_path), disk_blocks=4, meta={"m": 2})


def test_a_host_budget_below_one_block_is_refused():
    with pytest.raises(ValueError, match="kv-offload-mib"):
        KVTierStore(torch.zeros(SHAPE), BLOCK_BYTES - 1)


def a_returning(cache: torch.Tensor, kv: KVCacheManager) -> Request:
    """Prompt a computed, then b computed past it (a's 3 full blocks evicted from the cache, into the tier), then
    a's next request started: the one the tests admit."""
    a = list(range(1, 13)) + [99]
    compute(cache, kv, "a", a)
    compute(cache, kv, "b", list(range(50, 74)))
    req = Request("a2", a, PARAMS, 0)
    kv.start(req)
    return req


def held_loads(kv: KVCacheManager) -> threading.Event:
    """Make every load wait, on the load thread, until the returned event is set."""
    release = threading.Event()
    kv.tier.before_load = lambda: release.wait(10)
    return release


def test_a_load_under_way_keeps_its_blocks_out_of_sight_until_it_is_over():
    cache, pool, kv = setup(host_blocks=3)  # a's 3 blocks fill the host tier: saves meanwhile find no slot to take
    req = a_returning(cache, kv)
    release = held_loads(kv)
    assert kv.admit_cached_prefix(req) == 0 and req.tier_load is not None and len(req.block_ids) == 3
    assert not kv.loaded(req) and req.num_computed_tokens == 0
    assert pool.peek_cached_prefix(req.block_hashes) == 0  # not in the prefix cache before its bytes are
    # Meanwhile the cache serves others: a save into the host tier never takes a slot the load reads.
    compute(cache, kv, "c", list(range(300, 308)))
    release.set()
    assert req.tier_load.done.wait(10) and kv.loaded(req)
    assert req.num_computed_tokens == 12 and pool.peek_cached_prefix(req.block_hashes) == 3
    for i, b in enumerate(req.block_ids):
        assert torch.all(cache[:, :, :, b] == kv_of(req.prompt_token_ids, i))
    kv.free(req)
    pool.check_integrity()
    kv.tier.close()


def test_a_request_ended_mid_load_gives_its_blocks_back_once_the_load_stops():
    cache, pool, kv = setup(host_blocks=8)
    req = a_returning(cache, kv)
    release = held_loads(kv)
    kv.admit_cached_prefix(req)
    job = req.tier_load
    assert job is not None and pool.num_free_blocks == SHAPE[3] - 3
    kv.free(req)  # cancelled while the load is held: its blocks are still written into
    assert req.block_ids == [] and req.tier_load is None
    kv.reap()
    assert pool.num_free_blocks == SHAPE[3] - 3  # not before the load has stopped
    release.set()
    assert job.done.wait(10)
    kv.reap()
    assert pool.num_free_blocks == SHAPE[3] and not kv.tier._pinned  # nothing pinned, nothing held
    pool.check_integrity()
    kv.tier.close()


def test_copies_run_on_the_tier_threads_not_the_callers():
    cache, pool, kv = setup(host_blocks=8)
    seen = set()
    real = torch.Tensor.copy_

    def spy(self, *args, **kwargs):
        seen.add(threading.current_thread().name)
        return real(self, *args, **kwargs)

    torch.Tensor.copy_ = spy
    try:
        req = a_returning(cache, kv)
        assert admit(kv, req) == 12
    finally:
        torch.Tensor.copy_ = real
    assert seen == {"kv-offload-copy", "kv-offload-load"}, seen
    kv.free(req)
    kv.tier.close()
