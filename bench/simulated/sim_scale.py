"""Dozens of simulated workers under an RL-like bursty trace, and the planner's simulator on the same trace
and cluster, side by side in one run (issue #31).

    .venv/bin/python -m bench.simulated.sim_scale [--prefill-workers 8] [--decode-workers 24] [--gpu H100]
        [--model llama3-8b] [--waves 2] [--requests-per-wave 256] [--burst 5] [--period 40]
        [--input-mean 512] [--output-mean 128] [--time-scale 8] [--autoscale] [--json FILE]

The trace is bench.simulated.autoscale_sim's (waves of rollouts arriving within --burst seconds, one every --period
seconds; log-normal prompts and outputs, seeded), in the simulated GPU's time. The cluster: `pdserve serve
--load-format sim` with --prefill-workers + --decode-workers simulated workers of the model on the GPU (each
step sleeps the roofline's time x --time-scale, its KV held --sim-kv-scale times smaller), driven by `pdserve
bench` replaying the trace with its timestamps x --time-scale. Measured TTFT and TPOT are divided by the time
scale back into the GPU's time. The planner's simulator (pdserve.planner.simulator) runs the same trace on the
same cluster shape (pools, KV blocks, token budget, running cap) with the same step costs.

--autoscale: the pools are 1:--prefill-workers and 1:--decode-workers, sized by the router's autoscaler
(targets --slo-ttft-ms and --slo-tpot-ms in GPU time, its interval, window and scale-down delay in real
seconds); the planner's simulator runs the same policy with the same settings divided by the time scale, a
worker placeable the cluster's measured start-to-ready time (divided by the scale) after it is asked for.
Worker-seconds (every state, starting included) are read from /metrics every 0.5 s while the trace runs.
The router's autoscaler measures the arrival rate from when it began serving; the trace's first request
comes some seconds later (the bench client's start): the planner's requests are shifted by that gap
(divided by the scale), so that both autoscalers see the same rates, and its GPU-seconds exclude the two
workers' time over it (the cluster's count starts with the trace).

Printed: each worker's memory (RSS and PSS from /proc: PSS shares the pages of the libraries they all map),
the workers' late steps (a step whose host work outlasted its simulated time: the host did not keep up, so
the run no longer stands for the GPU; raise --time-scale), failed requests, and median and p99 TTFT and TPOT
of the cluster beside the planner's, with their ratio and whether the medians are within 15 %, and the
GPU-seconds each used.

bench.router.router_scale also drives simulated workers, to measure the router (its tokens/s, added latency and
CPU); this script measures the workers and the planner's simulator against each other, the router in the way.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from bench.common import (ROOT, Server, bench_report, late_steps, parser, pool_sums, rl_trace, run_header,
                          session_pids, write_json)
from pdserve.perf.hardware import gpu, kv_budget_bytes, resolve_model, roofline
from pdserve.planner.autoscale import Autoscaler, PoolLimits
from pdserve.planner.simulator import ClusterShape, PoolShape, simulate

WITHIN = 0.15
KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
# The router's autoscaler settings with --autoscale, in real seconds (the planner's: these / the time scale).
AUTOSCALE_INTERVAL_S, AUTOSCALE_WINDOW_S, SCALE_DOWN_DELAY_S = 2.0, 30.0, 30.0


def worker_memory(server: Server) -> list[dict]:
    """RSS and PSS (MiB) of each worker process of the server's session (Ray names them ray::ClassName)."""
    out = []
    for pid in session_pids(server.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        if not cmd.startswith("ray::") or "Actor" not in cmd:
            continue
        kib = {ln.split(":")[0]: int(ln.split()[1]) for ln in rollup.splitlines()[1:] if ln.split()[-1] == "kB"}
        out.append({"pid": pid, "process": cmd, "rss_mib": kib["Rss"] / 1024, "pss_mib": kib["Pss"] / 1024})
    return out


class WorkerSeconds:
    """Workers of every state (starting, ready, draining) summed over time while the block runs, from
    /metrics every 0.5 s: the cluster's worker-seconds, as the planner counts them (asked for to gone)."""

    def __init__(self, server: Server):
        self.server, self.seconds = server, 0.0
        self.first_request_at: float | None = None  # wall clock
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True),
                         threading.Thread(target=self._watch_first, daemon=True)]

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.5):
            try:
                n = sum(pool_sums(self.server.metrics_page(), "pdserve_pool_workers").values())
            except OSError:
                continue
            now = time.monotonic()
            self.seconds += n * (now - last)
            last = now

    def _watch_first(self) -> None:
        """The wall-clock time the router first has a request running (polled every 20 ms)."""
        while self.first_request_at is None and not self._stop.wait(0.02):
            try:
                page = self.server.metrics_page()
            except OSError:
                continue
            if any(ln.startswith("pdserve_router_requests_running ") and float(ln.split()[1]) > 0
                   for ln in page.splitlines()):
                self.first_request_at = time.time()

    def __enter__(self) -> WorkerSeconds:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)


