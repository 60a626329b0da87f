"""Agentic multi-turn traffic at scale on the simulated engine: placement by the workers' KV events (exact)
against the router's record of what it placed where (estimate) and against no prefix signal (random), one
after another on the same seeded trace (issue #48).

    .venv/bin/python -m bench.simulated.agentic_scale [--prefill-workers 8] [--decode-workers 24] [--gpu H100]
        [--model llama3-8b] [--sessions 1000] [--span 60] [--turns-mean 5] [--system-tokens 2000]
        [--user-mean 150] [--tool-mean 300] [--reply-mean 100] [--think-mean 3] [--time-scale 16]
        [--modes exact estimate random] [--json FILE]

The trace (seeded): --sessions agent sessions, each starting at a uniform time within --span seconds (GPU
time). A session's first prompt is a system prompt every session shares (--system-tokens: the agent's
instructions and tool definitions) and its task (log-normal, --user-mean); every later turn resends the
whole conversation so far, the model's own reply included, plus a tool's output (log-normal, --tool-mean),
after a think time (exponential, --think-mean seconds: the tool running). Turns a session: 2 to 2 x
--turns-mean - 2, uniform; replies log-normal (--reply-mean), asked with ignore_eos. Each request carries its
session's key (session_id). Token ids are drawn uniformly from ordinary vocabulary ids.

For each mode in --modes: `pdserve serve --load-format sim --prefix-routing MODE` with --prefill-workers +
--decode-workers simulated workers of the model on the GPU (bfloat16; each step sleeps the roofline's time
x --time-scale), the trace replayed over gRPC with its times x --time-scale, then the server stopped (the
next mode starts from empty caches). Times are in the GPU's time (measured / scale).

Printed, a row a mode: requests completed (and failed), TTFT p50 and p90, prompt tokens the workers computed
against those requested and against those new to the cluster (the system prompt once, each session's task
and tool outputs), the KV the hand-offs moved at the real model's size (the simulated workers hold each
token's KV --sim-kv-scale times smaller; the hand-off's own time is the host's, not an interconnect's), output
tokens a second, and the workers' late steps (a step whose host work outlasted its simulated time: many of
them and the run no longer stands for the GPU; raise --time-scale).
"""
from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import Server, late_steps, lognormal, parser, pool_sums, run_header, write_json
from pdserve.loadgen.stats import RequestRecord, percentile
from pdserve.perf.hardware import gpu, resolve_model, roofline

TOKEN_IDS = (1000, 30000)  # ordinary vocabulary ids in every preset's tokenizer
SIM_KV_SCALE = 1024  # pdserve serve's --sim-kv-scale default


@dataclass
class Session:
    start: float  # GPU seconds
    task: list[int]  # the first user message
    tools: list[list[int]]  # a tool's output before each turn after the first
    replies: list[int]  # tokens asked of each turn
    thinks: list[float]  # GPU seconds before each turn after the first


def make_trace(args) -> tuple[list[int], list[Session]]:
    g = np.random.default_rng(args.seed)
    ids = lambda n: g.integers(*TOKEN_IDS, int(n)).tolist()  # noqa: E731
    system = ids(args.system_tokens)
    sessions = []
    for start in np.sort(g.uniform(0, args.span, args.sessions)):
        turns = int(g.integers(2, max(2 * args.turns_mean - 2, 2) + 1))
        sessions.append(Session(float(start), ids(lognormal(g, 1, args.user_mean, 0.5, 16, 2000)[0]),
                                [ids(n) for n in lognormal(g, turns - 1, args.tool_mean, 0.8, 16, 4000)],
                                lognormal(g, turns, args.reply_mean, 0.6, 8, 1000).tolist(),
                                g.exponential(args.think_mean, turns - 1).tolist()))
    return system, sessions


async def drive(port: int, system: list[int], sessions: list[Session], scale: float,
                timeout: float) -> tuple[list[RequestRecord], float]:
    """Every session's turns as the trace says (times x scale); the records, times in real seconds."""
    import grpc

    from pdserve.client.grpc_client import AsyncClient, build_request

    records: list[RequestRecord] = []
    async with AsyncClient(f"127.0.0.1:{port}") as client:
        t0 = time.perf_counter()
        now = lambda: time.perf_counter() - t0  # noqa: E731

        async def one(i: int, s: Session) -> None:
            await asyncio.sleep(max(s.start * scale - now(), 0))
            prompt = system + s.task
            for t, asked in enumerate(s.replies):
                req = build_request(token_ids=prompt, max_tokens=asked, temperature=0.0, ignore_eos=True)
                req.session_id = f"session-{i}"
                rec = RequestRecord(send=now(), input_tokens=len(prompt), max_tokens=asked)
                records.append(rec)
                reply: list[int] = []
                try:
                    async for r in client.stub.Generate(req, timeout=timeout, metadata=client.metadata):
                        rec.chunks.append((now(), len(r.token_ids)))
                        reply += r.token_ids
                except grpc.aio.AioRpcError as e:
                    rec.error_code, rec.error = e.code().name, e.details() or ""
                rec.end = now()
                if rec.error_code is not None or t + 1 == len(s.replies):
                    return  # a session whose turn failed ends there
                prompt = prompt + reply + s.tools[t]
                await asyncio.sleep(s.thinks[t] * scale)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
        return records, now()


