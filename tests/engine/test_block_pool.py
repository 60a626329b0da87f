"""Block pool: exact block ids, exact eviction order, and a model-checked random workload."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.block_pool import BlockPool, OutOfBlocks, hash_block, hash_prompt_blocks

BLOCK = 4


def _prompt(num_tokens: int, offset: int = 0) -> list[int]:
    return list(range(offset, offset + num_tokens))


# --- allocation and the free queue -----------------------------------------------------------


def test_fresh_pool_allocates_in_id_order() -> None:
    pool = BlockPool(num_blocks=8, block_size=BLOCK)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(0) == []
    assert [pool.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert (pool.num_used_blocks, pool.num_free_blocks, pool.usage) == (5, 3, 5 / 8)
    pool.check_integrity()


def test_out_of_blocks_is_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK)
    pool.allocate(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [3]
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.check_integrity()


def test_freed_blocks_go_to_tail_and_least_recently_freed_is_reused_first() -> None:
    pool = BlockPool(num_blocks=6, block_size=BLOCK)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    pool.free(list(reversed(b)))  # queue: 4 5 3 2
    pool.free(list(reversed(a)))  # queue: 4 5 3 2 1 0
    assert pool.allocate(3) == [4, 5, 3]
    assert pool.allocate(3) == [2, 1, 0]
    pool.check_integrity()


def test_shared_block_is_freed_only_at_ref_zero() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK)
    [block] = pool.allocate(1)
    pool.cache_block(block, hash_block(None, _prompt(BLOCK)))
    assert pool.get_cached_prefix([hash_block(None, _prompt(BLOCK))]) == [block]
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert (pool.ref_count(block), pool.num_free_blocks) == (1, 3)
    pool.free([block])
    assert (pool.ref_count(block), pool.num_free_blocks) == (0, 4)
    pool.check_integrity()


# --- prefix caching ----------------------------------------------------------------------------


def test_prefix_reuse_exact_ids_refs_and_counters() -> None:
    pool = BlockPool(num_blocks=10, block_size=BLOCK)
    prompt = _prompt(3 * BLOCK + 2)  # 3 full blocks and a partial one
    hashes = hash_prompt_blocks(prompt, BLOCK)
    assert len(hashes) == 3

    assert pool.get_cached_prefix(hashes) == []
    table = pool.allocate(4)
    assert table == [0, 1, 2, 3]
    for block_id, block_hash in zip(table, hashes):
        pool.cache_block(block_id, block_hash)
    pool.free(list(reversed(table)))  # queue: 4..9 3 2 1 0
    assert (pool.prefix_hits, pool.prefix_queries) == (0, 3)

    # Same first two blocks, different third one.
    second = hash_prompt_blocks(prompt[: 2 * BLOCK] + _prompt(BLOCK, offset=100), BLOCK)
    assert second[:2] == hashes[:2] and second[2] != hashes[2]
    assert pool.peek_cached_prefix(second) == 2
    assert pool.get_cached_prefix(second) == [0, 1]
    assert (pool.ref_count(0), pool.ref_count(1)) == (1, 1)
    assert (pool.prefix_hits, pool.prefix_queries) == (2, 6)
    assert pool.allocate(1) == [4]  # the new third block comes from the head, not from 2 or 3

    third = pool.get_cached_prefix(hashes)  # concurrent request sharing the whole prompt prefix
    assert third == [0, 1, 2]
    assert [pool.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 0]
    assert (pool.prefix_hits, pool.prefix_queries) == (5, 9)
    assert pool.num_used_blocks == 4  # 0, 1, 2 and 4
    pool.check_integrity()


def test_peek_takes_no_references() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK)
    hashes = hash_prompt_blocks(_prompt(2 * BLOCK), BLOCK)
    table = pool.allocate(2)
    for block_id, block_hash in zip(table, hashes):
        pool.cache_block(block_id, block_hash)
    pool.free(table[::-1])
    assert pool.peek_cached_prefix(hashes) == 2
    miss = hash_block(None, _prompt(BLOCK, offset=50))
    assert pool.peek_cached_prefix([miss, *hashes]) == 0  # the match stops at the first miss
    assert pool.peek_cached_prefix([hashes[0], miss, hashes[1]]) == 1
    assert (pool.num_free_blocks, pool.prefix_queries) == (4, 0)


def test_duplicate_content_is_not_shared() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK)
    h = hash_block(None, _prompt(BLOCK))
    a, b = pool.allocate(2)
    pool.cache_block(a, h)
    pool.cache_block(b, h)  # same content written twice: the first mapping stays
    pool.cache_block(a, h)  # re-registering the same hash is harmless
    assert pool.num_cached_blocks == 1
    pool.free([b, a])
    assert pool.get_cached_prefix([h]) == [a]
    with pytest.raises(ValueError, match="different hash"):
        pool.cache_block(a, hash_block(None, _prompt(BLOCK, offset=1)))
    pool.check_integrity()


def test_eviction_takes_tail_blocks_of_reversed_tables_first() -> None:
    pool = BlockPool(num_blocks=6, block_size=BLOCK)
    prompt_a, prompt_b = _prompt(3 * BLOCK), _prompt(3 * BLOCK, offset=1000)
    ha, hb = hash_prompt_blocks(prompt_a, BLOCK), hash_prompt_blocks(prompt_b, BLOCK)
    a, b = pool.allocate(3), pool.allocate(3)
    assert (a, b) == ([0, 1, 2], [3, 4, 5])
    for table, hashes in ((a, ha), (b, hb)):
        for block_id, block_hash in zip(table, hashes):
            pool.cache_block(block_id, block_hash)
    pool.free(a[::-1])
    pool.free(b[::-1])  # queue: 2 1 0 5 4 3, every block cached

    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 6
    assert pool.allocate(1) == [2]  # a's last block goes first
    assert pool.peek_cached_prefix(ha) == 2
    assert pool.allocate(1) == [1]
    assert pool.peek_cached_prefix(ha) == 1
    assert pool.allocate(2) == [0, 5]
    assert pool.peek_cached_prefix(ha) == 0
    assert pool.peek_cached_prefix(hb) == 2
    assert pool.get_cached_prefix(hb) == [3, 4]  # b's prefix survived; revived from the queue
    assert pool.get_cached_prefix(ha) == []
    assert (pool.num_free_blocks, pool.num_cached_blocks) == (0, 2)
    pool.check_integrity()


def test_prefix_caching_disabled() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK, enable_prefix_caching=False)
    hashes = hash_prompt_blocks(_prompt(2 * BLOCK), BLOCK)
    table = pool.allocate(2)
    for block_id, block_hash in zip(table, hashes):
        pool.cache_block(block_id, block_hash)
    pool.free(table[::-1])
    assert pool.peek_cached_prefix(hashes) == 0
    assert pool.get_cached_prefix(hashes) == []
    assert (pool.num_cached_blocks, pool.prefix_hits, pool.prefix_queries) == (0, 0, 0)
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK)
    h = hash_block(None, _prompt(BLOCK))
    [block] = pool.allocate(1)
    pool.cache_block(block, h)
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 1
    pool.free([block])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_prefix([h]) == []
    pool.check_integrity()


# --- hashing -----------------------------------------------------------------------------------


def test_hash_chain_depends_on_parent_and_content() -> None:
    same = [7] * BLOCK
    first = hash_block(None, same)
    second = hash_block(first, same)
    assert first != second  # identical tokens at another position
    assert hash_block(first, same) == second
    assert hash_block(None, list(same)) == first
    assert hash_block(None, [7, 7, 7, 8]) != first
    assert hash_prompt_blocks(same * 2 + [1, 2], BLOCK) == [first, second]
    assert hash_prompt_blocks(same[:-1], BLOCK) == []


def test_hash_is_stable_across_processes() -> None:
    # Regression guard: routers in other processes must compute the same digests, so the value
    # itself is the contract. The literal was computed once; the spelled-out sha256 documents it.
    tokens = [1, 2, 3, 4]
    digest = hash_block(None, tokens)
    assert digest == hashlib.sha256(bytes(32) + struct.pack("<4q", *tokens)).digest()
    assert digest.hex() == "ffb37f396c221c1e32e2d90de01d531aa5e704f43017ac4142d39b24fe4d6c58"
    assert hash_block(digest, [5, 6, 7, 8]).hex() == (
        "1f49b0459c177f954af6a45eeb802b7e7e9d7ee9c371da27a9d5fc24a29af163"
    )


def test_hash_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        hash_block(None, [])
    with pytest.raises(ValueError):
        hash_block(b"short", [1])
    with pytest.raises(ValueError):
        hash_prompt_blocks([1, 2], 0)


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (-1, 16), (8, 0), (8, -4)])
def test_constructor_rejects_bad_arguments(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match="ref 0"):
        pool.free([a])
    with pytest.raises(ValueError):
        pool.free([b, b])  # ref 1, freed twice in one call: rejected before any change
    assert pool.ref_count(b) == 1
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])
    pool.check_integrity()


def test_boundary_errors() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="is free"):
        pool.cache_block(0, hash_block(None, _prompt(BLOCK)))
    with pytest.raises(ValueError):
        pool.ref_count(-1)


# --- random workloads against a shadow model ---------------------------------------------------

NUM_BLOCKS = 8
# A handful of labels makes cache hits, duplicate content and evictions frequent.
HASHES = [bytes([i]) * 32 for i in range(5)]


class BlockPoolMachine(RuleBasedStateMachine):
    """Requests hold block lists; the model predicts ref counts, free order and the hash map."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK)
        self.requests: list[list[int]] = []
        self.refs = [0] * NUM_BLOCKS
        self.free_order = list(range(NUM_BLOCKS))
        self.cached: dict[bytes, int] = {}
        self.hits = self.queries = 0

    def _hash_of(self, block_id: int) -> bytes | None:
        return next((h for h, b in self.cached.items() if b == block_id), None)

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        if n > len(self.free_order):
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(n)
            return
        blocks = self.pool.allocate(n)
        assert blocks == self.free_order[:n]
        del self.free_order[:n]
        for b in blocks:
            self.refs[b] = 1
            self.cached = {h: c for h, c in self.cached.items() if c != b}
        self.requests.append(blocks)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        blocks = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.pool.free(blocks[::-1])
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_order.append(b)

    @precondition(lambda self: any(self.requests))
    @rule(data=st.data(), h=st.sampled_from(HASHES))
    def cache(self, data: st.DataObject, h: bytes) -> None:
        block = data.draw(st.sampled_from([b for r in self.requests for b in r]))
        current = self._hash_of(block)
        if current is not None and current != h:
            with pytest.raises(ValueError):
                self.pool.cache_block(block, h)
            return
        self.pool.cache_block(block, h)
        if current is None and h not in self.cached:
            self.cached[h] = block

    @rule(chain=st.lists(st.sampled_from(HASHES), max_size=4))
    def get_cached_prefix(self, chain: list[bytes]) -> None:
        expected_len = self.pool.peek_cached_prefix(chain)
        blocks = self.pool.get_cached_prefix(chain)
        expected: list[int] = []
        for h in chain:
            if h not in self.cached:
                break
            expected.append(self.cached[h])
        assert blocks == expected and len(blocks) == expected_len
        self.hits += len(blocks)
        self.queries += len(chain)
        for b in blocks:
            if self.refs[b] == 0:
                self.free_order.remove(b)
            self.refs[b] += 1
        self.requests.append(blocks)

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_integrity()
        assert [self.pool.ref_count(b) for b in range(NUM_BLOCKS)] == self.refs
        assert self.pool.num_free_blocks == len(self.free_order)
        assert self.pool.num_cached_blocks == len(self.cached)
        assert (self.pool.prefix_hits, self.pool.prefix_queries) == (self.hits, self.queries)

    def teardown(self) -> None:
        for blocks in self.requests:
            self.pool.free(blocks[::-1])
        self.pool.check_integrity()
        assert self.pool.num_used_blocks == 0
        assert self.pool.num_free_blocks == NUM_BLOCKS


BlockPoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None
)
test_block_pool_random_workload = BlockPoolMachine.TestCase


def test_events_say_what_the_cache_stored_and_evicted():
    from pdserve.engine.block_pool import KVEvents

    pool = BlockPool(num_blocks=3, block_size=2)
    assert pool.take_events() is None  # not recorded
    pool.record_events()
    h = [bytes([i]) * 32 for i in range(4)]
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], h[0])
    pool.cache_block(blocks[1], h[1])
    assert pool.take_events() == KVEvents(stored=(h[0], h[1]))
    assert pool.take_events() is None  # each change said once
    pool.free(blocks[::-1])  # still cached: freeing evicts nothing
    assert pool.take_events() is None
    pool.allocate(3)  # the free queue's head first: block 2 (never cached), then 1, then 0
    assert pool.take_events() == KVEvents(removed=(h[1], h[0]))
    other = BlockPool(num_blocks=2, block_size=2)
    other.record_events()
    other.cache_block(other.allocate(1)[0], h[2])
    other.free([0])
    assert other.reset_prefix_cache()
    assert other.take_events() == KVEvents(cleared=True)  # what was stored before the reset is gone with it


def test_a_burst_with_one_uncached_prefix_computes_it_once():
    """Prompts sharing a prefix nobody holds, arriving together: the first computes it, the others wait one step
    and take it from the cache (the scheduler holds a prompt whose next block to compute is being computed in
    the same step); a prompt sharing nothing goes in the first step."""
    from pdserve.config import SchedulerConfig
    from pdserve.engine.kv_cache import KVCacheManager
    from pdserve.engine.request import FinishReason, Request
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.scheduler import Scheduler
    from pdserve.engine.scheduler_types import Role

    bs = 4
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8),
                      KVCacheManager(BlockPool(64, bs)), (), 1024, Role.PREFILL)
    shared = list(range(100, 112))  # three blocks
    a, b, c = (Request(rid, shared + tail, SamplingParams(max_tokens=1), 0)
               for rid, tail in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])))
    other = Request("o", list(range(200, 215)), SamplingParams(max_tokens=1), 0)
    for r in (a, b, c):
        sched.add(r)
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == ["a"]  # b and c wait: a computes their prefix
    for r, chunk in zip(step.requests, step.chunks):  # the step ran: a's full blocks are cached
        r.num_computed_tokens += len(chunk.token_ids)
        sched.kv.cache_computed_blocks(r)
        sched.finish(r, FinishReason.LENGTH)  # (its first token sampled and handed off)
    sched.add(other)
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == ["b", "c", "o"]
    assert b.num_cached_tokens == c.num_cached_tokens == len(shared) and other.num_cached_tokens == 0