def serving_since(log: str) -> float | None:
    """The wall-clock time the router began serving, from its log line "pdserve listening on ..."."""
    for line in log.splitlines():
        if "pdserve listening on" in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.replace(tzinfo=datetime.now().astimezone().tzinfo).timestamp()
    return None


def start_seconds(server: Server) -> float | None:
    """The workers' mean time from start to ready (pdserve_worker_start_seconds), over every pool."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for fam in text_string_to_metric_families(server.metrics_page()):
        for smp in fam.samples if fam.name == "pdserve_worker_start_seconds" else ():
            total += smp.value if smp.name.endswith("_sum") else 0.0
            count += smp.value if smp.name.endswith("_count") else 0.0
    return total / count if count else None


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prefill-workers", type=int, default=8)
    ap.add_argument("--decode-workers", type=int, default=24)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--model", default="llama3-8b", help="the simulated shape")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--requests-per-wave", type=int, default=256)
    ap.add_argument("--burst", type=float, default=5.0, help="seconds (GPU time) over which a wave arrives")
    ap.add_argument("--period", type=float, default=40.0, help="seconds (GPU time) from one wave to the next")
    ap.add_argument("--input-mean", type=float, default=512)
    ap.add_argument("--output-mean", type=float, default=128)
    ap.add_argument("--time-scale", type=float, default=8.0, help="--sim-time-scale: real seconds per GPU second")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=2048, help="--prefill-token-budget")
    ap.add_argument("--worker-cpus", type=float, default=0.0625)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--autoscale", action="store_true",
                    help="pools of 1:--prefill-workers and 1:--decode-workers, sized by the router's autoscaler "
                         "(and by the planner's, with the same settings, in the simulator)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="--autoscale: TTFT target (GPU time)")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0, help="--autoscale: TPOT target (GPU time)")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    head = run_header()

    name, cfg = resolve_model(args.model)
    device = gpu(args.gpu)
    costs = roofline(cfg, device, 2)  # bfloat16, as the simulated workers run
    kv_blocks = kv_budget_bytes(device, costs.resident_weight_bytes) // (costs.kv_bytes_per_token * args.block_size)
    arrival, inputs, outputs = rl_trace(args.waves, args.requests_per_wave, args.burst, args.period, args.input_mean,
                                        args.output_mean, cfg.max_position_embeddings)
    print(f"{len(arrival)} requests in {args.waves} waves of {args.requests_per_wave} within {args.burst:g} s every "
          f"{args.period:g} s ({args.gpu} time; x{args.time_scale:g} on this machine); prompts mean "
          f"{inputs.mean():.0f}, outputs mean {outputs.mean():.0f} (max {outputs.max()}); {kv_blocks} KV blocks "
          f"a worker", flush=True)

    with tempfile.TemporaryDirectory(prefix="pdserve-sim-scale-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        trace.write_text("".join(json.dumps({"input_len": int(i), "output_len": int(o),
                                             "timestamp": float(a) * args.time_scale}) + "\n"
                                 for a, i, o in zip(arrival, inputs, outputs)))
        sizes = {pool: f"1:{n}" if args.autoscale else str(n)
                 for pool, n in (("prefill", args.prefill_workers), ("decode", args.decode_workers))}
        flags = ["--load-format", "sim", "--model", args.model, "--dtype", "bfloat16", "--sim-gpu", args.gpu,
                 "--sim-time-scale", str(args.time_scale), "--prefill-workers", sizes["prefill"],
                 "--decode-workers", sizes["decode"], "--worker-cpus", str(args.worker_cpus),
                 "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
                 "--prefill-token-budget", str(args.token_budget), "--max-running", str(10**6),
                 "--max-queued", str(10**6)]
        if args.autoscale:  # the router's autoscaler in real time: the GPU's targets x the scale
            flags += ["--slo-ttft-ms", str(args.slo_ttft_ms * args.time_scale), "--slo-tpot-ms",
                      str(args.slo_tpot_ms * args.time_scale), "--scale-down-delay", str(SCALE_DOWN_DELAY_S),
                      "--autoscale-interval", str(AUTOSCALE_INTERVAL_S)]
        server = Server(flags, Path(tmp) / "serve.log")
        try:
            t0 = time.monotonic()
            server.wait_ready(2 if args.autoscale else args.prefill_workers + args.decode_workers, args.start_timeout)
            ready_s = time.monotonic() - t0
            memory = worker_memory(server)
            blocks = pool_sums(server.metrics_page(), "pdserve_worker_kv_blocks")
            out = Path(tmp) / "bench.json"
            span = float(arrival.max()) * args.time_scale
            cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--target", f"127.0.0.1:{server.port}", "--trace",
                   str(trace), "--arrival", "trace", "--ignore-eos", "--seed", "3", "--warmup", "0", "--timeout",
                   str(span + 600), "--output", str(out), "--no-progress"]
            t0 = time.monotonic()
            with WorkerSeconds(server) as counted:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=span + 900,
                                    check=False).returncode
            wall, worker_seconds = time.monotonic() - t0, counted.seconds
            log = server.log.read_text()
            serving = serving_since(log)
            # The router watches demand from when it serves (its window's start), the simulator from time 0:
            # the planner's requests come this much later, as the cluster's did.
            gap_s = max(counted.first_request_at - serving, 0.0) if serving and counted.first_request_at else 0.0
            start_s = start_seconds(server) or ready_s
            late, steps = late_steps(server)
        finally:
            server.stop()
        rep = bench_report(out, rc, f"pdserve bench failed: {shlex.join(cmd)}", log)

    # The planner's simulator: the same shape (pools, or their ranges and the autoscaler), costs and trace.
    pool = lambda n: PoolShape(n, kv_blocks, args.block_size, args.max_num_seqs, args.token_budget)  # noqa: E731
    scale = args.time_scale
    extra = {}
    if args.autoscale:
        limits = PoolLimits(kv_blocks, args.block_size, args.max_num_seqs, args.token_budget)
        scaler = Autoscaler(costs, {"prefill": limits, "decode": limits},
                            {"prefill": (1, args.prefill_workers), "decode": (1, args.decode_workers)},
                            args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, SCALE_DOWN_DELAY_S / scale, start_s / scale)
        extra = dict(autoscaler=scaler, interval_s=AUTOSCALE_INTERVAL_S / scale, window_s=AUTOSCALE_WINDOW_S / scale,
                     startup_s=start_s / scale)
    first = 1 if args.autoscale else None
    shape = ClusterShape("disaggregated", pool(first or args.prefill_workers), pool(first or args.decode_workers),
                         max_running=10**6, max_queued=10**6)
    t0 = time.perf_counter()
    gap = gap_s / scale if args.autoscale else 0.0  # GPU seconds between serving and the first request
    res = simulate(shape, costs, arrival + gap, inputs, outputs, **extra)
    ok = res.ok
    tpot = res.tpot[ok][~np.isnan(res.tpot[ok])]
    ttft = res.ttft[ok]
    planned = {"median_ttft_ms": float(np.median(ttft)) * 1e3, "p99_ttft_ms": float(np.percentile(ttft, 99)) * 1e3,
               "median_tpot_ms": float(np.median(tpot)) * 1e3, "p99_tpot_ms": float(np.percentile(tpot, 99)) * 1e3,
               # less the two first workers' time over the gap: the cluster's count starts with the trace
               "gpu_seconds": res.worker_seconds - 2 * gap, "completed": int(ok.sum()),
               "sim_seconds": time.perf_counter() - t0}

    measured = {k: (rep[k] / scale if rep.get(k) is not None else None) for k in KEYS}
    measured["gpu_seconds"] = worker_seconds / scale
    rss, pss = [m["rss_mib"] for m in memory], [m["pss_mib"] for m in memory]
    per_worker = "" if args.autoscale else "; KV blocks a worker " + str(
        {k: v / (args.prefill_workers if k == "prefill" else args.decode_workers) for k, v in blocks.items()})
    print(f"\nready in {ready_s:.0f} s (a worker's start: {start_s:.0f} s); {len(memory)} worker processes: RSS mean "
          f"{np.mean(rss):.0f} MiB (max {max(rss):.0f}), PSS mean {np.mean(pss):.0f} MiB, {sum(pss) / 1024:.2f} GiB "
          f"in all{per_worker}")
    print(f"bench: {rep['completed']} completed, {rep['failed']} failed {rep['failed_by_code']} in {wall:.0f} s; "
          f"late steps {late} of {steps}")
    print(f"\n| {args.gpu} time | cluster (sim engine) | planner | ratio | within {WITHIN:.0%} |\n"
          "|---|---|---|---|---|")
    rows = {}
    for k in (*KEYS, "gpu_seconds"):
        m, p = measured[k], planned[k]
        ratio = m / p if m is not None and p else None
        rows[k] = {"cluster": m, "planner": p, "ratio": ratio}
        judged = "yes" if ratio is not None and abs(ratio - 1) <= WITHIN else ("no" if k.startswith("median") else "-")
        if k == "gpu_seconds":
            judged = "-"
        print(f"| {k} | {m:.1f} | {p:.1f} | {ratio:.2f} | {judged} |" if ratio is not None
              else f"| {k} | - | {p:.1f} | - | - |")
    if args.json:
        write_json(args.json, {**head, "args": vars(args), "serve_flags": flags, "ready_s": ready_s, "start_s": start_s,
                               "serving_to_first_request_s": gap_s,
                               "memory": memory, "late_steps": late, "steps": steps, "bench": rep, "planner": planned,
                               "compare": rows})
        print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
