"""GPU-hours of autoscaled pools against a fixed cluster sized for the peak, on an RL-like bursty trace,
by the simulator (pdserve.planner.simulator) with the autoscaler the router runs (pdserve.planner.autoscale).

    .venv/bin/python -m bench.simulated.autoscale_sim [--gpu H100] [--model llama-3-8b] [--waves 6]
        [--requests-per-wave 4096] [--period 900] [--max-prefill 16] [--max-decode 48] [--startup 30 120]

The trace: waves of rollouts. Each wave's requests all arrive within --burst seconds (a trainer sending
its batch of prompts, several samples each), then nothing until the next wave, --period seconds after
the previous one began (rewards and the policy update). Prompts and outputs are log-normal (outputs
long and heavy-tailed, as reasoning rollouts are), seeded.

The fixed cluster has --max-prefill + --max-decode workers (one GPU each) all the time. The autoscaled
one has pools of min-prefill:max-prefill and min-decode:max-decode (1:16 and 1:48 by default), and a
worker it asks for is placeable --startup seconds
later (pod on a warm node + weights from the node's cache; a node the cloud must provision first takes
minutes). Printed per configuration: GPU-hours, SLO attainment (TTFT and TPOT within the targets),
median and p99 TTFT and TPOT, each wave's makespan (first arrival to last token), and the ratio of GPU-hours.

bench.cluster.autoscale_bursts asks the same question of real workers on this machine (a measured profile,
SmolLM2, two bursts, worker-seconds); this script asks it of GPUs at scale, where only the simulator reaches.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench.common import BLOCK, rl_trace, roofline_of, write_json
from pdserve.planner.autoscale import Autoscaler, PoolLimits
from pdserve.planner.simulator import ClusterShape, PoolShape, simulate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="H100")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--waves", type=int, default=6)
    p.add_argument("--requests-per-wave", type=int, default=4096)
    p.add_argument("--burst", type=float, default=10.0, help="seconds over which a wave's requests arrive")
    p.add_argument("--period", type=float, default=900.0, help="seconds from one wave's start to the next's")
    p.add_argument("--input-mean", type=float, default=1024)
    p.add_argument("--output-mean", type=float, default=2048)
    p.add_argument("--max-prefill", type=int, default=16)
    p.add_argument("--max-decode", type=int, default=48)
    p.add_argument("--min-prefill", type=int, default=1, help="the autoscaled pools' MIN (kept warm)")
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--slo-ttft-ms", type=float, default=60_000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--startup", type=float, nargs="+", default=[30.0, 120.0],
                   help="seconds from asking for a worker to its being placeable (one run each)")
    p.add_argument("--scale-down-delay", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--output", default=None, metavar="FILE.json")
    args = p.parse_args()

    device, name, cfg, costs, kv_blocks = roofline_of(args.gpu, args.model)
    arrival, inputs, outputs = rl_trace(args.waves, args.requests_per_wave, args.burst, args.period,
                                        args.input_mean, args.output_mean, cfg.max_position_embeddings)
    print(f"{name} on {device.name} (roofline), {kv_blocks} KV blocks of {BLOCK} per GPU; {len(arrival)} requests in "
          f"{args.waves} waves of {args.requests_per_wave} within {args.burst:g} s every {args.period:g} s; prompts "
          f"mean {inputs.mean():.0f}, outputs mean {outputs.mean():.0f} (max {outputs.max()}) tokens; SLO TTFT "
          f"{args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms")

    def pool(n: int) -> PoolShape:
        return PoolShape(n, kv_blocks, BLOCK, args.max_num_seqs, args.token_budget)

    def report(label: str, res, seconds: float) -> dict:
        ok = res.ok
        ttft, tpot = res.ttft[ok], np.nan_to_num(res.tpot[ok], nan=0.0)
        within = ok & (res.ttft <= args.slo_ttft_ms / 1000) & (np.nan_to_num(res.tpot, nan=0.0) <= args.slo_tpot_ms / 1000)
        wave = np.repeat(np.arange(args.waves), args.requests_per_wave)
        makespans = [float(np.nanmax(res.end[wave == w]) - arrival[wave == w].min()) for w in range(args.waves)]
        row = {"config": label, "gpu_hours": res.worker_seconds / 3600, "slo_attainment": float(within.mean()),
               "completed": int(ok.sum()), "median_ttft_s": float(np.median(ttft)), "p99_ttft_s": float(np.percentile(ttft, 99)),
               "median_tpot_ms": float(np.median(tpot) * 1000), "p99_tpot_ms": float(np.percentile(tpot, 99) * 1000),
               "wave_makespan_s": makespans, "kv_overflows": res.kv_overflows, "sim_seconds": seconds,
               "max_sizes": [max(s[1] for s in res.sizes), max(s[2] for s in res.sizes)] if res.sizes else None}
        print(f"{label:34} {row['gpu_hours']:8.1f} GPU-h  SLO ok {row['slo_attainment']:6.1%}  TTFT med "
              f"{row['median_ttft_s']:6.1f} s p99 {row['p99_ttft_s']:6.1f} s  TPOT med {row['median_tpot_ms']:5.1f} ms "
              f"p99 {row['p99_tpot_ms']:5.1f} ms  wave makespan mean {np.mean(makespans):6.1f} s  "
              f"(simulated in {seconds:.1f} s)")
        return row

    shape = ClusterShape("disaggregated", pool(args.max_prefill), pool(args.max_decode), max_running=10**6,
                         max_queued=10**6)
    t0 = time.perf_counter()
    fixed = report(f"fixed {args.max_prefill}P{args.max_decode}D", simulate(shape, costs, arrival, inputs, outputs),
                   time.perf_counter() - t0)
    rows = [fixed]
    limits = PoolLimits(kv_blocks, BLOCK, args.max_num_seqs, args.token_budget)
    for startup in args.startup:
        scaler = Autoscaler(costs, {"prefill": limits, "decode": limits},
                            {"prefill": (args.min_prefill, args.max_prefill), "decode": (args.min_decode, args.max_decode)},
                            args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000, args.scale_down_delay, startup)
        start = ClusterShape("disaggregated", pool(args.min_prefill), pool(args.min_decode), max_running=10**6,
                             max_queued=10**6)
        t0 = time.perf_counter()
        res = simulate(start, costs, arrival, inputs, outputs, autoscaler=scaler, interval_s=args.interval,
                       startup_s=startup)
        row = report(f"autoscaled {args.min_prefill}:{args.max_prefill} {args.min_decode}:{args.max_decode}, start {startup:g} s", res,
                     time.perf_counter() - t0)
        row["startup_s"] = startup
        row["gpu_hours_ratio"] = row["gpu_hours"] / fixed["gpu_hours"]
        print(f"{'':34} GPU-hours {row['gpu_hours_ratio']:.2f}x the fixed cluster's, SLO attainment "
              f"{row['slo_attainment'] - fixed['slo_attainment']:+.1%} against it; largest pools "
              f"{row['max_sizes'][0]}P {row['max_sizes'][1]}D")
        rows.append(row)
    if args.output:
        write_json(args.output, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
