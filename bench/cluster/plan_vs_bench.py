"""`pdserve plan`'s predictions against `pdserve bench` on real clusters, side by side in one run.

    .venv/bin/python -m bench.cluster.plan_vs_bench [--profile profile.json] [--rates 0.15 0.3] [--output out.json]

1. Profile this machine (`pdserve profile`, one torch thread as each of two workers gets), unless
   --profile names one.
2. For each request rate: plan the workload of bench.cluster.compare_modes (its seeded defaults at that
   rate) for up to 2 workers with compare_modes' pool settings (token budget 512, 256 MiB of KV, 64
   running), then run compare_modes itself: 1P1D and colocated x2 on a local Ray cluster, each
   driven by `pdserve bench` in its own process.
3. Print, per rate and configuration, predicted beside measured median and p99 TTFT and TPOT, goodput
   and SLO attainment, with the ratio and whether it is within the targets (median within 25 %, p99
   within 50 %), and whether the plan ranks the two configurations in the measured order of goodput
   (measured goodputs within 10 % of each other count as a tie).
   Also the simulator's speed: 10,000 requests of the workload through 20 configurations.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import MODES_BENCH_ARGS, ROOT, parser, pdserve_profile, write_json

KEYS = (("median_ttft_ms", 0.25), ("p99_ttft_ms", 0.5), ("median_tpot_ms", 0.25), ("p99_tpot_ms", 0.5))
TIE = 0.1
CONFIGS = {"1P1D": "disaggregated 1P1D", "colocated x2": "colocated x2"}


def bench_args(rate: float) -> list[str]:
    args = list(MODES_BENCH_ARGS)
    args[args.index("--request-rate") + 1] = str(rate)
    return args


def plan_for(profile: dict, rate: float, num_prompts: int | None = None, max_workers: int = 2,
             caps: tuple[int, ...] = (64,)) -> dict:
    from pdserve.loadgen.cli import add_workload_args
    from pdserve.loadgen.stats import Slo
    from pdserve.perf.costs import MeasuredCosts
    from pdserve.planner.plan import PoolSettings, make_plan, workload_from_args

    p = argparse.ArgumentParser()
    add_workload_args(p)
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    args, _ = p.parse_known_args(bench_args(rate))
    if num_prompts:
        args.num_prompts = num_prompts
    m = profile["model"]
    w = workload_from_args(args, m["vocab_size"], m["eos_token_ids"], m["max_model_len"])
    settings = PoolSettings(kv_cache_bytes=256 << 20, block_size=profile["block_size"], token_budget=512)
    return make_plan(MeasuredCosts.from_dict(profile["costs"]), w, Slo(args.slo_ttft_ms, args.slo_tpot_ms),
                     max_workers, list(caps), settings)


def fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 1 else f"{v:.3f}"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--profile", default=None, help="a pdserve profile (default: measure one now)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.15, 0.3])
    ap.add_argument("--output", default=None, metavar="FILE.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-plan-vs-bench-"))
    prof_path = Path(args.profile) if args.profile else tmp / "profile.json"
    if not args.profile:
        pdserve_profile(prof_path)
    profile = json.loads(prof_path.read_text())

    from pdserve.planner.plan import format_plan

    start = time.perf_counter()
    speed = plan_for(profile, max(args.rates), num_prompts=10_000, max_workers=4, caps=(16, 64))
    speed_s = time.perf_counter() - start
    print(f"simulator: {speed['requests']} requests through {len(speed['candidates'])} configurations in "
          f"{speed['simulation_seconds']:.2f} s (with the workload's generation: {speed_s:.2f} s)")

    results = []
    for rate in args.rates:
        plan = plan_for(profile, rate)
        print(f"\n## plan at {rate} req/s\n{format_plan(plan)}", flush=True)
        out = tmp / f"measured-{rate}.json"
        subprocess.run([sys.executable, "-m", "bench.cluster.compare_modes", "--output", str(out), "--request-rate",
                        str(rate)], check=True, cwd=ROOT)
        measured = json.loads(out.read_text())["reports"]
        predicted = {c["label"].split(",")[0]: c for c in plan["candidates"]}
        results.append({"rate": rate, "predicted": {k: predicted[k] for k in CONFIGS},
                        "measured": {k: measured[v] for k, v in CONFIGS.items()}, "plan": plan})

    print(f"\n{'rate':>5} {'config':13} {'metric':16} {'predicted':>10} {'measured':>10} {'ratio':>7}  target")
    ok_all = True
    for r in results:
        for name in CONFIGS:
            pr, me = r["predicted"][name], r["measured"][name]
            for key, tol in KEYS:
                ratio = pr[key] / me[key] if pr[key] and me[key] else None
                ok = ratio is not None and abs(ratio - 1) <= tol
                ok_all &= ok
                print(f"{r['rate']:5g} {name:13} {key:16} {fmt(pr[key]):>10} {fmt(me[key]):>10} "
                      f"{fmt(ratio) if ratio else 'n/a':>7}  {'ok' if ok else 'MISS'} (±{tol:.0%})")
            for key in ("request_goodput", "slo_attainment"):
                print(f"{r['rate']:5g} {name:13} {key:16} {fmt(pr[key]):>10} {fmt(me[key]):>10}")
        order_p = sorted(CONFIGS, key=lambda k: -(r["predicted"][k]["request_goodput"] or 0))
        order_m = sorted(CONFIGS, key=lambda k: -(r["measured"][k]["request_goodput"] or 0))
        g = sorted((r["measured"][k]["request_goodput"] or 0) for k in CONFIGS)
        # Measured goodputs within TIE of each other are one run's noise apart: no order to match.
        tie = g[-1] > 0 and (g[-1] - g[0]) / g[-1] < TIE
        same = order_p == order_m
        ok_all &= same or tie
        verdict = "same" if same else f"tie (measured within {TIE:.0%})" if tie else "DIFFERENT"
        print(f"{r['rate']:5g} goodput order: predicted {' > '.join(order_p)}; measured {' > '.join(order_m)}: "
              f"{verdict}")
    print(f"\nall within targets: {ok_all}")
    if args.output:
        for r in results:
            for rep in r["measured"].values():
                rep.pop("requests", None)
                rep.pop("timeline", None)
        write_json(args.output, {"profile": str(prof_path), "simulator_seconds": speed["simulation_seconds"],
                                 "results": results})
        print(f"results: {args.output}")


if __name__ == "__main__":
    main()
