"""The decode worker actor (decode_worker.actor) on a real local Ray cluster, driven by hand the way the
router drives it: reservations, a prefill worker lost, cancels, each a call on its real link
(pdserve.serving.link, through pdserve.serving.calls: tests/linked.py), its step outputs read there.

The prefill side is a recording actor, not a prefill worker: what is checked is the notice the decode
worker sends it (kv_ready) when it has reserved room, which is all a prefill worker would act on. The
weight-version test pairs it with a real prefill worker (prefill_worker.actor), the KV pushed between them.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import ray
import torch

from decode_worker.actor import DecodeActor
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.request import NO_TOKEN, FinishReason
from pdserve.engine.sampling import SamplingParams
from pdserve.serving.messages import DecodeTask, FailureReason, PrefillTask
from prefill_worker.actor import PrefillActor

from conftest import wait_for
from linked import RouterEnd

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
    """A decode worker with 8 KV blocks of 4 tokens, linked to the router's end here (its calls, its outputs)."""
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=BLOCK, num_blocks=8),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    handle = ray.remote(DecodeActor).options(num_cpus=0).remote("decode-t", config, 10.0, torch_threads=1,
                                                                bind_host="127.0.0.1")
    ray.get(handle.ready.remote(), timeout=120)
    router = RouterEnd(aloop)
    yield handle, router.link(handle, "decode-t")
    ray.get(handle.shutdown.remote(), timeout=30)
    ray.kill(handle)
    router.close()


def task(rid: str, prompt_len: int, prefill_id: str) -> DecodeTask:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return DecodeTask(rid, tuple(range(1, prompt_len + 1)), (), params, 0, prefill_id)


def test_a_lost_prefill_workers_reservations_fail_and_the_others_notices_go_out(decode):
    """Reservations for a prefill worker that was lost while they waited for room are failed (PREFILL_LOST)
    when room comes, and the notice to another prefill worker reserved in the same step still goes out
    (the decode worker holds a prefill worker's handle only until it hears the worker is lost)."""
    handle, linked = decode
    outputs = linked.outputs
    lost, alive = NoticeLog.remote(), NoticeLog.remote()

    def stats():
        return ray.get(handle.stats.remote(), timeout=30)

    # "hold" takes 6 of the 8 blocks (its KV never comes): a and b (3 blocks each) wait for room.
    linked.call(lambda w: w.reserve(task("hold", 20, "p-alive"), alive))
    wait_for(lambda: ray.get(alive.seen.remote()) == [("hold",)], 30, what="the notice for 'hold'")
    linked.call(lambda w: w.reserve(task("a", 8, "p-lost"), lost))
    linked.call(lambda w: w.reserve(task("b", 8, "p-alive")))  # its handle was given with "hold"'s
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


def test_reservations_and_cancels_on_the_link(decode):
    """The router's calls on the decode worker's link, as router.cluster makes them: a reservation (the
    prefill worker's handle pickled with the first one only) is answered once queued and announced to
    that prefill worker; one that cannot fit is refused as the caller's error (ValueError); a cancel
    sent right behind a reservation on the same link frees it (calls run in the order sent)."""
    handle, linked = decode
    notices = NoticeLog.remote()

    assert linked.call(lambda w: w.reserve(task("a", 8, "p-0"), notices)) is None
    wait_for(lambda: ray.get(notices.seen.remote()) == [("a",)], 30, what="the notice for 'a'")
    with pytest.raises(ValueError, match="needs more KV blocks than this decode worker has"):
        linked.call(lambda w: w.reserve(task("huge", 40, "p-0")))

    async def reserve_then_cancel(w):
        answered = w.reserve(task("b", 8, "p-0"))
        w.cancel("b")
        await answered

    linked.call(reserve_then_cancel)
    wait_for(lambda: ray.get(handle.recent_cancels.remote()) and
             ray.get(handle.recent_cancels.remote())[-1].request_id == "b", 30, what="b's cancel")
    # The heartbeat's stats, asked on the link (router.pools): the step thread's count, as Ray's call gives it.
    assert linked.call(lambda w: w.stats()).kv_blocks_used > 0
    linked.call(lambda w: w.cancel("a"))
    wait_for(lambda: linked.call(lambda w: w.stats()).kv_blocks_used == 0, 30, what="every block freed")
    assert ray.get(handle.stats.remote()).kv_blocks_used == 0
    assert linked.call(lambda w: w.stats()).worker_id == "decode-t"
    assert ray.get(notices.seen.remote())[0] == ("a",)