def run_mode(mode: str, args, system: list[int], sessions: list[Session], tmp: Path) -> dict:
    flags = ["--load-format", "sim", "--model", args.model, "--dtype", "bfloat16", "--sim-gpu", args.gpu,
             "--sim-time-scale", str(args.time_scale), "--prefill-workers", str(args.prefill_workers),
             "--decode-workers", str(args.decode_workers), "--worker-cpus", str(args.worker_cpus),
             "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
             "--prefill-token-budget", str(args.token_budget), "--stream-interval", str(args.stream_interval),
             "--max-running", str(10**6), "--max-queued", str(10**6), "--prefix-routing", mode]
    server = Server(flags, tmp / f"serve-{mode}.log")
    try:
        t0 = time.monotonic()
        server.wait_ready(args.prefill_workers + args.decode_workers, args.start_timeout)
        ready_s = time.monotonic() - t0
        before = server.metrics_page()
        span = (args.span + 2 * args.turns_mean * args.think_mean) * args.time_scale
        records, wall = asyncio.run(drive(server.port, system, sessions, args.time_scale, span + 600))
        after = server.metrics_page()
        late, steps = late_steps(server)
    finally:
        server.stop()

    def delta(name: str) -> float:
        return sum(pool_sums(after, name).values()) - sum(pool_sums(before, name).values())
    ok = [r for r in records if r.ok]
    ttft = [r.ttft / args.time_scale * 1e3 for r in ok]
    return {"mode": mode, "ready_s": ready_s, "requests": len(ok), "failed": len(records) - len(ok),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
            "ttft_p99_ms": percentile(ttft, 99), "computed": delta("pdserve_worker_prompt_tokens_computed"),
            "requested": sum(r.input_tokens for r in records),
            "kv_bytes": delta("pdserve_kv_transfer_bytes") * SIM_KV_SCALE,
            "output_tok_s": sum(r.output_tokens for r in ok) / (wall / args.time_scale),
            "wall_s": wall, "late_steps": late, "steps": steps,
            "errors": dict(Counter(f"{r.error_code}: {r.error}" for r in records if not r.ok))}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prefill-workers", type=int, default=8)
    ap.add_argument("--decode-workers", type=int, default=24)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--model", default="llama3-8b", help="the simulated shape")
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--span", type=float, default=60.0, help="seconds (GPU time) over which sessions start")
    ap.add_argument("--turns-mean", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--user-mean", type=float, default=150)
    ap.add_argument("--tool-mean", type=float, default=300)
    ap.add_argument("--reply-mean", type=float, default=100)
    ap.add_argument("--think-mean", type=float, default=3.0, help="seconds (GPU time) between a reply and the next turn")
    ap.add_argument("--time-scale", type=float, default=16.0, help="--sim-time-scale: real seconds per GPU second")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=2048, help="--prefill-token-budget")
    ap.add_argument("--stream-interval", type=int, default=8, help="tokens a message (the first token alone)")
    ap.add_argument("--worker-cpus", type=float, default=0.0625)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--modes", nargs="+", default=["exact", "estimate", "random"],
                    choices=["exact", "estimate", "random"])
    ap.add_argument("--seed", type=int, default=48)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    head = run_header()
    _, cfg = resolve_model(args.model)
    kv_per_token = roofline(cfg, gpu(args.gpu), 2).kv_bytes_per_token
    system, sessions = make_trace(args)
    turns = sum(len(s.replies) for s in sessions)
    new = len(system) + sum(len(s.task) + sum(map(len, s.tools)) for s in sessions)
    print(f"{len(sessions)} sessions starting within {args.span:g} s, {turns} turns; system prompt {len(system)} "
          f"tokens; tool outputs mean {np.mean([len(t) for s in sessions for t in s.tools]):.0f}, replies mean "
          f"{np.mean([r for s in sessions for r in s.replies]):.0f}, think mean {args.think_mean:g} s ({args.gpu} "
          f"time; x{args.time_scale:g} here); {new} prompt tokens new to the cluster", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-agentic-scale-") as tmp:
        for mode in args.modes:
            rows.append(run_mode(mode, args, system, sessions, Path(tmp)))
            r = rows[-1]
            print(f"{mode}: ready in {r['ready_s']:.0f} s, ran {r['wall_s']:.0f} s; late steps {r['late_steps']} of "
                  f"{r['steps']}", flush=True)
            for error, count in r["errors"].items():  # a failed request is a finding: say what it was
                print(f"  failed x{count}: {error}", flush=True)
    print(f"\n| prefix routing | requests (failed) | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | prompt tokens computed / "
          f"requested | computed / new | KV moved GB | output tok/s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['requests']} ({r['failed']}) | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
              f"{r['ttft_p99_ms']:.0f} | {r['computed']:,.0f} / {r['requested']:,} ({r['computed'] / r['requested']:.2f})"
              f" | {r['computed'] / new:.2f}x | {r['kv_bytes'] / 1e9:,.1f} | {r['output_tok_s']:,.0f} |")
    by = {r["mode"]: r for r in rows}
    if "exact" in by and "estimate" in by:
        print(f"\nTTFT p90, exact / estimate: {by['exact']['ttft_p90_ms'] / by['estimate']['ttft_p90_ms']:.2f}")
    if args.json:
        write_json(args.json, {**head, "args": vars(args), "new_tokens": new, "kv_bytes_per_token": kv_per_token,
                               "rows": rows})


if __name__ == "__main__":
    main()
