"""The scheduler's roles wired together in one process (no Ray, no channel): the hand-off's request states.

A prefill engine (Role.PREFILL) and a decode engine (Role.DECODE) share a loaded model; the KV is copied
by hand between their caches where a cluster would push it, so these tests pin the states and the block
accounting on both sides: WAITING -> RUNNING -> HELD on the prefill side, WAITING -> WAITING_FOR_KV ->
RUNNING on the decode side.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import EngineCore, LLMEngine
from pdserve.engine.request import FinishReason, RequestStatus, token_stop_reason
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler_types import Role
from pdserve.model.loader import load
from pdserve.serving.messages import DecodeTask, PrefillTask
from pdserve.transfer.channel import extract_blocks, insert_blocks

LENS = [5, 40, 13, 70, 2, 33, 9, 21]


def config(path, blocks=256, budget=32, seqs=16) -> EngineConfig:
    return EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs))


def prompts(n=len(LENS)):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 320, (LENS[i % len(LENS)],), generator=g).tolist() for i in range(n)]


def hand_off(prefill: EngineCore, decode: EngineCore, rid: str, token: int) -> None:
    """What a push does: the HELD request's KV into the reserved blocks, then free it on the prefill side."""
    src = prefill.scheduler.held[rid]
    dst = decode.scheduler.waiting_for_kv[rid]
    src_blocks, dst_blocks = prefill.scheduler.kv_blocks(src), decode.scheduler.kv_blocks(dst)
    assert len(src_blocks) == len(dst_blocks)
    insert_blocks(decode.runner.kv_cache, dst_blocks, extract_blocks(prefill.runner.kv_cache, src_blocks))
    assert prefill.cancel(rid)
    assert decode.scheduler.kv_arrived(rid, [token])


def run_disaggregated(prefill: EngineCore, decode: EngineCore, batch, params, seeds) -> dict[str, list[int]]:
    """Prefill, reserve (in the same breath, as the router places both), push, decode, until all finish."""
    out: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    for i, p in enumerate(batch):
        prefill.scheduler.add(PrefillTask(f"r{i}", tuple(p), params[i], seeds[i], hand_off=True).new_request())
        decode.scheduler.add(DecodeTask(f"r{i}", tuple(p), (), params[i], seeds[i], "p").new_request())
    while prefill.scheduler.has_work or decode.scheduler.has_work or first:
        for s in prefill.step():
            assert s.request.status is RequestStatus.HELD
            out[s.request.request_id] = [s.token]
            first[s.request.request_id] = s.token
        step = decode.scheduler.schedule()
        for rid, token in list(first.items()):
            if rid in decode.scheduler.waiting_for_kv:
                hand_off(prefill, decode, rid, token)
                del first[rid]
        if step.chunks:
            for s in decode.account(step, decode.execute(step)):
                out[s.request.request_id].append(s.token)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return path, load(config(path))


def test_disaggregated_equals_offline_engine(tiny):
    path, loaded = tiny
    batch = prompts()
    params = [SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.8, seed=100 + i, ignore_eos=True)
              for i in range(len(batch))]
    ref = [c.token_ids for c in LLMEngine(config(path), loaded).generate(batch, params)]
    # Budget 16 < the 40- and 70-token prompts: they are ingested in chunks.
    prefill = EngineCore(config(path, budget=16), loaded, Role.PREFILL)
    decode = EngineCore(config(path), loaded, Role.DECODE)
    got = run_disaggregated(prefill, decode, batch, params, [100 + i for i in range(len(batch))])
    assert [got[f"r{i}"] for i in range(len(batch))] == ref
    for core in (prefill, decode):
        assert core.pool.num_used_blocks == 0 and not core.scheduler.requests
        core.pool.check_integrity()


