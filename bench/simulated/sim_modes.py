"""Disaggregation's claim on the simulated engine (issue #31): for the same number of GPUs, `pdserve plan`'s
best disaggregated and best colocated configuration, each then run as a cluster of simulated workers on
the same workload, side by side in one run.

    .venv/bin/python -m bench.simulated.sim_modes [--gpus 8] [--gpu H100] [--model llama-3-8b] [--time-scale 8]
        [--workloads default long-prompt] [--num-prompts 400] [--json FILE]

Workloads (in the GPU's time; Poisson arrivals, seeded, long-tailed lengths):
- default: 512-token prompts, 256 out, --rate requests/s;
- long-prompt: 4,096-token prompts, 256 out, --long-rate requests/s.
SLOs: TTFT --slo-ttft-ms, TPOT --slo-tpot-ms. `pdserve plan --gpu --model --max-workers GPUS` ranks every
configuration (colocated xN, xPyD, each batch cap of --max-num-seqs) by goodput per worker; of those on
exactly --gpus workers whose KV fits, the best of each mode (rank order) is served: `pdserve serve
--load-format sim` (each step sleeps the GPU roofline's time x --time-scale), driven by `pdserve bench` with
the same workload stretched by the time scale (rate / scale, SLOs x scale, same seed: the same requests at
the same moments). Measured times are
divided by the scale, goodput multiplied, back into the GPU's time. The planner runs with no router latency
(--first-token-latency-ms 0 --token-latency-ms 0): the router's own, divided by the scale, is a fraction of a
millisecond of GPU time.

Printed per workload: each configuration's goodput (req/s), SLO attainment, TTFT p50/p99, TPOT p50/p99 and
ITL p99 (ms; measured only: the planner has no gaps), measured and (planned), and disaggregated / colocated
goodput.

bench.cluster.compare_modes runs the same comparison with the real model (SmolLM2) on this machine, for an
xPyD named on its command line and no plan; this script lets the planner pick, on GPUs this machine has not.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, Server, bench_report, late_steps, parser, run_header, write_json

WORKLOADS = {"default": (512, 256), "long-prompt": (4096, 256)}
SHOWN = (("goodput", "request_goodput", ".2f"), ("SLO ok", "slo_attainment", ".0%"),
         ("TTFT p50", "median_ttft_ms", ".0f"), ("TTFT p99", "p99_ttft_ms", ".0f"),
         ("TPOT p50", "median_tpot_ms", ".1f"), ("TPOT p99", "p99_tpot_ms", ".1f"),
         ("ITL p99", "p99_itl_ms", ".1f"))  # the planner has no ITL (its TPOT is a request's mean gap)


def workload_args(args, name: str, scale: float) -> list[str]:
    """The bench/plan flags of a workload, its times stretched by scale (1: the GPU's)."""
    inp, out = WORKLOADS[name]
    rate = args.rate if name == "default" else args.long_rate
    return ["--arrival", "poisson", "--request-rate", str(rate / scale), "--lengths", "longtail", "--input-len",
            str(inp), "--output-len", str(out), "--num-prompts", str(args.num_prompts), "--seed", "11", "--ignore-eos",
            "--slo-ttft-ms", str(args.slo_ttft_ms * scale), "--slo-tpot-ms", str(args.slo_tpot_ms * scale)]


def plan(args, name: str, tmp: Path) -> dict:
    out = tmp / f"plan-{name}.json"
    cmd = [sys.executable, "-m", "pdserve.cli", "plan", "--gpu", args.gpu, "--model", args.model, "--max-workers",
           str(args.gpus), "--max-num-seqs", *map(str, args.max_num_seqs), "--prefill-token-budget",
           str(args.token_budget), "--block-size", str(args.block_size), "--first-token-latency-ms", "0",
           "--token-latency-ms", "0", "--output", str(out), *workload_args(args, name, 1.0)]
    subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, check=True, timeout=1800)
    return json.loads(out.read_text())


def best_of(plan_: dict, mode: str, gpus: int) -> dict:
    """The plan's best-ranked configuration of the mode on exactly `gpus` workers whose KV fits."""
    fits = [c for c in plan_["candidates"] if c["mode"] == mode and c["kv_fits"] and c["workers"] == gpus]
    return min(fits, key=lambda c: c["rank"])