def test_a_partial_reservation_pins_the_prefix_it_holds_or_fails_as_prefix_missed(decode):
    """A partial hand-off's reservation takes the prefix from the worker's own cache and reserves only the rest;
    one whose prefix is not all there, or was matched at another weight version, fails as PREFIX_MISSED (the
    router tries it again whole), holding nothing."""
    handle, linked = decode
    notices = NoticeLog.remote()

    def stats():
        return ray.get(handle.stats.remote(), timeout=30)

    turn = tuple(range(1, 13))  # computed here (a local prefill): its 3 full blocks stay in the prefix cache
    linked.call(lambda w: w.reserve(DecodeTask("turn", turn, (), SamplingParams(max_tokens=2, temperature=0.0,
                                                                                ignore_eos=True), 0, "", local=True)))
    wait_for(lambda: any(e.request_id == "turn" and e.finish_reason for o in linked.outputs for e in o.events), 60,
             what="the first turn to end")
    wait_for(lambda: stats().kv_blocks_used == 0, 30, what="its blocks freed (and cached)")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    longer = turn + (20, 21, 22, 23, 24, 25)  # 18 tokens: 5 blocks with the next token's

    def partial(rid: str, held: int, version: int = 0) -> DecodeTask:
        return DecodeTask(rid, longer, (), params, 0, "p-0", held_blocks=held, held_version=version)

    linked.call(lambda w: w.reserve(partial("other-version", 3, 1), notices))
    linked.call(lambda w: w.reserve(partial("too-many", 4)))
    failed = wait_for(lambda: len(f := [f for o in linked.outputs for f in o.failed]) == 2 and f, 30,
                      what="both refused")
    assert {(f.request_id, f.reason) for f in failed} == {("other-version", FailureReason.PREFIX_MISSED),
                                                          ("too-many", FailureReason.PREFIX_MISSED)}
    assert stats().kv_blocks_used == 0
    hits = stats().prefix_hit_blocks
    linked.call(lambda w: w.reserve(partial("a", 3)))
    wait_for(lambda: ray.get(notices.seen.remote()) == [("a",)], 30, what="the notice for 'a'")
    s = stats()
    assert (s.kv_blocks_used, s.prefix_hit_blocks) == (5, hits + 3)  # its 3 blocks from the cache, 2 new
    linked.call(lambda w: w.cancel("a"))
    wait_for(lambda: stats().kv_blocks_used == 0, 30, what="every block freed")


def test_two_routers_links_route_outputs_and_a_dead_routers_requests_are_cancelled(ray_local, aloop,
                                                                                    tiny_checkpoints):
    """Router replicas: a decode worker linked to routers "a" and "b" sends each request's outputs on the
    link of the router whose name begins its id, and when b's link ends (b died) cancels b's requests
    only, freeing their KV."""
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=BLOCK, num_blocks=8),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    handle = ray.remote(DecodeActor).options(num_cpus=0).remote("decode-r", config, 10.0, torch_threads=1,
                                                                bind_host="127.0.0.1")
    notices = NoticeLog.remote()
    ray.get(handle.ready.remote(), timeout=120)
    routers = {r: RouterEnd(aloop, r) for r in "ab"}
    links = {r: routers[r].link(handle, "decode-r") for r in "ab"}

    try:
        links["a"].call(lambda w: w.reserve(task("a/r1#0", 8, "p-0"), notices))
        links["b"].call(lambda w: w.reserve(task("b/r2#0", 8, "p-0")))
        links["b"].call(lambda w: w.reserve(task("b/r2#0", 8, "p-0")))  # the same id again: refused on the step thread
        failed = wait_for(lambda: [f for o in links["b"].outputs for f in o.failed], 30, what="b's duplicate refused")
        assert [(f.request_id, f.reason) for f in failed] == [("b/r2#0", FailureReason.REJECTED)]
        assert [f for o in links["a"].outputs for f in o.failed] == []  # nothing of b's on a's link
        wait_for(lambda: ray.get(handle.stats.remote()).kv_blocks_used == 6, 30, what="both reservations")

        routers["b"].close()  # router b dies: its link ends
        wait_for(lambda: ray.get(handle.stats.remote()).kv_blocks_used == 3, 30, what="b's reservation freed")
        assert [c.request_id for c in ray.get(handle.recent_cancels.remote())] == ["b/r2#0"]
        links["a"].call(lambda w: w.reserve(task("a/r3#0", 4, "p-0")))  # a's link still works
        wait_for(lambda: ray.get(handle.stats.remote()).kv_blocks_used == 5, 30, what="a's second reservation")
    finally:
        ray.get(handle.shutdown.remote(), timeout=30)
        ray.kill(handle)
        routers["a"].close()


