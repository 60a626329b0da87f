"""Router scale (issue #31): the streamed tokens/s and requests/s the router sustains against N simulated
decode workers, the latency it adds (p50, p99), and its CPU per token and per request.

    .venv/bin/python -m bench.router.router_scale [--prefill-workers 1] [--decode-workers 2 4] [--stream-interval 1 16]
        [--concurrency 16 64 128] [--num-prompts 256] [--output-len 128] [--short-len 16] [--routers 1 2]
        [--json FILE] [other `pdserve serve` flags, passed through: --sim-time-scale 2, --max-num-seqs 128, ...]

--routers 2: router replicas (docs/serving.md): a Ray head started for the run (`ray start --head`), two
`pdserve serve --router-name` on it over the same workers, and two `pdserve bench` clients at once, each with
half the concurrency and half the requests against its own router. Their reports are merged: tokens/s and
requests/s summed, p50s averaged (two equal halves of the load), p99s the larger of the two; router CPU the sum
of both routers'.

Per configuration (decode workers x stream interval): `pdserve serve --load-format sim` (llama3-8b on simulated
H100s, each step sleeping the roofline's time; router on 127.0.0.1, /metrics on a free port, HTTP off), ready
when every worker is; one 1-request warm-up run; the router's idle CPU over --idle-s; then per concurrency two
closed-loop `pdserve bench` runs of --num-prompts fixed-length requests: --output-len tokens out, then --short-len.
Measured around each run: the bench JSON (tokens/s, requests/s; TTFT and ITL p50/p99, ITL from the 2nd gap on
since the 1st holds the KV hand-off, a message of k tokens counting as k gaps of 1/k its gap); the workers'
counters on /metrics (step = the pool's busy seconds / its steps); the router process's CPU (utime + stime in
/proc/PID/stat); the bench client's (getrusage of children, less the warm-up run's: its start-up). The client
shares the cores: near 100 % of a core, it and not the router is the limit. Router core % is over the bench's
own duration. All times in ms.
Derived, and ESTIMATES (the workers report aggregates, no per-token timestamps):
- +ITL = client ITL - mean decode step: all of a gap that is not the step (the worker's host work between steps,
  Ray, the router, gRPC, the client), so an upper bound on the router's share; a mean step a bit above the
  median gap makes it slightly negative.
- +TTFT = client TTFT - mean prefill step: admission, placement, forwarding, and the wait at the prefill worker
  (closed-loop fixed-length requests arrive in waves and queue there): an upper bound, often mostly that wait.
- router CPU per token and per request: each run's router CPU less its idle rate x wall time, the long and short
  runs solved for cpu = a x tokens + b x requests (as ../shared/tools/router-cpu does). It includes the
  router's metrics (every gap into a histogram), on here for the workers' counters.

bench.simulated.sim_scale also serves simulated workers, to check them and the planner's simulator against each
other; this script measures the router between them and the clients.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RAY_TOKEN_ENV, ROOT, Server, free_port, parser, run_header, session_pids, write_json

TCK = os.sysconf("SC_CLK_TCK")
COLUMNS = (("conc", "concurrency", "d"), ("tok/s", "tokens_per_s", ".0f"), ("req/s", "requests_per_s", ".2f"),
           ("ITL p50", "itl_p50_ms", ".2f"), ("ITL p99", "itl_p99_ms", ".2f"), ("decode step", "decode_step_ms", ".2f"),
           ("+ITL p50", "added_itl_p50_ms", ".2f"), ("+ITL p99", "added_itl_p99_ms", ".2f"),
           ("TTFT p50", "ttft_p50_ms", ".1f"), ("TTFT p99", "ttft_p99_ms", ".1f"),
           ("prefill step", "prefill_step_ms", ".1f"), ("+TTFT p50", "added_ttft_p50_ms", ".1f"),
           ("+TTFT p99", "added_ttft_p99_ms", ".1f"), ("router core %", "router_core_pct", ".0f"),
           ("router us/token", "router_us_per_token", ".1f"), ("router ms/request", "router_ms_per_request", ".2f"),
           ("client core %", "client_core_pct", ".0f"), ("failed", "failed", "d"))


# -- measurements ------------------------------------------------------------------------------------------
def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process so far, from /proc (fields after the command's ')')."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TCK


def parse_worker_counters(text: str) -> dict[tuple[str, str], dict[str, float]]:
    """{(pool, worker): {"busy": s, "steps": n}} from a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], dict[str, float]] = {}
    keys = {"pdserve_worker_busy_seconds": "busy", "pdserve_worker_steps": "steps"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples if fam.name in keys else ():
            if s.name.endswith("_total"):
                out.setdefault((s.labels["pool"], s.labels["worker"]), {})[keys[fam.name]] = s.value
    return out


def step_ms(before: dict, after: dict, pool: str) -> float | None:
    """Mean step time of pool's workers between two scrapes: their busy seconds over their steps."""
    both = [k for k in after if k[0] == pool and k in before]
    steps = sum(after[k]["steps"] - before[k]["steps"] for k in both)
    return 1e3 * sum(after[k]["busy"] - before[k]["busy"] for k in both) / steps if steps > 0 else None


def solve_cpu(long: dict, short: dict, idle_cores: float) -> tuple[float | None, float | None]:
    """(seconds per token, seconds per request) from two runs: cpu - idle = a x tokens + b x requests."""
    net = [r["router_cpu_s"] - idle_cores * r["wall_s"] for r in (long, short)]
    ta, tb = (r["report"]["total_output_tokens"] for r in (long, short))
    rb = short["report"]["completed"]
    if ta == tb or not rb:
        return None, None
    a = (net[0] - net[1]) / (ta - tb)
    return a, (net[1] - a * tb) / rb


def row_of(concurrency: int, long: dict, short: dict, idle_cores: float, client_base_s: float) -> dict:
    """One table row from the long and short runs at one concurrency."""
    rep, dstep, pstep = long["report"], long["decode_step_ms"], long["prefill_step_ms"]
    minus = lambda v, s: None if v is None or s is None else v - s
    per_tok, per_req = solve_cpu(long, short, idle_cores)
    dur = rep["duration"] or long["wall_s"]
    return {"concurrency": concurrency, "tokens_per_s": rep["output_throughput"],
            "requests_per_s": rep["request_throughput"], "itl_p50_ms": rep["median_later_itl_ms"],
            "itl_p99_ms": rep["p99_later_itl_ms"], "decode_step_ms": dstep,
            "added_itl_p50_ms": minus(rep["median_later_itl_ms"], dstep),
            "added_itl_p99_ms": minus(rep["p99_later_itl_ms"], dstep),
            "ttft_p50_ms": rep["median_ttft_ms"], "ttft_p99_ms": rep["p99_ttft_ms"], "prefill_step_ms": pstep,
            "added_ttft_p50_ms": minus(rep["median_ttft_ms"], pstep), "added_ttft_p99_ms": minus(rep["p99_ttft_ms"], pstep),
            # the router's CPU while requests ran: less its idle rate over the client's start-up and exit
            "router_core_pct": 100 * (long["router_cpu_s"] - idle_cores * (long["wall_s"] - dur)) / dur,
            "router_us_per_token": None if per_tok is None else 1e6 * per_tok,
            "router_ms_per_request": None if per_req is None else 1e3 * per_req,
            "client_core_pct": 100 * max(0.0, long["client_cpu_s"] - client_base_s) / dur,
            "failed": rep["failed"] + short["report"]["failed"]}


def markdown(rows: list[dict]) -> str:
    cell = lambda v, spec: "n/a" if v is None else format(v, spec)
    lines = ["| " + " | ".join(t for t, _, _ in COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[k], spec) for _, k, spec in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


# -- the Ray head and the runs ------------------------------------------------------------------------------
class RayHead:
    """`ray start --head --block` on loopback in its own session, for router replicas; stop() ends it."""

    def __init__(self, log: Path):
        self.address = f"127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
             f"--port={self.address.split(':')[1]}",
             "--node-ip-address=127.0.0.1", f"--num-cpus={os.cpu_count()}", "--include-dashboard=false",
             "--disable-usage-stats"], cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
            env=RAY_TOKEN_ENV)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        for pid in session_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def merge_reports(reps: list[dict]) -> dict:
    """Reports of clients that ran at once against different routers, as one (see the module docstring)."""
    if len(reps) == 1:
        return reps[0]
    out = dict(reps[0])
    for k in ("output_throughput", "request_throughput", "total_output_tokens", "completed", "failed"):
        out[k] = sum(r[k] for r in reps)
    out["duration"] = max(r["duration"] or 0 for r in reps)
    for k in reps[0]:
        if k.startswith(("median_", "mean_")) and all(r.get(k) is not None for r in reps):
            out[k] = sum(r[k] for r in reps) / len(reps)
        elif k.startswith("p99_") and all(r.get(k) is not None for r in reps):
            out[k] = max(r[k] for r in reps)
    return out


