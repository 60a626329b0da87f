"""Service tiers in one process: the order every stage decides by, flex preemption (kept and recomputed)
with token-exact resumes, and the tier module's parsing. The router's line and the fast lane on a real
Ray cluster are in tests/router/test_tiers_cluster.py; the KV pushes' order in tests/transfer/test_handoff.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import EngineCore, LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler_types import Role
from pdserve.model.loader import load
from pdserve.serving.messages import DecodeTask, PrefillTask
from pdserve.tiers import ServiceTier, TiersConfig, TierSLO, flex_floor, parse_mix, parse_tier
from pdserve.transfer.channel import extract_blocks, insert_blocks

P, D, F = (t.rank for t in (ServiceTier.PRIORITY, ServiceTier.DEFAULT, ServiceTier.FLEX))


def engine_config(path, blocks=256, budget=64, seqs=16, flex_share=0.0) -> EngineConfig:
    return EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                                  flex_min_share=flex_share))


def prompts(n, length=9, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (length + i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load(engine_config(tiny_checkpoints["llama"]))


def test_parse_tier_and_mix():
    assert parse_tier("") is parse_tier("auto") is parse_tier(None) is ServiceTier.DEFAULT
    assert parse_tier("priority") is ServiceTier.PRIORITY and parse_tier("flex") is ServiceTier.FLEX
    with pytest.raises(ValueError, match="unknown service_tier 'scale'"):
        parse_tier("scale")
    assert parse_mix("priority=1,default=2,flex=1") == {ServiceTier.PRIORITY: 0.25, ServiceTier.DEFAULT: 0.5,
                                                          ServiceTier.FLEX: 0.25}
    for bad in ("priority", "priority=x", "priority=-1", "flex=0", "flex=1,flex=2"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    assert [flex_floor(0.1, n) for n in (0, 1, 10, 11, 64)] == [0, 1, 1, 2, 7] and flex_floor(0.0, 64) == 0
    c = TiersConfig(slo={"priority": {"ttft_s": 0.5, "tpot_s": 0.02}})
    assert c.slo_of(ServiceTier.PRIORITY) == TierSLO(0.5, 0.02) and c.slo_of(ServiceTier.FLEX).ttft_s == 120.0
    with pytest.raises(ValueError, match="fast_lane_when_full"):
        TiersConfig(fast_lane_when_full="drop")


def test_cluster_config_fast_lane():
    c = ClusterConfig(fast=PoolConfig(num_workers=2), tiers=TiersConfig(fast_lane_max_running=3, flex_min_share=0.25),
                      decode=PoolConfig(scheduler=SchedulerConfig(max_num_seqs=40, max_num_batched_tokens=512)))
    assert list(c.pools) == ["prefill", "decode", "fast"]
    lane = c.engine_for(c.fast).scheduler
    assert (lane.max_num_seqs, lane.max_num_batched_tokens, lane.flex_min_share) == (3, 512, 0.25)
    assert c.engine_for(c.decode).scheduler.max_num_seqs == 40
    with pytest.raises(ValueError, match="disaggregated"):
        ClusterConfig(mode="colocated", fast=PoolConfig())


def test_prefill_batches_by_tier_then_arrival(loaded, tiny_checkpoints):
    """A prefill worker takes prompts priority first, then default, then flex, each in arrival order."""
    core = EngineCore(engine_config(tiny_checkpoints["llama"], budget=9), loaded, Role.PREFILL)
    tiers = [F, D, P, D, F, P]
    for i, (p, t) in enumerate(zip(prompts(6, length=9), tiers)):
        core.scheduler.add(PrefillTask(f"r{i}", tuple(p), SamplingParams(max_tokens=4), 0, tier=t).new_request())
    order = []
    while core.scheduler.waiting:
        step = core.scheduler.schedule()
        order += [r.request_id for r, c in zip(step.requests, step.chunks) if c.start == 0]
        core.account(step, core.execute(step))
    assert order == ["r2", "r5", "r1", "r3", "r0", "r4"]


def test_decode_reserves_and_admits_by_tier(loaded, tiny_checkpoints):
    """Reservations for incoming KV go by tier too: with room for two, priority and default get it."""
    core = EngineCore(engine_config(tiny_checkpoints["llama"], seqs=2), loaded, Role.DECODE)
    for i, t in enumerate([F, F, D, P]):
        core.scheduler.add(DecodeTask(f"r{i}", tuple(range(1, 9)), (), SamplingParams(), 0, "p", tier=t).new_request())
    step = core.scheduler.schedule()
    assert [r.request_id for r in step.reserved] == ["r3", "r2"]
    assert [r.request_id for r in core.scheduler.waiting] == ["r0", "r1"]


def hand_off(prefill: EngineCore, decode: EngineCore, rid: str, token: int) -> None:
    src, dst = prefill.scheduler.held[rid], decode.scheduler.waiting_for_kv[rid]
    insert_blocks(decode.runner.kv_cache, decode.scheduler.kv_blocks(dst),
                  extract_blocks(prefill.runner.kv_cache, prefill.scheduler.kv_blocks(src)))
    assert prefill.cancel(rid)
    assert decode.scheduler.kv_arrived(rid, [token])


def disaggregated(loaded, path, batches, decode_blocks=256, seqs=2, flex_share=0.0):
    """Prefill and decode engines in one process; `batches` arrive one after the other (each once the
    decode worker has run a few steps): [(rid, prompt, tier, params), ...]. Returns tokens by request,
    the decode engine, and the order in which each request's tokens were produced (rid per token)."""
    prefill = EngineCore(engine_config(path, budget=256), loaded, Role.PREFILL)
    decode = EngineCore(engine_config(path, blocks=decode_blocks, seqs=seqs, flex_share=flex_share), loaded,
                        Role.DECODE)
    out: dict[str, list[int]] = {}
    timeline: list[str] = []
    pending = list(batches)
    steps = 0
    while pending or prefill.scheduler.has_work or decode.scheduler.has_work or prefill.scheduler.held:
        if pending and (steps % 4 == 0):
            for rid, p, tier, params in pending.pop(0):
                prefill.scheduler.add(PrefillTask(rid, tuple(p), params, 7, hand_off=True, tier=tier).new_request())
                decode.scheduler.add(DecodeTask(rid, tuple(p), (), params, 7, "p", tier=tier).new_request())
        for s in prefill.step():
            out[s.request.request_id] = [s.token]
        step = decode.scheduler.schedule()
        for rid in [r.request_id for r in step.reserved]:
            if rid in prefill.scheduler.held:
                hand_off(prefill, decode, rid, out[rid][0])
        for rid in [r for r in list(prefill.scheduler.held) if r in decode.scheduler.waiting_for_kv]:
            hand_off(prefill, decode, rid, out[rid][0])
        if step.chunks:
            for s in decode.account(step, decode.execute(step)):
                out[s.request.request_id].append(s.token)
                timeline.append(s.request.request_id)
        steps += 1
        assert steps < 2000
    return out, decode, timeline


