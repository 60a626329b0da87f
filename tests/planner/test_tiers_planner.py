"""Service tiers in the planner: each tier's price and the fast lane's size (pdserve.planner.pricing,
`pdserve plan --tier-mix`), and the simulator serving tiers (pdserve.planner.simulator). Pure Python,
exact numbers from hand-made cost models."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.perf.costs import MeasuredCosts, Transport
from pdserve.planner.autoscale import PoolLimits
from pdserve.planner.pricing import format_prices, tier_prices
from pdserve.planner.simulator import ClusterShape, PoolShape, simulate
from pdserve.tiers import ServiceTier, TiersConfig, TierSLO

LINK = Transport(latency_s=0.001, bytes_per_s=1e15)
P, D, F = ServiceTier.PRIORITY, ServiceTier.DEFAULT, ServiceTier.FLEX


def costs() -> MeasuredCosts:
    """Prefill 1 ms a token; decode 10 ms at batch 1, +1 ms per request more, nothing per context token."""
    return MeasuredCosts({"overhead_s": 0.0, "per_token_s": 0.001, "per_pair_s": 0.0, "per_seq_s": 0.0},
                         (1, 64), (0.01, 0.073), 0.0, LINK, kv_bytes_per_token=1000, weight_bytes=10**6)


LIMITS = PoolLimits(kv_blocks=10_000, block_size=16, max_num_seqs=64, token_budget=2048)
SLOS = {P: TierSLO(1.0, 0.0155), D: TierSLO(4.0, 0.150), F: TierSLO(120.0, 1.0)}
MIX = {P: 0.1, D: 0.6, F: 0.3}


# -- prices -----------------------------------------------------------------------------------------

def test_the_price_of_speed_is_the_step_over_the_batch():
    prices = tier_prices(costs(), LIMITS, 100, 50, SLOS, MIX, rate=100.0)
    t = prices["tiers"]
    # Priority's 15.5 ms allows batch 6 (15 ms): 2.5 ms a token. Default's 150 ms: the cap, 64 (73 ms).
    assert (t["priority"]["batch"], t["default"]["batch"], t["flex"]["batch"]) == (6, 64, 64)
    assert t["priority"]["device_s_per_token"] == pytest.approx(0.015 / 6)
    assert t["default"]["device_s_per_token"] == pytest.approx(0.073 / 64)
    assert t["priority"]["relative_to_default"] == pytest.approx((0.015 / 6) / (0.073 / 64))  # 2.19x
    assert t["flex"]["relative_to_default"] == pytest.approx(1.0)
    assert t["flex"]["marginal_device_s_per_token"] == pytest.approx(0.001)  # step(64) - step(63)
    lane = prices["fast_lane"]
    # 10 req/s of priority x 49 steps x 15 ms = 7.35 decoding at once, over 90 % of 6: 2 workers.
    assert (lane["max_running"], lane["workers"]) == (6, 2)
    assert lane["price_multiplier"] == pytest.approx(2.1918, abs=1e-4)
    text = format_prices(prices)
    assert "2.19x" in text and "max running 6" in text and "2 worker(s)" in text


def test_an_unreachable_priority_target_is_flagged():
    prices = tier_prices(costs(), LIMITS, 100, 50, {**SLOS, P: TierSLO(1.0, 0.005)}, MIX)
    assert prices["tiers"]["priority"]["batch"] == 1 and not prices["tiers"]["priority"]["tpot_met"]
    assert prices["fast_lane"]["workers"] is None
    assert "10.0 ms!" in format_prices(prices)


def test_plan_command_prints_and_writes_tier_prices(tmp_path, capsys):
    from pdserve.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", "--gpu", "H100", "--model", "llama-3-8b", "--num-prompts", "50", "--request-rate", "10",
               "--input-len", "1024", "--output-len", "256", "--max-workers", "1", "--max-num-seqs", "256",
               "--tier-mix", "priority=0.1,default=0.6,flex=0.3", "--tier-slo", "priority=1000:10",
               "--output", str(out)])
    assert rc == 0
    plan = json.loads(out.read_text())
    assert plan["slo"]["ttft_ms"] == 4000 and plan["slo"]["tpot_ms"] == 150  # default's, with no --slo-*
    tiers = plan["tiers"]
    assert tiers["tiers"]["priority"]["tpot_target_ms"] == 10 and tiers["tiers"]["flex"]["tpot_target_ms"] == 1000
    assert 1 < tiers["fast_lane"]["max_running"] < tiers["tiers"]["default"]["batch"] <= 256
    assert tiers["fast_lane"]["price_multiplier"] > 1
    assert "fast lane: max running" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--tier-slo", "priority=1000:50"], "--tier-slo goes with --tier-mix"),
    (["--tier-mix", "priority=0.1,default=0.9", "--tier-slo", "priority=1000"], "TIER=TTFT_MS:TPOT_MS"),
    (["--tier-mix", "priority=0.1,default=0.9", "--tier-slo", "gold=1:1"], "unknown service_tier"),
    (["--tier-mix", "priority"], "TIER=SHARE"),
])
def test_plan_tier_errors(argv, message, capsys):
    from pdserve.cli import main

    base = ["plan", "--gpu", "H100", "--model", "llama-3-8b", "--max-workers", "1", "--num-prompts", "5"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


# -- the simulator with tiers ------------------------------------------------------------------------

def pool(workers: int, max_num_seqs: int = 64, kv_blocks: int = 10_000) -> PoolShape:
    return PoolShape(workers, kv_blocks, 16, max_num_seqs, 2048)


def test_all_default_tiers_change_nothing():
    g = np.random.default_rng(1)
    n = 300
    arrival = np.sort(g.uniform(0, 10, n))
    ins, outs = g.integers(10, 400, n), g.integers(1, 80, n)
    shape = ClusterShape("disaggregated", pool(2), pool(2, max_num_seqs=8, kv_blocks=300))
    plain = simulate(shape, costs(), arrival, ins, outs)
    tiered = simulate(shape, costs(), arrival, ins, outs, tier=np.full(n, "default"))
    for name in ("first_token", "second_token", "end", "rejected"):
        assert np.array_equal(getattr(plain, name), getattr(tiered, name), equal_nan=True)
    assert plain.tier_stats()["default"]["slo_attainment"] == tiered.tier_stats()["default"]["slo_attainment"]


def test_the_routers_line_serves_priority_first():
    # One prefill worker, 1000-token prompts (1 s each), a budget of one prompt a step and room for two
    # in its queue: the rest wait at the router, where the priority request, last to arrive, goes first.
    arrival = np.zeros(5)
    shape = ClusterShape("disaggregated", PoolShape(1, 10_000, 16, 64, 1000), pool(1))
    res = simulate(shape, costs(), arrival, np.full(5, 1000), np.full(5, 2), tier=[D, D, D, F, P])
    order = np.argsort(res.first_token, kind="stable")
    assert list(order) == [0, 1, 4, 2, 3]  # two already at the worker, then priority, default, flex


def test_flex_under_its_floor_keeps_its_place_in_line():
    arrival = np.zeros(5)
    shape = ClusterShape("disaggregated", PoolShape(1, 10_000, 16, 64, 1000), pool(1, max_num_seqs=10))
    # Floor: 50 % of 10 slots = 5 > flex in flight: the flex request, earlier, is at default's rank.
    res = simulate(shape, costs(), arrival, np.full(5, 1000), np.full(5, 2), tier=[D, D, F, D, D],
                   tiers=TiersConfig(flex_min_share=0.5))
    assert list(np.argsort(res.first_token, kind="stable")) == [0, 1, 2, 3, 4]


def test_default_preempts_flex_above_its_floor_which_resumes_with_its_kv():
    # 4 flex requests fill a decode worker of 4 slots (floor: 25 % = 1); a default request comes later.
    arrival = np.array([0, 0, 0, 0, 1.0])
    outs = np.array([200, 200, 200, 200, 20])
    shape = ClusterShape("disaggregated", pool(1), pool(1, max_num_seqs=4))
    res = simulate(shape, costs(), arrival, np.full(5, 10), outs, tier=[F, F, F, F, D],
                   tiers=TiersConfig(flex_min_share=0.25))
    assert res.ok.all()
    assert list(res.preemptions) == [0, 0, 0, 1, 0] and not res.recomputes.any()  # the latest flex, its KV kept
    assert res.end[4] < res.end[3]  # default ran in its place
    stats = res.tier_stats()
    assert stats["flex"]["preemptions"] == 1 and stats["default"]["preemptions"] == 0
    # Without tiers the default request waits for a slot: all four 200-token requests end first.
    plain = simulate(shape, costs(), arrival, np.full(5, 10), outs)
    assert plain.end[4] > plain.end[:4].max()


def test_flex_at_its_floor_is_not_preempted():
    arrival = np.array([0, 1.0])
    shape = ClusterShape("disaggregated", pool(1), pool(1, max_num_seqs=1))
    res = simulate(shape, costs(), arrival, np.full(2, 10), np.array([200, 20]), tier=[F, D],
                   tiers=TiersConfig(flex_min_share=0.5))  # floor: 1 slot of 1
    assert not res.preemptions.any() and res.end[1] > res.end[0]


def test_preempted_flex_recomputes_when_kv_is_short():
    # KV for two requests' contexts only: the default one needs the flex one's blocks.
    arrival = np.array([0, 0, 1.0])
    shape = ClusterShape("disaggregated", pool(1), pool(1, max_num_seqs=4, kv_blocks=40))
    res = simulate(shape, costs(), arrival, np.full(3, 200), np.array([200, 200, 20]), tier=[F, F, D],
                   tiers=TiersConfig(flex_min_share=0.25))
    assert res.ok.all()
    assert list(res.preemptions) == [0, 1, 0] and list(res.recomputes) == [0, 1, 0]
    assert res.end[2] < res.end[1]


def test_the_fast_lane_serves_priority_within_its_cap_then_downgrades():
    arrival = np.zeros(3)
    shape = ClusterShape("disaggregated", pool(1), pool(1), fast=pool(1, max_num_seqs=1))
    for when_full, served in (("downgrade", [0, 1, 1]), ("wait", [0, 0, 0])):
        res = simulate(shape, costs(), arrival, np.full(3, 10), np.full(3, 20), tier=[P, P, P],
                       tiers=TiersConfig(fast_lane_when_full=when_full, fast_lane_max_wait_s=10.0))
        assert list(res.served_tier) == served and res.busy_s["fast-0"] > 0
        assert res.tier_stats()["priority"]["served_lower"] == served.count(1)
    # "wait" with a short bound: the 2nd and 3rd wait 0.1 s (the 1st takes 0.2 s), then go to the decode pool.
    res = simulate(shape, costs(), arrival, np.full(3, 10), np.full(3, 20), tier=[P, P, P],
                   tiers=TiersConfig(fast_lane_max_wait_s=0.1))
    assert list(res.served_tier) == [0, 1, 1] and res.first_token[1] > 0.1


def test_flex_is_refused_when_its_queue_is_full():
    arrival = np.zeros(6)
    shape = ClusterShape("disaggregated", PoolShape(1, 10_000, 16, 64, 1000), pool(1))
    res = simulate(shape, costs(), arrival, np.full(6, 1000), np.full(6, 2), tier=[F] * 5 + [D],
                   tiers=TiersConfig(flex_max_queued=1))
    # Two go to the prefill worker's queue, one waits in line, the next two are refused; default is not.
    assert list(res.rejected) == [False, False, False, True, True, False]
    assert res.tier_stats()["flex"]["rejected"] == 2