def test_small_decode_cache_reservation_waits_and_all_complete(tiny):
    path, loaded = tiny
    batch = prompts(8)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 8
    ref = [c.token_ids for c in LLMEngine(config(path), loaded).generate(batch, params)]
    decode = EngineCore(config(path, blocks=24), loaded, Role.DECODE)  # room for one or two requests at a time
    prefill = EngineCore(config(path), loaded, Role.PREFILL)
    # Before any step: the first requests fit, the rest wait for room, in order.
    for i, p in enumerate(batch):
        decode.scheduler.add(DecodeTask(f"x{i}", tuple(p), (), params[i], 0, "p").new_request())
    reserved = [r.request_id for r in decode.scheduler.schedule().reserved]
    assert reserved and len(reserved) < 8 and reserved == [f"x{i}" for i in range(len(reserved))]
    assert all(r.status is RequestStatus.WAITING for r in decode.scheduler.waiting)
    for rid in list(decode.scheduler.requests):
        decode.cancel(rid)
    assert decode.pool.num_used_blocks == 0
    got = run_disaggregated(prefill, decode, batch, params, [0] * 8)
    assert [got[f"r{i}"] for i in range(8)] == ref
    assert decode.pool.num_used_blocks == 0 and prefill.pool.num_used_blocks == 0


def test_reservation_leaves_one_block_per_running_request(tiny):
    path, loaded = tiny
    decode = EngineCore(config(path, blocks=12), loaded, Role.DECODE)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    decode.scheduler.add(DecodeTask("a", tuple(range(10)), (), params, 0, "p").new_request())
    assert [r.request_id for r in decode.scheduler.schedule().reserved] == ["a"]  # 3 blocks for 10 + 1 tokens
    decode.scheduler.kv_arrived("a", [7])
    # 9 free; "b" needs 9 (32 + 1 tokens), which would leave none for "a"'s next token: it waits.
    decode.scheduler.add(DecodeTask("b", tuple(range(32)), (), params, 0, "p").new_request())
    step = decode.scheduler.schedule()
    assert step.reserved == [] and [r.request_id for r in step.requests] == ["a"]
    assert decode.scheduler.requests["b"].status is RequestStatus.WAITING
    decode.cancel("a")
    assert [r.request_id for r in decode.scheduler.schedule().reserved] == ["b"]
    decode.cancel("b")
    assert decode.pool.num_used_blocks == 0


def test_prefill_reuses_cached_prefix_and_first_token_matches(tiny):
    path, loaded = tiny
    prefill = EngineCore(config(path), loaded, Role.PREFILL)
    p = prompts()[3]  # 70 tokens
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prefill.scheduler.add(PrefillTask("a", tuple(p), params, 1).new_request())
    (first,) = [s for _ in range(10) for s in prefill.step()]
    assert first.finish_reason is FinishReason.LENGTH and first.request.status is RequestStatus.HELD
    assert prefill.cancel("a")
    prefill.scheduler.add(PrefillTask("b", tuple(p), params, 1).new_request())
    (second,) = [s for _ in range(10) for s in prefill.step()]
    assert second.token == first.token
    assert (first.request.num_cached_tokens, second.request.num_cached_tokens) == (0, 68)  # 17 full blocks
    assert len(prefill.scheduler.kv_blocks(second.request)) == 18
    prefill.cancel("b")
    assert prefill.pool.num_used_blocks == 0


def test_prefill_allocates_whole_prompts_and_held_kv_is_backpressure(tiny):
    path, loaded = tiny
    prefill = EngineCore(config(path, blocks=20, budget=16), loaded, Role.PREFILL)
    ps = prompts()
    for i in (1, 3):  # 40 and 70 tokens: 10 + 18 blocks > 20
        prefill.scheduler.add(PrefillTask(f"r{i}", tuple(ps[i]), SamplingParams(max_tokens=1), 0).new_request())
    done = []
    for _ in range(3):
        done += prefill.step()
    assert [s.request.request_id for s in done] == ["r1"]  # 40 tokens at 16 per step: 3 steps
    assert len(prefill.scheduler.requests["r1"].block_ids) == 10  # the whole prompt, from its first chunk
    for _ in range(5):
        done += prefill.step()
    assert len(done) == 1 and prefill.scheduler.requests["r3"].status is RequestStatus.WAITING  # r1's HELD KV fills the pool
    prefill.cancel("r1")
    for _ in range(5):
        done += prefill.step()
    assert [s.request.request_id for s in done] == ["r1", "r3"]
    prefill.cancel("r3")
    with pytest.raises(ValueError, match="needs more KV blocks"):
        prefill.scheduler.add(PrefillTask("big", tuple(range(90)), SamplingParams(), 0).new_request())
    assert prefill.pool.num_used_blocks == 0


