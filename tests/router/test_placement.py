from __future__ import annotations

from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.block_pool import KVEvents
from router.kv_index import KVIndex
from router.placement import DecodeLoad, PrefillLoad, pick_decode, pick_prefill


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


def test_decode_by_cached_prefix_against_load():
    # Worker 1 holds 512 tokens of the prompt; at 256 tokens a running request it is worth two more of them.
    loads = [DecodeLoad(1, 900, 1000), DecodeLoad(2, 900, 1000, cached_tokens=512)]
    assert pick_decode(loads, load_tokens=256) == 1  # 512 - 2 * 256 = 0 < 1 * 256
    assert pick_decode([DecodeLoad(1, 900, 1000), DecodeLoad(4, 900, 1000, cached_tokens=512)], 256) == 0
    assert pick_decode(loads, load_tokens=0) == 0  # by load alone
    # Nothing cached anywhere: fewest active, then most free blocks, as by load alone.
    assert pick_decode([DecodeLoad(2, 10, 1000), DecodeLoad(2, 500, 1000), DecodeLoad(3, 999, 1000)], 256) == 1


def test_kv_index_follows_the_events_in_order_and_forgets_a_worker():
    a = hash_prompt_blocks(list(range(64)), 16)  # 4 blocks
    b = hash_prompt_blocks(list(range(100, 132)), 16)  # 2 blocks
    idx = KVIndex()
    idx.apply("d0", KVEvents(stored=tuple(a)))
    assert idx.match("d0", a) == 4 and idx.match("d0", a[:2]) == 2 and idx.match("d0", b) == 0
    assert idx.match("d0", hash_prompt_blocks(list(range(32)) + [999] * 32, 16)) == 2  # diverges in block 3
    assert idx.match("d1", a) == 0  # another worker holds nothing
    idx.apply("d0", KVEvents(stored=tuple(b), removed=(a[1],)))  # an evicted block breaks the chain there
    assert idx.match("d0", a) == 1 and idx.match("d0", b) == 2
    idx.apply("d0", KVEvents(stored=(b[0],), cleared=True))  # the cache was reset, then one block stored
    assert idx.match("d0", a) == 0 and idx.match("d0", b) == 1 and idx.blocks("d0") == 1
    idx.forget("d0")
    assert idx.match("d0", b) == 0 and idx.blocks("d0") == 0


def test_kv_events_merge_in_order():
    x, y = b"x" * 32, b"y" * 32
    first = KVEvents(stored=(x,), removed=(y,))
    assert first.merged(KVEvents(stored=(y,), removed=(x,))) == KVEvents(stored=(y,), removed=(x,))
    later = KVEvents(stored=(y,), cleared=True)
    assert first.merged(later) == later  # a reset forgets what came before it


def test_a_session_stays_on_its_decode_worker_while_it_has_room():
    """Dispatch's choice among decode workers with room: the worker of the session's last turn first, however
    the load compares; a request without a session key by the index and the load."""
    import asyncio
    from types import SimpleNamespace

    from pdserve.config import ClusterConfig
    from pdserve.tiers import ServiceTier
    from router.dispatch import Dispatch
    from router.line import Entry
    from router.workers import Worker

    async def run() -> None:
        pools = SimpleNamespace(by_name={"prefill": [], "decode": []}, kv_index=KVIndex(), listeners=[])
        dispatch = Dispatch(ClusterConfig(), pools, block_size=16)
        busy, idle = Worker("d-busy", None, "decode", 0), Worker("d-idle", None, "decode", 1)
        busy.requests.update({"x", "y"})
        prompt = list(range(40))
        plain = Entry("a#0", 40, "decode", (), prompt, ServiceTier.DEFAULT)
        assert [busy, idle][dispatch._pick_decode(plain, [busy, idle])] is idle  # by load
        first = Entry("b#0", 40, "decode", (), prompt, ServiceTier.DEFAULT, session="chat-1")
        dispatch.line.add(first)
        dispatch._set(first, None, busy)  # the session's last turn ran on the busy one
        later = Entry("b#1", 40, "decode", (), prompt, ServiceTier.DEFAULT, session="chat-1")
        assert [busy, idle][dispatch._pick_decode(later, [busy, idle])] is busy
        assert [idle][dispatch._pick_decode(later, [idle])] is idle  # no room there (not offered): elsewhere
    asyncio.run(run())


def test_prefix_routing_modes_read_their_own_signal():
    """ClusterConfig.prefix_routing, through Dispatch.dispatch: the router placed the first 64 tokens of a prompt
    on p0 and d0 earlier (the estimate's record); the KV events say p1 and d1 hold all 96 (the exact index).
    exact follows the index, estimate the record, random neither (and never a local prefill)."""
    import asyncio
    from types import SimpleNamespace

    from pdserve.config import ClusterConfig
    from pdserve.tiers import ServiceTier
    from router.dispatch import Dispatch
    from router.line import Entry
    from router.workers import Worker

    prompt = list(range(1000, 1096))  # 6 blocks of 16

    async def place(dispatch: Dispatch, tokens: list[int], local: bool, avoid: tuple[str, ...] = ()):
        e = Entry(f"r{len(dispatch._counted)}", len(tokens), "decode", avoid, tokens, ServiceTier.DEFAULT,
                  local_ok=local)
        dispatch.line.add(e)
        dispatch.dispatch()
        p, d = e.placed.result()
        dispatch.unplace(e, p, d)  # the room back: every placement below sees idle workers
        return (p.worker_id if p else None), d.worker_id

    async def run(mode: str) -> list[tuple[str | None, str]]:
        p0, p1 = Worker("p0", None, "prefill", 0), Worker("p1", None, "prefill", 1)
        d0, d1 = Worker("d0", None, "decode", 0), Worker("d1", None, "decode", 1)
        pools = SimpleNamespace(by_name={"prefill": [p0, p1], "decode": [d0, d1]}, kv_index=KVIndex(), listeners=[])
        dispatch = Dispatch(ClusterConfig(prefix_routing=mode), pools, block_size=16)
        assert await place(dispatch, prompt[:64], False, avoid=("p1", "d1")) == ("p0", "d0")
        for w in ("p1", "d1"):
            pools.kv_index.apply(w, KVEvents(stored=tuple(hash_prompt_blocks(prompt, 16))))
        return [await place(dispatch, prompt, False), await place(dispatch, prompt, True)] + \
            [await place(dispatch, prompt, i % 2 == 1) for i in range(40)]

    exact, estimate, rand = (asyncio.run(run(m)) for m in ("exact", "estimate", "random"))
    # Every other placement may be local. The index: both hold all 96; d1 lacks none (local).
    assert exact[0::2] == [("p1", "d1")] * 21 and exact[1::2] == [(None, "d1")] * 21
    # The record: 64 of the 96 placed on p0 and d0; d0 lacks 32 (local).
    assert estimate[0::2] == [("p0", "d0")] * 21 and estimate[1::2] == [(None, "d0")] * 21
    assert all(p is not None for p, _ in rand)  # no signal: never local
    assert {p for p, _ in rand} == {"p0", "p1"} and {d for _, d in rand} == {"d0", "d1"}
    try:
        ClusterConfig(prefix_routing="approximate")
    except ValueError as e:
        assert "prefix_routing" in str(e)
    else:
        raise AssertionError("an unknown prefix_routing was accepted")
