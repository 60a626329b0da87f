"""Autoscaled pools against a fixed cluster on bursty load, on this machine, side by side in one run.

    .venv/bin/python -m bench.cluster.autoscale_bursts [--profile profile.json] [--output out.json]
        [--scale-down-delay 15] [--slo-ttft-ms 10000] [--slo-tpot-ms 120] [any `pdserve bench` flag ...]

1. Profile this machine (`pdserve profile`, about 2 minutes, one torch thread as each worker gets),
   unless --profile names one: the cost model the autoscaler sizes the pools by.
2. Serve the default model (SmolLM2-135M) with pools of 1:2 prefill and 1:2 decode workers, and drive
   it with `pdserve bench` in its own process: two bursts of 24 requests, 60 s apart (seeded). Every
   0.25 s the pools' sizes are sampled; the router's scaling and drain log lines are kept.
3. The same workload on a fixed 2P2D cluster.
4. Print, for both: requests completed and failed, SLO attainment, TTFT and TPOT percentiles,
   worker-seconds over the run (every worker with an actor: starting, ready or draining), and for the
   autoscaled run the pools' sizes over time (largest in each burst, smallest between them), the
   workers' time to ready, and the scale and drain events.

Both clusters give every worker one torch thread and the same Ray CPU share. On a 2-core machine more
workers add no cores: the fixed 2P2D cluster is four workers time-sharing two cores, so what its extra
workers buy here is batching room and queues, not compute; on GPUs each worker is its own device.

bench.simulated.autoscale_sim asks the same question of GPUs at scale (the roofline, RL waves of thousands of
requests, GPU-hours) through the planner's simulator; this script measures real workers, on this machine.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (Table, bench_report, local_cluster, local_router, parser, pdserve_bench, pdserve_profile,
                          write_json)

BENCH_ARGS = ["--num-prompts", "48", "--arrival", "bursty", "--burst-size", "24", "--burst-interval", "60",
              "--lengths", "uniform", "--input-len", "128", "--output-len", "96", "--range-ratio", "0.25",
              "--seed", "0", "--timeout", "600"]
SAMPLE_S = 0.25


class Lines(logging.Handler):
    """The router's scaling and drain log lines, with seconds since `t0`."""

    def __init__(self, t0: float):
        super().__init__(logging.INFO)
        self.t0, self.lines = t0, []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if any(k in msg for k in ("scaling", "drained in", "ready in", "pool:")):
            self.lines.append(f"{time.monotonic() - self.t0:7.1f} s  {msg}")


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--profile", default=None, help="a `pdserve profile` JSON (default: profile now)")
    ap.add_argument("--max-workers", type=int, default=2, help="each pool's MAX (and the fixed cluster's size)")
    ap.add_argument("--scale-down-delay", type=float, default=15.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=10000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=120.0)
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--prefill-token-budget", type=int, default=512)
    ap.add_argument("--output", default=None, metavar="FILE.json")
    args, extra = ap.parse_known_args()

    from pdserve.config import AutoscaleConfig, CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from router.pools import init_local_ray

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-autoscale-"))
    profile = args.profile
    if profile is None:
        profile = str(tmp / "profile.json")
        t = time.perf_counter()
        pdserve_profile(profile)
        print(f"profiled in {time.perf_counter() - t:.0f} s", flush=True)
    bench_args = [*BENCH_ARGS, "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms), *extra]
    n = args.max_workers
    cores = os.cpu_count() or 1
    cache = CacheConfig(memory_bytes=args.kv_cache_mib << 20)
    sched = SchedulerConfig(max_num_batched_tokens=args.prefill_token_budget)
    cpus = min(0.5, cores / (2 * n + 1))

    def pool(lo: int, hi: int | None) -> PoolConfig:
        return PoolConfig(lo, max_workers=hi, num_cpus=cpus, cache=cache, scheduler=sched, torch_threads=1)

    engine = EngineConfig(cache=cache, scheduler=sched)
    autoscale = AutoscaleConfig(profile=profile, ttft_target_s=args.slo_ttft_ms / 1000,
                                tpot_target_s=args.slo_tpot_ms / 1000, scale_down_delay_s=args.scale_down_delay)
    configs = {f"autoscaled 1:{n} 1:{n}": ClusterConfig(engine=engine, prefill=pool(1, n), decode=pool(1, n),
                                                        autoscale=autoscale),
               f"fixed {n}P{n}D": ClusterConfig(engine=engine, prefill=pool(n, None), decode=pool(n, None))}
    print(f"{cores} cores, 1 torch thread per worker; pdserve bench {' '.join(bench_args)}", flush=True)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("router").setLevel(logging.INFO)
    init_local_ray()

    async def run(name: str, config: ClusterConfig) -> dict:
        t = time.perf_counter()
        out = tmp / f"{name.split()[0]}.json"
        async with local_cluster(config) as cluster, local_router(cluster) as router:
            print(f"\n## {name}: started in {time.perf_counter() - t:.0f} s", flush=True)
            pools = cluster.scaling
            t0 = time.monotonic()
            lines = Lines(t0)
            logging.getLogger("router").addHandler(lines)
            samples: list[tuple[float, int, int, int]] = []  # (s, prefill, decode, all workers with an actor)

            async def sample() -> None:
                while True:
                    size = {p: len(pools.by_name[p]) + len(pools.starting[p]) for p in ("prefill", "decode")}
                    samples.append((time.monotonic() - t0, size["prefill"], size["decode"],
                                    sum(size.values()) + len(pools.draining)))
                    await asyncio.sleep(SAMPLE_S)

            sampler = asyncio.create_task(sample())
            try:
                rc = await pdserve_bench(router.port, bench_args, name, out)
            finally:
                sampler.cancel()
                logging.getLogger("router").removeHandler(lines)
        report = bench_report(out, rc, f"pdserve bench failed for {name}")
        worker_s = sum(w * (b[0] - a[0]) for a, b in zip(samples, samples[1:]) for w in [a[3]])
        return {"report": report, "samples": samples, "log": lines.lines,
                "worker_seconds": worker_s, "seconds": samples[-1][0],
                "start_seconds": {p: list(v) for p, v in pools.start_seconds.items() if v}}

    results = {name: asyncio.run(run(name, cfg)) for name, cfg in configs.items()}
    print()
    (na, a), (nb, b) = results.items()
    keys = [("completed", "d"), ("failed", "d"), ("slo_attainment", "pct"), ("median_ttft_ms", ".0f"),
            ("p99_ttft_ms", ".0f"), ("median_tpot_ms", ".1f"), ("p99_tpot_ms", ".1f")]
    t = Table(("", 26, "<"), (na, 24, ""), (nb, 24, ""), sep="")
    print(t.header())
    for key, spec in keys:
        va, vb = a["report"][key], b["report"][key]
        f = (lambda v: f"{100 * v:.1f} %") if spec == "pct" else (lambda v: format(v, spec))
        print(t.row(key, f(va), f(vb)))
    print(t.row("run (s)", f"{a['seconds']:.0f}", f"{b['seconds']:.0f}"))
    print(t.row("worker-seconds", f"{a['worker_seconds']:.0f}", f"{b['worker_seconds']:.0f}"))
    print(f"worker-seconds ratio (autoscaled / fixed): {a['worker_seconds'] / b['worker_seconds']:.2f}")
    s = a["samples"]
    second = 60.0  # the second burst's send time, from the bench's first request
    first_req = next((t for t, p, d, _ in s if p > 1 or d > 1), None)
    print(f"\nautoscaled pools over time (sampled every {SAMPLE_S} s; the bench starts at ~0 s, bursts at ~0 and ~60 s):")
    for lo, hi, label in ((0, second, "first burst"), (second, s[-1][0] + 1, "second burst")):
        window = [x for x in s if lo <= x[0] < hi]
        print(f"  {label}: largest prefill {max(x[1] for x in window)}, decode {max(x[2] for x in window)}; "
              f"smallest after growing: prefill {min(x[1] for x in window if x[0] > (first_req or 0))}, "
              f"decode {min(x[2] for x in window if x[0] > (first_req or 0))}")
    idle = [x for x in s if x[1] == 1 and x[2] == 1 and 5 < x[0] < second]
    print(f"  both pools back at 1 before the second burst: {'yes, from %.1f s' % idle[0][0] if idle else 'no'}")
    print(f"  time to ready: {a['start_seconds']}")
    print("  events:")
    for line in a["log"]:
        print("   ", line)
    if args.output:
        write_json(args.output, {"args": vars(args), "bench_args": bench_args, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