def test_cancel_in_every_state_frees_blocks(tiny):
    path, loaded = tiny
    prefill = EngineCore(config(path), loaded, Role.PREFILL)
    decode = EngineCore(config(path, blocks=30), loaded, Role.DECODE)
    ps = prompts()
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(3):
        prefill.scheduler.add(PrefillTask(f"r{i}", tuple(ps[i]), params, 0).new_request())
        decode.scheduler.add(DecodeTask(f"r{i}", tuple(ps[i]), (), params, 0, "p").new_request())
    sampled = prefill.step()  # r0 (5 tokens) completes; r1 (40) is ingested in chunks of the budget of 32
    states = {rid: r.status for rid, r in prefill.scheduler.requests.items()}
    assert states == {"r0": RequestStatus.HELD, "r1": RequestStatus.RUNNING, "r2": RequestStatus.WAITING}
    assert prefill.cancel("r2")  # waiting
    assert prefill.cancel("r1")  # running
    assert prefill.cancel("r0")  # held
    assert prefill.pool.num_used_blocks == 0
    decode.scheduler.add(DecodeTask("r3", tuple(ps[3]), (), params, 0, "p").new_request())  # 70 tokens: no room yet
    assert {r.request_id for r in decode.scheduler.schedule().reserved} == {"r0", "r1", "r2"}
    assert decode.scheduler.requests["r3"].status is RequestStatus.WAITING
    assert decode.scheduler.kv_arrived("r0", [sampled[0].token])
    decode.step()
    assert decode.cancel("r0")  # running
    assert decode.cancel("r1")  # waiting for KV
    assert decode.scheduler.kv_arrived("r1", [5]) == []  # a late arrival is refused
    assert decode.cancel("r3")  # waiting for room
    assert decode.cancel("r2")
    assert not decode.cancel("unknown") and not prefill.cancel("unknown")
    assert decode.pool.num_used_blocks == 0
    decode.pool.check_integrity()


def test_first_token_that_ends_the_request_ends_it_on_arrival(tiny):
    path, loaded = tiny
    decode = EngineCore(config(path), loaded, Role.DECODE)
    decode.scheduler.add(DecodeTask("a", (1, 2, 3), (), SamplingParams(max_tokens=5, stop_token_ids=(9,)), 0,
                                    "p").new_request())
    decode.scheduler.schedule()
    (s,) = decode.scheduler.kv_arrived("a", [9])
    assert s.finish_reason is FinishReason.STOP and s.request.finished
    assert decode.pool.num_used_blocks == 0 and not decode.scheduler.has_work


def test_roles_refuse_what_they_cannot_do(tiny):
    path, loaded = tiny
    prefill = EngineCore(config(path), loaded, Role.PREFILL)
    with pytest.raises(ValueError, match="only a decode worker"):
        prefill.scheduler.add(DecodeTask("a", (1, 2), (), SamplingParams(), 0, "p").new_request())
    prefill.scheduler.add(PrefillTask("a", (1, 2), SamplingParams(), 0).new_request())
    with pytest.raises(ValueError, match="already in use"):
        prefill.scheduler.add(PrefillTask("a", (1, 2), SamplingParams(), 0).new_request())
    prefill.cancel("a")


def test_first_token_stop_rules():
    from pdserve.engine.request import Request

    r = Request("a", [1, 2], SamplingParams(max_tokens=1), 0)
    r.token_ids.append(5)
    assert token_stop_reason(r, (9,), 100) is FinishReason.LENGTH
    r = Request("a", [1, 2], SamplingParams(max_tokens=5), 0)
    r.token_ids.append(9)
    assert token_stop_reason(r, (9,), 100) is FinishReason.STOP


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=12, temperature=1.0, seed=9, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_resumed_request_continues_exactly(tiny, params):
    """A request re-prefilled with the tokens it already streamed samples exactly the tokens it would have."""
    path, loaded = tiny
    p = prompts()[1]
    ref = LLMEngine(config(path), loaded).generate([p], params)[0].token_ids
    prefill = EngineCore(config(path), loaded, Role.PREFILL)
    decode = EngineCore(config(path), loaded, Role.DECODE)
    streamed = ref[:5]  # what the client got before the decode worker was lost
    prefill.scheduler.add(PrefillTask("r", tuple(p), params, 9, tuple(streamed), hand_off=True).new_request())
    decode.scheduler.add(DecodeTask("r", tuple(p), tuple(streamed), params, 9, "p").new_request())
    (s,) = [x for _ in range(5) for x in prefill.step()]
    assert s.token == ref[5]
    assert [r.request_id for r in decode.scheduler.schedule().reserved] == ["r"]
    hand_off(prefill, decode, "r", s.token)
    rest = []
    while decode.scheduler.has_work:
        rest += [x.token for x in decode.step()]
    assert [*streamed, s.token, *rest] == ref
    assert decode.pool.num_used_blocks == 0 and prefill.pool.num_used_blocks == 0


