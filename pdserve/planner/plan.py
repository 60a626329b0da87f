"""`pdserve plan`: every configuration of up to N workers, simulated on one workload, ranked by goodput per worker.

Candidates: colocated with 1..N workers, and every xPyD with x + y <= N, each with every batch cap
given (--max-num-seqs, the decode and colocated pools' running-batch limit). Each is simulated
(pdserve.planner.simulator) on the same requests, and its statistics carry the key names of
`pdserve bench`'s report, so a prediction and a measurement compare key by key. With speculative decoding
(PoolSettings.speculation: k and an acceptance rate, given or measured) the decode and colocated pools' decode
steps run at the speculating rate (pdserve.perf.speculation), so TPOT and the pool sizes that meet it follow it.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.loadgen.stats import Slo
from pdserve.perf.costs import StepCosts
from pdserve.perf.speculation import SpeculationModel
from pdserve.planner.simulator import ClusterShape, PoolShape, SimResult, simulate

# Ray and gRPC hops a token takes from a worker to the client, added to the simulated step ends:
# the first token crosses the prefill worker's Ray reply, the router and gRPC; later ones the decode
# worker's batched output stream, the router's fan-out and gRPC. Estimates (a Ray actor reply and a
# gRPC message on loopback take 1-3 ms each on the 2-core CPU machines), not measured one by one;
# against seconds of TTFT and tens of ms of TPOT they move no prediction by more than a few percent.
FIRST_TOKEN_LATENCY_S = 0.005
TOKEN_LATENCY_S = 0.003


@dataclass(frozen=True)
class Workload:
    """Requests as the simulator takes them: one entry per request, arrivals non-decreasing."""

    arrival: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    concurrency: int | None
    description: dict[str, Any]
    cached_len: np.ndarray | None = None  # each prompt's tokens the cluster holds already (None: none)

    def scaled(self, factor: float) -> Workload:
        """The same requests arriving factor times as fast (the plot's request-rate axis)."""
        return Workload(self.arrival / factor, self.input_len, self.output_len, self.concurrency, self.description,
                        self.cached_len)

    @property
    def mean_rate(self) -> float | None:
        span = float(self.arrival[-1] - self.arrival[0]) if len(self.arrival) > 1 else 0.0
        return (len(self.arrival) - 1) / span if span > 0 else None


def workload_from_args(args: argparse.Namespace, vocab_size: int, eos_token_ids: list[int], max_model_len: int,
                       tokenizer: Any = None) -> Workload:
    """The requests `pdserve bench` would send with these flags (same generators, same seed), as lengths."""
    from pdserve.loadgen.cli import build_workload
    from pdserve.loadgen.workload import LengthSampler

    requests, arrivals, _, num, desc = build_workload(args, vocab_size, eos_token_ids, max_model_len, LengthSampler)
    if getattr(args, "sessions", 0):
        return session_workload(args, arrivals, desc, max_model_len)
    at_list, in_list, out_list = [], [], []
    for req, at in zip(requests, arrivals):
        if num is not None and len(at_list) >= num:
            break
        if args.duration is not None and at >= args.duration:
            break
        n_in = req.input_len
        if n_in is None:
            if tokenizer is None:
                raise ValueError("a trace of text prompts needs the model's tokenizer (plan with --profile of a model "
                                 "that has one), or give input_len or token_ids in the trace")
            n_in = len(tokenizer.encode(req.prompt) if req.prompt is not None else
                       tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in req.messages or ()]))
        at_list.append(at)
        in_list.append(n_in)
        out_list.append(req.max_tokens)
    if not at_list:
        raise ValueError("the workload has no requests")
    return Workload(np.array(at_list, dtype=float), np.array(in_list), np.array(out_list), args.concurrency, desc)


def session_workload(args: argparse.Namespace, arrivals, desc: dict[str, Any], max_model_len: int) -> Workload:
    """The requests of `pdserve bench --sessions` as lengths, with each prompt's cached tokens: a session starts at
    its arrival, its turn t at that time + t x --think-time (a reply's own time is not known up front), and a
    turn's cached tokens are those a cluster keeping every session's KV holds (SessionSpec.cached_len: the system
    prompt, then the conversation so far but the newest tokens). --concurrency caps the requests in flight, as
    bench's caps the sessions: a session has one request in flight at a time."""
    from pdserve.loadgen.cli import session_spec_from_args

    spec = session_spec_from_args(args)
    if spec.longest > max_model_len:
        raise ValueError(f"a session's last turn needs {spec.longest} tokens; the model's context is {max_model_len}")
    rows = []
    for s, start in zip(range(spec.sessions), arrivals):
        if args.duration is not None and start >= args.duration:
            break
        rows += [(start + t * spec.think_time, spec.prompt_len(t), spec.output_len, spec.cached_len(t, s == 0))
                 for t in range(spec.turns)]
    if not rows:
        raise ValueError("the workload has no requests")
    at, n_in, n_out, cached = (np.array(col) for col in zip(*sorted(rows, key=lambda r: r[0])))
    desc = {**desc, "sessions": spec.describe(), "num_prompts": len(rows), "cached_fraction": spec.cached_fraction}
    return Workload(at.astype(float), n_in, n_out, args.concurrency, desc, cached)


