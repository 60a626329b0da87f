"""pdserve bench: statistics against hand-computed timelines, workloads, traces, the runner against a
scripted gRPC server, and one short real run against a local cluster (slow)."""
from __future__ import annotations

import asyncio
import json
import math
from collections import Counter

import grpc
import numpy as np
import pytest

from pdserve.loadgen.cli import build_workload, format_report
from pdserve.loadgen.runner import RunConfig, prompt_tokens_between, run_workload
from pdserve.loadgen.stats import (
    RequestRecord,
    Slo,
    build_report,
    peak_concurrency,
    percentile,
    summarize,
    timeline,
    timeline_bin,
)
from pdserve.loadgen.workload import (
    BenchRequest,
    LengthSpec,
    TokenSampler,
    TraceError,
    bursty_arrivals,
    closed_arrivals,
    load_trace,
    poisson_arrivals,
    synthetic_requests,
    tier_draws,
    trace_arrivals,
)
from pdserve.cli import build_parser
from pdserve.tiers import parse_mix
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc


def take(it, n):
    return [next(it) for _ in range(n)]


# -- statistics -------------------------------------------------------------------------------------
# Times are multiples of 1/8 so every expected value below is exact in binary floating point.
def rec_a() -> RequestRecord:
    # one token a message: TTFT 0.5, E2EL 1.25, TPOT (1.25 - 0.5) / 3 = 0.25, ITL 0.125, 0.25, 0.375
    return RequestRecord(send=1.0, chunks=[(1.5, 1), (1.625, 1), (1.875, 1), (2.25, 1)], end=2.25,
                         input_tokens=10, max_tokens=4, finish_reason="length")


def rec_b() -> RequestRecord:
    # 2 tokens, then 3 tokens 0.75 s later, then an empty final message: TTFT 0.25, E2EL 1.125,
    # TPOT (1.125 - 0.25) / 4 = 0.21875; ITL: 0 for the first message's second token, 0.75 / 3 each after
    return RequestRecord(send=0.0, chunks=[(0.25, 2), (1.0, 3), (1.125, 0)], end=1.125,
                         input_tokens=20, max_tokens=5, finish_reason="length")


def rec_c() -> RequestRecord:
    # a single output token: no TPOT, no ITL
    return RequestRecord(send=0.0, chunks=[(0.375, 1)], end=0.375, input_tokens=30, max_tokens=1,
                         finish_reason="length")


def rec_d() -> RequestRecord:
    # failed after one token: counted by code, excluded from tokens and latencies
    return RequestRecord(send=0.25, chunks=[(0.5, 1)], end=0.75, input_tokens=40, max_tokens=8,
                         error_code="UNAVAILABLE", error="worker died")


def test_per_request_definitions():
    a, b, c, d = rec_a(), rec_b(), rec_c(), rec_d()
    assert (a.ttft, a.e2el, a.tpot, a.itl, a.output_tokens) == (0.5, 1.25, 0.25, [0.125, 0.25, 0.375], 4)
    assert (b.ttft, b.e2el, b.tpot, b.output_tokens) == (0.25, 1.125, 0.21875, 5)
    assert b.itl == [0.0, 0.25, 0.25, 0.25]
    # output_tokens - 1 ITL samples summing to last-token time - TTFT
    assert len(b.itl) == b.output_tokens - 1 and sum(b.itl) == 1.0 - 0.25
    assert (c.ttft, c.tpot, c.itl) == (0.375, None, [])
    assert a.ok and not d.ok
    # TTFT is the first message that carries a token
    assert RequestRecord(send=0.0, chunks=[(0.125, 0), (0.5, 1)], end=0.5).ttft == 0.5


def test_percentiles_and_summary():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    rng = np.random.default_rng(0)
    ys = list(rng.exponential(size=101))
    for q in (10, 50, 90, 99):
        assert percentile(ys, q) == pytest.approx(float(np.percentile(ys, q)))
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s == {"mean": 2.5, "median": 2.5, "std": pytest.approx(math.sqrt(1.25)), "p90": pytest.approx(3.7),
                 "p99": pytest.approx(3.97)}
    assert summarize([]) == dict.fromkeys(("mean", "median", "std", "p90", "p99"))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_peak_concurrency():
    assert peak_concurrency([]) == 0
    assert peak_concurrency([(0, 1), (1, 2)]) == 1  # touching, not overlapping
    assert peak_concurrency([(0, 3), (1, 2), (1.5, 4), (3, 5)]) == 3


def test_report_against_hand_computed_timeline():
    recs = [rec_a(), rec_b(), rec_c(), rec_d()]
    rep = build_report(recs, Slo(ttft_ms=375, tpot_ms=250))
    assert rep["completed"] == 3 and rep["failed"] == 1
    assert rep["failed_by_code"] == {"UNAVAILABLE": 1}
    assert rep["errors"] == [{"code": "UNAVAILABLE", "message": "worker died", "count": 1}]
    assert rep["duration"] == 2.25  # the last end; time 0 is the start of the run
    assert rep["total_input_tokens"] == 60 and rep["total_output_tokens"] == 10
    assert rep["request_throughput"] == pytest.approx(3 / 2.25)
    assert rep["input_throughput"] == pytest.approx(60 / 2.25)
    assert rep["output_throughput"] == pytest.approx(10 / 2.25)
    assert rep["total_token_throughput"] == pytest.approx(70 / 2.25)
    assert rep["peak_concurrency"] == 3  # b, c and d around t = 0.3
    # TTFT 0.5, 0.25, 0.375
    assert rep["mean_ttft_ms"] == pytest.approx(375) and rep["median_ttft_ms"] == pytest.approx(375)
    assert rep["p90_ttft_ms"] == pytest.approx(475)  # rank 1.8 of [250, 375, 500]
    # TPOT 0.25, 0.21875 (c has none)
    assert rep["mean_tpot_ms"] == pytest.approx(234.375) and rep["median_tpot_ms"] == pytest.approx(234.375)
    # ITL: a's 3 gaps and b's 4 samples
    assert rep["mean_itl_ms"] == pytest.approx(1.5 / 7 * 1e3) and rep["median_itl_ms"] == pytest.approx(250)
    assert rep["p99_itl_ms"] == pytest.approx(375 - 0.06 * 125)  # rank 5.94 of [0, 125, 250 x4, 375]
    assert rep["mean_e2el_ms"] == pytest.approx(2.75 / 3 * 1e3)
    # SLO: a misses TTFT (500 > 375); b meets both; c meets TTFT at the bound and has no TPOT; d failed
    assert rep["good_requests"] == 2
    assert rep["request_goodput"] == pytest.approx(2 / 2.25)
    assert rep["slo_attainment"] == 0.5
    assert [r["met_slo"] for r in rep["requests"]] == [False, True, True, False]
    assert rep["requests"][1]["itl_ms"] == [0.0, 250.0, 250.0, 250.0]
    json.dumps(rep)  # serializable as is