def run_bench(servers: list[Server], args, concurrency: int, output_len: int, num_prompts: int, out: Path) -> dict:
    """One `pdserve bench` run per router at once (each its share of the concurrency and the requests), with
    the routers' CPU, the clients' and the workers' counters around them."""
    n = len(servers)
    outs = [out.with_suffix(f".{i}.json") for i in range(n)]
    cmds = [[sys.executable, "-m", "pdserve.cli", "bench", "--target", f"127.0.0.1:{server.port}",
             "--arrival", "closed",
             "--concurrency", str(max(1, concurrency // n)), "--num-prompts", str(max(1, num_prompts // n)),
             "--input-len", str(args.input_len), "--output-len", str(output_len), "--lengths", "fixed", "--ignore-eos",
             "--seed", str(5 + i), "--warmup", "0", "--output", str(o), "--no-progress"]
            for i, (server, o) in enumerate(zip(servers, outs))]
    cpu = lambda: sum(proc_cpu(s.proc.pid) for s in servers)  # noqa: E731
    counters = lambda: parse_worker_counters(servers[0].metrics_page())  # noqa: E731
    c0, k0, r0, t0 = counters(), cpu(), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL) for cmd in cmds]
    rcs = [p.wait(args.run_timeout) for p in procs]
    wall, k1, r1, c1 = time.monotonic() - t0, cpu(), resource.getrusage(resource.RUSAGE_CHILDREN), counters()
    for rc, cmd, o in zip(rcs, cmds, outs):
        if rc != 0 or not o.exists():
            raise SystemExit(f"pdserve bench failed (exit {rc}): {shlex.join(cmd)}")
    rep = merge_reports([{k: v for k, v in json.loads(o.read_text()).items() if k not in ("requests", "timeline")}
                         for o in outs])
    return {"concurrency": concurrency, "output_len": output_len, "wall_s": wall, "router_cpu_s": k1 - k0,
            "client_cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
            "decode_step_ms": step_ms(c0, c1, "decode"), "prefill_step_ms": step_ms(c0, c1, "prefill"), "report": rep}


