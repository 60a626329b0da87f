"""Speculative decoding in the planner (pdserve.perf.speculation): the expected tokens per verification and its
inverse, a verification step's cost from the cost model (about a plain step at a small batch, more when
compute-bound), the simulator's decode pools and fast lane at the speculating rate, a plan that changes with the
acceptance rate, and the rate read from a speculating cluster's metrics. Pure Python."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.loadgen.stats import Slo
from pdserve.perf.costs import MeasuredCosts, Transport
from pdserve.perf.hardware import gpu, resolve_model, roofline
from pdserve.perf.speculation import (
    SpeculationModel,
    SpeculativeCosts,
    acceptance_from_lengths,
    accepted_per_step,
    measured_speculation,
    tokens_per_step,
    verify_step_time,
)
from pdserve.planner.plan import PoolSettings, Workload, make_plan
from pdserve.planner.simulator import ClusterShape, PoolShape, simulate
from pdserve.tiers import ServiceTier, TiersConfig

LINK = Transport(latency_s=0.001, bytes_per_s=1e15)


def costs() -> MeasuredCosts:
    """Prefill 1 ms a token (no overhead); decode 20 ms at batch 1 to 84 ms at 64, nothing per context token."""
    return MeasuredCosts({"overhead_s": 0.0, "per_token_s": 0.001, "per_pair_s": 0.0, "per_seq_s": 0.0},
                         (1, 64), (0.02, 0.084), 0.0, LINK, kv_bytes_per_token=1000, weight_bytes=10**6)


@pytest.mark.parametrize("a, k, want", [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 3, 1.875), (0.8, 4, 3.3616),
                                        (0.6, 1, 1.6)])
def test_tokens_per_step_is_the_geometric_sum(a, k, want):
    assert tokens_per_step(a, k) == pytest.approx(want)
    # the same, summed over the run lengths: j + 1 tokens with probability a^j (1 - a), k + 1 with a^k
    assert sum((j + 1) * a ** j * (1 - a) for j in range(k)) + (k + 1) * a ** k == pytest.approx(want)


def test_acceptance_from_lengths_inverts_the_mean():
    for a in (0.0, 0.1, 0.45, 0.8, 0.97):
        for k in (1, 3, 4.5, 8):
            assert acceptance_from_lengths(accepted_per_step(a, k), k) == pytest.approx(a, abs=1e-6)
    with pytest.raises(ValueError, match="mean accepted"):
        acceptance_from_lengths(5.0, 4)
    with pytest.raises(ValueError, match="acceptance rate"):
        tokens_per_step(1.2, 4)


def test_verification_costs_a_step_at_small_batch_and_more_when_compute_bound():
    h100 = roofline(resolve_model("llama-3-8b")[1], gpu("H100"), 2)
    for b in (1, 4):
        ratio = verify_step_time(h100, b, b * 2000, 4) / h100.step_time(0, 0, 0, b, b * 2000)
        assert 1.0 <= ratio < 1.05, (b, ratio)
    ratio = verify_step_time(h100, 256, 256 * 200, 4) / h100.step_time(0, 0, 0, 256, 256 * 200)
    assert ratio > 3  # 1280 rows: past the ridge, the rows' compute costs
    # ... unless reading long contexts' KV dominates the step (the drafts read the same KV)
    assert verify_step_time(h100, 256, 256 * 2000, 4) / h100.step_time(0, 0, 0, 256, 256 * 2000) < 1.2
    spec = SpeculationModel(4, 0.8)
    assert spec.speedup(h100, 1, 2000) == pytest.approx(tokens_per_step(0.8, 4), rel=0.05)
    assert spec.speedup(h100, 256, 256 * 200) < 1.0
    # measured costs: the verification is costed as a mixed step, the larger of the decode step and the rows' prefill
    c = costs()
    assert verify_step_time(c, 1, 500, 4) == pytest.approx(0.02)  # 5 rows' prefill (5 ms) < the 20 ms step
    assert verify_step_time(c, 64, 64 * 500, 4) == pytest.approx(64 * 5 * 0.001)  # 320 ms of rows > 84 ms


def test_token_time_speculates_only_where_it_pays_or_within_the_cap():
    c = costs()
    spec = SpeculationModel(4, 0.5)  # 1.9375 tokens a verification
    assert spec.token_time(c, 1, 100) == pytest.approx(0.02 / 1.9375)
    assert spec.token_time(c, 64, 6400) == pytest.approx(0.084)  # verification 320 ms / 1.94 > the plain 84 ms
    capped = SpeculationModel(4, 0.5, max_batch=2)
    assert capped.token_time(c, 2, 200) == pytest.approx(verify_step_time(c, 2, 200, 4) / 1.9375)
    assert capped.token_time(c, 3, 300) == pytest.approx(c.step_time(0, 0, 0, 3, 300))
    wrapped = SpeculativeCosts(c, spec)
    assert wrapped.step_time(100, 5050, 1, 0, 0) == c.step_time(100, 5050, 1, 0, 0)  # prefill: as is
    assert wrapped.step_time(0, 0, 0, 1, 100) == spec.token_time(c, 1, 100)
    assert wrapped.kv_bytes_per_token == c.kv_bytes_per_token and wrapped.transport is c.transport
    with pytest.raises(ValueError, match="speculative tokens"):
        SpeculationModel(0, 0.5)


def pool(workers: int, max_num_seqs: int = 64, speculation: SpeculationModel | None = None) -> PoolShape:
    return PoolShape(workers, 10_000, 16, max_num_seqs, 2048, speculation=speculation)


def test_a_speculating_decode_pool_streams_at_the_expected_rate():
    """One request at a time: TPOT is the verification step over its tokens per step (20 ms / 3.36 at a = 0.8),
    and a prefill pool given speculation ignores it."""
    arrival = np.arange(5) * 10.0
    ins, outs = np.full(5, 100), np.full(5, 201)
    spec = SpeculationModel(4, 0.8)
    plain = simulate(ClusterShape("disaggregated", pool(1), pool(1)), costs(), arrival, ins, outs)
    fast = simulate(ClusterShape("disaggregated", pool(1, speculation=spec), pool(1, speculation=spec)), costs(),
                    arrival, ins, outs)
    assert np.allclose(plain.tpot, 0.02, rtol=1e-3)
    assert np.allclose(fast.tpot, 0.02 / tokens_per_step(0.8, 4), rtol=1e-3)
    assert np.allclose(fast.ttft, plain.ttft)  # the prompt's step is the prefill pool's own
    colocated = simulate(ClusterShape("colocated", colocated=pool(1, speculation=spec)), costs(), arrival, ins, outs)
    assert np.nanmedian(colocated.tpot) < 0.5 * np.nanmedian(
        simulate(ClusterShape("colocated", colocated=pool(1)), costs(), arrival, ins, outs).tpot)


def test_a_speculating_fast_lane_halves_prioritys_tpot():
    """The tiers' simulator: the fast lane speculates where the default pool does not; priority's TPOT falls by
    the speed-up, default's does not move."""
    g = np.random.default_rng(3)
    n = 60
    arrival = np.sort(g.uniform(0, 20, n))
    tier = np.where(g.uniform(size=n) < 0.3, "priority", "default")
    ins, outs = np.full(n, 200), np.full(n, 100)
    spec = SpeculationModel(4, 0.8)
    res = {}
    for name, lane in (("plain", pool(1, 8)), ("spec", pool(1, 8, spec))):
        shape = ClusterShape("disaggregated", pool(1), pool(1), fast=lane)
        res[name] = simulate(shape, costs(), arrival, ins, outs, tier=tier, tiers=TiersConfig())
    prio = tier == "priority"
    for name in res:
        assert (res[name].served_tier[prio] == ServiceTier.PRIORITY.rank).all()
    ratio = np.median(res["spec"].tpot[prio]) / np.median(res["plain"].tpot[prio])
    assert ratio < 0.5
    assert np.median(res["spec"].tpot[~prio]) == pytest.approx(np.median(res["plain"].tpot[~prio]), rel=0.02)