def test_goodput_each_slo_and_none():
    recs = [rec_a(), rec_b(), rec_c(), rec_d()]
    assert build_report(recs, Slo(tpot_ms=218.75))["good_requests"] == 2  # b at the bound, c has no TPOT
    assert build_report(recs, Slo(tpot_ms=218.0))["good_requests"] == 1  # only c
    assert build_report(recs, Slo(e2el_ms=400))["good_requests"] == 1
    assert build_report(recs, Slo(ttft_ms=1000, tpot_ms=1000, e2el_ms=2000))["good_requests"] == 3
    rep = build_report(recs)
    assert rep["good_requests"] is None and rep["request_goodput"] is None and rep["slo_attainment"] is None
    with pytest.raises(ValueError):
        Slo(ttft_ms=0)


def test_timeline():
    recs = [rec_a(), rec_b(), rec_c(), rec_d()]
    tl = timeline(recs, 2.25, bin_s=0.5)
    assert tl["start_s"] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert tl["output_tokens_per_s"] == [6.0, 2.0, 6.0, 6.0, 2.0]  # d's delivered token included
    assert tl["completed"] == [1, 0, 1, 0, 1]
    assert tl["in_flight"] == [2, 2, 2, 1, 1]
    assert timeline_bin(6.0) == 0.5 and timeline_bin(120.0) == 5.0 and timeline_bin(1e6) == 300.0


def rec_group() -> RequestRecord:
    # two samples, interleaved: sample 0 at 0.25, 0.5, 1.0 (TPOT 0.375; gaps 0.25, 0.5), sample 1 at 0.25,
    # 0.625, 0.75 (TPOT 0.25; gaps 0.375, 0.125). Over the stream as one (what a record of one sample reads)
    # TPOT would be (1.0 - 0.25) / 5 = 0.15, with gaps of 0 between the samples' messages.
    return RequestRecord(send=0.0, chunks=[(0.25, 1), (0.25, 1), (0.5, 1), (0.625, 1), (0.75, 1), (1.0, 1)],
                         chunk_index=[0, 1, 0, 1, 1, 0], samples=2, end=1.0, input_tokens=8, max_tokens=3,
                         finish_reason="length")


def test_a_group_is_timed_per_sample():
    g = rec_group()
    assert (g.ttft, g.e2el, g.output_tokens, g.output_tokens_per_sample) == (0.25, 1.0, 6, [3, 3])
    assert g.tpot == (0.375 + 0.25) / 2 and g.itl == [0.25, 0.5, 0.375, 0.125]
    rep = build_report([g, rec_a()], Slo(tpot_ms=320))
    assert rep["total_output_tokens"] == 10 and rep["total_input_tokens"] == 18  # the group's prompt once
    assert rep["good_requests"] == 2  # the group's TPOT is 312.5 ms
    assert rep["requests"][0]["samples"] == 2 and rep["requests"][0]["output_tokens_per_sample"] == [3, 3]
    assert "samples" not in rep["requests"][1]


def test_workers_prompt_tokens_over_a_run():
    before = {"p0": (100, 90), "d0": (0, 4)}
    after = {"p0": (160, 130), "d0": (0, 10), "p1": (20, 20)}  # p1 started during the run
    assert prompt_tokens_between(before, after) == (80, 66)
    assert prompt_tokens_between(None, after) == prompt_tokens_between(before, None) == (None, None)


def test_empty_and_all_failed_reports():
    rep = build_report([RequestRecord(send=0.0, end=0.5, error_code="RESOURCE_EXHAUSTED", error="full")])
    assert rep["completed"] == 0 and rep["failed_by_code"] == {"RESOURCE_EXHAUSTED": 1}
    assert rep["mean_ttft_ms"] is None and rep["request_throughput"] == 0.0
    # a stream that ended without a finish reason is a failure too
    assert build_report([RequestRecord(send=0.0, end=None)])["failed_by_code"] == {"INCOMPLETE": 1}


# -- arrivals ---------------------------------------------------------------------------------------
def test_poisson_rate_and_seed():
    n, rate = 4000, 5.0
    ts = take(poisson_arrivals(rate, seed=1), n)
    assert ts[0] == 0.0 and all(b >= a for a, b in zip(ts, ts[1:]))
    assert (n - 1) / ts[-1] == pytest.approx(rate, rel=0.05)
    gaps = np.diff(ts)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps: CV 1
    assert take(poisson_arrivals(rate, seed=1), n) == ts
    assert take(poisson_arrivals(rate, seed=2), 10) != ts[:10]
    assert take(poisson_arrivals(math.inf, seed=1), 5) == [0.0] * 5
    with pytest.raises(ValueError):
        next(poisson_arrivals(0.0, seed=1))