def run_config(args, serve_extra: list[str], decode: int, interval: int, routers: int, tmp: Path) -> dict:
    flags = ["--load-format", "sim", "--model", args.model, "--dtype", "bfloat16", "--prefill-workers",
             str(args.prefill_workers), "--decode-workers", str(decode), "--worker-cpus", str(args.worker_cpus),
             "--stream-interval", str(interval), *serve_extra]
    name = f"{decode}-{interval}-{routers}"
    head = RayHead(tmp / f"ray-{name}.log") if routers > 1 else None
    servers: list[Server] = []
    try:
        t0 = time.monotonic()
        for i in range(routers):  # the first owns the pools (it starts the workers); the others follow it
            replica = ["--ray-address", head.address, "--router-name", f"r{i}", "--kv-bind-host", "127.0.0.1"] \
                if head else []
            servers.append(Server(flags + replica, tmp / f"serve-{name}-{i}.log"))
            servers[-1].wait_ready(args.prefill_workers + decode, args.start_timeout)
        ready_s = time.monotonic() - t0
        warm = run_bench(servers, args, len(servers), 1, len(servers), tmp / "warm.json")  # clients' start-up CPU
        cpu0 = sum(proc_cpu(s.proc.pid) for s in servers)
        time.sleep(args.idle_s)
        idle = (sum(proc_cpu(s.proc.pid) for s in servers) - cpu0) / args.idle_s
        runs, rows = [], []
        for c in args.concurrency:
            long = run_bench(servers, args, c, args.output_len, args.num_prompts, tmp / f"{name}-{c}-long.json")
            short = run_bench(servers, args, c, args.short_len, args.num_prompts, tmp / f"{name}-{c}-short.json")
            runs += [long, short]
            rows.append(row_of(c, long, short, idle, warm["client_cpu_s"]))
    finally:
        for server in servers:
            server.stop()
        if head is not None:
            head.stop()
    return {"prefill_workers": args.prefill_workers, "decode_workers": decode, "stream_interval": interval,
            "routers": routers, "serve_command": shlex.join(servers[0].argv), "ready_s": ready_s, "router_idle_cores": idle,
            "client_startup_cpu_s": warm["client_cpu_s"], "rows": rows, "runs": runs}