def test_a_plan_changes_with_the_acceptance_rate():
    """A TPOT target the plain decode step (20 ms and up) misses and a speculating one meets: without speculation
    no configuration keeps the SLO, at a = 0.8 one does; the predicted TPOT falls with the rate."""
    n = 200
    g = np.random.default_rng(5)
    w = Workload(np.sort(g.uniform(0, 40, n)), np.full(n, 200), np.full(n, 60), None, {"workload": "test"})
    slo = Slo(ttft_ms=2000, tpot_ms=15)
    plans = {a: make_plan(costs(), w, slo, 3, [16], PoolSettings(
        kv_cache_bytes=1 << 30, speculation=None if a is None else SpeculationModel(4, a))) for a in (None, 0.5, 0.8)}
    assert plans[None]["recommended"]["slo_attainment"] < 0.1 and "no configuration" in plans[None]["recommended"][
        "reason"]
    assert plans[0.8]["recommended"]["slo_attainment"] >= 0.9
    tpot = {a: min(c["median_tpot_ms"] for c in p["candidates"]) for a, p in plans.items()}
    assert tpot[None] > tpot[0.5] > tpot[0.8]
    assert tpot[0.8] == pytest.approx(tpot[None] / tokens_per_step(0.8, 4), rel=0.15)
    s = plans[0.8]["speculation"]
    assert s["tokens_per_step"] == pytest.approx(3.3616) and s["speedup"][1] == pytest.approx(3.3616, rel=1e-3)
    assert "speculation" not in plans[None]
    json.dumps(plans[0.8])


