"""GPU-hours of one shared cluster serving three service tiers against separate clusters (one for default
traffic, one for flex), by the simulator (pdserve.planner.simulator) with the autoscaler the router runs
(pdserve.planner.autoscale), and the fast lane's computed price multiplier (pdserve.planner.pricing).

    .venv/bin/python -m bench.simulated.tiers_sim [--gpu H100] [--model llama-3-8b] [--minutes 60]
        [--default-rate 40] [--priority-rate 2] [--flex-wave 4096] [--flex-period 600] [--priority-tpot-ms 12]

The trace: steady default traffic (Poisson), a small priority share (Poisson), and flex in RL-rollout-like
waves (--flex-wave requests within --flex-burst seconds every --flex-period seconds, nothing between).
Prompts and outputs are log-normal, seeded.

- separate: a default cluster (default and priority requests; a fast lane for priority) and a flex
  cluster (flex requests only, sized for flex's own SLO: the autoscaler's targets are flex's TTFT and
  TPOT), each autoscaled on its own traffic; GPU-hours are their sum.
- shared: one cluster, all three tiers (the router's line and decode admission by tier, flex preempted
  above its floor, the fast lane for priority), autoscaled on all the traffic with default's targets.

Every pool of every cluster is autoscaled from 1 worker (the fast lane too, from priority's demand), a
new worker placeable --startup seconds after it is asked for. Each tier's SLO attainment is judged by its
own SLO (TiersConfig's defaults, priority's TPOT set by --priority-tpot-ms). flex's queue is unbounded
here (flex_max_queued: a rollout trainer does not retry). One GPU per worker; the costs are the GPU's
roofline (pdserve.perf.hardware), never checked against a GPU.

bench.cluster.tiers_local runs the tiers on real workers on this machine (one fast-lane and one default decode
worker: each tier's latency and device seconds per token, the same tokens on every tier); this script weighs
the GPU-hours of sharing one cluster against splitting it, at a scale only the simulator reaches.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench.common import BLOCK, lognormal, roofline_of, write_json
from pdserve.planner.autoscale import Autoscaler, PoolLimits
from pdserve.planner.pricing import format_prices, tier_prices
from pdserve.planner.simulator import ClusterShape, PoolShape, simulate
from pdserve.tiers import TIERS, ServiceTier, TiersConfig, TierSLO


def trace(args: argparse.Namespace, max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(arrival, prompt tokens, output tokens, tier rank) of every request, by arrival."""
    g = np.random.default_rng(args.seed)
    horizon = args.minutes * 60.0

    def poisson(rate: float) -> np.ndarray:
        times = np.cumsum(g.exponential(1 / rate, int(rate * horizon * 1.2) + 10))
        return times[times < horizon]

    parts = []
    for rank, arr, in_mean, out_mean in (
            (0, poisson(args.priority_rate), args.input_mean, args.output_mean),
            (1, poisson(args.default_rate), args.input_mean, args.output_mean),
            (2, np.concatenate([w * args.flex_period + np.sort(g.uniform(0, args.flex_burst, args.flex_wave))
                                for w in range(int(horizon // args.flex_period))]), args.flex_input_mean,
             args.flex_output_mean)):
        n = len(arr)
        parts.append((arr, lognormal(g, n, in_mean, 0.5, 32, max_len // 4),
                      lognormal(g, n, out_mean, 0.8, 16, max_len - max_len // 4), np.full(n, rank)))
    arrival, ins, outs, tier = (np.concatenate([p[i] for p in parts]) for i in range(4))
    order = np.argsort(arrival, kind="stable")
    return arrival[order], ins[order], outs[order], tier[order]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="H100")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--default-rate", type=float, default=40.0, help="default requests per second")
    p.add_argument("--priority-rate", type=float, default=2.0, help="priority requests per second")
    p.add_argument("--input-mean", type=float, default=1024)
    p.add_argument("--output-mean", type=float, default=256)
    p.add_argument("--flex-wave", type=int, default=4096, help="flex requests per wave")
    p.add_argument("--flex-burst", type=float, default=10.0, help="seconds over which a wave arrives")
    p.add_argument("--flex-period", type=float, default=600.0, help="seconds from one wave's start to the next's")
    p.add_argument("--flex-input-mean", type=float, default=1024)
    p.add_argument("--flex-output-mean", type=float, default=1024)
    p.add_argument("--priority-tpot-ms", type=float, default=12.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--max-prefill", type=int, default=16)
    p.add_argument("--max-decode", type=int, default=48)
    p.add_argument("--max-fast", type=int, default=8)
    p.add_argument("--startup", type=float, default=60.0, help="seconds from asking for a worker to its being placeable")
    p.add_argument("--scale-down-delay", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, metavar="FILE.json")
    args = p.parse_args()

    device, name, cfg, costs, kv_blocks = roofline_of(args.gpu, args.model)
    slo = {"priority": TierSLO(1.0, args.priority_tpot_ms / 1e3)}
    flex_rate = args.flex_wave / args.flex_period  # the mean over the run: the mix's shares are of requests
    rate = args.priority_rate + args.default_rate + flex_rate
    base = TiersConfig(slo=slo)
    lane_cap_prices = tier_prices(costs, PoolLimits(kv_blocks, BLOCK, args.max_num_seqs, args.token_budget),
                                  args.input_mean, args.output_mean, {t: base.slo_of(t) for t in TIERS},
                                  {ServiceTier.PRIORITY: args.priority_rate / rate, ServiceTier.DEFAULT: args.default_rate / rate,
                                   ServiceTier.FLEX: flex_rate / rate}, rate)
    lane_cap = lane_cap_prices["fast_lane"]["max_running"]
    tiers = TiersConfig(fast_lane_max_running=lane_cap, flex_max_queued=10**9, slo=slo)
    arrival, ins, outs, tier = trace(args, cfg.max_position_embeddings)
    counts = {t.value: int((tier == t.rank).sum()) for t in TIERS}
    print(f"{name} on {device.name} (roofline), {kv_blocks} KV blocks of {BLOCK} per GPU; {len(arrival)} requests over "
          f"{args.minutes:g} min: {counts}; default {args.default_rate:g} req/s and priority {args.priority_rate:g} req/s "
          f"steady, flex {args.flex_wave} within {args.flex_burst:g} s every {args.flex_period:g} s")
    print(format_prices(lane_cap_prices))
    print()

    def pool(n: int, cap: int | None = None) -> PoolShape:
        return PoolShape(n, kv_blocks, BLOCK, cap or args.max_num_seqs, args.token_budget)

    limits = PoolLimits(kv_blocks, BLOCK, args.max_num_seqs, args.token_budget)
    lane_limits = PoolLimits(kv_blocks, BLOCK, lane_cap, args.token_budget)

    def run(label: str, sel: np.ndarray, target: ServiceTier, lane: bool) -> dict:
        ranges = {"prefill": (1, args.max_prefill), "decode": (1, args.max_decode)}
        lims = {"prefill": limits, "decode": limits}
        if lane:
            ranges["fast"], lims["fast"] = (1, args.max_fast), lane_limits
        s = tiers.slo_of(target)
        scaler = Autoscaler(costs, lims, ranges, s.ttft_s, s.tpot_s, args.scale_down_delay, args.startup,
                            tiers.slo_of(ServiceTier.PRIORITY).tpot_s)
        shape = ClusterShape("disaggregated", pool(1), pool(1), max_running=10**9, max_queued=10**9,
                             fast=pool(1, lane_cap) if lane else None)
        t0 = time.perf_counter()
        res = simulate(shape, costs, arrival[sel], ins[sel], outs[sel], autoscaler=scaler, interval_s=args.interval,
                       startup_s=args.startup, tier=tier[sel], tiers=tiers)
        seconds = time.perf_counter() - t0
        row = {"cluster": label, "gpu_hours": res.worker_seconds / 3600, "tiers": res.tier_stats(tiers),
               "sim_seconds": seconds, "requests": int(sel.sum()),
               "largest_pools": [max(s[1] for s in res.sizes), max(s[2] for s in res.sizes)]}
        print(f"{label:32} {row['gpu_hours']:7.1f} GPU-h  largest {row['largest_pools'][0]}P "
              f"{row['largest_pools'][1]}D  ({sel.sum()} requests simulated in {seconds:.1f} s)")
        return row

    everyone = np.ones(len(arrival), bool)
    rows = [run("separate: default (+priority lane)", tier != 2, ServiceTier.DEFAULT, True),
            run("separate: flex", tier == 2, ServiceTier.FLEX, False),
            run("shared, with tiers", everyone, ServiceTier.DEFAULT, True)]
    separate = rows[0]["gpu_hours"] + rows[1]["gpu_hours"]
    print()
    head = (f"{'cluster':22} {'GPU-h':>6} {'tier':9} {'SLO ok':>7} {'TTFT med':>9} {'p99':>8} {'TPOT med':>9} "
            f"{'p99':>7} {'preempted':>9} {'lower':>6}")
    print(head)
    print("-" * len(head))
    for label, gh, group in (("separate (sum)", separate, [rows[0], rows[1]]), ("shared, with tiers",
                                                                                  rows[2]["gpu_hours"], [rows[2]])):
        first = True
        for t in TIERS:
            st = next((r["tiers"][t.value] for r in group if t.value in r["tiers"]), None)
            if st is None:
                continue
            print(f"{label if first else '':22} {f'{gh:.1f}' if first else '':>6} {t.value:9} "
                  f"{st['slo_attainment']:7.1%} {st['median_ttft_s']:8.2f}s {st['p99_ttft_s']:7.2f}s "
                  f"{st['median_tpot_ms']:7.1f}ms {st['p99_tpot_ms']:5.1f}ms {st['preemptions']:9d} "
                  f"{st['served_lower']:6d}")
            first = False
    print(f"\nshared / separate GPU-hours: {rows[2]['gpu_hours'] / separate:.2f}; fast lane: max running {lane_cap}, "
          f"a priority token costs {lane_cap_prices['fast_lane']['price_multiplier']:.2f}x a default one")
    if args.output:
        write_json(args.output, {"args": vars(args), "prices": lane_cap_prices, "rows": rows,
                                 "separate_gpu_hours": separate})
    return 0


if __name__ == "__main__":
    sys.exit(main())