def serve_flags(args, c: dict) -> list[str]:
    flags = ["--load-format", "sim", "--model", args.model, "--dtype", "bfloat16", "--sim-gpu", args.gpu,
             "--sim-time-scale", str(args.time_scale), "--worker-cpus", str(args.worker_cpus), "--block-size",
             str(args.block_size), "--prefill-token-budget", str(args.token_budget), "--max-num-seqs",
             str(c["max_num_seqs"]), "--max-running", str(10**6), "--max-queued", str(10**6)]
    if c["mode"] == "colocated":
        return [*flags, "--mode", "colocated", "--colocated-workers", str(c["decode_workers"])]
    return [*flags, "--prefill-workers", str(c["prefill_workers"]), "--decode-workers", str(c["decode_workers"])]


def run(args, name: str, c: dict, tmp: Path) -> dict:
    flags = serve_flags(args, c)
    server = Server(flags, tmp / f"serve-{name}-{c['mode']}.log")
    out = tmp / f"bench-{name}-{c['mode']}.json"
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--target", f"127.0.0.1:{server.port}", "--warmup", "0",
           "--timeout", "3600", "--output", str(out), "--no-progress", *workload_args(args, name, args.time_scale)]
    try:
        server.wait_ready(c["workers"], args.start_timeout)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=7200, check=False).returncode
        wall = time.monotonic() - t0
        late, steps = late_steps(server)
        log = server.log.read_text()
    finally:
        server.stop()
    rep = bench_report(out, rc, f"pdserve bench failed: {shlex.join(cmd)}", log)
    s = args.time_scale
    scaled = {k: None if rep.get(k) is None else rep[k] / s for _, k, _ in SHOWN[2:]}
    measured = {"request_goodput": (rep["request_goodput"] or 0.0) * s, "slo_attainment": rep["slo_attainment"],
                **scaled, "completed": rep["completed"], "failed": rep["failed"]}
    return {"config": c["label"], "mode": c["mode"], "serve_flags": flags, "wall_s": wall, "late_steps": late,
            "steps": steps, "measured": measured, "planned": {k: c.get(k) for _, k, _ in SHOWN}}


def table(rows: list[dict]) -> str:
    head = "| config | " + " | ".join(f"{h} (ms)" if "ms" in k else h for h, k, _ in SHOWN) + " | failed | late steps |"
    lines = [head, "|" + "---|" * (len(SHOWN) + 3)]
    for r in rows:
        cells = []
        for _, k, spec in SHOWN:
            m, p = r["measured"][k], r["planned"][k]
            cells.append(f"{format(m, spec) if m is not None else '-'} ({format(p, spec) if p is not None else '-'})")
        late = sum(r["late_steps"].values())
        lines.append(f"| {r['config']} | " + " | ".join(cells) + f" | {r['measured']['failed']} | "
                     f"{late:.0f} of {sum(r['steps'].values()):.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--rate", type=float, default=80.0, help="default workload: requests/s (GPU time)")
    ap.add_argument("--long-rate", type=float, default=25.0, help="long-prompt workload: requests/s (GPU time)")
    ap.add_argument("--num-prompts", type=int, default=400)
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=40.0)
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[128])
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=8.0)
    ap.add_argument("--worker-cpus", type=float, default=0.0625)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    head = run_header()
    results = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-sim-modes-") as tmp:
        for name in args.workloads:
            p = plan(args, name, Path(tmp))
            picks = [best_of(p, "disaggregated", args.gpus), best_of(p, "colocated", args.gpus)]
            print(f"\n### {name}: {p['workload']['workload']}; {args.gpus} {args.gpu}s, SLO TTFT "
                  f"{args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms; plan's picks: " + ", ".join(
                      f"{c['label']} (rank {c['rank']})" for c in picks), flush=True)
            rows = [run(args, name, c, Path(tmp)) for c in picks]
            d, c = (r["measured"]["request_goodput"] for r in rows)
            pd_, pc = (r["planned"]["request_goodput"] for r in rows)
            print(f"\nmeasured (planned), {args.gpu} time:\n\n{table(rows)}\n\ngoodput disaggregated / colocated: "
                  f"{d / c if c else float('inf'):.2f}x measured, {pd_ / pc if pc else float('inf'):.2f}x planned",
                  flush=True)
            results[name] = {"plan_workload": p["workload"], "rows": rows}
    if args.json:
        write_json(args.json, {**head, "args": vars(args), "results": results})
        print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