def _metrics_text() -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.serving.messages import WorkerStats
    from router.metrics import WorkerCollector

    # Two workers, 120 verifications of 4 drafts, 180 accepted: 1.5 per verification.
    stats = [WorkerStats("d0", "decode", 0, 0, 1, 1, 10, speculation={
        "drafted": 240, "accepted": 100, "verifications": 60, "acceptance_lengths": {0: 20, 1: 10, 4: 20, 2: 10}}),
        WorkerStats("d1", "decode", 0, 0, 1, 1, 10, speculation={
            "drafted": 240, "accepted": 80, "verifications": 60, "acceptance_lengths": {0: 30, 2: 10, 4: 15, 1: 5}})]
    reg = CollectorRegistry()
    reg.register(WorkerCollector(lambda: stats))
    return generate_latest(reg).decode()


def test_the_rate_is_read_from_a_speculating_clusters_metrics():
    a, k = measured_speculation(_metrics_text())
    assert k == pytest.approx(4.0)
    assert accepted_per_step(a, 4) == pytest.approx(1.5, abs=1e-6)
    with pytest.raises(ValueError, match="no speculative verifications"):
        measured_speculation("# nothing\n")


def test_plan_command_takes_the_rate_or_the_metrics(tmp_path, capsys):
    from pdserve.cli import main

    metrics = tmp_path / "metrics.txt"
    metrics.write_text(_metrics_text())
    base = ["plan", "--gpu", "H100", "--model", "llama-3-8b", "--num-prompts", "100", "--request-rate", "5",
            "--input-len", "1000", "--output-len", "200", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "40",
            "--max-workers", "2"]
    tpot = {}
    for name, extra in (("plain", []), ("given", ["--speculative-acceptance", "0.7"]),
                        ("measured", ["--speculative-metrics", str(metrics)])):
        out = tmp_path / f"{name}.json"
        assert main(base + extra + ["--output", str(out)]) == 0
        plan = json.loads(out.read_text())
        tpot[name] = min(c["median_tpot_ms"] for c in plan["candidates"])
        if name != "plain":
            assert plan["speculation"]["num_speculative_tokens"] == 4
            assert "speculation: k=4" in capsys.readouterr().out
    assert tpot["given"] < tpot["plain"] / 2 and tpot["measured"] < tpot["plain"]


@pytest.mark.parametrize("argv, message", [
    (["--speculative-acceptance", "0.5", "--speculative-metrics", "m.txt"], "not both"),
    (["--speculative-acceptance", "1.5"], "--speculative-acceptance must be in [0, 1]"),
    (["--speculative-tokens", "3"], "go with --speculative-acceptance"),
    (["--speculative-acceptance", "0.5", "--speculative-tokens", "40"], "speculative tokens"),
])
def test_plan_speculation_errors(argv, message, capsys):
    from pdserve.cli import main

    base = ["plan", "--gpu", "H100", "--model", "llama-3-8b", "--max-workers", "1", "--num-prompts", "5",
            "--slo-ttft-ms", "1000"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err