def test_bursty_and_closed_arrivals():
    ts = take(bursty_arrivals(burst_size=50, interval=8.0), 150)
    assert ts == [0.0] * 50 + [8.0] * 50 + [16.0] * 50  # nothing between bursts
    assert take(closed_arrivals(), 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        next(bursty_arrivals(0, 1.0))


# -- lengths and prompts ----------------------------------------------------------------------------
def test_length_distributions():
    rng = np.random.default_rng(0)
    assert set(LengthSpec("fixed", 100).sample(rng, 1000)) == {100}
    u = LengthSpec("uniform", 128, range_ratio=0.5)
    assert u.bounds == (64, 192)
    xs = u.sample(rng, 20000)
    assert xs.min() == 64 and xs.max() == 192 and xs.mean() == pytest.approx(128, rel=0.02)
    lt = LengthSpec("longtail", 200)
    assert lt.bounds == (1, 2000)
    ys = lt.sample(rng, 20000)
    assert ys.min() >= 1 and ys.max() == 2000  # about 1% of log-normal(sigma 1) draws pass 10 x the median
    assert np.median(ys) == pytest.approx(200, rel=0.05)
    assert ys.mean() > 1.4 * np.median(ys)  # long tail: the mean sits well above the median
    assert LengthSpec("longtail", 200, max_len=500).sample(rng, 5000).max() == 500
    for spec in (u, lt):
        assert list(spec.sample(np.random.default_rng(7), 50)) == list(spec.sample(np.random.default_rng(7), 50))
    for bad in (dict(dist="zipf"), dict(length=0), dict(range_ratio=1.0), dict(length=10, max_len=5)):
        with pytest.raises(ValueError):
            LengthSpec(**bad)


def test_synthetic_requests_exact_and_seeded():
    sampler = TokenSampler(50, exclude=[0, 49])
    assert set(sampler.allowed) == set(range(1, 49))
    spec_in, spec_out = LengthSpec("uniform", 40, 0.5), LengthSpec("fixed", 8)
    reqs = take(synthetic_requests(spec_in, spec_out, sampler, 4096, seed=3), 200)
    assert all(20 <= r.input_len <= 60 and r.max_tokens == 8 and r.ignore_eos for r in reqs)
    assert all(0 not in r.token_ids and 49 not in r.token_ids for r in reqs)
    assert take(synthetic_requests(spec_in, spec_out, sampler, 4096, seed=3), 200) == reqs
    assert take(synthetic_requests(spec_in, spec_out, sampler, 4096, seed=4), 5) != reqs[:5]
    # prompts are cut so prompt + output fits the context
    long = take(synthetic_requests(LengthSpec("fixed", 100), spec_out, sampler, 64, seed=0), 3)
    assert all(r.input_len == 56 for r in long)
    with pytest.raises(ValueError):
        next(synthetic_requests(spec_in, LengthSpec("fixed", 64), sampler, 64, seed=0))
    kw = reqs[0].client_kwargs()
    assert kw["token_ids"] == list(reqs[0].token_ids) and kw["max_tokens"] == 8 and kw["ignore_eos"] is True


# -- traces -----------------------------------------------------------------------------------------
def test_trace_parsing(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"prompt": "Hello", "output_len": 4, "timestamp": 1.5}\n'
                 "\n"
                 '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "timestamp": 0.25}\n'
                 '{"token_ids": [5, 6, 7], "output_len": 2, "timestamp": 0.5, "ignore_eos": true}\n'
                 '{"input_len": 12, "output_len": 3, "timestamp": 0.5}\n')
    reqs = load_trace(p, TokenSampler(100, [0]), seed=0)
    assert [r.timestamp for r in reqs] == [0.25, 0.5, 0.5, 1.5]  # sorted, ties in file order
    assert reqs[0].messages == (("user", "Hi"),) and reqs[0].max_tokens == 8
    assert reqs[1].token_ids == (5, 6, 7) and reqs[1].ignore_eos and not reqs[0].ignore_eos
    assert reqs[2].input_len == 12 and 0 not in reqs[2].token_ids
    assert reqs[3].prompt == "Hello" and reqs[3].client_kwargs()["prompt"] == "Hello"
    assert list(trace_arrivals(reqs)) == [0.25, 0.5, 0.5, 1.5]
    # no timestamps: file order, a default output length
    q = tmp_path / "q.jsonl"
    q.write_text('{"prompt": "a"}\n{"prompt": "b", "output_len": 2}\n')
    reqs = load_trace(q, default_output_len=16)
    assert [(r.prompt, r.max_tokens, r.timestamp) for r in reqs] == [("a", 16, None), ("b", 2, None)]
    with pytest.raises(ValueError, match="timestamp"):
        list(trace_arrivals(reqs))


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "output_len": 4', "t.jsonl:2: "),  # broken JSON names file and line
    ('{"prompt": "a", "output_len": 0}', "output_len must be an integer >= 1"),
    ('{"prompt": "a", "promt": "b", "output_len": 1}', "unknown keys \\['promt'\\]"),
    ('{"output_len": 4}', "give exactly one of"),
    ('{"prompt": "a", "token_ids": [1], "output_len": 4}', "give exactly one of"),
    ('{"token_ids": [1, -2], "output_len": 4}', "non-negative integers"),
    ('{"prompt": "a", "output_len": 4, "timestamp": -1}', "timestamp must be"),
    ('{"messages": [{"role": "user"}], "output_len": 4}', "messages must be"),
    ('{"prompt": "a"}', "output_len is missing"),
    ('[1, 2]', "expected a JSON object"),
])
def test_trace_bad_line(tmp_path, line, message):
    p = tmp_path / "t.jsonl"
    p.write_text('{"prompt": "ok", "output_len": 4}\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as e:
        load_trace(p, TokenSampler(10))
    assert f"{p}:2: " in str(e.value)


def test_trace_whole_file_errors(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"prompt": "a", "output_len": 4, "timestamp": 0}\n{"prompt": "b", "output_len": 4}\n')
    with pytest.raises(TraceError, match="1 of 2 lines have a timestamp"):
        load_trace(p)
    p.write_text("\n\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(p)


# -- CLI --------------------------------------------------------------------------------------------
def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_cli_flags_and_workloads(tmp_path):
    a = parse("--target", "h:1", "--request-rate", "4", "--num-prompts", "7", "--slo-ttft-ms", "500",
              "--slo-tpot-ms", "50", "--lengths", "longtail", "--output", "r.json", "--plot", "r.png")
    assert (a.target, a.request_rate, a.num_prompts, a.slo_ttft_ms, a.slo_tpot_ms) == ("h:1", 4.0, 7, 500.0, 50.0)
    reqs, arrivals, kind, num, desc = build_workload(a, 1000, [2], 2048)
    assert kind == "poisson" and num == 7 and desc["ignore_eos"] is True and desc["input_len_bounds"] == (1, 1280)
    _, _, kind, num, _ = build_workload(parse("--duration", "5", "--request-rate", "2"), 1000, [2], 2048)
    assert num is None  # bounded by time only
    _, _, _, num, _ = build_workload(parse(), 1000, [2], 2048)
    assert num == 100
    a = parse("--arrival", "closed", "--max-concurrency", "4", "--no-ignore-eos")
    _, arrivals, kind, _, desc = build_workload(a, 1000, [2], 2048)
    assert kind == "closed" and a.concurrency == 4 and desc["ignore_eos"] is False and next(arrivals) == 0.0
    with pytest.raises(ValueError, match="--concurrency"):
        build_workload(parse("--arrival", "closed"), 1000, [2], 2048)
    with pytest.raises(ValueError, match="--trace"):
        build_workload(parse("--arrival", "trace"), 1000, [2], 2048)
    t = tmp_path / "t.jsonl"
    t.write_text('{"input_len": 5, "output_len": 2, "timestamp": 0.5}\n' * 3)
    reqs, arrivals, kind, num, _ = build_workload(parse("--trace", str(t)), 1000, [2], 2048)
    assert kind == "trace" and num == 3 and list(arrivals) == [0.5] * 3
    assert all(not r.ignore_eos and r.input_len == 5 for r in reqs)


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts out of range"),
    (["--request-rate", "-1"], "--request-rate out of range"),
    (["--lengths", "uniform", "--range-ratio", "1.5"], "range_ratio"),
    (["--slo-ttft-ms", "0"], "SLO ttft_ms"),
    (["--trace", "/nonexistent.jsonl"], "not found"),
    (["--duration", "5"], "needs --num-prompts or --concurrency"),  # infinitely many at t = 0
])
def test_cli_rejects_bad_flags_before_connecting(argv, message, capsys):
    from pdserve.cli import main

    # the target does not exist: these must fail on the flags, with exit code 2, not on the network
    assert main(["bench", "--target", "127.0.0.1:1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_format_report_has_every_section():
    rep = build_report([rec_a(), rec_b(), rec_c(), rec_d()], Slo(ttft_ms=375, tpot_ms=250))
    text = format_report({"mode": "disaggregated", "config": {"workload": "poisson 4 req/s"}, **rep})
    for s in ("Successful requests:", "UNAVAILABLE:", "Request goodput (req/s):", "SLO attainment (%):",
              "P99 TTFT (ms):", "Median TPOT (ms):", "P90 ITL (ms):", "Mean E2EL (ms):", "Peak concurrent requests:"):
        assert s in text


# -- the runner against a scripted server ----------------------------------------------------------
class ScriptedGeneration(pb_grpc.GenerationServicer):
    """Streams max_tokens one-token messages 20 ms apart, of each of the n samples asked (the usage on the last
    message); prompts starting with token 13 are refused, those starting with 14 end after sample 0."""

    async def Generate(self, request, context):
        if request.token_ids.ids[0] == 13:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        n = request.n if request.HasField("n") else 1
        for i in range(request.max_tokens):
            await asyncio.sleep(0.02)
            last = i == request.max_tokens - 1
            for sample in range(n if request.token_ids.ids[0] != 14 else 1):
                r = pb.GenerateResponse(request_id="x", token_ids=[i], index=sample)
                if last:
                    r.finish_reason = pb.FINISH_REASON_LENGTH
                if last and sample == n - 1:
                    r.usage.prompt_tokens = len(request.token_ids.ids)
                    r.usage.completion_tokens = request.max_tokens * n
                yield r


def test_runner_against_scripted_server():
    async def main():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(ScriptedGeneration(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            reqs = [BenchRequest(max_tokens=4, token_ids=(13 if i == 2 else 1, 2, 3)) for i in range(6)]
            closed = await run_workload(f"127.0.0.1:{port}", reqs, closed_arrivals(),
                                        RunConfig(num_prompts=6, concurrency=2))
            burst = await run_workload(f"127.0.0.1:{port}", reqs, bursty_arrivals(3, 0.3),
                                       RunConfig(num_prompts=6))
            timed = await run_workload(f"127.0.0.1:{port}", iter(lambda: reqs[0], None), poisson_arrivals(50, 0),
                                       RunConfig(duration=0.3))
            return closed, burst, timed
        finally:
            await server.stop(0)

    # Nothing below depends on how loaded the machine is: the bounds are the script's own (the server
    # sleeps 20 ms before each message; a schedule is never sent early) and the order of events. How
    # closely the runner keeps to its schedule is measured by bench.router.runner_schedule.
    (closed, wall), (burst, _), (timed, _) = asyncio.run(asyncio.wait_for(main(), 60))
    rep = build_report(closed, Slo(ttft_ms=1000), wall)
    assert rep["completed"] == 5 and rep["failed_by_code"] == {"RESOURCE_EXHAUSTED": 1}
    assert rep["errors"][0]["message"] == "queue full"
    assert rep["total_output_tokens"] == 20 and rep["total_input_tokens"] == 15
    assert rep["peak_concurrency"] == 2  # the closed loop holds 2 in flight
    assert all(r.finish_reason == "length" for r in closed if r.ok)
    # Inter-token latency is measured per streamed message, from the client's clock: three gaps for four
    # messages, adding up to first message -> last; each request's last message came at least the
    # server's 4 x 20 ms after its send; TPOT over a request is the mean of its gaps.
    for row, r in zip(rep["requests"], closed):
        if r.ok:
            assert len(row["itl_ms"]) == 3 and all(g >= 0 for g in row["itl_ms"])
            assert sum(row["itl_ms"]) == pytest.approx((r.end - r.chunks[0][0]) * 1e3, abs=0.01)
            assert row["e2el_ms"] >= 80 - 0.01 and row["tpot_ms"] == pytest.approx(sum(row["itl_ms"]) / 3, abs=0.01)
    assert rep["mean_tpot_ms"] == pytest.approx(rep["mean_itl_ms"], rel=0.01)
    # Two bursts of three, 0.3 s apart: the first three all go before the second burst, which waits for
    # its time (records are in the order the runner made them).
    sends = [r.send for r in burst]
    assert len(burst) == 6 and max(sends[:3]) < min(sends[3:]) and min(sends[3:]) >= 0.3 - 1e-6
    # Poisson at 50/s for 0.3 s: never an arrival scheduled at or after 0.3 s (seed 0 schedules 19 before
    # it), none sent before its scheduled time, and every request sent ran to its end.
    schedule = take(poisson_arrivals(50, 0), 25)
    due = sum(1 for t in schedule if t < 0.3)
    assert due == 19 and 1 <= len(timed) <= due
    assert all(r.send >= t - 1e-6 for r, t in zip(timed, schedule))
    assert all(r.finish_reason == "length" and r.end is not None for r in timed)


def test_runner_asks_for_n_samples_and_times_each():
    async def main():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(ScriptedGeneration(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            reqs = [BenchRequest(max_tokens=4, token_ids=(14 if i == 1 else 1, 2, 3)) for i in range(3)]
            return await run_workload(f"127.0.0.1:{port}", reqs, closed_arrivals(),
                                      RunConfig(num_prompts=3, concurrency=3, n=3))
        finally:
            await server.stop(0)

    records, wall = asyncio.run(asyncio.wait_for(main(), 60))
    rep = build_report(records, Slo(), wall)
    # The one whose stream ended with a sample unfinished failed; the others count each sample's tokens.
    assert rep["completed"] == 2 and rep["failed_by_code"] == {"INCOMPLETE": 1}
    assert rep["errors"][0]["message"] == "the stream ended with 1 of 3 samples finished"
    assert rep["total_output_tokens"] == 2 * 3 * 4 and rep["total_input_tokens"] == 2 * 3
    for r in records[::2]:
        assert r.output_tokens_per_sample == [4, 4, 4] and len(r.itl) == 3 * 3
        # Each sample's messages come 20 ms apart (the server's own sleep); the samples' side by side.
        assert r.tpot >= 0.02 - 1e-3 and all(g >= 0.02 - 1e-3 for g in r.itl)
    with pytest.raises(ValueError, match="n must be"):
        RunConfig(num_prompts=1, n=129)


# -- a real short run against a local cluster -------------------------------------------------------
REPORT_KEYS = [
    "date", "label", "target", "mode", "model", "config", "completed", "failed", "failed_by_code", "errors",
    "duration", "total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput",
    "output_throughput", "total_token_throughput", "peak_concurrency",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p90", "p99")),
    "slo", "good_requests", "request_goodput", "slo_attainment", "timeline", "requests",
]


@pytest.mark.slow
def test_real_bench_run(aloop, smol_1p1d, tmp_path):
    """SmolLM2 on one prefill and one decode worker: the cluster tests/router's API modules share
    (conftest.smol_1p1d); what the run reads of the workers it reads as deltas over the run."""
    from pdserve.cli import main
    from router.compose import build_router
    from router.config import RouterConfig

    router = build_router(smol_1p1d, RouterConfig(port=0))
    try:
        port = aloop.run(router.start())
        out, png = tmp_path / "run.json", tmp_path / "run.png"
        rc = main(["bench", "--target", f"127.0.0.1:{port}", "--num-prompts", "12", "--request-rate", "8",
                   "--lengths", "uniform", "--input-len", "32", "--output-len", "6", "--slo-ttft-ms", "5000",
                   "--slo-tpot-ms", "2000", "--timeout", "120", "--output", str(out), "--plot", str(png),
                   "--label", "test", "--no-progress"])
        # The group shape: 4 prompts x 2 samples (another seed: prompts the prefix cache has not seen).
        group = tmp_path / "group.json"
        group_rc = main(["bench", "--target", f"127.0.0.1:{port}", "--num-prompts", "4", "--n", "2", "--temperature",
                         "1", "--lengths", "uniform", "--input-len", "32", "--output-len", "5", "--timeout", "120",
                         "--seed", "1", "--output", str(group), "--no-progress"])
    finally:
        aloop.run(router.stop(grace=5))
    assert rc == 0 and group_rc == 0
    g = json.loads(group.read_text())
    assert g["completed"] == 4 and g["failed"] == 0 and g["config"]["n"] == 2
    rows = g["requests"]
    assert all(r["samples"] == 2 and r["output_tokens_per_sample"] == [r["max_tokens"]] * 2 for r in rows)
    assert g["total_output_tokens"] == sum(2 * r["max_tokens"] for r in rows)  # every sample's (ignore_eos)
    assert g["total_input_tokens"] == sum(r["input_tokens"] for r in rows) >= 4 * 16  # each prompt once
    # The workers were asked for each prompt once and computed it once, not once a sample.
    assert g["worker_prompt_tokens_requested"] == g["worker_prompt_tokens_computed"] == g["total_input_tokens"]
    rep = json.loads(out.read_text())
    assert [k for k in REPORT_KEYS if k not in rep] == []
    assert rep["completed"] == 12 and rep["failed"] == 0 and rep["mode"] == "disaggregated"
    assert len(rep["requests"]) == 12 and all(r["output_tokens"] == r["max_tokens"] for r in rep["requests"])
    assert rep["total_output_tokens"] == sum(r["max_tokens"] for r in rep["requests"])  # ignore_eos: exact
    assert 16 * 12 <= rep["total_input_tokens"] <= 48 * 12
    assert all(rep[k] is not None and rep[k] >= 0 for k in REPORT_KEYS if k.endswith("_ms"))
    assert rep["good_requests"] is not None and 0 <= rep["slo_attainment"] <= 1
    assert sum(rep["timeline"]["completed"]) == 12 and rep["peak_concurrency"] >= 1
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    # The workers' prompt tokens over the run: those of its 12 prompts, the warm-up's not included.
    assert rep["worker_prompt_tokens_requested"] == rep["total_input_tokens"]
    assert rep["worker_prompt_tokens_computed"] == rep["total_input_tokens"]  # distinct random prompts: no cache hit
    assert "n" in rep["config"] and rep["config"]["n"] == 1


# -- service tiers ----------------------------------------------------------------------------------
MIX = "priority=0.1,default=0.6,flex=0.3"


def test_tier_draws_seeded_and_shares_honoured():
    from pdserve.tiers import ServiceTier

    mix = parse_mix(MIX)
    draws = [t.value for t in take(tier_draws(mix, seed=0), 20)]
    assert draws == ["flex", "default", "default", "default", "flex", "default", "default", "flex", "flex", "default",
                     "default", "default", "priority", "default", "default", "flex", "default", "flex", "flex",
                     "default"]
    assert [t.value for t in take(tier_draws(mix, seed=0), 20)] == draws  # seeded
    assert [t.value for t in take(tier_draws(mix, seed=1), 20)] != draws
    # the order the mix is written in changes nothing
    assert [t.value for t in take(tier_draws(parse_mix("flex=3,default=6,priority=1"), seed=0), 20)] == draws
    n = 100_000
    counts = Counter(take(tier_draws(mix, seed=1), n))
    for tier, share in ((ServiceTier.PRIORITY, 0.1), (ServiceTier.DEFAULT, 0.6), (ServiceTier.FLEX, 0.3)):
        assert counts[tier] / n == pytest.approx(share, abs=0.005)
    only = Counter(take(tier_draws(parse_mix("priority=0,default=1,flex=0"), seed=0), 1000))
    assert only == {ServiceTier.DEFAULT: 1000}  # a zero share is never drawn


def test_tier_mix_changes_no_prompt_length_or_arrival():
    base = ("--num-prompts", "30", "--request-rate", "5", "--lengths", "uniform", "--seed", "3")
    plain, plain_at, *_, plain_desc = build_workload(parse(*base), 1000, [2], 2048)
    tiered, tiered_at, *_, desc = build_workload(parse(*base, "--service-tier-mix", MIX), 1000, [2], 2048)
    plain, tiered = take(plain, 30), take(tiered, 30)
    assert [(r.token_ids, r.max_tokens) for r in tiered] == [(r.token_ids, r.max_tokens) for r in plain]
    assert take(tiered_at, 30) == take(plain_at, 30)
    assert [r.service_tier for r in tiered] == [t.value for t in take(tier_draws(parse_mix(MIX), 3), 30)]
    assert tiered[0].client_kwargs()["service_tier"] == tiered[0].service_tier
    # without a mix no tier is sent at all (the server's default), and the config says nothing of tiers
    assert all(r.service_tier is None and "service_tier" not in r.client_kwargs() for r in plain)
    assert "service_tier_mix" not in plain_desc
    assert desc["service_tier_mix"] == {"priority": 0.1, "default": 0.6, "flex": 0.3}
    # the planner's parsers have no tier flags: build_workload works without them
    args = parse(*base)
    del args.service_tier_mix, args.tier_slo
    assert [r.token_ids for r in take(build_workload(args, 1000, [2], 2048)[0], 30)] == [r.token_ids for r in plain]


def tiered_records() -> list[RequestRecord]:
    """a, b ask for priority (a served as default: downgraded), c for default, d for flex and is refused."""
    a, b, c, d = rec_a(), rec_b(), rec_c(), rec_d()
    a.service_tier, a.served_tier = "priority", "default"
    b.service_tier, b.served_tier = "priority", "priority"
    c.service_tier, c.served_tier = "default", "default"
    d.service_tier, d.error_code, d.error = "flex", "RESOURCE_EXHAUSTED", "flex queue full"
    return [a, b, c, d]


def test_report_split_by_tier():
    recs = tiered_records()
    rep = build_report(recs, Slo(ttft_ms=375, tpot_ms=250))
    # the run as a whole: what it was without tiers, but d's code
    assert rep["completed"] == 3 and rep["good_requests"] == 2 and rep["total_output_tokens"] == 10
    assert rep["failed_by_code"] == {"RESOURCE_EXHAUSTED": 1}
    by = rep["by_service_tier"]
    assert list(by) == ["priority", "default", "flex"]  # rank order
    p, dflt, flex = by["priority"], by["default"], by["flex"]
    assert (p["sent"], p["completed"], p["failed"], p["refused"], p["downgraded"]) == (2, 2, 0, 0, 1)
    assert p["served"] == {"priority": 1, "default": 1}
    assert p["duration"] == 2.25  # the run's: per-tier throughputs add up to the run's
    assert (p["total_input_tokens"], p["total_output_tokens"]) == (30, 9)
    assert p["request_throughput"] == pytest.approx(2 / 2.25) and p["output_throughput"] == pytest.approx(9 / 2.25)
    assert p["mean_ttft_ms"] == pytest.approx(375) and p["p99_ttft_ms"] == pytest.approx(497.5)  # [250, 500]
    assert p["mean_tpot_ms"] == pytest.approx(234.375) and p["median_itl_ms"] == pytest.approx(250)
    assert p["mean_e2el_ms"] == pytest.approx(1187.5) and p["peak_concurrency"] == 2  # a and b overlap at t = 1
    assert (p["good_requests"], p["slo_attainment"]) == (1, 0.5)  # a misses TTFT, b meets both
    assert p["request_goodput"] == pytest.approx(1 / 2.25)
    assert (dflt["sent"], dflt["completed"], dflt["served"], dflt["downgraded"]) == (1, 1, {"default": 1}, 0)
    assert dflt["mean_ttft_ms"] == pytest.approx(375) and dflt["mean_tpot_ms"] is None and dflt["good_requests"] == 1
    assert (flex["sent"], flex["completed"], flex["failed"], flex["refused"], flex["served"]) == (1, 0, 1, 1, {})
    assert flex["failed_by_code"] == {"RESOURCE_EXHAUSTED": 1} and flex["mean_ttft_ms"] is None
    assert (flex["good_requests"], flex["slo_attainment"], flex["request_throughput"]) == (0, 0.0, 0.0)
    assert sum(t["good_requests"] for t in by.values()) == rep["good_requests"]
    # every key of the run's statistics is in each tier's
    stat_keys = set(rep) - {"by_service_tier", "timeline", "requests"}
    assert all(stat_keys <= set(t) for t in by.values())
    assert [(r["service_tier"], r["served_tier"]) for r in rep["requests"]] == [
        ("priority", "default"), ("priority", "priority"), ("default", "default"), ("flex", None)]
    # the tiers of the mix are all reported, even one that drew no request
    assert build_report(recs[:3], tiers=["priority", "default", "flex"])["by_service_tier"]["flex"]["sent"] == 0
    # a success whose stream did not say what it served
    recs[2].served_tier = ""
    assert build_report(recs)["by_service_tier"]["default"]["served"] == {"unreported": 1}
    json.dumps(rep)


def test_no_tiers_no_split():
    rep = build_report([rec_a(), rec_b(), rec_c(), rec_d()], Slo(ttft_ms=375))
    assert "by_service_tier" not in rep and all("service_tier" not in r for r in rep["requests"])
    text = format_report({"mode": "disaggregated", "config": {"workload": "w"}, **rep})
    assert "By service tier" not in text


def test_tier_slo_goodput():
    recs = tiered_records()
    glob = Slo(ttft_ms=375, tpot_ms=250)
    # priority judged by its own TTFT 500: a (TTFT 500, TPOT 250) now meets it; default keeps the global SLO
    rep = build_report(recs, glob, tier_slos={"priority": Slo(ttft_ms=500, tpot_ms=250)})
    by = rep["by_service_tier"]
    assert by["priority"]["slo"] == {"ttft_ms": 500, "tpot_ms": 250, "e2el_ms": None}
    assert by["default"]["slo"] == rep["slo"] == glob.as_dict()
    assert (by["priority"]["good_requests"], by["default"]["good_requests"], by["flex"]["good_requests"]) == (2, 1, 0)
    assert rep["good_requests"] == 3 and rep["slo_attainment"] == 0.75
    assert [r["met_slo"] for r in rep["requests"]] == [True, True, True, False]
    # a stricter priority TPOT: b (218.75) misses 200, so does a
    rep = build_report(recs, glob, tier_slos={"priority": Slo(ttft_ms=500, tpot_ms=200)})
    assert rep["by_service_tier"]["priority"]["good_requests"] == 0 and rep["good_requests"] == 1
    # only a tier SLO: the tiers without one count their successes (they met every SLO given them)
    rep = build_report(recs, Slo(), tier_slos={"priority": Slo(ttft_ms=300)})
    assert rep["by_service_tier"]["priority"]["good_requests"] == 1  # b only
    assert rep["by_service_tier"]["default"]["good_requests"] == 1 and rep["good_requests"] == 2
    text = format_report({"mode": "m", "config": {"workload": "w"}, **rep})
    assert "SLOs:                                   none" in text
    assert "  priority SLOs:                        TTFT<=300ms" in text


def test_tier_slo_flag_merges_with_global():
    from pdserve.loadgen.cli import tier_slos_from_args

    a = parse("--slo-ttft-ms", "375", "--slo-tpot-ms", "250", "--service-tier-mix", MIX,
              "--tier-slo", "priority=500:", "--tier-slo", "flex=:200:9000", "--tier-slo", "auto=100")
    assert tier_slos_from_args(a, Slo(375, 250)) == {"priority": Slo(500, 250), "flex": Slo(375, 200, 9000),
                                                     "default": Slo(100, 250)}
    assert tier_slos_from_args(parse("--service-tier-mix", MIX), Slo(375)) == {}


def test_format_report_tier_rows():
    rep = build_report(tiered_records(), Slo(ttft_ms=375, tpot_ms=250))
    lines = format_report({"mode": "disaggregated", "config": {"workload": "w"}, **rep}).splitlines()
    i = lines.index("Tier       Sent    OK Failed Refused Downgr  SLO % Goodput TTFT p50 TTFT p99 TPOT p50 TPOT p99")
    assert "By service tier asked" in lines[i - 1]
    assert lines[i + 1:i + 4] == [
        "priority      2     2      0       0      1   50.0    0.44    375.0    497.5    234.4    249.7",
        "default       1     1      0       0      0  100.0    0.44    375.0    375.0      n/a      n/a",
        "flex          1     0      1       1      0    0.0    0.00      n/a      n/a      n/a      n/a",
    ]
    assert lines[i + 4] == "=" * 50


@pytest.mark.parametrize("argv, message", [
    (["--service-tier-mix", "priority=0.1,gold=0.9"], "unknown service_tier 'gold'"),
    (["--service-tier-mix", "priority"], "a tier mix is TIER=SHARE"),
    (["--service-tier-mix", "priority=lots"], "must be a number"),
    (["--service-tier-mix", "priority=-1,default=2"], "share >= 0"),
    (["--service-tier-mix", "priority=0.5,priority=0.5"], "each tier once"),
    (["--service-tier-mix", "priority=0,flex=0"], "positive share"),
    (["--service-tier-mix", "=1"], "a tier mix is TIER=SHARE"),
    (["--service-tier-mix", ""], "--service-tier-mix ''"),
    (["--tier-slo", "priority=100:10"], "--tier-slo needs --service-tier-mix"),
    (["--service-tier-mix", MIX, "--tier-slo", "priority:100"], "TIER=TTFT_MS:TPOT_MS[:E2EL_MS]"),
    (["--service-tier-mix", MIX, "--tier-slo", "priority=1:2:3:4"], "TIER=TTFT_MS:TPOT_MS[:E2EL_MS]"),
    (["--service-tier-mix", MIX, "--tier-slo", "priority=fast:10"], "TIER=TTFT_MS:TPOT_MS[:E2EL_MS]"),
    (["--service-tier-mix", MIX, "--tier-slo", "gold=1:2"], "unknown service_tier 'gold'"),
    (["--service-tier-mix", MIX, "--tier-slo", "priority=0:10"], "SLO ttft_ms must be > 0"),
    (["--service-tier-mix", MIX, "--tier-slo", "flex=1:2", "--tier-slo", "flex=3:4"], "given twice for flex"),
])
def test_cli_rejects_bad_tier_flags(argv, message, capsys):
    from pdserve.cli import main

    assert main(["bench", "--target", "127.0.0.1:1", *argv]) == 2  # on the flags, before the network
    assert message in capsys.readouterr().err


class TieredGeneration(pb_grpc.GenerationServicer):
    """A synchronous scripted router: records the tier each request asks for (by its first prompt token);
    refuses flex at once (RESOURCE_EXHAUSTED), serves priority as default when the first token is even,
    and reports nothing served when no tier was asked (as a server without tiers)."""

    def __init__(self):
        self.seen: list[tuple[int, str]] = []

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(name="scripted", vocab_size=64, max_model_len=256, eos_token_ids=[0])

    def GetClusterStatus(self, request, context):
        return pb.ClusterStatus(mode="scripted")

    def Generate(self, request, context):
        first = request.token_ids.ids[0]
        self.seen.append((first, request.service_tier))
        if request.service_tier == "flex":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "flex queue full")
        served = ("default" if first % 2 == 0 else "priority") if request.service_tier == "priority" \
            else request.service_tier
        for i in range(request.max_tokens):
            r = pb.GenerateResponse(request_id="x", token_ids=[i])
            if i == request.max_tokens - 1:
                r.finish_reason = pb.FINISH_REASON_LENGTH
                r.usage.prompt_tokens = len(request.token_ids.ids)
                r.service_tier = served
            yield r


@pytest.fixture
def tiered_server():
    from concurrent import futures

    servicer = TieredGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_bench_sends_tiers_and_records_served(tiered_server, tmp_path, capsys):
    from pdserve.cli import main

    servicer, target = tiered_server
    flags = ["--num-prompts", "24", "--input-len", "8", "--output-len", "3", "--seed", "7",
             "--service-tier-mix", "priority=0.25,default=0.5,flex=0.25", "--tier-slo", "priority=60000:60000"]
    out = tmp_path / "run.json"
    assert main(["bench", "--target", target, "--warmup", "0", "--no-progress", "--output", str(out), *flags]) == 0
    sent = take(build_workload(parse(*flags), 64, [0], 256)[0], 24)
    asked = Counter(r.service_tier for r in sent)
    assert asked == {"default": 13, "flex": 4, "priority": 7}
    # on the wire: each prompt with the tier drawn for it
    assert sorted(servicer.seen) == sorted((r.token_ids[0], r.service_tier) for r in sent)
    rep = json.loads(out.read_text())
    by = rep["by_service_tier"]
    down = sum(1 for r in sent if r.service_tier == "priority" and r.token_ids[0] % 2 == 0)
    assert down == 3  # both outcomes happen
    assert (by["priority"]["sent"], by["priority"]["completed"], by["priority"]["downgraded"]) == (7, 7, down)
    assert by["priority"]["served"] == {k: v for k, v in (("priority", 7 - down), ("default", down)) if v}
    assert (by["default"]["sent"], by["default"]["served"], by["default"]["refused"]) == (13, {"default": 13}, 0)
    assert (by["flex"]["sent"], by["flex"]["completed"], by["flex"]["refused"]) == (4, 0, 4)
    assert rep["failed_by_code"] == {"RESOURCE_EXHAUSTED": 4} and rep["completed"] == 20
    assert by["priority"]["slo"]["ttft_ms"] == 60000 and by["priority"]["good_requests"] == 7
    assert by["default"]["good_requests"] == 13 and rep["good_requests"] == 20  # no global SLO: successes count
    assert [r["service_tier"] for r in rep["requests"]] == [r.service_tier for r in sent]
    assert rep["config"]["service_tier_mix"] == {"priority": 0.25, "default": 0.5, "flex": 0.25}
    text = capsys.readouterr().out
    assert "\nflex          4     0      4       4      0    0.0    " in text
    # without a mix: no tier on the wire, none served, no split
    servicer.seen.clear()
    assert main(["bench", "--target", target, "--warmup", "0", "--no-progress", "--output", str(out),
                 *flags[:8]]) == 0
    assert len(servicer.seen) == 24 and {t for _, t in servicer.seen} == {""}
    rep = json.loads(out.read_text())
    assert "by_service_tier" not in rep and "service_tier_mix" not in rep["config"] and rep["completed"] == 24