@dataclass(frozen=True)
class PoolSettings:
    """What every simulated worker gets, whatever the candidate (pdserve serve's flags)."""

    kv_cache_bytes: int
    block_size: int = 16
    token_budget: int = 2048
    headroom_blocks: int = 1
    max_running: int = 256
    max_queued: int = 1024
    first_token_latency_s: float = FIRST_TOKEN_LATENCY_S
    token_latency_s: float = TOKEN_LATENCY_S
    # Speculative decoding on the decode and colocated pools (pdserve serve --speculative-config), priced at an
    # acceptance rate (pdserve.perf.speculation); None: none.
    speculation: SpeculationModel | None = None


def candidates(max_workers: int, batch_caps: list[int], settings: PoolSettings, kv_bytes_per_token: int
               ) -> list[tuple[ClusterShape, int]]:
    """(shape, batch cap) of colocated x1..xN and every xPyD with x + y <= N, for each batch cap."""
    if max_workers < 1:
        raise ValueError(f"--max-workers must be >= 1, got {max_workers}")
    blocks = settings.kv_cache_bytes // (kv_bytes_per_token * settings.block_size)
    if blocks < 1:
        raise ValueError(f"a KV cache of {settings.kv_cache_bytes} B holds no block of {settings.block_size} tokens")
    common = dict(max_running=settings.max_running, max_queued=settings.max_queued,
                  first_token_latency_s=settings.first_token_latency_s, token_latency_s=settings.token_latency_s)
    out = []
    for cap in batch_caps:
        def pool(n: int, max_num_seqs: int = cap, speculation: SpeculationModel | None = settings.speculation
                 ) -> PoolShape:
            return PoolShape(n, blocks, settings.block_size, max_num_seqs, settings.token_budget,
                             settings.headroom_blocks, speculation)

        for n in range(1, max_workers + 1):
            out.append((ClusterShape("colocated", colocated=pool(n), **common), cap))
        for x in range(1, max_workers):
            for y in range(1, max_workers - x + 1):
                # A prefill worker's batch is set by its token budget; the cap is the decode pool's.
                out.append((ClusterShape("disaggregated", prefill=pool(x, 64, None), decode=pool(y), **common), cap))
    return out


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values.size else None


def report(res: SimResult, slo: Slo) -> dict[str, Any]:
    """The simulated run's statistics under `pdserve bench`'s key names (milliseconds where bench's are)."""
    ok = res.ok
    n = len(ok)
    # As bench: from the first send to the last end, a refused request's (at once) included.
    ends = np.concatenate([res.end[ok], res.arrival[res.rejected]])
    duration = float(ends.max()) if ends.size else 0.0
    ttft, e2el = res.ttft[ok], res.e2el[ok]
    tpot_all = res.tpot[ok]
    tpot = tpot_all[~np.isnan(tpot_all)]
    first_gap = (res.second_token - res.first_token)[ok]
    first_gap = first_gap[~np.isnan(first_gap)]
    out_tokens = int(res.output_len[ok].sum())
    rep: dict[str, Any] = {"completed": int(ok.sum()), "failed": int(n - ok.sum()), "duration": duration,
                           "request_throughput": ok.sum() / duration if duration else None,
                           "output_throughput": out_tokens / duration if duration else None}
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)):
        rep[f"mean_{name}_ms"] = float(vals.mean()) * 1e3 if vals.size else None
        for stat, q in (("median", 50), ("p90", 90), ("p99", 99)):
            rep[f"{stat}_{name}_ms"] = _pct(vals, q)
    rep["median_first_gap_ms"] = _pct(first_gap, 50)
    rep["p99_first_gap_ms"] = _pct(first_gap, 99)
    good = ok.copy()
    for limit, vals in ((slo.ttft_ms, res.ttft), (slo.tpot_ms, np.nan_to_num(res.tpot, nan=0.0)),
                        (slo.e2el_ms, res.e2el)):
        if limit is not None:
            with np.errstate(invalid="ignore"):
                good &= vals * 1e3 <= limit
    n_good = int(good.sum())
    rep["good_requests"] = n_good if slo.given else None
    rep["request_goodput"] = (n_good / duration if duration else None) if slo.given else None
    rep["slo_attainment"] = n_good / n if slo.given and n else None
    return rep


