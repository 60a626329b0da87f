"""The decode worker actor (decode_worker.actor) on a real local Ray cluster, driven by hand the way the
router drives it: reservations, a prefill worker lost, cancels; its step outputs read on a real
link (pdserve.serving.link).

The prefill side is a recording actor, not a prefill worker: what is checked is the notice the decode
worker sends it (kv_ready) when it has reserved room, which is all a prefill worker would act on.
"""
from __future__ import annotations

import asyncio

import pytest
import ray

from decode_worker.actor import DecodeActor
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.sampling import SamplingParams
from pdserve.serving.link import LinkServer
from pdserve.serving.messages import DecodeTask, FailureReason, StepOutput

from conftest import wait_for

BLOCK = 4


@ray.remote(num_cpus=0)
class NoticeLog:
    """Stands in for a prefill worker: records the decode worker's kv_ready notices."""

    def __init__(self):
        self.notices: list[tuple[str, ...]] = []

    def kv_ready(self, decode_id, handle, host, port, request_ids, tp=1) -> None:
        self.notices.append(tuple(request_ids))

    def seen(self) -> list[tuple[str, ...]]:
        return self.notices


@pytest.fixture
def decode(ray_local, aloop, tiny_checkpoints):
    """A decode worker with 8 KV blocks of 4 tokens, its outputs collected here, and the router's end of its link."""
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=BLOCK, num_blocks=8),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    handle = ray.remote(DecodeActor).options(num_cpus=0).remote("decode-t", config, 10.0, torch_threads=1,
                                                                bind_host="127.0.0.1")
    server = LinkServer("127.0.0.1")
    outputs: list[StepOutput] = []

    async def connect():
        await server.start()
        link = server.expect("decode-t", outputs.append)
        await handle.link_to.remote(server.host, server.port, server.token)
        await link.wait_open(30)
        return link

    ray.get(handle.ready.remote(), timeout=120)
    link = aloop.run(connect())  # the router's end of its link
    yield handle, outputs, link
    ray.get(handle.shutdown.remote(), timeout=30)
    ray.kill(handle)
    aloop.run(server.close())


def task(rid: str, prompt_len: int, prefill_id: str) -> DecodeTask:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return DecodeTask(rid, tuple(range(1, prompt_len + 1)), (), params, 0, prefill_id)


def test_a_lost_prefill_workers_reservations_fail_and_the_others_notices_go_out(decode):
    """Reservations for a prefill worker that was lost while they waited for room are failed (PREFILL_LOST)
    when room comes, and the notice to another prefill worker reserved in the same step still goes out
    (the decode worker holds a prefill worker's handle only until it hears the worker is lost)."""
    handle, outputs, _ = decode
    lost, alive = NoticeLog.remote(), NoticeLog.remote()

    def stats():
        return ray.get(handle.stats.remote(), timeout=30)

    # "hold" takes 6 of the 8 blocks (its KV never comes): a and b (3 blocks each) wait for room.
    ray.get(handle.reserve.remote(task("hold", 20, "p-alive"), alive), timeout=30)
    wait_for(lambda: ray.get(alive.seen.remote()) == [("hold",)], 30, what="the notice for 'hold'")
    ray.get(handle.reserve.remote(task("a", 8, "p-lost"), lost), timeout=30)
    ray.get(handle.reserve.remote(task("b", 8, "p-alive")), timeout=30)  # its handle was given with "hold"'s
    wait_for(lambda: stats().waiting == 3, 30, what="a and b to wait for room")
    assert stats().kv_blocks_used == 6

    ray.get(handle.peer_lost.remote("p-lost"), timeout=30)
    assert ray.get(handle.cancel.remote("hold"), timeout=30)  # room for both, in the same step

    wait_for(lambda: ("b",) in ray.get(alive.seen.remote()), 30, what="the notice for 'b' to the live prefill worker")
    failed = wait_for(lambda: [f for o in outputs for f in o.failed], 30, what="a's failure")
    assert [(f.request_id, f.reason) for f in failed] == [("a", FailureReason.PREFILL_LOST)]
    assert ray.get(lost.seen.remote()) == []
    s = stats()
    assert (s.waiting, s.kv_blocks_used) == (1, 3)  # b's reservation alone
    assert ray.get(handle.cancel.remote("b"), timeout=30)
    assert stats().kv_blocks_used == 0


