"""Bad requests beside streams under load (#47): are the streams token-exact and unaffected?

    .venv/bin/python -m bench.router.bad_neighbours [--streams 16] [--max-tokens 64] [--repeat 3]
                                                    [--json out.json]

A local cluster of the default model (SmolLM2-135M) on one prefill and one decode worker, behind the router's
gRPC and HTTP doors. Each repeat runs the same --streams greedy gRPC streams twice: alone (the baseline), and
with two bad requests sent over HTTP once every stream has its first tokens: /v1/completions with
`top_k: 9223372036854775808` and temperature 1 (finding 2: it used to fail the step of every request batched
with it, and was retried onto the next worker, 503 after 3 attempts), and one with 100,000 stop strings
(finding 4: it was accepted, and slowed the step thread every request on its worker shares). Each bad request
must be answered 400; every stream must be token-exact with the baseline; and the inter-token latency's
p99 (over every stream's gaps between two tokens, from the client's receipt of each message) with the bad
requests must stay within --max-ratio (1.5) of the baseline's. Prints each run and the medians; exits 1 if
anything failed.
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time

import torch

from bench.common import Table, local_cluster, local_router, parser, run_header, write_json

BIG_TOP_K = 2**63
STOPS = 100_000


async def stream(client, prompt: list[int], max_tokens: int, started: asyncio.Event | None, counter: list[int]):
    """A greedy stream: its tokens and the gaps between consecutive tokens' arrival (a message carrying k
    tokens counts one gap and k - 1 of zero)."""
    tokens, gaps, last = [], [], None
    async for r in client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                   timeout=600):
        now = time.perf_counter()
        if last is not None and r.token_ids:
            gaps += [now - last] + [0.0] * (len(r.token_ids) - 1)
        if r.token_ids:
            last = now
        tokens += r.token_ids
        if len(tokens) >= 4 and started is not None and len(tokens) - len(r.token_ids) < 4:
            counter[0] += 1
            if counter[0] == counter[1]:
                started.set()
    return tokens, gaps


def p99(gaps: list[float]) -> float:
    ordered = sorted(gaps)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def bad_requests(url: str) -> list[tuple[str, int, str]]:
    """The two bad requests over HTTP (off the event loop: the client's JSON of 100,000 strings is its own)."""
    import httpx

    def send(name: str, body: dict) -> tuple[str, int, str]:
        with httpx.Client(timeout=120) as h:
            r = h.post(f"{url}/v1/completions", json={"model": "smol", "prompt": [1, 2, 3], "max_tokens": 8, **body})
            return name, r.status_code, r.json().get("error", {}).get("message", "")[:120]

    return list(await asyncio.gather(
        asyncio.to_thread(send, "top_k 2**63", {"top_k": BIG_TOP_K, "temperature": 1.0}),
        asyncio.to_thread(send, f"{STOPS:,} stop strings", {"stop": [f"stop-{i}" for i in range(STOPS)]})))


async def run_once(router, prompts, max_tokens: int, bad: bool) -> dict:
    from pdserve.client import AsyncClient

    started = asyncio.Event()
    counter = [0, len(prompts)]
    async with AsyncClient(f"127.0.0.1:{router.port}") as c:
        tasks = [asyncio.create_task(stream(c, p, max_tokens, started, counter)) for p in prompts]
        answers = []
        if bad:
            await asyncio.wait_for(started.wait(), 300)
            answers = await bad_requests(f"http://127.0.0.1:{router.http_port}")
        results = await asyncio.gather(*tasks)
    gaps = [g for _, gs in results for g in gs]
    return dict(tokens=[t for t, _ in results], itl_p99_ms=p99(gaps) * 1e3,
                itl_median_ms=statistics.median(gaps) * 1e3, answers=answers)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-ratio", type=float, default=1.5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    head = run_header()

    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from router.pools import init_local_ray

    init_local_ray(num_cpus=2)
    engine = EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=2048),
                          scheduler=SchedulerConfig(max_num_seqs=64))
    config = ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.5), decode=PoolConfig(1, num_cpus=0.5))
    g = torch.Generator().manual_seed(47)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist() for _ in range(args.streams)]
    table = Table(("run", 10, "<"), ("bad requests", 34, "<"), ("exact", 6, "<"), ("ITL p50 ms", 11, ".1f"),
                  ("ITL p99 ms", 11, ".1f"))
    rows, failed = [], []

    async def measure() -> None:
        async with local_cluster(config) as cluster, local_router(cluster, http_port=0, served_model_name="smol") as r:
            await run_once(r, prompts, 8, bad=False)  # warm-up
            print(table.header())
            for rep in range(args.repeat):
                base = await run_once(r, prompts, args.max_tokens, bad=False)
                worst = await run_once(r, prompts, args.max_tokens, bad=True)
                exact = worst["tokens"] == base["tokens"] and all(len(t) == args.max_tokens for t in base["tokens"])
                refused = all(code == 400 for _, code, _ in worst["answers"])
                said = "; ".join(f"{name}: {code}" for name, code, _ in worst["answers"])
                for name, run in (("alone", base), ("with bad", worst)):
                    print(table.row(f"{name} {rep}", said if run is worst else "-", str(exact) if run is worst else "",
                                    run["itl_median_ms"], run["itl_p99_ms"]))
                rows.append(dict(repeat=rep, exact=exact, answers=worst["answers"],
                                 baseline_itl_p99_ms=base["itl_p99_ms"], bad_itl_p99_ms=worst["itl_p99_ms"],
                                 baseline_itl_median_ms=base["itl_median_ms"], bad_itl_median_ms=worst["itl_median_ms"]))
                if not exact or not refused:
                    failed.append(f"repeat {rep}: exact {exact}, answers {worst['answers']}")

    asyncio.run(measure())
    base = statistics.median(r["baseline_itl_p99_ms"] for r in rows)
    bad = statistics.median(r["bad_itl_p99_ms"] for r in rows)
    ratio = bad / base
    print(f"ITL p99, median of {len(rows)} repeats: {base:.1f} ms alone, {bad:.1f} ms with the bad requests: "
          f"{ratio:.2f}x (bound {args.max_ratio}x)")
    if ratio > args.max_ratio:
        failed.append(f"ITL p99 {ratio:.2f}x the baseline's")
    head["load_after"] = os.getloadavg()
    if args.json:
        write_json(args.json, dict(head, args=vars(args), rows=rows, itl_p99_ratio=ratio, failed=failed))
    print(json.dumps({"failed": failed}) if failed else "all streams token-exact, both bad requests 400")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