def evaluate(shape: ClusterShape, cap: int, costs: StepCosts, workload: Workload, slo: Slo) -> dict[str, Any]:
    res = simulate(shape, costs, workload.arrival, workload.input_len, workload.output_len, workload.concurrency,
                   cached_len=workload.cached_len)
    rep = report(res, slo)
    block_bytes = costs.kv_bytes_per_token * (shape.colocated or shape.decode).block_size
    peaks = {pool: max((v for k, v in res.peak_kv_blocks.items() if k.startswith(pool)), default=0)
             for pool in ("prefill", "decode", "colocated")}
    capacity = (shape.colocated or shape.decode).kv_blocks * block_bytes
    kv_need = max(peaks.values()) * block_bytes
    busy = {pool: sum(v for k, v in res.busy_s.items() if k.startswith(pool)) for pool in ("prefill", "decode", "colocated")}
    workers = {"prefill": shape.prefill.workers if shape.prefill else 0,
               "decode": shape.decode.workers if shape.decode else 0,
               "colocated": shape.colocated.workers if shape.colocated else 0}
    goodput = rep["request_goodput"]
    return {
        "label": shape.label + (f", batch <= {cap}" if cap else ""),
        "mode": shape.mode,
        "prefill_workers": workers["prefill"],
        "decode_workers": workers["decode"] or workers["colocated"],
        "workers": shape.workers,
        "max_num_seqs": cap,
        **rep,
        "goodput_per_worker": None if goodput is None else goodput / shape.workers,
        "kv_bytes_per_worker": kv_need,
        "kv_bytes_per_prefill_worker": peaks["prefill"] * block_bytes if shape.prefill else None,
        "kv_bytes_per_decode_worker": (peaks["decode"] or peaks["colocated"]) * block_bytes,
        "kv_cache_bytes": capacity,
        "kv_fits": res.kv_overflows == 0 and kv_need <= capacity,
        "kv_overflow_steps": res.kv_overflows,
        "busy_fraction": {pool: busy[pool] / (workers[pool] * rep["duration"])
                          for pool in busy if workers[pool] and rep["duration"]},
    }


def rank_key(c: dict[str, Any]) -> tuple:
    """Goodput per worker (higher first), then SLO attainment, then fewer workers."""
    return (-(c["goodput_per_worker"] or 0.0), -(c["slo_attainment"] or 0.0), c["workers"])


def recommend(ranked: list[dict[str, Any]], min_attainment: float) -> tuple[dict[str, Any], str]:
    """The best-ranked candidate whose KV fits and whose SLO attainment reaches min_attainment; if none
    does, the one that comes closest (highest attainment). Returns it and why."""
    fit = [c for c in ranked if c["kv_fits"]] or ranked
    meets = [c for c in fit if (c["slo_attainment"] or 0.0) >= min_attainment]
    if meets:
        best = meets[0]
        why = (f"highest goodput per worker ({best['goodput_per_worker']:.3f} req/s) among configurations that keep "
               f"{min_attainment:.0%} of requests within the SLOs ({best['slo_attainment']:.1%})")
        rivals = [c for c in meets[1:] if c["workers"] != best["workers"] or c["mode"] != best["mode"]]
        if rivals:
            r = rivals[0]
            why += f"; next: {r['label']} at {r['goodput_per_worker']:.3f} req/s per worker"
        return best, why
    best = max(fit, key=lambda c: (c["slo_attainment"] or 0.0, -c["workers"]))
    return best, (f"no configuration of at most {max(c['workers'] for c in ranked)} workers keeps "
                  f"{min_attainment:.0%} of requests within the SLOs; this one comes closest "
                  f"({(best['slo_attainment'] or 0.0):.1%}): add workers, relax the SLOs or lower the rate")


