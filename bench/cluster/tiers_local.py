"""Service tiers on this machine: 1 prefill, 1 default decode and 1 fast-lane decode worker, one table.

    .venv/bin/python -m bench.cluster.tiers_local [--output tiers.json] [any `pdserve bench` flag ...]

In one run: start a local Ray cluster (loopback) with the pools and the gRPC router in this process;
check that one prompt with one seed gives the same tokens on every tier (priority on the fast lane,
default and flex on the decode pool); then run `pdserve bench --service-tier-mix` in a separate process
with a load that keeps the default decode pool full, sampling flex's queue depth meanwhile; read each
tier's device seconds from the workers. Prints, per tier: completed / failed / refused, the tier served,
median and p99 TTFT and TPOT, and device seconds per output token; then priority's ratios to default.

Flags this script does not know go to `pdserve bench` after its defaults (DEFAULT_BENCH_ARGS).

bench.simulated.tiers_sim weighs one shared cluster against separate ones in GPU-hours, on GPUs at scale
through the planner's simulator; this script measures what each tier gets from real workers here.
"""
from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from bench.common import bench_report, local_cluster, local_router, parser, pdserve_bench, write_json

# Poisson at 1.5 req/s, 100 requests of 24-40 prompt and 144-240 output tokens: decode is the
# bottleneck, the default pool (32 running) stays full and a line forms at the router; priority is 10 %,
# flex 30 %. (With longer prompts and shorter outputs the single prefill worker is the bottleneck, the
# default batch stays small, and on a CPU, whose decode step is bound by reading the weights up to
# batches of ~8, a smaller batch buys no speed: docs/benchmarks.md.)
DEFAULT_BENCH_ARGS = ["--num-prompts", "100", "--request-rate", "1.5", "--lengths", "uniform", "--input-len", "32",
                      "--output-len", "192", "--range-ratio", "0.25", "--seed", "0", "--temperature", "0",
                      "--service-tier-mix", "priority=0.1,default=0.6,flex=0.3", "--slo-ttft-ms", "4000",
                      "--slo-tpot-ms", "150", "--tier-slo", "priority=4000:60", "--tier-slo", "flex=120000:1000",
                      "--timeout", "600"]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--decode-max-running", type=int, default=32, help="running requests on the default decode worker")
    ap.add_argument("--fast-lane-max-running", type=int, default=2)
    ap.add_argument("--flex-max-queued", type=int, default=8)
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--output", default=None, metavar="FILE.json")
    args, bench_args = ap.parse_known_args()

    from pdserve.client import AsyncClient
    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from pdserve.tiers import ServiceTier, TiersConfig
    from router.pools import init_local_ray

    cores = os.cpu_count() or 1
    cache = CacheConfig(memory_bytes=args.kv_cache_mib << 20)
    threads = max(1, cores // 3)

    def pool(seqs: int) -> PoolConfig:
        return PoolConfig(1, num_cpus=min(0.5, cores / 4), cache=cache, torch_threads=threads,
                          scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=512))

    config = ClusterConfig(engine=EngineConfig(cache=cache), prefill=pool(64), decode=pool(args.decode_max_running),
                           fast=pool(args.fast_lane_max_running),
                           tiers=TiersConfig(fast_lane_max_running=args.fast_lane_max_running,
                                             flex_max_queued=args.flex_max_queued))
    cmd_args = [*DEFAULT_BENCH_ARGS, *bench_args]
    print(f"{cores} cores; 3 workers, {threads} torch thread(s) each; decode max running {args.decode_max_running}, "
          f"fast lane {args.fast_lane_max_running}; flex queue bound {args.flex_max_queued}\n"
          f"pdserve bench {' '.join(cmd_args)}", flush=True)
    init_local_ray()
    out = Path(tempfile.mkdtemp(prefix="pdserve-tiers-")) / "bench.json"

    async def run() -> tuple[dict, dict, int, list]:
        async with local_cluster(config) as cluster, local_router(cluster) as router:
            port = router.port
            # The same tokens for the same seed, whatever the tier (sampled, temperature 1).
            seen = {}
            async with AsyncClient(f"127.0.0.1:{port}") as c:
                for tier in ("priority", "default", "flex"):
                    done = await c.complete(prompt="The service tier of a request decides", max_tokens=32,
                                            temperature=1.0, seed=1234, ignore_eos=True, service_tier=tier,
                                            timeout=120)
                    seen[tier] = (done.token_ids, done.service_tier, done.timings["decode_worker"])
            before = {s.worker_id: dict(s.tier_seconds) for s in await cluster.stats()}
            depth, stop = [0], asyncio.Event()

            async def sample() -> None:
                while not stop.is_set():
                    depth[0] = max(depth[0], router.front.queued(ServiceTier.FLEX))
                    await asyncio.sleep(0.02)

            sampler = asyncio.create_task(sample())
            rc = await pdserve_bench(port, cmd_args, "tiers", out)
            stop.set()
            await sampler
            stats = await cluster.stats()
            seconds: dict[str, float] = {}
            for s in stats:
                for tier, v in s.tier_seconds.items():
                    seconds[tier] = seconds.get(tier, 0.0) + v - before.get(s.worker_id, {}).get(tier, 0.0)
            preempt = {k: sum(s.tier_preemptions.get(k, 0) for s in stats) for k in ("flex/kept", "flex/recomputed")}
        report = bench_report(out, rc, "pdserve bench failed")
        return seen, {"seconds": seconds, "preemptions": preempt}, depth[0], report

    seen, workers, depth, report = asyncio.run(run())
    same = len({tuple(v[0]) for v in seen.values()}) == 1
    print("\nsame seed on every tier: " + ("same tokens" if same else "DIFFERENT tokens") + "; "
          + ", ".join(f"{t}: served {s}, decoded on {w}" for t, (_, s, w) in seen.items()))
    tiers = report["by_service_tier"]
    print(f"\n{'tier':10}{'done':>6}{'failed':>8}{'refused':>9}  {'served':24}{'med TTFT':>10}{'p99 TTFT':>10}"
          f"{'med TPOT':>10}{'p99 TPOT':>10}{'SLO met':>9}{'dev-s/tok':>11}")
    per_token = {}
    for tier, r in tiers.items():
        tokens = r["total_output_tokens"]
        per_token[tier] = workers["seconds"].get(tier, 0.0) / tokens if tokens else float("nan")
        served = ",".join(f"{k}={v}" for k, v in sorted(r.get("served", {}).items()))
        print(f"{tier:10}{r['completed']:>6}{r['failed'] - r.get('refused', 0):>8}{r.get('refused', 0):>9}  {served:24}"
              f"{r['median_ttft_ms']:>10.0f}{r['p99_ttft_ms']:>10.0f}{r['median_tpot_ms']:>10.1f}{r['p99_tpot_ms']:>10.1f}"
              f"{r['slo_attainment']:>9.1%}{per_token[tier] * 1000:>9.2f}ms")
    p, d = tiers["priority"], tiers["default"]
    print(f"\npriority / default: median TPOT {p['median_tpot_ms'] / d['median_tpot_ms']:.2f}x, median TTFT "
          f"{p['median_ttft_ms'] / d['median_ttft_ms']:.2f}x, device seconds per output token "
          f"{per_token['priority'] / per_token['default']:.2f}x")
    print(f"flex: most waiting at once {depth} (bound {args.flex_max_queued}); preemptions {workers['preemptions']}")
    if args.output:
        write_json(args.output, {"bench_args": cmd_args, "same_tokens": same, "seen": seen, "workers": workers,
                                 "max_flex_queued": depth, "report": report})


if __name__ == "__main__":
    main()