# --- the cache's memory ------------------------------------------------------------------------

def test_a_cpu_kv_cache_is_zeros_and_its_memory_is_taken_as_it_is_written() -> None:
    """allocate_kv_cache on a CPU: the shape and dtype asked, every value zero, and the process's resident
    memory grows with the pages written, not with the whole cache at allocation."""
    import os

    import torch

    from pdserve.config import ModelConfig
    from pdserve.engine.kv_cache import allocate_kv_cache

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def private_mapping(address: int) -> bool:
        with open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if lo <= address < hi:
                    return perms.endswith("p")
        raise AssertionError(f"{address:#x} is in no mapping")

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("resident memory is read from /proc (Linux)")
    model = ModelConfig("llama", vocab_size=64, hidden_size=256, intermediate_size=128, num_layers=8, num_heads=4,
                        num_kv_heads=2, head_dim=64, max_position_embeddings=1024)
    for dtype in (torch.float32, torch.bfloat16):
        before = resident()
        kv = allocate_kv_cache(model, num_blocks=4096, block_size=16, dtype=dtype, device="cpu")  # 256 or 128 MiB
        assert kv.shape == (8, 2, 2, 4096, 16, 64) and kv.dtype == dtype and kv.is_contiguous()
        assert resident() - before < 16 << 20
        assert private_mapping(kv.data_ptr())  # a forked child's writes would stay its own
        kv[:, :, :, :64].fill_(1.5)  # 64 blocks of each layer and head: 1/64th of the cache
        assert resident() - before < (kv.nbytes >> 4)
        assert float(kv[:, :, :, :64].sum()) == 1.5 * kv[:, :, :, :64].numel()
        assert not kv[:, :, :, 64:].any()  # never written: zeros
        kv.fill_(0.5)
        assert resident() - before >= kv.nbytes * 9 // 10
        del kv