def make_plan(costs: StepCosts, workload: Workload, slo: Slo, max_workers: int, batch_caps: list[int],
              settings: PoolSettings, min_attainment: float = 0.9) -> dict[str, Any]:
    if not slo.given:
        raise ValueError("give at least one SLO (--slo-ttft-ms, --slo-tpot-ms, --slo-e2el-ms): goodput ranks the plan")
    # A worker refuses a request its whole KV cache could not hold (pdserve.engine.scheduler.Scheduler.add).
    blocks = settings.kv_cache_bytes // (costs.kv_bytes_per_token * settings.block_size)
    longest = int((workload.input_len + 1).max())
    if -(-longest // settings.block_size) > blocks:
        raise ValueError(f"the workload's longest prompt ({longest - 1} tokens) needs more KV than a worker's cache "
                         f"holds ({blocks} blocks of {settings.block_size} tokens): raise --kv-cache-mib")
    start = time.perf_counter()
    cands = [evaluate(shape, cap, costs, workload, slo)
             for shape, cap in candidates(max_workers, batch_caps, settings, costs.kv_bytes_per_token)]
    seconds = time.perf_counter() - start
    ranked = sorted(cands, key=rank_key)
    for i, c in enumerate(ranked, 1):
        c["rank"] = i
    best, why = recommend(ranked, min_attainment)
    plan = {"candidates": ranked, "recommended": {**best, "reason": why},
            "slo": slo.as_dict(), "min_attainment": min_attainment, "workload": workload.description,
            "requests": len(workload.arrival), "simulation_seconds": seconds}
    if settings.speculation is not None:
        plan["speculation"] = speculation_report(settings.speculation, costs, workload, batch_caps)
    return plan


def speculation_report(spec: SpeculationModel, costs: StepCosts, workload: Workload, batch_caps: list[int]
                       ) -> dict[str, Any]:
    """The speculation the plan priced: k, the acceptance rate, tokens per verification, and the speed-up of a
    decode step's tokens at batch 1 and at each batch cap, at the workload's mean context (prompt and half the
    output); where it is below 1 the pool decodes plainly (SpeculationModel.token_time)."""
    ctx = float(workload.input_len.mean() + workload.output_len.mean() / 2)
    batches = sorted({1, *batch_caps})
    return {**spec.as_dict(), "mean_context": ctx,
            "speedup": {b: spec.speedup(costs, b, round(b * ctx)) for b in batches}}


def format_speculation(s: dict[str, Any]) -> str:
    ups = ", ".join(f"{v:.2f}x at batch {b}" for b, v in s["speedup"].items())
    return (f"speculation: k={s['num_speculative_tokens']} at acceptance {s['acceptance']:.2f}: "
            f"{s['tokens_per_step']:.2f} tokens per verification; decode tokens/s against plain steps: {ups}")


def _mb(b: int | None) -> str:
    if b is None:
        return "-"
    return f"{b / 2**30:.1f}G" if b >= 2**30 else f"{b / 2**20:.0f}M"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _num(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_plan(plan: dict[str, Any]) -> str:
    head = (f"{'#':>3} {'configuration':24} {'goodput':>8} {'/worker':>8} {'SLO ok':>7} {'TTFT med':>9} {'p99':>7} "
            f"{'TPOT med':>9} {'p99':>7} {'KV/worker':>10} {'busy P/D':>9}")
    lines = [head, "-" * len(head)]
    for c in plan["candidates"]:
        busy = c["busy_fraction"]
        b = "/".join(f"{busy[k]:.0%}" for k in ("prefill", "decode", "colocated") if k in busy)
        kv = _mb(c["kv_bytes_per_worker"]) + ("" if c["kv_fits"] else "!")
        lines.append(f"{c['rank']:>3} {c['label']:24} {_num(c['request_goodput'], '.3f'):>8} "
                     f"{_num(c['goodput_per_worker'], '.3f'):>8} {_num(c['slo_attainment'], '.1%'):>7} "
                     f"{_ms(c['median_ttft_ms']):>9} {_ms(c['p99_ttft_ms']):>7} "
                     f"{_ms(c['median_tpot_ms']):>9} {_ms(c['p99_tpot_ms']):>7} {kv:>10} {b:>9}")
    r = plan["recommended"]
    lines += ["", f"goodput in req/s; times in ms; KV/worker: the most KV a worker held (! : more than its cache, "
                  f"{_mb(r['kv_cache_bytes'])}: it would preempt)",
              f"recommended: {r['label']}: {r['reason']}"]
    return "\n".join(lines)


def plot_plan(plan_candidates: list[tuple[ClusterShape, int]], costs: StepCosts, workload: Workload, slo: Slo,
              path: str | Path, factors: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)) -> Path:
    """Predicted goodput against request rate for each configuration: the workload's requests, arriving
    faster or slower by each factor."""
    from pdserve.loadgen.plot import pyplot, save_figure

    plt = pyplot()
    base = workload.mean_rate
    xs = [f * base for f in factors] if base else list(factors)
    fig, ax = plt.subplots(figsize=(9, 6))
    for shape, cap in plan_candidates:
        ys = []
        for f in factors:
            w = workload.scaled(f)
            res = simulate(shape, costs, w.arrival, w.input_len, w.output_len, w.concurrency, cached_len=w.cached_len)
            ys.append(report(res, slo)["request_goodput"] or 0.0)
        ax.plot(xs, ys, marker="o", label=shape.label + (f", batch <= {cap}" if len(
            {c for _, c in plan_candidates}) > 1 else ""))
    ax.set_xlabel("request rate (req/s)" if base else "arrival speed-up")
    ax.set_ylabel("predicted goodput (req/s)")
    ax.set_title("pdserve plan: goodput against request rate, " + ", ".join(
        f"{k[:-3].upper()} <= {v:g} ms" for k, v in slo.as_dict().items() if v is not None))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)