def test_reservation_headroom_is_a_decode_knob(tiny):
    path, loaded = tiny
    cfg = config(path, blocks=12)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for headroom, reserved in ((0, ["b"]), (1, [])):
        decode = EngineCore(replace(cfg, scheduler=replace(cfg.scheduler, reservation_headroom_blocks=headroom)),
                            loaded, Role.DECODE)
        decode.scheduler.add(DecodeTask("a", tuple(range(10)), (), params, 0, "p").new_request())
        decode.scheduler.schedule()
        decode.scheduler.kv_arrived("a", [7])  # running, 3 blocks; 9 free
        decode.scheduler.add(DecodeTask("b", tuple(range(32)), (), params, 0, "p").new_request())  # needs 9
        assert [r.request_id for r in decode.scheduler.schedule().reserved] == reserved
        for rid in list(decode.scheduler.requests):
            decode.cancel(rid)
        assert decode.pool.num_used_blocks == 0


def test_a_group_is_computed_once_and_forked_on_the_decode_worker(tiny):
    """n = 4 through the prefill and decode roles: the prefill worker samples the 4 first tokens from one
    row of logits (its request HELD once), the KV moves once, and once it lands the decode worker holds the
    prompt's full blocks once (shared by the 4 samples) plus one block of each sample's own (the group's
    partial last block, and each fork's copy of it); every sample equals the offline engine's."""
    path, loaded = tiny
    prompt = prompts()[2]  # 13 tokens: 3 full blocks of 4 and a partial one
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9, n=4, ignore_eos=True)
    want = LLMEngine(config(path), loaded).generate([prompt], params)
    prefill = EngineCore(config(path), loaded, Role.PREFILL)
    decode = EngineCore(config(path), loaded, Role.DECODE)
    prefill.scheduler.add(PrefillTask("g", tuple(prompt), params, 9, hand_off=True).new_request())
    decode.scheduler.add(DecodeTask("g", tuple(prompt), (), params, 9, "p").new_request())
    firsts = prefill.step()
    assert [s.sample_index for s in firsts] == [0, 1, 2, 3] and {s.request.request_id for s in firsts} == {"g"}
    assert list(prefill.scheduler.held) == ["g"] and prefill.prompt_tokens_computed == len(prompt)
    assert decode.scheduler.schedule().reserved
    src, dst = prefill.scheduler.held["g"], decode.scheduler.waiting_for_kv["g"]
    insert_blocks(decode.runner.kv_cache, decode.scheduler.kv_blocks(dst),
                  extract_blocks(prefill.runner.kv_cache, prefill.scheduler.kv_blocks(src)))
    assert prefill.cancel("g") and prefill.pool.num_used_blocks == 0
    landed = decode.scheduler.kv_arrived("g", [s.token for s in firsts])
    assert [s.request.request_id for s in landed] == ["g", "g~1", "g~2", "g~3"]
    full = len(prompt) // 4
    assert decode.pool.num_used_blocks == full + 4
    assert all(decode.pool.ref_count(b) == 4 for b in dst.block_ids[:full])
    out = {s.request.sample_index: [s.token] for s in landed}
    while decode.scheduler.has_work:
        step = decode.scheduler.schedule()
        for s in decode.account(step, decode.execute(step)):
            out[s.request.sample_index].append(s.token)
    assert [out[i] for i in range(4)] == [c.token_ids for c in want]
    assert decode.pool.num_used_blocks == 0 and decode.prompt_tokens_computed == 0
    decode.pool.check_integrity()
