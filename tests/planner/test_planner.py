"""The planner: cost models, the roofline's physics, the cluster simulator, the plan and its commands.

The simulator's expectations are worked out by hand from step costs chosen to make them easy (a
prefill token costs 1 ms, a decode step 10 ms); the profile test measures the real engine.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

import numpy as np
import pytest

from pdserve.loadgen.stats import Slo
from pdserve.config import ModelConfig
from pdserve.perf.costs import MeasuredCosts, RooflineCosts, Transport, attention_pairs, fit_measured
from pdserve.perf.hardware import (
    DECODE_MBU,
    GPUS,
    PREFILL_MFU,
    STEP_OVERHEAD_S,
    gpu,
    kv_budget_bytes,
    resolve_model,
    roofline,
)
from pdserve.engine.utilization import step_bytes, step_flops, weight_bytes
from pdserve.planner.plan import PoolSettings, candidates, format_plan, make_plan, recommend, report, workload_from_args
from pdserve.planner.simulator import ClusterShape, PoolShape, simulate

FAST_LINK = Transport(latency_s=0.002, bytes_per_s=1e15)


def costs(per_token=0.001, per_pair=0.0, per_seq=0.0, decode=(0.01,), batches=(1,), per_ctx=0.0,
          transport=FAST_LINK) -> MeasuredCosts:
    return MeasuredCosts({"overhead_s": 0.0, "per_token_s": per_token, "per_pair_s": per_pair, "per_seq_s": per_seq},
                         tuple(batches), tuple(decode), per_ctx, transport, kv_bytes_per_token=1000,
                         weight_bytes=10**6)


def pool(workers=1, kv_blocks=10_000, budget=2048, max_num_seqs=64) -> PoolShape:
    return PoolShape(workers, kv_blocks, 16, max_num_seqs, budget)


def disagg(p=1, d=1, **kw) -> ClusterShape:
    return ClusterShape("disaggregated", prefill=kw.pop("prefill", pool(p)), decode=kw.pop("decode", pool(d)), **kw)


def run(shape, c, arrivals, ins, outs, concurrency=None):
    return simulate(shape, c, np.array(arrivals, dtype=float), np.array(ins), np.array(outs), concurrency)


# -- cost models ------------------------------------------------------------------------------------

def test_fit_recovers_the_model_that_made_the_measurements():
    true = costs(per_token=0.003, per_pair=2e-6, per_seq=0.007, decode=(0.02, 0.02, 0.07, 0.13),
                 batches=(1, 4, 16, 32), per_ctx=2e-6)
    true = MeasuredCosts({**true.prefill, "overhead_s": 0.0015}, true.decode_batches, true.decode_batch_s,
                         true.per_context_token_s, true.transport, 1000, 10**6)
    prefill = [{"tokens": n, "pairs": attention_pairs(s, n), "seqs": q,
                "seconds": true.prefill_time(n, attention_pairs(s, n), q)}
               for n, s, q in ((16, 0, 1), (256, 0, 1), (512, 512, 0), (2048, 0, 1), (512, 0, 4))]
    decode = [{"seqs": b, "context": b * c, "seconds": true.step_time(0, 0, 0, b, b * c)}
              for b in (1, 4, 16, 32) for c in (64, 512)]
    fitted, err = fit_measured(prefill, decode, FAST_LINK, 1000, 10**6)
    assert err["prefill_max_rel_error"] < 1e-9 and err["decode_max_rel_error"] < 1e-9
    for k, v in true.prefill.items():
        assert fitted.prefill[k] == pytest.approx(v, rel=1e-6)
    assert fitted.decode_batch_s == pytest.approx(true.decode_batch_s)
    assert MeasuredCosts.from_dict(json.loads(json.dumps(fitted.to_dict()))) == fitted


def test_decode_step_is_piecewise_linear_in_the_batch_and_never_cheaper_for_more():
    c = costs(decode=(0.02, 0.02, 0.08), batches=(1, 4, 16))
    assert c.batch_time(1) == c.batch_time(3) == 0.02
    assert c.batch_time(10) == pytest.approx(0.05)
    assert c.batch_time(32) == pytest.approx(0.16)  # the last slope, extended
    assert c.step_time(0, 0, 0, 0, 0) == 0.0
    times = [c.batch_time(b) for b in range(1, 100)]
    assert times == sorted(times)


def test_a_mixed_step_costs_at_least_either_part():
    c = costs(per_token=0.003, decode=(0.02, 0.07), batches=(1, 16), per_ctx=1e-6)
    mixed = c.step_time(512, attention_pairs(0, 512), 1, 8, 8 * 300)
    assert mixed >= c.step_time(512, attention_pairs(0, 512), 1, 0, 0)
    assert mixed >= c.step_time(0, 0, 0, 8, 8 * 300)


def test_costs_reject_negative_or_unordered_terms():
    with pytest.raises(ValueError):
        costs(per_token=-1.0)
    with pytest.raises(ValueError):
        costs(decode=(0.1, 0.2), batches=(4, 1))
    with pytest.raises(ValueError):
        Transport(0.0, 0.0)


def test_exposed_hand_off_is_the_last_part_unless_the_link_is_slower_than_the_prefill():
    link = Transport(latency_s=0.001, bytes_per_s=1e9, part_bytes=1 << 20)
    # 10 MB over a 1 GB/s link (10 ms) fed by a 100 ms prefill: only the last part is left.
    assert link.exposed_time(10**7, 0.1) == pytest.approx(0.001 + (1 << 20) / 1e9)
    # 1 GB (1 s) fed by the same prefill: the link is the bottleneck.
    assert link.exposed_time(10**9, 0.1) == pytest.approx(0.001 + 1.0 - 0.1)
    assert link.send_time(10**9) == pytest.approx(1.001)


# -- the roofline never beats physics (Llama-3-8B on an H100) ---------------------------------------

@pytest.fixture(scope="module")
def llama8b() -> ModelConfig:
    name, cfg = resolve_model("Llama-3-8B")
    assert name == "llama3-8b" and cfg.num_layers == 32 and cfg.num_kv_heads == 8
    return cfg


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
@pytest.mark.parametrize("context", [128, 2048, 8192])
def test_decode_step_at_least_weights_and_kv_over_bandwidth(llama8b, batch, context):
    h100 = gpu("h100")
    r = roofline(llama8b, h100)
    # The floor, counted independently: pdserve.engine.utilization's bytes of a decode step (every weight once,
    # each sequence's whole context of K and V) over the datasheet bandwidth.
    floor = step_bytes(llama8b, [(context - 1, 1)] * batch, 2) / h100.bytes_per_s
    t = r.step_time(0, 0, 0, batch, batch * context)
    assert t >= floor
    compute = step_flops(llama8b, [(context - 1, 1)] * batch, batch) / h100.flops
    # ... and exactly the roofline stated in hardware.py: overhead + the larger bound over its efficiency.
    assert t == pytest.approx(STEP_OVERHEAD_S + max(floor / DECODE_MBU, compute / PREFILL_MFU), rel=0.01)


@pytest.mark.parametrize("tokens", [128, 512, 4096, 8192])
def test_prefill_at_least_flops_over_peak(llama8b, tokens):
    h100 = gpu("H100")
    r = roofline(llama8b, h100)
    floor = step_flops(llama8b, [(0, tokens)], 1) / h100.flops
    t = r.step_time(tokens, attention_pairs(0, tokens), 1, 0, 0)
    assert t >= floor
    if tokens >= 512:  # compute-bound: the roofline's compute side
        assert t == pytest.approx(STEP_OVERHEAD_S + floor / PREFILL_MFU, rel=0.01)


def test_roofline_rejects_efficiencies_above_one(llama8b):
    with pytest.raises(ValueError):
        RooflineCosts(llama8b, 2, 1e15, 3e12, mfu=1.2, mbu=0.8, overhead_s=0.0, transport=FAST_LINK)


def test_gpu_table_and_memory(llama8b):
    assert set(GPUS) == {"H100", "H200", "A100", "L40S", "L4"}
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu("V100")
    assert kv_budget_bytes(gpu("H100"), weight_bytes(llama8b, 2)) > 50 * 10**9
    _, big = resolve_model("llama-3-70b")
    with pytest.raises(ValueError, match="do not fit"):
        kv_budget_bytes(gpu("L4"), weight_bytes(big, 2))
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("no-such-model")


# -- the simulator, against hand-worked timelines ---------------------------------------------------

def test_disaggregated_single_request_timeline():
    res = run(disagg(), costs(), [0.0], [100], [5])
    # Prefill: 100 tokens at 1 ms. KV pushed during it; 2 ms latency after. Then 4 decode steps of 10 ms.
    assert res.first_token[0] == pytest.approx(0.1)
    assert res.second_token[0] == pytest.approx(0.102 + 0.01)
    assert res.end[0] == pytest.approx(0.102 + 4 * 0.01)
    assert res.tpot[0] == pytest.approx((0.142 - 0.1) / 4)
    assert res.peak_kv_blocks["prefill-0"] == 7  # ceil(100 / 16)


def test_colocated_single_request_timeline():
    res = run(ClusterShape("colocated", colocated=pool()), costs(), [0.0], [100], [5])
    # Step 0 prefills and samples token 1; steps 1..4 decode tokens 2..5.
    assert res.first_token[0] == pytest.approx(0.1)
    assert res.second_token[0] == pytest.approx(0.11)
    assert res.end[0] == pytest.approx(0.14)


def test_one_token_request_ends_with_its_prefill():
    for shape in (disagg(), ClusterShape("colocated", colocated=pool())):
        res = run(shape, costs(), [0.0], [50], [1])
        assert res.end[0] == res.first_token[0] == pytest.approx(0.05)
        assert math.isnan(res.tpot[0])


def test_chunked_prefill_pays_attention_over_earlier_chunks():
    c = costs(per_pair=1e-6)
    shape = disagg(prefill=pool(budget=128))
    res = run(shape, c, [0.0], [300], [2])
    assert res.first_token[0] == pytest.approx(0.3 + 1e-6 * attention_pairs(0, 300))
    assert res.steps == 3 + 1  # three prefill chunks, one decode step


def test_decode_batches_requests_and_placement_spreads_them():
    c = costs(decode=(0.011,))
    one = run(disagg(d=1), c, [0.0, 0.0], [100, 100], [21, 21])
    # The prefill worker starts on the first arrival alone; the second waits for that step.
    assert one.first_token == pytest.approx([0.1, 0.2])
    # Alone, each needs 20 decode steps; batched on one worker they share the steps they overlap in.
    assert one.busy_s["decode-0"] < 2 * 20 * 0.011 - 0.05
    assert one.end[1] - one.first_token[1] == pytest.approx(0.002 + 20 * 0.011, abs=0.0111)
    two = run(disagg(d=2), c, [0.0, 0.0], [100, 100], [21, 21])
    assert two.busy_s["decode-0"] == pytest.approx(two.busy_s["decode-1"]) == pytest.approx(20 * 0.011)


def test_prefill_placement_prefers_the_least_queued_worker():
    res = run(disagg(p=2), costs(), [0.0, 0.0], [1000, 10], [2, 2])
    # The long prompt on one worker, the short one on the other: it is not stuck behind it.
    assert res.first_token[1] == pytest.approx(0.01)
    assert res.first_token[0] == pytest.approx(1.0)


def test_router_admission_queues_then_refuses():
    res = run(disagg(max_running=1, max_queued=1), costs(), [0.0, 0.0, 0.0], [100, 100, 100], [3, 3, 3])
    assert list(res.rejected) == [False, False, True]
    assert res.first_token[1] > res.end[0]  # placed only when the first finished
    rep = report(res, Slo(ttft_ms=10_000))
    assert rep["completed"] == 2 and rep["failed"] == 1 and rep["slo_attainment"] == pytest.approx(2 / 3)


def test_client_concurrency_cap_sends_when_one_ends():
    res = run(disagg(), costs(), [0.0] * 4, [100] * 4, [3] * 4, concurrency=1)
    assert res.arrival[1:] == pytest.approx(res.end[:-1])  # a closed loop of one
    assert res.ok.all()


def test_decode_kv_capacity_holds_back_reservations():
    # Prefills of 10 ms, decodes of 40: the two overlap. 10 blocks: one request of 100 prompt tokens (7 blocks +
    # growth) at a time.
    shape = disagg(decode=pool(kv_blocks=10))
    res = run(shape, costs(per_token=1e-4), [0.0, 0.0], [100, 100], [5, 5])
    assert res.second_token[1] > res.end[0]
    assert res.peak_kv_blocks["decode-0"] <= 10
    assert res.kv_overflows == 0
    # With room for both, the second decodes as soon as its KV lands.
    roomy = run(disagg(), costs(per_token=1e-4), [0.0, 0.0], [100, 100], [5, 5])
    assert roomy.second_token[1] < roomy.end[0]
    assert roomy.end[1] < res.end[1]


def test_overflowing_decode_kv_is_counted():
    shape = disagg(decode=pool(kv_blocks=8))  # 7 blocks reserved, then the request grows past 8
    res = run(shape, costs(), [0.0], [100], [60])
    assert res.kv_overflows > 0


def test_simulation_conserves_requests_on_a_random_workload():
    rng = np.random.default_rng(1)
    n = 500
    arrival = np.sort(rng.uniform(0, 50, n))
    ins, outs = rng.integers(1, 600, n), rng.integers(1, 80, n)
    c = costs(per_pair=1e-7, per_seq=0.001, decode=(0.01, 0.03), batches=(1, 32), per_ctx=1e-6)
    for shape in (disagg(2, 2), ClusterShape("colocated", colocated=pool(3, budget=512))):
        res = simulate(shape, c, arrival, ins, outs)
        assert res.ok.all()
        assert (res.first_token >= res.arrival + ins * 0.001 - 1e-9).all()
        assert (res.end >= res.first_token).all()
        two = outs > 1
        assert (res.second_token[two] > res.first_token[two]).all()
        assert np.isnan(res.second_token[~two]).all()


def test_decode_batch_cap_holds_back_reservations():
    shape = disagg(decode=pool(max_num_seqs=1))
    res = run(shape, costs(per_token=1e-4), [0.0, 0.0], [100, 100], [5, 5])
    assert res.second_token[1] > res.end[0]


def test_kv_held_for_a_late_reservation_is_sent_whole_after_it():
    link = Transport(latency_s=0.001, bytes_per_s=1e6)  # 1 MB/s: 100 tokens of 1000 B take 0.1 s
    c = costs(per_token=1e-4, decode=(0.05,), transport=link)
    res = run(disagg(), c, [0.0, 0.12], [100, 100], [3, 3])
    # Request 0: KV streamed during its 10 ms prefill, at 1 MB/s; 2 decode steps of 50 ms after it lands.
    landed0 = 0.01 + link.exposed_time(100_000, 0.01)
    assert res.end[0] == pytest.approx(landed0 + 0.1)
    # Request 1 arrives while the decode worker is in a step: its prompt is done (at 0.13) before the
    # worker reserves, at the step's end; then its whole KV goes, and its first decode step follows.
    reserved1 = landed0 + 0.05
    assert res.first_token[1] == pytest.approx(0.13) and res.first_token[1] < reserved1
    assert res.second_token[1] == pytest.approx(reserved1 + link.send_time(100_000) + 0.05)


def test_prompts_wait_at_the_router_for_decode_room():
    # One request at a time fits a decode worker (max_num_seqs 1): the second prompt is not even
    # computed until the first request ends, so its KV never waits on the prefill worker.
    c = costs(per_token=1e-4, decode=(0.05,))
    res = run(disagg(decode=pool(max_num_seqs=1)), c, [0.0, 0.0], [100, 100], [3, 3])
    assert res.first_token[1] == pytest.approx(res.end[0] + 0.01)


def test_one_step_to_one_decode_worker_is_one_transfer():
    link = Transport(latency_s=0.001, bytes_per_s=1e6)
    c = costs(per_token=1e-5, transport=link)
    res = run(disagg(), c, [0.0, 0.0, 0.0], [10, 100, 100], [2, 2, 2])
    # The 10-token prompt runs alone; the two 100-token prompts share the next step and one transfer
    # of 200,000 bytes, so they land (and reach their 2nd token) together.
    assert res.second_token[1] == pytest.approx(res.second_token[2])
    step_end = res.first_token[1]
    assert res.second_token[1] >= step_end + link.exposed_time(200_000, 0.002) + 0.01 - 1e-9


def test_colocated_kv_capacity_holds_back_prompts():
    shape = ClusterShape("colocated", colocated=pool(kv_blocks=10))
    res = run(shape, costs(), [0.0, 0.0], [100, 100], [5, 5])
    # Each holds 7 blocks and grows: the second prompt is admitted only after the first has finished.
    assert res.first_token[1] > res.end[0] - 1e-9
    assert res.peak_kv_blocks["colocated-0"] <= 10 and res.kv_overflows == 0


# -- the plan ---------------------------------------------------------------------------------------

def test_candidates_cover_colocated_and_every_xpyd():
    settings = PoolSettings(kv_cache_bytes=1 << 30)
    got = candidates(3, [16, 64], settings, kv_bytes_per_token=46080)
    labels = sorted({s.label for s, _ in got})
    assert labels == ["1P1D", "1P2D", "2P1D", "colocated x1", "colocated x2", "colocated x3"]
    assert len(got) == 12
    assert all(s.workers <= 3 for s, _ in got)
    with pytest.raises(ValueError):
        candidates(0, [64], settings, 46080)


def _bench_args(**kw) -> argparse.Namespace:
    from pdserve.loadgen.cli import add_workload_args

    p = argparse.ArgumentParser()
    add_workload_args(p)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def test_workload_matches_what_bench_sends():
    from pdserve.loadgen.cli import build_workload

    args = _bench_args(num_prompts=40, request_rate=2.0, lengths="longtail", input_len=200, output_len=30, seed=7)
    w = workload_from_args(args, 1000, [0], 4096)
    requests, arrivals, *_ = build_workload(args, 1000, [0], 4096)
    sent = [(at, len(r.token_ids), r.max_tokens) for r, at in itertools.islice(zip(requests, arrivals), 40)]
    assert list(zip(w.arrival, w.input_len, w.output_len)) == sent
    assert w.mean_rate == pytest.approx(2.0, rel=0.5)


def test_plan_ranks_by_goodput_per_worker_and_recommends():
    # Decode is cheap per token and prefill dear: the plan must see the trade.
    c = costs(per_token=0.002, decode=(0.02, 0.05), batches=(1, 32), per_ctx=1e-6)
    args = _bench_args(num_prompts=200, request_rate=1.5, lengths="uniform", input_len=300, output_len=40)
    w = workload_from_args(args, 1000, [0], 4096)
    plan = make_plan(c, w, Slo(ttft_ms=1500, tpot_ms=60), 3, [64], PoolSettings(kv_cache_bytes=1 << 30))
    cands = plan["candidates"]
    per_worker = [x["goodput_per_worker"] for x in cands]
    assert per_worker == sorted(per_worker, reverse=True)
    keys = {"mode", "prefill_workers", "decode_workers", "workers", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "p99_tpot_ms", "request_goodput", "slo_attainment", "kv_bytes_per_worker"}
    assert keys <= set(cands[0])
    rec = plan["recommended"]
    assert rec["slo_attainment"] >= 0.9 and rec["reason"]
    assert all(x["goodput_per_worker"] <= rec["goodput_per_worker"] for x in cands if x["slo_attainment"] >= 0.9)
    json.dumps(plan)  # JSON-able as it stands


def test_plan_refuses_a_prompt_larger_than_a_workers_cache():
    args = _bench_args(num_prompts=5, input_len=3000, output_len=10)
    w = workload_from_args(args, 1000, [0], 8192)
    with pytest.raises(ValueError, match="raise --kv-cache-mib"):
        make_plan(costs(), w, Slo(ttft_ms=1000), 2, [64], PoolSettings(kv_cache_bytes=1000 * 16 * 100))


def test_format_plan_shows_missing_figures_as_na():
    c = costs()
    args = _bench_args(num_prompts=3, input_len=50, output_len=5)
    w = workload_from_args(args, 1000, [0], 4096)
    plan = make_plan(c, w, Slo(ttft_ms=1000), 1, [64], PoolSettings(kv_cache_bytes=1 << 26))
    plan["candidates"][0].update(request_goodput=None, goodput_per_worker=None, slo_attainment=None,
                                 median_ttft_ms=None)
    text = format_plan(plan)
    assert text.count("n/a") >= 4


def test_recommend_says_when_nothing_meets_the_slo():
    ranked = [{"label": "a", "mode": "colocated", "workers": 1, "goodput_per_worker": 0.5, "slo_attainment": 0.5,
               "kv_fits": True},
              {"label": "b", "mode": "colocated", "workers": 2, "goodput_per_worker": 0.4, "slo_attainment": 0.7,
               "kv_fits": True}]
    best, why = recommend(ranked, 0.9)
    assert best["label"] == "b" and "comes closest" in why


# -- the commands -----------------------------------------------------------------------------------

def _write_profile(path, c: MeasuredCosts) -> None:
    path.write_text(json.dumps({"version": 1, "costs": c.to_dict(), "kv_cache_bytes": 1 << 28, "block_size": 16,
                                "model": {"name": "synthetic", "path": None, "vocab_size": 1000,
                                          "eos_token_ids": [0], "max_model_len": 4096}}))


def test_plan_command_writes_json_and_plot(tmp_path, capsys):
    from pdserve.cli import main

    prof = tmp_path / "profile.json"
    _write_profile(prof, costs(per_token=0.002, decode=(0.02, 0.05), batches=(1, 32)))
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["plan", "--profile", str(prof), "--num-prompts", "60", "--request-rate", "1", "--input-len", "200",
               "--output-len", "20", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--max-workers", "2",
               "--output", str(out), "--plot", str(png)])
    assert rc == 0
    plan = json.loads(out.read_text())
    assert {c["label"].split(",")[0] for c in plan["candidates"]} == {"colocated x1", "colocated x2", "1P1D"}
    assert plan["recommended"]["label"] in {c["label"] for c in plan["candidates"]}
    assert png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "recommended:" in printed and "simulated" in printed


def test_plan_command_roofline(tmp_path):
    from pdserve.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", "--gpu", "H100", "--model", "llama-3-8b", "--num-prompts", "300", "--request-rate", "20",
               "--input-len", "2000", "--output-len", "200", "--slo-ttft-ms", "500", "--slo-tpot-ms", "40",
               "--max-workers", "3", "--output", str(out)])
    assert rc == 0
    plan = json.loads(out.read_text())
    assert plan["costs"] == "roofline of H100" and len(plan["candidates"]) == 6
    assert all(c["median_tpot_ms"] >= 1e3 * weight_bytes(resolve_model("llama3-8b")[1], 2) / 3.35e12
               for c in plan["candidates"])


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "H100", "--profile", "x.json"], "give --profile FILE, or --gpu"),
    (["--gpu", "V100", "--model", "llama-3-8b"], "unknown GPU"),
    (["--gpu", "H100"], "--gpu needs --model"),
    (["--gpu", "H100", "--model", "llama-3-8b", "--slo-ttft-ms", "-1"], "SLO ttft_ms must be > 0"),
    (["--gpu", "H100", "--model", "llama-3-8b", "--max-running", "0"], "--max-running must be >= 1"),
    (["--gpu", "L4", "--model", "llama-3-70b", "--tensor-parallel-sizes", "1"], "no tensor-parallel size of [1] fits"),
    (["--profile", "/nonexistent.json"], "not a pdserve profile"),
])
def test_plan_command_errors(argv, message, capsys):
    from pdserve.cli import main

    base = ["plan", "--max-workers", "2", "--num-prompts", "5"]
    if "--slo-ttft-ms" not in argv:
        base += ["--slo-ttft-ms", "1000"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_plan_needs_a_request_count_where_bench_would_stop_by_the_clock(capsys):
    from pdserve.cli import main

    assert main(["plan", "--gpu", "H100", "--model", "llama-3-8b", "--max-workers", "2", "--slo-ttft-ms", "500",
                 "--arrival", "closed", "--concurrency", "4", "--duration", "60"]) == 2
    assert "needs --num-prompts" in capsys.readouterr().err


def test_plan_needs_an_slo(capsys):
    from pdserve.cli import main

    assert main(["plan", "--gpu", "H100", "--model", "llama-3-8b", "--max-workers", "2", "--num-prompts", "5"]) == 2
    assert "give at least one SLO" in capsys.readouterr().err


def test_profile_measures_the_engine(tmp_path, cpu_kernels_built):
    """A real (quick) profile of the default model's shape with dummy weights: every measurement is
    there, the fit follows them, and larger work costs more. How well the fit follows noisy measurements
    on shared cores is not asserted (a loaded machine decides it); that it recovers the model that made
    exact measurements is (test_fit_recovers_the_model_that_made_the_measurements)."""
    from pdserve.cli import main
    from pdserve.planner.profile import fit_transport

    out = tmp_path / "profile.json"
    assert main(["profile", "--model", "smollm2-135m", "--load-format", "dummy", "--quick", "--threads", "1",
                 "--kv-cache-mib", "128", "--output", str(out)]) == 0
    prof = json.loads(out.read_text())
    m = prof["measurements"]
    single = [r for r in m["prefill"] if r["seqs"] == 1 and r["pairs"] == attention_pairs(0, r["tokens"])]
    assert [r["tokens"] for r in single][:3] == [16, 64, 256]
    assert single[2]["seconds"] > single[0]["seconds"]
    assert all(r["tokens"] > 0 and r["seconds"] > 0 for r in m["prefill"])
    assert len(m["transfer"]) == 3 and all(r["seconds"] > 0 for r in m["transfer"])
    # The fit follows these measurements: fitting them again gives the profile's costs and errors exactly.
    c = MeasuredCosts.from_dict(prof["costs"])
    refit, err = fit_measured(m["prefill"], m["decode"], fit_transport(m["transfer"]), c.kv_bytes_per_token,
                              prof["weight_bytes"])
    assert refit == c and err == prof["fit"]
    assert all(math.isfinite(e) and e >= 0 for e in err.values())
    assert c.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert c.step_time(0, 0, 0, 16, 16 * 300) > c.step_time(0, 0, 0, 1, 300)