def test_reservations_and_cancels_on_the_link(decode, aloop):
    """The router's calls on the decode worker's link, as router.cluster makes them: a reservation (the
    prefill worker's handle pickled with the first one only) is answered once queued and announced to
    that prefill worker; one that cannot fit is refused as the caller's error (ValueError); a cancel
    sent right behind a reservation on the same link frees it (calls run in the order sent)."""
    handle, _, link = decode
    notices = NoticeLog.remote()

    def call(*args):
        async def go():
            return await asyncio.wait_for(link.call(*args), 30)
        return aloop.run(go())

    assert call("reserve", task("a", 8, "p-0"), notices) is None
    wait_for(lambda: ray.get(notices.seen.remote()) == [("a",)], 30, what="the notice for 'a'")
    with pytest.raises(ValueError, match="needs more KV blocks than this decode worker has"):
        call("reserve", task("huge", 40, "p-0"))

    async def reserve_then_cancel():
        answered = link.call("reserve", task("b", 8, "p-0"))
        link.send("cancel", "b")
        await asyncio.wait_for(answered, 30)

    aloop.run(reserve_then_cancel())
    wait_for(lambda: ray.get(handle.recent_cancels.remote()) and
             ray.get(handle.recent_cancels.remote())[-1].request_id == "b", 30, what="b's cancel")
    link.send("cancel", "a")
    wait_for(lambda: ray.get(handle.stats.remote()).kv_blocks_used == 0, 30, what="every block freed")
    assert ray.get(notices.seen.remote())[0] == ("a",)


def test_two_routers_links_route_outputs_and_a_dead_routers_requests_are_cancelled(ray_local, aloop,
                                                                                    tiny_checkpoints):
    """Router replicas: a decode worker linked to routers "a" and "b" sends each request's outputs on the
    link of the router whose name begins its id, and when b's link ends (b died) cancels b's requests
    only, freeing their KV."""
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=BLOCK, num_blocks=8),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    handle = ray.remote(DecodeActor).options(num_cpus=0).remote("decode-r", config, 10.0, torch_threads=1,
                                                                bind_host="127.0.0.1")
    servers = {r: LinkServer("127.0.0.1") for r in "ab"}
    outputs: dict[str, list[StepOutput]] = {r: [] for r in "ab"}
    notices = NoticeLog.remote()

    async def connect(r):
        await servers[r].start()
        link = servers[r].expect("decode-r", outputs[r].append)
        await handle.link_to.remote(servers[r].host, servers[r].port, servers[r].token, r)
        await link.wait_open(30)
        return link

    ray.get(handle.ready.remote(), timeout=120)
    links = {r: aloop.run(connect(r)) for r in "ab"}

    def call(r, *args):
        async def go():
            return await asyncio.wait_for(links[r].call(*args), 30)
        return aloop.run(go())

    try:
        call("a", "reserve", task("a/r1#0", 8, "p-0"), notices)
        call("b", "reserve", task("b/r2#0", 8, "p-0"))
        call("b", "reserve", task("b/r2#0", 8, "p-0"))  # the same id again: refused on the step thread
        failed = wait_for(lambda: [f for o in outputs["b"] for f in o.failed], 30, what="b's duplicate refused")
        assert [(f.request_id, f.reason) for f in failed] == [("b/r2#0", FailureReason.REJECTED)]
        assert [f for o in outputs["a"] for f in o.failed] == []  # nothing of b's on a's link
        wait_for(lambda: ray.get(handle.stats.remote()).kv_blocks_used == 6, 30, what="both reservations")

        aloop.run(servers["b"].close())  # router b dies: its link ends
        wait_for(lambda: ray.get(handle.stats.remote()).kv_blocks_used == 3, 30, what="b's reservation freed")
        assert [c.request_id for c in ray.get(handle.recent_cancels.remote())] == ["b/r2#0"]
        call("a", "reserve", task("a/r3#0", 4, "p-0"))  # a's link still works
        wait_for(lambda: ray.get(handle.stats.remote()).kv_blocks_used == 5, 30, what="a's second reservation")
    finally:
        ray.get(handle.shutdown.remote(), timeout=30)
        ray.kill(handle)
        aloop.run(servers["a"].close())
