"""Disaggregated (xPyD) versus colocated on the same machine: one seeded workload, one table.

    .venv/bin/python -m bench.cluster.compare_modes [--prefill-workers 1] [--decode-workers 1] [--output both.json]
                                                    [--plot both.png] [any `pdserve bench` flag ...]

In one run: start a local Ray cluster (loopback); start the pools in disaggregated mode (P prefill + D
decode workers) and the gRPC router, run `pdserve bench` against it in a separate process, shut it down;
then the same with P + D colocated workers (each does both phases), the same torch threads per worker
(cores // workers), the same KV cache, batching limits and Ray CPU share per worker, and the same
seeded workload. Prints one table: goodput, SLO attainment, throughput, TTFT/TPOT/ITL/E2EL percentiles
of each mode and their ratio (disaggregated / colocated: below 1 is better for a latency, above 1 for
goodput and throughput).

Flags this script does not know go to `pdserve bench` after its defaults (bench.common.MODES_BENCH_ARGS), so
`--request-rate 2` or `--num-prompts 32` overrides them.

bench.simulated.sim_modes asks the same question of GPUs (the simulated engine, `pdserve plan`'s best of each
mode on N GPUs, measured beside planned); this script runs the real model on this machine, the xPyD you name.
"""
from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

from bench.common import (MODES_BENCH_ARGS, Table, bench_report, local_cluster, local_router, parser, pdserve_bench,
                          write_json)

ROWS = [  # (label, report key, format, better when higher)
    ("completed / failed", None, "", None),
    ("request goodput (req/s)", "request_goodput", ".3f", True),
    ("SLO attainment (%)", "slo_attainment", "pct", True),
    ("request throughput (req/s)", "request_throughput", ".3f", True),
    ("output throughput (tok/s)", "output_throughput", ".1f", True),
    *((f"{s} TTFT (ms)", f"{k}_ttft_ms", ".0f", False) for s, k in
      (("mean", "mean"), ("median", "median"), ("p90", "p90"), ("p99", "p99"))),
    *((f"{s} TPOT (ms)", f"{k}_tpot_ms", ".1f", False) for s, k in
      (("mean", "mean"), ("median", "median"), ("p90", "p90"), ("p99", "p99"))),
    ("median ITL (ms)", "median_itl_ms", ".1f", False),
    ("p99 ITL (ms)", "p99_itl_ms", ".1f", False),
    ("median E2EL (ms)", "median_e2el_ms", ".0f", False),
    ("p99 E2EL (ms)", "p99_e2el_ms", ".0f", False),
    # Split of the ITL: the first gap holds the KV hand-off in disaggregated mode; the later ones show
    # whether prefills interrupt decoding (colocated steps mix them in).
    ("median 1st->2nd token gap (ms)", "median_first_gap_ms", ".0f", False),
    ("median ITL after the 2nd token (ms)", "median_later_itl_ms", ".1f", False),
    ("p99 ITL after the 2nd token (ms)", "p99_later_itl_ms", ".1f", False),
    ("max ITL after the 2nd token (ms)", "max_later_itl_ms", ".1f", False),
]


def fmt(v, spec: str) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.1f}" if spec == "pct" else format(v, spec)


def table(names: tuple[str, str], a: dict, b: dict) -> str:
    w = max(len(n) for n in names) + 2
    t = Table(("", 30, "<"), (names[0], w, ""), (names[1], w, ""), ("ratio", 9, ""), sep="")
    lines = [t.header(), "-" * t.width]
    for label, key, spec, _ in ROWS:
        if key is None:
            va, vb, ratio = f"{a['completed']} / {a['failed']}", f"{b['completed']} / {b['failed']}", ""
        else:
            va, vb = fmt(a[key], spec), fmt(b[key], spec)
            ratio = f"{a[key] / b[key]:.2f}" if a[key] is not None and b[key] else "n/a"
        lines.append(t.row(label, va, vb, ratio))
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--torch-threads", type=int, default=None, help="per worker (default: cores // workers)")
    ap.add_argument("--prefill-threads", type=int, default=None, help="per prefill worker (default: --torch-threads)")
    ap.add_argument("--only", choices=["disaggregated", "colocated"], default=None, help="run one mode")
    ap.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache per worker")
    ap.add_argument("--prefill-token-budget", type=int, default=512, help="tokens per step (both modes)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--output", default=None, metavar="FILE.json", help="both reports and the settings")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="both runs on one figure")
    args, bench_args = ap.parse_known_args()

    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from router.pools import init_local_ray

    workers = args.prefill_workers + args.decode_workers
    cores = os.cpu_count() or 1
    threads = args.torch_threads or max(1, cores // workers)
    cache = CacheConfig(memory_bytes=args.kv_cache_mib << 20)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.prefill_token_budget)
    cpus = min(0.5, cores / (workers + 1))  # fractional: all workers must fit beside the driver

    def pool(n: int, torch_threads: int = threads) -> PoolConfig:
        return PoolConfig(n, num_cpus=cpus, cache=cache, scheduler=sched, torch_threads=torch_threads)

    engine = EngineConfig(model=args.model, cache=cache, scheduler=sched)
    xpyd = f"{args.prefill_workers}P{args.decode_workers}D"
    modes = {
        f"disaggregated {xpyd}": ClusterConfig(engine=engine,
                                              prefill=pool(args.prefill_workers, args.prefill_threads or threads),
                                              decode=pool(args.decode_workers)),
        f"colocated x{workers}": ClusterConfig(engine=engine, mode="colocated", colocated=pool(workers)),
    }
    cmd_args = [*MODES_BENCH_ARGS, *bench_args]
    print(f"{cores} cores; {workers} workers per mode, {threads} torch thread(s) each; "
          f"pdserve bench {' '.join(cmd_args)}", flush=True)
    init_local_ray()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-compare-"))

    async def run_mode(name: str, config: ClusterConfig) -> dict:
        t = time.perf_counter()
        out = tmp / f"{name.split()[0]}.json"
        async with local_cluster(config) as cluster, local_router(cluster) as router:
            print(f"\n## {name}: started in {time.perf_counter() - t:.0f}s on 127.0.0.1:{router.port}", flush=True)
            rc = await pdserve_bench(router.port, cmd_args, name, out)
        return bench_report(out, rc, f"pdserve bench failed in {name} mode")

    reports = {name: asyncio.run(run_mode(name, cfg)) for name, cfg in modes.items()
               if args.only is None or name.startswith(args.only)}
    if len(reports) == 1:
        return
    (na, a), (nb, b) = reports.items()
    print(f"\n{'':30}workload: {a['config']['workload']}; SLOs: "
          + ", ".join(f"{k[:-3].upper()} <= {v:g} ms" for k, v in a["slo"].items() if v is not None))
    print(table((na, nb), a, b))
    if args.output:
        write_json(args.output, {"bench_args": cmd_args, "torch_threads": threads, "cores": cores, "reports": reports})
        print(f"reports: {args.output}")
    if args.plot:
        from pdserve.loadgen.plot import plot_reports

        plot_reports(list(reports.items()), args.plot, title=f"disaggregated vs colocated: {a['config']['workload']}")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