@pytest.fixture(scope="module")
def newer_weights(tiny_checkpoints, tmp_path_factory) -> Path:
    """Weight version 1 of the tiny Llama, as a partial update: layer 0's input norm (so the KV changes) and
    the final norm."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("newer")
    shutil.copy(tiny_checkpoints["llama"] / "config.json", d)
    save_file({"model.layers.0.input_layernorm.weight": torch.linspace(2.0, 0.2, 64),
               "model.norm.weight": torch.linspace(0.2, 2.0, 64)}, str(d / "model.safetensors"))
    return d


def test_kv_of_another_weight_version_follows_each_requests_version_policy(ray_local, aloop, tiny_checkpoints,
                                                                          newer_weights):
    """A prefill worker computes prompts at weight version 0 and HOLDS their KV (no reservation yet), updates
    to version 1, computes one more; a decode worker at version 1 then reserves them all, and the pushes of
    held KV may mix versions. Each request lands with its own version: the version-1 one runs as is (its
    policy, abort, would show otherwise); each version-0 one follows its policy as it lands: "keep" decodes
    over the old KV (as the offline engine does when the update comes right after the first token),
    "recompute" (a group of 2 as well: each forked sample) computes prompt + first token again with version
    1 (as an engine of version 1 given that prefix), "abort" publishes an ABORT end (no token) after its
    first token. Every block is freed at the end."""
    model = str(tiny_checkpoints["llama"])
    config = EngineConfig(model=model, cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64), weights_root=str(newer_weights))
    prefill = ray.remote(PrefillActor).options(num_cpus=0).remote("prefill-v", config, 10.0, torch_threads=1)
    decode = ray.remote(DecodeActor).options(num_cpus=0).remote("decode-v", config, 10.0, torch_threads=1,
                                                                bind_host="127.0.0.1")
    router = None

    g = torch.Generator().manual_seed(7)
    names = ["keep", "recompute", "abort", "group", "fresh"]
    prompts = {rid: tuple(torch.randint(0, 320, (9 + i,), generator=g).tolist()) for i, rid in enumerate(names)}
    params = {rid: SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2 if rid == "group" else 1,
                                  version_policy={"fresh": "abort", "group": "recompute"}.get(rid, rid))
              for rid in names}

    def prefilled(rid):
        return to_prefill.call(lambda w: w.prefill(PrefillTask(rid, prompts[rid], params[rid], 0, hand_off=True)), 60)

    try:
        ray.get([prefill.ready.remote(), decode.ready.remote()], timeout=120)
        router = RouterEnd(aloop)
        to_prefill, to_decode = router.link(prefill, "prefill-v"), router.link(decode, "decode-v")
        ray.get(decode.update_weights.remote(str(newer_weights), 1), timeout=60)
        firsts = {rid: prefilled(rid) for rid in names[:4]}  # version 0, held
        ray.get(prefill.update_weights.remote(str(newer_weights), 1), timeout=60)
        firsts["fresh"] = prefilled("fresh")  # version 1, held
        assert ray.get(prefill.stats.remote(), timeout=30).version_outcomes == {}  # held KV waits for its decode worker
        for i, rid in enumerate(names):
            to_decode.call(lambda w: w.reserve(DecodeTask(rid, prompts[rid], (), params[rid], 0, "prefill-v"),
                                               prefill if i == 0 else None))

        def events():
            got: dict[str, list] = {}
            for o in to_decode.outputs:
                for e in o.events:
                    got.setdefault(e.request_id, []).append(e)
            return got

        def ended():
            got = events()
            return all(got.get(r) and got[r][-1].finish_reason is not None
                       for r in ["keep", "recompute", "abort", "group", "group~1", "fresh"]) and got

        got = wait_for(ended, 60, what="every request to end")
        assert ray.get(decode.stats.remote(), timeout=30).version_outcomes == {"kept": 1, "recomputed": 3,
                                                                                "aborted": 1}
        wait_for(lambda: ray.get(decode.stats.remote(), timeout=30).kv_blocks_used == 0, 30, what="every block freed")
        assert ray.get(prefill.stats.remote(), timeout=30).kv_blocks_used == 0

        def engine(version: int) -> LLMEngine:
            eng = LLMEngine(EngineConfig(model=model, cache=CacheConfig(block_size=BLOCK, num_blocks=64)))
            if version:
                eng.update_weights(str(newer_weights), version)
            return eng

        def greedy(n: int, **kw) -> SamplingParams:
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)

        def tokens(rid):
            assert all(e.version == 1 for e in got[rid])  # sampled here, by version 1
            return [e.token for e in got[rid]]

        v0, v1 = engine(0), engine(1)
        for rid in names[:4]:  # their first token came from version 0
            assert firsts[rid].first_token == v0.generate([list(prompts[rid])], greedy(1))[0].token_ids[0]
        # keep: the offline engine at version 0, updated to version 1 right after the first token
        offline = engine(0)
        offline.add_request(list(prompts["keep"]), greedy(8, version_policy="keep"), "keep")
        offline.step()
        offline.update_weights(str(newer_weights), 1)
        kept = [t for out in offline.stream() for t in out.new_token_ids]
        assert tokens("keep") == kept
        again = v1.generate([[*prompts["recompute"], firsts["recompute"].first_token]], greedy(7))[0].token_ids
        assert tokens("recompute") == again != kept  # (the old KV makes a difference, or this shows nothing)
        group_first = firsts["group"].first_token
        assert [f.token for f in firsts["group"].others] == [group_first]  # greedy: both samples alike
        again = v1.generate([[*prompts["group"], group_first]], greedy(7))[0].token_ids
        assert tokens("group") == tokens("group~1") == again
        assert [(e.token, e.finish_reason) for e in got["abort"]] == [(NO_TOKEN, FinishReason.ABORT)]
        fresh = v1.generate([list(prompts["fresh"])], greedy(8))[0].token_ids
        assert [firsts["fresh"].first_token, *tokens("fresh")] == fresh  # its KV was version 1: no policy
    finally:
        for h in (prefill, decode):
            ray.get(h.shutdown.remote(), timeout=30)
            ray.kill(h)
        if router is not None:
            router.close()


def test_a_partial_hand_off_whose_rest_comes_of_another_weight_version_fails_as_prefix_missed(
        ray_local, aloop, tiny_checkpoints, newer_weights):
    """The decode worker (version 0) holds a prefix at version 0 and pins it; the prefill worker, updated to version
    1, computes the prompt and pushes the rest; the request's policy would keep KV of another version, but the two
    versions' KV are never joined in one request (abort or recompute discard it instead). The request fails as
    PREFIX_MISSED when the KV lands (the router tries it again whole), and every block is freed. The same prompt
    pushed whole (the retry) lands and decodes."""
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64), weights_root=str(newer_weights))
    prefill = ray.remote(PrefillActor).options(num_cpus=0).remote("prefill-m", config, 10.0, torch_threads=1)
    decode = ray.remote(DecodeActor).options(num_cpus=0).remote("decode-m", config, 10.0, torch_threads=1,
                                                                bind_host="127.0.0.1")
    router = None
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, version_policy="keep")
    turn = tuple(range(1, 13))
    longer = turn + (20, 21, 22, 23, 24, 25)
    try:
        ray.get([prefill.ready.remote(), decode.ready.remote()], timeout=120)
        router = RouterEnd(aloop)
        to_prefill, to_decode = router.link(prefill, "prefill-m"), router.link(decode, "decode-m")
        to_decode.call(lambda w: w.reserve(DecodeTask("turn", turn, (), greedy, 0, "", local=True)))
        wait_for(lambda: any(e.request_id == "turn" and e.finish_reason for o in to_decode.outputs for e in o.events),
                 60, what="the first turn to end here")
        ray.get(prefill.update_weights.remote(str(newer_weights), 1), timeout=60)

        def handed_off(rid: str, held: int, first: bool = False) -> None:
            to_decode.call(lambda w: w.reserve(DecodeTask(rid, longer, (), greedy, 0, "prefill-m", held_blocks=held),
                                               prefill if first else None))
            to_prefill.call(lambda w: w.prefill(PrefillTask(rid, longer, greedy, 0, hand_off=True, skip_blocks=held)),
                            60)

        handed_off("partial", 3, first=True)
        failed = wait_for(lambda: [f for o in to_decode.outputs for f in o.failed], 60, what="the landing refused")
        assert [(f.request_id, f.reason) for f in failed] == [("partial", FailureReason.PREFIX_MISSED)]
        handed_off("whole", 0)
        wait_for(lambda: any(e.request_id == "whole" and e.finish_reason for o in to_decode.outputs for e in o.events),
                 60, what="the whole hand-off to decode")
        wait_for(lambda: ray.get(decode.stats.remote(), timeout=30).kv_blocks_used == 0, 30, what="every block freed")
        wait_for(lambda: ray.get(prefill.stats.remote(), timeout=30).kv_blocks_used == 0, 30, what="P's freed")
    finally:
        for h in (prefill, decode):
            ray.get(h.shutdown.remote(), timeout=30)
            ray.kill(h)
        if router is not None:
            router.close()
