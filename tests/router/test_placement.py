from __future__ import annotations

from pdserve.engine.block_pool import hash_prompt_blocks
from router.placement import DecodeLoad, PrefillLoad, PrefixIndex, pick_decode, pick_prefill


def test_prefill_least_queued_tokens_first_on_ties():
    assert pick_prefill([PrefillLoad(500), PrefillLoad(100), PrefillLoad(300)]) == 1
    assert pick_prefill([PrefillLoad(0), PrefillLoad(0)]) == 0


def test_prefill_prefix_affinity_outweighs_a_shorter_queue_only_by_the_saved_work():
    # Worker 0 holds 256 tokens of this prompt's prefix: 300 - 256 = 44 effective < 100.
    assert pick_prefill([PrefillLoad(300, 256), PrefillLoad(100, 0)]) == 0
    # A long queue beats the cache: 1000 - 256 > 100.
    assert pick_prefill([PrefillLoad(1000, 256), PrefillLoad(100, 0)]) == 1


def test_decode_fewest_active_then_most_free_blocks():
    assert pick_decode([DecodeLoad(3, 900, 1000), DecodeLoad(2, 10, 1000)]) == 1
    assert pick_decode([DecodeLoad(2, 10, 1000), DecodeLoad(2, 500, 1000), DecodeLoad(2, 400, 1000)]) == 1


def test_prefix_index_matches_leading_blocks_and_evicts_lru():
    a = hash_prompt_blocks(list(range(64)), 16)  # 4 blocks
    b = hash_prompt_blocks(list(range(100, 132)), 16)  # 2 blocks
    idx = PrefixIndex(capacity_blocks=5)
    idx.add(a)
    assert idx.match(a) == 4 and idx.match(a[:2]) == 2 and idx.match(b) == 0
    assert idx.match(hash_prompt_blocks(list(range(32)) + [999] * 32, 16)) == 2  # diverges in block 3
    idx.add(b)  # 6 > 5: the least recently used (a's first block) goes
    assert len(idx) == 5
    assert idx.match(a) == 0 and idx.match(b) == 2
