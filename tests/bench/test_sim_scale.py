"""bench.simulated.sim_scale and bench.simulated.sim_modes without a cluster: the per-pool sums they read from
a /metrics page made by the router's own collector (bench.common.pool_sums), the router's listening line, and
the claim that stretching a workload by the time scale (rate / scale, SLOs x scale, same seed) sends the same
requests at the same moments, scaled."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
from prometheus_client import generate_latest

from bench.common import pool_sums
from bench.simulated import sim_modes
from bench.simulated.sim_scale import serving_since
from pdserve.loadgen.cli import add_bench_parser
from pdserve.planner.plan import workload_from_args
from pdserve.serving.messages import WorkerStats
from router.metrics import RouterMetrics


def stats(pool: str, worker: str, steps: int, late: int) -> WorkerStats:
    return WorkerStats(worker_id=worker, pool=pool, waiting=0, waiting_tokens=0, running=0, kv_blocks_used=0,
                       kv_blocks_total=100, steps=steps, late_steps=late)


def test_late_steps_and_steps_are_summed_by_pool():
    workers = [stats("prefill", "prefill-0", 10, 1), stats("decode", "decode-0", 300, 2),
               stats("decode", "decode-1", 200, 0)]
    page = generate_latest(RouterMetrics(lambda: workers).registry).decode()
    assert pool_sums(page, "pdserve_worker_late_steps") == {"prefill": 1, "decode": 2}
    assert pool_sums(page, "pdserve_worker_steps") == {"prefill": 10, "decode": 500}
    assert pool_sums(page, "pdserve_worker_kv_blocks") == {"prefill": 100, "decode": 200}  # a gauge


def test_a_stretched_workload_is_the_same_requests_later():
    opts = argparse.Namespace(rate=80.0, long_rate=25.0, num_prompts=50, slo_ttft_ms=500.0, slo_tpot_ms=40.0)

    def workload(name: str, scale: float):
        p = argparse.ArgumentParser()
        add_bench_parser(p.add_subparsers())  # the flags as `pdserve bench` parses them
        args = p.parse_args(["bench", *sim_modes.workload_args(opts, name, scale)])
        return args, workload_from_args(args, 128256, [128001], 8192)

    for name in sim_modes.WORKLOADS:
        args1, gpu = workload(name, 1.0)
        args16, slow = workload(name, 16.0)
        assert (gpu.input_len == slow.input_len).all() and (gpu.output_len == slow.output_len).all()
        assert len(gpu.arrival) == 50 and np.allclose(slow.arrival, 16 * gpu.arrival, rtol=1e-9)
        assert (args16.slo_ttft_ms, args16.slo_tpot_ms) == (16 * args1.slo_ttft_ms, 16 * args1.slo_tpot_ms)
    assert gpu.input_len.mean() > 1000  # the long-prompt workload


def test_serving_since_reads_the_routers_listening_line():
    import logging

    # A line as the router's logging writes it (local time, milliseconds after a comma).
    record = logging.LogRecord("router.server", logging.INFO, "", 0, "pdserve listening on 127.0.0.1:5 (x)", (), None)
    line = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s").format(record)
    log = "2026-11-25 07:58:16,522 INFO router.pools: starting 1 prefill worker\n" + line + "\n"
    assert serving_since(log) == pytest.approx(record.created, abs=1e-3)
    assert serving_since("no such line\n") is None
