"""`pdserve bench`: drive a running router and report the serving statistics (see stats.py).

    pdserve bench --target 127.0.0.1:50051 --request-rate 4 --num-prompts 200 \
        --lengths uniform --input-len 256 --output-len 64 --slo-ttft-ms 500 --slo-tpot-ms 50 \
        --output run.json --plot run.png

Group sampling (GRPO rollouts): `--n 8 --num-prompts 64 --temperature 1` sends 64 prompts, each asking
for 8 samples; the report counts every sample's tokens and the prompt tokens the workers were asked to
compute against those they computed (a prompt of n samples is computed once).

Service tiers: `--service-tier-mix priority=0.1,default=0.6,flex=0.3` has each request ask for a tier
drawn from the mix, and splits the report by the tier asked for (stats.py); `--tier-slo
priority=1000:50` gives a tier its own SLOs for goodput.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdserve.loadgen.runner import MAX_N
from pdserve.loadgen.sessions import SessionSpec, format_sessions, run_session_bench
from pdserve.loadgen.stats import Slo
from pdserve.loadgen.workload import (
    ARRIVALS,
    LENGTH_DISTS,
    BenchRequest,
    LengthSpec,
    TokenSampler,
    bursty_arrivals,
    closed_arrivals,
    load_trace,
    poisson_arrivals,
    synthetic_requests,
    trace_arrivals,
    with_tiers,
)
from pdserve.client.grpc_client import add_connection_args
from pdserve.tiers import TIERS, ServiceTier, parse_mix, parse_tier

DEFAULT_NUM_PROMPTS = 100


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="load-test a running router: throughput, TTFT/TPOT/ITL, SLO goodput",
                       description="Drive a running pdserve router over gRPC with a synthetic or replayed "
                                   "workload and report throughput, latency percentiles and SLO goodput.")
    add_connection_args(p)
    add_workload_args(p)
    g = p.add_argument_group("SLOs (goodput counts successful requests that meet every one given)")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="time to first token, ms")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="time per output token after the first, ms")
    g.add_argument("--slo-e2el-ms", type=float, default=None, help="end-to-end latency, ms")
    g = p.add_argument_group("group sampling")
    g.add_argument("--n", type=int, default=1,
                   help="samples of each prompt every request asks for (1..128): --num-prompts B --n N is a batch of "
                        "B prompts x N samples, reinforcement learning's group shape (use --temperature > 0, or the N "
                        "are alike). Output tokens count every sample; TPOT and ITL are each sample's own")
    g = p.add_argument_group("service tiers (without --service-tier-mix no tier is sent: the server's default)")
    g.add_argument("--service-tier-mix", default=None, metavar="TIER=SHARE,...",
                   help="each request asks for a tier (priority, default, flex; auto is default) drawn from these "
                        "shares (normalised to sum to 1), e.g. priority=0.1,default=0.6,flex=0.3; seeded by --seed "
                        "apart from the lengths, prompts and arrivals, which stay those of the same seed without a "
                        "mix. The report gains by_service_tier: the statistics of each tier asked for, what it was "
                        "served (served, downgraded) and how many were refused (RESOURCE_EXHAUSTED)")
    g.add_argument("--tier-slo", action="append", default=[], metavar="TIER=TTFT_MS:TPOT_MS[:E2EL_MS]",
                   help="this tier's SLOs for goodput, in ms, instead of the --slo-* ones (which apply to every tier "
                        "not given here); an empty field keeps the --slo-* value: priority=1000:50 (TTFT 1 s, TPOT "
                        "50 ms; no E2EL limit unless --slo-e2el-ms), flex=:200 (TPOT 200 ms, TTFT that of "
                        "--slo-ttft-ms). Repeatable, once per tier; needs --service-tier-mix")
    g = p.add_argument_group("output")
    g.add_argument("--output", default=None, metavar="FILE.json", help="write the full report as JSON")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="latency CDFs and throughput timeline (matplotlib)")
    g.add_argument("--label", default="", help="name of this run in the report and plot")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=cmd_bench)
    return p


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("arrivals")
    g.add_argument("--arrival", choices=ARRIVALS, default=None,
                   help="poisson: open loop at --request-rate; closed: --concurrency requests always in flight; "
                        "bursty: --burst-size requests at once every --burst-interval s; trace: the timestamps "
                        "of --trace (default: trace if --trace has timestamps, else poisson)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")
    g.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=None,
                   help="requests in flight at most (required by --arrival closed; a cap otherwise)")
    g.add_argument("--burst-size", type=int, default=32, help="requests per burst (bursty)")
    g.add_argument("--burst-interval", type=float, default=10.0, help="seconds from one burst to the next (bursty)")
    g = p.add_argument_group("requests")
    g.add_argument("--lengths", choices=LENGTH_DISTS, default="fixed",
                   help="prompt and output length distribution: fixed, uniform (+-range-ratio), "
                        "longtail (ShareGPT-like log-normal with median --input-len/--output-len)")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (fixed; uniform centre; longtail median)")
    g.add_argument("--output-len", type=int, default=32, help="output tokens (same meaning)")
    g.add_argument("--range-ratio", type=float, default=0.5, help="uniform: lengths in [len*(1-r), len*(1+r)]")
    g.add_argument("--max-input-len", type=int, default=None, help="longtail cap (default 10 x --input-len)")
    g.add_argument("--max-output-len", type=int, default=None, help="longtail cap (default 10 x --output-len)")
    g.add_argument("--trace", default=None, metavar="FILE.jsonl",
                   help="replay these requests instead (one JSON object a line; see docs/benchmarks.md)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly the output length (default: on for synthetic prompts, off for traces)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0, help="seeds lengths, prompts and arrivals")
    g = p.add_argument_group("multi-turn sessions (chat, agents: each turn resends the conversation)")
    g.add_argument("--sessions", type=int, default=0,
                   help="send N sessions of --turns turns instead of single requests: each turn is the whole "
                        "conversation so far (a shared system prompt, every earlier turn, the model's own replies) "
                        "and --turn-input-len new tokens, with the session's key; sessions start on the arrival "
                        "schedule, --concurrency of them at a time. The report adds TTFT by turn and the prompt "
                        "tokens computed against those sent, by pool")
    g.add_argument("--turns", type=int, default=4, help="turns a session (with --sessions)")
    g.add_argument("--system-prompt-len", type=int, default=256,
                   help="tokens of the system prompt every session begins with (with --sessions)")
    g.add_argument("--turn-input-len", type=int, default=64,
                   help="new tokens a turn: the user's message or a tool's output (with --sessions; the reply is "
                        "--output-len tokens)")
    g.add_argument("--think-time", type=float, default=0.0,
                   help="seconds from a reply to the session's next turn: a tool call (with --sessions)")
    g = p.add_argument_group("run bounds")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests to send (default {DEFAULT_NUM_PROMPTS}, or the trace's length, unless --duration)")
    g.add_argument("--duration", type=float, default=None,
                   help="stop sending new requests after this many seconds (sent ones finish and count)")
    g.add_argument("--timeout", type=float, default=None, help="per-request deadline, seconds")
    g.add_argument("--warmup", type=int, default=2, help="short requests sent and awaited first, not recorded")


def cmd_bench(args: argparse.Namespace) -> int:
    import grpc

    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)  # ValueErrors before any network call
    tier_slos = tier_slos_from_args(args, slo)
    check_args(args)
    if args.plot:  # fail now, not after the run
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'pdserve[bench]'") from None
    try:
        report = asyncio.run(run_bench(args, slo, tier_slos))
    except grpc.RpcError as e:
        print(f"pdserve bench: {args.target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
        print(f"report: {args.output}")
    if args.plot:
        from pdserve.loadgen.plot import plot_reports

        plot_reports([(args.label or report["mode"] or "run", report)], args.plot, title=plot_title(report))
        print(f"plot: {args.plot}")
    return 0 if report["completed"] else 1


def check_args(args: argparse.Namespace) -> None:
    for name, ok in (("num_prompts", lambda v: v >= 1), ("duration", lambda v: v > 0),
                     ("concurrency", lambda v: v >= 1), ("timeout", lambda v: v > 0),
                     ("request_rate", lambda v: v > 0), ("burst_size", lambda v: v >= 1),
                     ("burst_interval", lambda v: v > 0), ("warmup", lambda v: v >= 0),
                     ("n", lambda v: 1 <= v <= MAX_N)):
        v = getattr(args, name, None)  # the planner takes the workload's flags, not bench's own (--n)
        if v is not None and not ok(v):
            raise ValueError(f"--{name.replace('_', '-')} out of range: {v}")
    if session_spec_from_args(args) is not None:
        if args.trace or getattr(args, "n", 1) > 1 or args.lengths != "fixed":
            raise ValueError("--sessions takes fixed lengths (--turn-input-len, --output-len), no --trace and no --n")
        if args.num_prompts is not None:
            raise ValueError("--sessions counts sessions: --num-prompts has no meaning with it")
    unbounded = args.num_prompts is None and args.concurrency is None and args.duration is not None
    if unbounded and math.isinf(args.request_rate) and args.arrival in (None, "poisson") and not args.trace:
        raise ValueError("--duration with --request-rate inf (all at once) needs --num-prompts or --concurrency")
    if not args.trace:
        LengthSpec(args.lengths, args.input_len, args.range_ratio, args.max_input_len)
        LengthSpec(args.lengths, args.output_len, args.range_ratio, args.max_output_len)
    elif not Path(args.trace).is_file():
        raise FileNotFoundError(f"trace {args.trace} not found")


def session_spec_from_args(args: argparse.Namespace) -> SessionSpec | None:
    """The multi-turn workload of --sessions, or None without it (single requests)."""
    if not getattr(args, "sessions", 0):
        return None
    return SessionSpec(args.sessions, args.turns, args.system_prompt_len, args.turn_input_len, args.output_len,
                       args.think_time)


def tier_mix_from_args(args: argparse.Namespace) -> dict[ServiceTier, float] | None:
    """The --service-tier-mix shares in rank order, or None without one (nor the flag: the planner's)."""
    text = getattr(args, "service_tier_mix", None)
    if text is None:
        return None
    try:
        if any(not item.partition("=")[0].strip() for item in text.split(",")):
            raise ValueError("a tier mix is TIER=SHARE,... with TIER one of priority, default, flex")
        mix = parse_mix(text)
    except ValueError as e:
        raise ValueError(f"--service-tier-mix {text!r}: {e}") from None
    return {t: mix[t] for t in TIERS if t in mix}


def parse_tier_slo(text: str, base: Slo) -> tuple[str, Slo]:
    """`TIER=TTFT_MS:TPOT_MS[:E2EL_MS]` -> (tier, its SLO); an empty field keeps base's value."""
    form = "--tier-slo is TIER=TTFT_MS:TPOT_MS[:E2EL_MS] (an empty field keeps the --slo-* value)"
    name, sep, values = text.partition("=")
    fields = values.split(":")
    if not sep or not name.strip() or not 1 <= len(fields) <= 3:
        raise ValueError(f"{form}; got {text!r}")
    try:
        tier = parse_tier(name.strip()).value
        ms = [float(f) if f.strip() else None for f in fields] + [None] * (3 - len(fields))
    except ValueError as e:
        raise ValueError(f"{form}; got {text!r}: {e}") from None
    ttft, tpot, e2el = (given if given is not None else dflt
                        for given, dflt in zip(ms, (base.ttft_ms, base.tpot_ms, base.e2el_ms)))
    try:
        return tier, Slo(ttft, tpot, e2el)
    except ValueError as e:
        raise ValueError(f"--tier-slo {text!r}: {e}") from None


def tier_slos_from_args(args: argparse.Namespace, slo: Slo) -> dict[str, Slo]:
    """The SLOs of the tiers given --tier-slo (the others are judged by `slo`); checks the mix too."""
    mix = tier_mix_from_args(args)
    given = getattr(args, "tier_slo", None) or []
    if given and mix is None:
        raise ValueError("--tier-slo needs --service-tier-mix (without a mix every request is judged by --slo-*)")
    out: dict[str, Slo] = {}
    for text in given:
        tier, tslo = parse_tier_slo(text, slo)
        if tier in out:
            raise ValueError(f"--tier-slo given twice for {tier}")
        out[tier] = tslo
    return out


def plot_title(report: dict[str, Any]) -> str:
    c = report["config"]
    return (f"pdserve bench{' ' + report['label'] if report['label'] else ''}: {report['mode']} {c['workload']}, "
            f"{report['completed']} ok / {report['failed']} failed in {report['duration']:.1f}s")


def build_workload(args: argparse.Namespace, vocab_size: int, eos_ids: list[int], max_model_len: int,
                   sampler_type: type[TokenSampler] = TokenSampler
                   ) -> tuple[Iterator[BenchRequest], Iterator[float], str, int | None, dict[str, Any]]:
    """(requests, arrivals, arrival kind, request count bound, description) from the flags and the model.
    sampler_type: LengthSampler where only the lengths matter (the planner)."""
    sampler = sampler_type(vocab_size, eos_ids)
    num = args.num_prompts
    if args.trace:
        trace = load_trace(args.trace, sampler, seed=args.seed, default_output_len=args.output_len,
                           ignore_eos=bool(args.ignore_eos), max_model_len=max_model_len)
        arrival = args.arrival or ("trace" if trace[0].timestamp is not None else "poisson")
        requests: Iterator[BenchRequest] = iter(trace)
        num = min(num, len(trace)) if num is not None else (len(trace) if args.duration is None else None)
        desc: dict[str, Any] = {"trace": str(args.trace), "trace_requests": len(trace)}
    else:
        arrival = args.arrival or "poisson"
        if arrival == "trace":
            raise ValueError("--arrival trace needs --trace FILE.jsonl")
        in_spec = LengthSpec(args.lengths, args.input_len, args.range_ratio, args.max_input_len)
        out_spec = LengthSpec(args.lengths, args.output_len, args.range_ratio, args.max_output_len)
        ignore_eos = True if args.ignore_eos is None else args.ignore_eos
        requests = synthetic_requests(in_spec, out_spec, sampler, max_model_len, args.seed, ignore_eos)
        if num is None and args.duration is None:
            num = DEFAULT_NUM_PROMPTS
        desc = {"lengths": args.lengths, "input_len": args.input_len, "output_len": args.output_len,
                "range_ratio": args.range_ratio if args.lengths == "uniform" else None,
                "input_len_bounds": in_spec.bounds, "output_len_bounds": out_spec.bounds, "ignore_eos": ignore_eos}
    if arrival == "poisson":
        arrivals: Iterator[float] = poisson_arrivals(args.request_rate, args.seed)
        what = f"poisson {args.request_rate:g} req/s"
    elif arrival == "closed":
        if args.concurrency is None:
            raise ValueError("--arrival closed needs --concurrency N")
        arrivals, what = closed_arrivals(), f"closed loop at concurrency {args.concurrency}"
    elif arrival == "bursty":
        arrivals = bursty_arrivals(args.burst_size, args.burst_interval)
        what = f"bursts of {args.burst_size} every {args.burst_interval:g}s"
    else:
        if not args.trace:
            raise ValueError("--arrival trace needs --trace FILE.jsonl")
        arrivals, what = trace_arrivals(trace), "trace timestamps"
    mix = tier_mix_from_args(args)
    if mix is not None:  # its own random stream: the same seed sends the same prompts with or without a mix
        requests = with_tiers(requests, mix, args.seed)
        desc["service_tier_mix"] = {t.value: share for t, share in mix.items()}
    if args.concurrency is not None and arrival != "closed":
        what += f", at most {args.concurrency} in flight"
    desc = {"workload": what, "arrival": arrival, "request_rate": args.request_rate if arrival == "poisson" else None,
            "concurrency": args.concurrency,
            "burst_size": args.burst_size if arrival == "bursty" else None,
            "burst_interval": args.burst_interval if arrival == "bursty" else None,
            **desc, "num_prompts": num, "duration_limit": args.duration, "timeout": args.timeout,
            "temperature": args.temperature, "seed": args.seed, "warmup": args.warmup}
    return requests, arrivals, arrival, num, desc


async def run_bench(args: argparse.Namespace, slo, tier_slos: dict | None = None) -> dict[str, Any]:
    from pdserve.loadgen.runner import (
        Progress,
        RunConfig,
        prompt_tokens_between,
        run_workload,
        warm_up,
        worker_prompt_tokens,
    )
    from pdserve.loadgen.stats import build_report
    from pdserve.client.grpc_client import AsyncClient, connection_from_args

    conn = connection_from_args(args)
    async with AsyncClient(conn) as client:
        info = await client.model_info(timeout=30)
        try:
            mode = (await client.cluster_status(timeout=30)).mode
        except Exception:  # status is informative only
            mode = ""
    requests, arrivals, _, num, desc = build_workload(args, info.vocab_size, list(info.eos_token_ids),
                                                      info.max_model_len)
    spec = session_spec_from_args(args)
    if spec is not None:
        num = desc["num_prompts"] = spec.sessions * spec.turns
    cfg = RunConfig(num_prompts=num, duration=args.duration, concurrency=args.concurrency, timeout=args.timeout,
                    temperature=args.temperature, n=args.n)
    desc["n"] = args.n
    if args.warmup:
        sampler = TokenSampler(info.vocab_size, info.eos_token_ids)
        import numpy as np

        rng = np.random.default_rng([args.seed, 9])
        await warm_up(conn, [BenchRequest(max_tokens=4, token_ids=sampler(rng, 16), ignore_eos=True)
                                    for _ in range(args.warmup)], args.temperature)
    progress = None if args.no_progress else Progress(num, args.duration)
    if spec is not None:
        records, wall, sessions = await run_session_bench(conn, spec, info, arrivals, cfg, args.seed, progress)
        requested, computed = sessions["worker_prompt_tokens_requested"], sessions["worker_prompt_tokens_computed"]
    else:
        before = await worker_prompt_tokens(conn)  # after the warm-up: the run's own prompts alone
        records, wall = await run_workload(conn, requests, arrivals, cfg, progress)
        requested, computed = prompt_tokens_between(before, await worker_prompt_tokens(conn))
    mix = tier_mix_from_args(args)
    tiers = None if mix is None else [t.value for t, share in mix.items() if share > 0]
    report = build_report(records, slo, wall, tier_slos=tier_slos, tiers=tiers)
    if spec is not None:
        report["sessions"] = sessions
    model = {"name": info.name, "architecture": info.architecture, "num_params": info.num_params,
             "dtype": info.dtype, "vocab_size": info.vocab_size, "max_model_len": info.max_model_len}
    # The workers' prompt tokens over the run (other clients' included; null where the router does not say):
    # requested counts a prompt of n samples once, computed what was computed of them.
    return {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "label": args.label,
            "target": args.target, "mode": mode, "model": model, "config": desc, **report,
            "worker_prompt_tokens_requested": requested, "worker_prompt_tokens_computed": computed}


def _f(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def _slo_text(slo: dict[str, float | None]) -> str:
    return ", ".join(f"{k[:-3].upper()}<={v:g}ms" for k, v in slo.items() if v is not None) or "none"


def format_report(rep: dict[str, Any]) -> str:
    """The summary in the layout of `vllm bench serve`."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
             f"{'Mode / workload:':<40}{rep['mode']}, {rep['config']['workload']}"]
    row = lambda name, v: lines.append(f"{name:<40}{v:<10}")  # noqa: E731
    row("Successful requests:", rep["completed"])
    row("Failed requests:", rep["failed"])
    for code, n in rep["failed_by_code"].items():
        row(f"  {code}:", n)
    row("Benchmark duration (s):", _f(rep["duration"]))
    if rep["config"].get("n", 1) > 1:
        row("Samples per request:", rep["config"]["n"])
    row("Total input tokens:", rep["total_input_tokens"])
    if rep.get("worker_prompt_tokens_requested") is not None:
        row("Prompt tokens requested (workers):", rep["worker_prompt_tokens_requested"])
        row("Prompt tokens computed (workers):", rep["worker_prompt_tokens_computed"])
    row("Total generated tokens:", rep["total_output_tokens"])
    row("Request throughput (req/s):", _f(rep["request_throughput"]))
    if rep["good_requests"] is not None:
        row("SLOs:", _slo_text(rep["slo"]))
        for tier, t in (rep.get("by_service_tier") or {}).items():
            if t["slo"] != rep["slo"]:  # given its own by --tier-slo
                row(f"  {tier} SLOs:", _slo_text(t["slo"]))
        row("Request goodput (req/s):", _f(rep["request_goodput"]))
        row("SLO attainment (%):", _f(100 * rep["slo_attainment"], ".1f"))
    row("Input token throughput (tok/s):", _f(rep["input_throughput"]))
    row("Output token throughput (tok/s):", _f(rep["output_throughput"]))
    row("Total token throughput (tok/s):", _f(rep["total_token_throughput"]))
    row("Peak concurrent requests:", rep["peak_concurrency"])
    for metric, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                          ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {metric.upper()} (ms):",
                _f(rep[f"{stat}_{metric}_ms"]))
    lines.append("{s:{c}^50}".format(s="ITL split: 1st->2nd token, later", c="-"))
    row("Median 1st->2nd token gap (ms):", _f(rep["median_first_gap_ms"]))
    row("P99 1st->2nd token gap (ms):", _f(rep["p99_first_gap_ms"]))
    row("Median ITL after the 2nd token (ms):", _f(rep["median_later_itl_ms"]))
    row("P99 ITL after the 2nd token (ms):", _f(rep["p99_later_itl_ms"]))
    if rep.get("by_service_tier"):
        lines += format_tiers(rep["by_service_tier"])
    if rep.get("sessions"):
        lines += format_sessions(rep["sessions"])
    lines.append("=" * 50)
    return "\n".join(lines)


TIER_COLUMNS = ("Tier", "Sent", "OK", "Failed", "Refused", "Downgr", "SLO %", "Goodput", "TTFT p50", "TTFT p99",
                "TPOT p50", "TPOT p99")


def format_tiers(by_tier: dict[str, dict[str, Any]]) -> list[str]:
    """A row per tier asked for: requests, refusals (RESOURCE_EXHAUSTED), downgrades, SLO attainment (%),
    goodput (req/s) and TTFT / TPOT percentiles (ms)."""
    widths = (9, 6, 6, 7, 8, 7, 7, 8, 9, 9, 9, 9)
    fmt = lambda cells: "".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}"  # noqa: E731
                                for i, (c, w) in enumerate(zip(cells, widths)))
    out = ["{s:{c}^50}".format(s="By service tier asked (ms; goodput req/s)", c="-"), fmt(TIER_COLUMNS)]
    for tier, t in by_tier.items():
        att = t["slo_attainment"]
        out.append(fmt((tier, t["sent"], t["completed"], t["failed"], t["refused"], t["downgraded"],
                        _f(None if att is None else 100 * att, ".1f"), _f(t["request_goodput"]),
                        _f(t["median_ttft_ms"], ".1f"), _f(t["p99_ttft_ms"], ".1f"), _f(t["median_tpot_ms"], ".1f"),
                        _f(t["p99_tpot_ms"], ".1f"))))
    return out
