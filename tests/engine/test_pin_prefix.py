"""A partial hand-off's decode side: the prefix its cache holds pinned at reservation (KVCacheManager.pin_prefix), all
or nothing and at the weight version the router matched it at, and the scheduler reserving only the rest."""
from __future__ import annotations

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool, hash_prompt_blocks
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_types import Role

BS = 4
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def cached(pool: BlockPool, tokens: list[int], version: int = 0) -> list[int]:
    """Blocks holding the full blocks of `tokens` in the prefix cache, at `version`, unreferenced (a finished turn's)."""
    hashes = hash_prompt_blocks(tokens, BS, version)
    blocks = pool.allocate(len(hashes))
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h)
    pool.free(blocks[::-1])
    return blocks


def remote(rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, PARAMS, 0)
    req.remote_kv = True
    return req


def test_the_prefix_is_pinned_whole_and_only_the_rest_is_reserved():
    pool = BlockPool(16, BS)
    kv = KVCacheManager(pool)
    turn = list(range(100, 112))
    prefix = cached(pool, turn)  # 3 blocks
    req = remote("a", turn + list(range(7)))  # 19 tokens: 3 blocks held, 2 to receive (with the next token's)
    assert kv.pin_prefix(req, 3, 0)
    assert (req.block_ids, req.held_blocks, req.num_registered_blocks) == (prefix, 3, 3)
    assert [pool.ref_count(b) for b in prefix] == [1, 1, 1]
    assert pool.prefix_hits == 3
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, (), 1000, Role.DECODE)
    s.add(req)
    step = s.schedule()
    assert step.reserved == [req] and req.status is RequestStatus.WAITING_FOR_KV
    assert req.block_ids[:3] == prefix and len(req.block_ids) == 5
    assert len(s.kv_blocks(req)[req.held_blocks:]) == 2  # what the prefill worker sends
    s.finish(req, None)
    assert pool.num_used_blocks == 0 and pool.peek_cached_prefix(hash_prompt_blocks(turn, BS)) == 3
    pool.check_integrity()


def test_a_prefix_not_all_there_or_of_another_version_pins_nothing():
    pool = BlockPool(16, BS)
    kv = KVCacheManager(pool)
    turn = list(range(100, 112))
    cached(pool, turn[:8])  # 2 of the 3 blocks
    cached(pool, turn, version=1)  # all 3, of weight version 1
    for k, version in ((3, 0), (4, 1), (3, 2)):
        req = remote("a", turn + [1, 2, 3])
        assert not kv.pin_prefix(req, k, version), (k, version)
        assert req.block_ids == [] and req.held_blocks == 0
        assert pool.num_used_blocks == 0
    req = remote("b", turn + [1, 2, 3])
    assert kv.pin_prefix(req, 3, 1) and req.kv_version == 1
    pool.check_integrity()


def test_the_last_token_is_always_received():
    pool = BlockPool(16, BS)
    kv = KVCacheManager(pool)
    turn = list(range(100, 112))
    cached(pool, turn)
    assert not kv.pin_prefix(remote("a", turn), 3, 0)  # all 12 tokens: the prefill worker's last is sent
    assert kv.pin_prefix(remote("b", turn), 0, 0)  # nothing held: a full hand-off
    assert pool.num_used_blocks == 0


def test_a_pinned_prefix_counts_as_room():
    """A request whose whole KV needs more blocks than are free is reserved when the free ones hold the rest."""
    pool = BlockPool(6, BS)
    kv = KVCacheManager(pool)
    turn = list(range(100, 112))
    cached(pool, turn)  # 3 blocks, free but cached
    req = remote("a", turn + [1, 2, 3, 4, 5])  # 17 tokens and the next: 5 blocks, 3 of them held
    assert kv.pin_prefix(req, 3, 0)
    assert pool.num_free_blocks == 3
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, reservation_headroom_blocks=1), kv, (), 1000,
                  Role.DECODE)
    s.add(req)
    assert s.schedule().reserved == [req]
    assert pool.num_free_blocks == 1


def test_a_pinned_prefix_behind_the_head_gives_way_to_it():
    """A partial hand-off pins its prefix when it arrives, before its turn to reserve: pins of requests behind the
    queue's head must not keep the head from its room, or nothing would ever free it (the head waits for room the
    pins hold, the pinned requests wait behind the head). The last such request gives its prefix back: it ends here
    (`Scheduler.unpinned`: its worker fails it as PREFIX_MISSED, and the router tries it again as a full
    hand-off), and the head is reserved at once."""
    pool = BlockPool(16, BS)
    kv = KVCacheManager(pool)
    turns = [list(range(100, 112)), list(range(200, 212))]
    for t in turns:
        cached(pool, t)  # 3 blocks each
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, reservation_headroom_blocks=1), kv, (), 1000,
                  Role.DECODE)
    head = remote("head", list(range(40)))  # 40 tokens and the next: 11 of the 16 blocks
    s.add(head)
    pinned = []
    for i, t in enumerate(turns):
        req = remote(f"turn-{i}", t + [1, 2])
        assert kv.pin_prefix(req, 3, 0)
        s.add(req)
        pinned.append(req)
    assert pool.num_free_blocks == 10  # 16 less the two pinned prefixes: too few for the head
    assert s.has_work  # a step would reserve: the pins give way
    step = s.schedule()
    # Only the last pinned request gave its prefix back (one was enough), and has ended here; the other, still
    # pinned, fits beside the head and is reserved in its turn.
    assert step.reserved == [head, pinned[0]] and head.status is RequestStatus.WAITING_FOR_KV
    assert s.unpinned == [pinned[1]]
    assert pinned[1].status is RequestStatus.FINISHED and "turn-1" not in s.requests
    assert pinned[0].status is RequestStatus.WAITING_FOR_KV and pinned[0].held_blocks == 3
    assert pool.num_free_blocks == 16 - 11 - 4
    pool.check_integrity()


def test_a_pinned_prefix_is_not_given_to_its_own_request_or_one_behind_it():
    """The head's own pin counts as its room (it is never given back for itself), and a request behind a pinned one
    waits in line rather than take the pin from a request ahead of it."""
    pool = BlockPool(8, BS)
    kv = KVCacheManager(pool)
    turn = list(range(100, 112))
    cached(pool, turn)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, reservation_headroom_blocks=0), kv, (), 1000, Role.DECODE)
    head = remote("head", turn + list(range(9)))  # 21 tokens and the next: 6 blocks, 3 of them pinned
    assert kv.pin_prefix(head, 3, 0)
    s.add(head)
    behind = remote("behind", list(range(20)))  # 6 blocks: not there while the head holds its 6
    s.add(behind)
    assert s.schedule().reserved == [head]
    assert not s.schedule().reserved and s.unpinned == []
    assert not s.has_work
    pool.check_integrity()