def main() -> None:
    ap = parser(__doc__)
    for flag, default in (("--decode-workers", [2, 4]), ("--stream-interval", [1, 16]), ("--concurrency", [16, 64, 128])):
        ap.add_argument(flag, type=int, nargs="+", default=default)
    ap.add_argument("--routers", type=int, nargs="+", default=[1], help="router replicas (1, 2, ...)")
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=256, help="requests per run")
    for flag in ("--input-len", "--output-len"):
        ap.add_argument(flag, type=int, default=128)
    ap.add_argument("--short-len", type=int, default=16, help="output tokens of the second run (CPU per request)")
    ap.add_argument("--model", default="llama3-8b", help="the simulated shape")
    ap.add_argument("--worker-cpus", type=float, default=0.0625)
    ap.add_argument("--idle-s", type=float, default=3.0, help="seconds the router's idle CPU is read over")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--run-timeout", type=float, default=600.0, help="seconds one bench run may take")
    ap.add_argument("--json", default=None, metavar="FILE")
    args, serve_extra = ap.parse_known_args()
    head = run_header()
    configs = []
    with tempfile.TemporaryDirectory(prefix="pdserve-router-scale-") as tmp:
        for decode, interval, routers in ((d, i, r) for d in args.decode_workers for i in args.stream_interval
                                          for r in args.routers):
            cfg = run_config(args, serve_extra, decode, interval, routers, Path(tmp))
            configs.append(cfg)
            print(f"\n### {args.prefill_workers}P{decode}D, stream interval {interval}, {routers} router"
                  f"{'s' * (routers > 1)}\n\n"
                  f"{args.num_prompts} requests a run, {args.input_len} prompt tokens, {args.output_len} out "
                  f"(CPU per token/request: against a run of {args.short_len}); router idle "
                  f"{100 * cfg['router_idle_cores']:.1f} % of a core; ready in {cfg['ready_s']:.0f} s\n"
                  f"serve: `{cfg['serve_command']}`\n\n{markdown(cfg['rows'])}", flush=True)
            if any(r["failed"] for r in cfg["rows"]):
                print("WARNING: failed requests (see the JSON's runs[].report.errors)")
    if args.json:
        write_json(args.json, {**head, "args": vars(args), "serve_extra": serve_extra, "configs": configs})
        print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
