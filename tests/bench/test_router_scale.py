"""bench.router.router_scale's arithmetic on canned numbers: the workers' counters from a /metrics page, step
times, router CPU per token and per request, a table row and the markdown (no cluster)."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from bench.router import router_scale as rs


def metrics_page(counters: dict[tuple[str, str], tuple[float, float]]) -> str:
    """A /metrics page with the two worker counters, made as the router's WorkerCollector makes them."""
    class Workers:
        def collect(self):
            for name, i in (("pdserve_worker_busy_seconds", 0), ("pdserve_worker_steps", 1)):
                f = CounterMetricFamily(name, "doc", labels=["pool", "worker"])
                for (pool, worker), values in counters.items():
                    f.add_metric([pool, worker], values[i])
                yield f

    reg = CollectorRegistry()
    reg.register(Workers())
    return generate_latest(reg).decode()


def test_counters_and_step_times():
    before = rs.parse_worker_counters(metrics_page({("prefill", "p0"): (1.0, 10), ("decode", "d0"): (2.0, 100),
                                                    ("decode", "d1"): (3.0, 200)}))
    assert before[("decode", "d1")] == {"busy": 3.0, "steps": 200}
    after = rs.parse_worker_counters(metrics_page({("prefill", "p0"): (1.5, 30), ("decode", "d0"): (2.25, 120),
                                                   ("decode", "d1"): (3.75, 260), ("decode", "d2"): (9.0, 9)}))
    # decode: (0.25 + 0.75) s over (20 + 60) steps; d2 started between the scrapes and is left out
    assert rs.step_ms(before, after, "decode") == pytest.approx(12.5)
    assert rs.step_ms(before, after, "prefill") == pytest.approx(25.0)
    assert rs.step_ms(before, before, "decode") is None  # no steps


def run(tokens: int, requests: int, router_cpu: float, wall: float, client_cpu: float = 0.0, **report) -> dict:
    rep = {"total_output_tokens": tokens, "completed": requests, "failed": 0, "duration": wall / 2,
           "output_throughput": tokens / (wall / 2), "request_throughput": requests / (wall / 2),
           "median_later_itl_ms": 9.0, "p99_later_itl_ms": 20.0, "median_ttft_ms": 100.0, "p99_ttft_ms": 300.0}
    return {"report": {**rep, **report}, "router_cpu_s": router_cpu, "wall_s": wall, "client_cpu_s": client_cpu,
            "decode_step_ms": 8.0, "prefill_step_ms": 25.0}


def test_cpu_per_token_and_request():
    # 100 us a token, 5 ms a request, and an idle router taking 1 % of a core through each run's wall time
    idle, per_tok, per_req = 0.01, 100e-6, 5e-3
    long = run(8192, 64, 8192 * per_tok + 64 * per_req + idle * 10, 10.0, client_cpu=4.0)
    short = run(1024, 64, 1024 * per_tok + 64 * per_req + idle * 4, 4.0)
    assert rs.solve_cpu(long, short, idle) == (pytest.approx(per_tok), pytest.approx(per_req))
    assert rs.solve_cpu(long, long, idle) == (None, None)  # one length: nothing to solve

    row = rs.row_of(16, long, short, idle, client_base_s=2.0)
    assert row["router_us_per_token"] == pytest.approx(100.0)
    assert row["router_ms_per_request"] == pytest.approx(5.0)
    assert row["added_itl_p50_ms"] == pytest.approx(1.0) and row["added_itl_p99_ms"] == pytest.approx(12.0)
    assert row["added_ttft_p50_ms"] == pytest.approx(75.0) and row["added_ttft_p99_ms"] == pytest.approx(275.0)
    # the router's CPU over the bench's own 5 s, its idle rate over the other 5 s of the wall time taken out
    assert row["router_core_pct"] == pytest.approx(100 * (8192 * per_tok + 64 * per_req + idle * 5) / 5)
    assert row["client_core_pct"] == pytest.approx(100 * 2.0 / 5)
    assert row["tokens_per_s"] == pytest.approx(8192 / 5)


def test_markdown():
    long, short = run(8192, 64, 1.0, 10.0), run(1024, 64, 0.5, 4.0)
    row = rs.row_of(32, long, short, 0.0, 0.0)
    row["decode_step_ms"] = row["added_itl_p50_ms"] = None  # a pool with no steps in the run
    lines = rs.markdown([row]).splitlines()
    assert len(lines) == 3 and all(ln.count("|") == len(rs.COLUMNS) + 1 for ln in lines)
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    titles = [t for t, _, _ in rs.COLUMNS]
    assert cells[0] == "32" and cells[titles.index("decode step")] == "n/a" and cells[titles.index("+ITL p50")] == "n/a"
    assert cells[titles.index("tok/s")] == "1638"


def test_two_clients_reports_merge():
    """Two routers' clients at once: rates and counts add up, p50s average, p99s take the worse."""
    a = {"output_throughput": 1000.0, "request_throughput": 8.0, "total_output_tokens": 4096, "completed": 32,
         "failed": 0, "duration": 4.0, "median_later_itl_ms": 9.0, "p99_later_itl_ms": 20.0, "median_ttft_ms": 100.0,
         "p99_ttft_ms": 300.0, "mean_ttft_ms": 120.0}
    b = dict(a, output_throughput=900.0, failed=1, duration=4.5, median_later_itl_ms=11.0, p99_later_itl_ms=35.0,
             p99_ttft_ms=250.0)
    m = rs.merge_reports([a, b])
    assert (m["output_throughput"], m["completed"], m["failed"], m["duration"]) == (1900.0, 64, 1, 4.5)
    assert m["median_later_itl_ms"] == pytest.approx(10.0) and m["p99_later_itl_ms"] == 35.0
    assert m["p99_ttft_ms"] == 300.0 and m["mean_ttft_ms"] == 120.0
    assert rs.merge_reports([a]) is a