def test_priority_preempts_flex_on_a_full_decode_worker_and_flex_resumes_token_exact(loaded, tiny_checkpoints):
    """Two flex requests fill a decode worker's two slots; a default one arrives: the newer flex request
    leaves the batch keeping its KV, and resumes without recomputing once a slot frees. Every request's
    tokens equal the offline engine's; no block is left used."""
    path = tiny_checkpoints["llama"]
    ps = prompts(3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    short = replace(params, max_tokens=6)
    batches = [[("f0", ps[0], F, params), ("f1", ps[1], F, params)], [("d0", ps[2], D, short)]]
    out, decode, timeline = disaggregated(loaded, path, batches)
    assert decode.scheduler.preemptions == {("flex", "kept"): 1}
    assert decode.pool.num_used_blocks == 0 and not decode.scheduler.requests
    # While the default request ran, f1 made no progress; f0 (the older flex) kept its slot.
    first_d, last_d = timeline.index("d0"), len(timeline) - 1 - timeline[::-1].index("d0")
    assert "f1" not in timeline[first_d:last_d + 1] and "f0" in timeline[first_d:last_d + 1]
    ref = LLMEngine(engine_config(path), loaded).generate(ps, [replace(x, seed=7) for x in (params, params, short)])
    assert [out["f0"], out["f1"], out["d0"]] == [r.token_ids for r in ref]


def test_flex_floor_keeps_flex_running(loaded, tiny_checkpoints):
    """With flex's floor at one slot of two, the one flex request running is not preempted: the default
    request waits for a free slot instead."""
    path = tiny_checkpoints["llama"]
    ps = prompts(3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    batches = [[("f0", ps[0], F, params), ("d1", ps[1], D, params)], [("d0", ps[2], D, params)]]
    out, decode, _ = disaggregated(loaded, path, batches, flex_share=0.5)
    assert not decode.scheduler.preemptions and decode.pool.num_used_blocks == 0
    assert all(len(v) == 8 for v in out.values())


def test_flex_kv_freed_for_a_reservation_then_recomputed_token_exact(loaded, tiny_checkpoints):
    """A decode cache too small for both: the default request's reservation takes flex's blocks (flex is
    preempted and its KV freed), and flex is recomputed afterwards, token-exact."""
    path = tiny_checkpoints["llama"]
    ps = prompts(2, length=20)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    # 20-21 prompt tokens + 10 out = 8 blocks of 4 each; 12 blocks hold one request, not two.
    batches = [[("f0", ps[0], F, params)], [("d0", ps[1], D, params)]]
    out, decode, _ = disaggregated(loaded, path, batches, decode_blocks=12, seqs=4)
    assert decode.scheduler.preemptions[("flex", "recomputed")] >= 1
    assert decode.scheduler.preemptions[("flex", "kept")] == 0
    assert decode.pool.num_used_blocks == 0 and not decode.scheduler.requests
    ref = LLMEngine(engine_config(path), loaded).generate(ps, [replace(params, seed=7)] * 2)
    assert [out["f0"], out["d0"]] == [r.token_ids for r in ref]


def test_memory_preemption_takes_the_lowest_tier_first(loaded, tiny_checkpoints):
    """Out of blocks mid-decode, the victim is the lowest tier's most recent request, not simply the
    most recent one; everything still ends token-exact."""
    path = tiny_checkpoints["llama"]
    core = EngineCore(engine_config(path, blocks=14, budget=64, seqs=4), loaded, Role.COLOCATED)
    ps = prompts(3, length=10)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    tiers = [D, F, D]  # flex in the middle: a victim by recency would be the last default
    for i, (p, t) in enumerate(zip(ps, tiers)):
        req = PrefillTask(f"r{i}", tuple(p), params, 7, tier=t).new_request()
        core.scheduler.add(req)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while core.scheduler.has_work:
        for s in core.step():
            out[s.request.request_id].append(s.token)
    recomputed = {t: n for (t, kind), n in core.scheduler.preemptions.items() if kind == "recomputed"}
    assert set(recomputed) == {"flex"}
    assert core.pool.num_used_blocks == 0
    ref = LLMEngine(engine_config(path), loaded).generate(ps, [replace(params, seed=7)] * 3)
    assert [out[f"r{i}"] for i in range(3)] == [r.token_ids for r in ref]


def test_serve_flags_and_config_keys_of_the_same_names(tmp_path):
    from router.cli import cluster_config_from_args, parse_args

    f = tmp_path / "serve.yaml"
    f.write_text("fast-lane-workers: 1:3\nfast-lane-max-running: 2\nfast-lane-when-full: downgrade\n"
                 "flex-max-queued: 5\nflex-min-share: 0.25\ntier-slo: [priority=500:30]\ngpu: H100\n")
    c = cluster_config_from_args(parse_args(["serve", "--config", str(f), "--fast-lane-max-wait", "2"]))
    assert (c.fast.num_workers, c.fast.max_workers, c.engine_for(c.fast).scheduler.max_num_seqs) == (1, 3, 2)
    t = c.tiers
    assert (t.fast_lane_when_full, t.fast_lane_max_wait_s, t.flex_max_queued, t.flex_min_share) == \
        ("downgrade", 2.0, 5, 0.25)
    assert t.slo["priority"] == TierSLO(0.5, 0.03) and c.ranges == {"fast": (1, 3)}
    assert cluster_config_from_args(parse_args(["serve"])).fast is None
    with pytest.raises(ValueError, match="disaggregated"):
        cluster_config_from_args(parse_args(["serve", "--mode", "colocated", "--fast-lane-workers", "1"]))
    with pytest.raises(ValueError, match="TIER=TTFT_MS:TPOT_MS"):
        cluster_config_from_args(parse_args(["serve", "--tier-slo", "priority=fast"]))
