"""n samples of each prompt as one request (SamplingParams.n) against n requests of one sample each, and
the cost of logprobs: prompt tokens computed, KV moved, output tokens/s, side by side in one run.

    .venv/bin/python -m bench.cluster.group_sampling [--prompts 8] [--n 8] [--prompt-len 512] [--max-tokens 16]
                                                     [--logprobs 20] [--repeat 2] [--json out.json]

A 1P1D cluster of the default model (SmolLM2-135M, fp32, no prefix cache) on a local Ray cluster in this
process; every way runs once unmeasured first. Each
repeat runs, all requests at once, the GRPO shape (B prompts x n seeded samples, temperature 1): as B
requests of n (group), as B x n requests of one sample seeded sample_seed(seed, i) (separate: what a
trainer sends without n), and the group again asking for the top --logprobs of every token. Every sample
of the group is checked token for token against its separate request. Prints per way: wall seconds,
output tokens/s, prompt tokens the prefill worker computed against those requested, KV transfers and
bytes received by the decode worker, the decode worker's peak of used KV blocks.
"""
from __future__ import annotations

import asyncio
import time

import torch

from bench.common import Table, local_cluster, parser, write_json


async def run(cluster, prompts, params_list) -> tuple[list[list[list[int]]], float, int]:
    """Every request at once: per request, per sample, its tokens; wall seconds; the decode worker's peak
    of used blocks (sampled from its reported stats while the requests run)."""
    peak = 0
    done = asyncio.Event()

    async def watch():
        nonlocal peak
        while not done.is_set():
            for s in cluster.worker_stats():
                if s.pool == "decode":
                    peak = max(peak, s.kv_blocks_used)
            await asyncio.sleep(0.005)

    async def one(prompt, params):
        samples = [[] for _ in range(params.n)]
        async for out in cluster.generate(prompt, params):
            assert out.error is None, out.error
            samples[out.index] += out.new_token_ids
        return samples

    watcher = asyncio.ensure_future(watch())
    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params_list)))
    wall = time.perf_counter() - t0
    done.set()
    await watcher
    return got, wall, peak


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--logprobs", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig
    from pdserve.engine.sampling import SamplingParams, sample_seed
    from router.pools import init_local_ray

    init_local_ray(num_cpus=2)
    # No prefix cache: each way computes what it asks for (with it, later ways would find the prompts cached).
    engine = EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=3072, enable_prefix_caching=False))
    config = ClusterConfig(engine=engine, mode="disaggregated", prefill=PoolConfig(1, num_cpus=0.5),
                           decode=PoolConfig(1, num_cpus=0.5))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    n, seeds = args.n, [1000 * (b + 1) for b in range(args.prompts)]

    def sampling(seed: int, n: int = 1, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True, **kw)

    ways = {
        "group (n)": (prompts, [sampling(s, n) for s in seeds]),
        "separate (n x 1)": ([p for p in prompts for _ in range(n)],
                             [sampling(sample_seed(s, i)) for s in seeds for i in range(n)]),
        f"group, logprobs {args.logprobs}": (prompts, [sampling(s, n, logprobs=args.logprobs) for s in seeds]),
    }
    table = Table(("way", 26, "<"), ("wall s", 8, ".2f"), ("out tok/s", 10, ".1f"), ("prompt computed", 16, "d"),
                  ("of requested", 13, "d"), ("KV transfers", 13, "d"), ("KV MB", 8, ".1f"), ("peak blocks", 12, "d"))
    results: list[dict] = []

    async def measure() -> None:
        async with local_cluster(config) as cluster:
            for ps, params in ways.values():  # warm-up: kernels, channels, every shape once
                await run(cluster, ps, params)
            print(table.header())
            for rep in range(args.repeat):
                answers = {}
                for way, (ps, params) in ways.items():
                    before = {s.pool: s for s in await cluster.stats()}
                    got, wall, peak = await run(cluster, ps, params)
                    after = {s.pool: s for s in await cluster.stats()}
                    p0, p1, d0, d1 = before["prefill"], after["prefill"], before["decode"], after["decode"]
                    tokens = sum(len(t) for r in got for t in r)
                    answers[way] = [t for r in got for t in r]
                    row = dict(way=way, repeat=rep, wall_s=wall, output_tokens_per_s=tokens / wall,
                               prompt_tokens_computed=p1.prompt_tokens_computed - p0.prompt_tokens_computed,
                               prompt_tokens_requested=p1.prompt_tokens_requested - p0.prompt_tokens_requested,
                               kv_transfers=d1.transfer["transfers"] - d0.transfer["transfers"],
                               kv_mb=(d1.transfer["bytes"] - d0.transfer["bytes"]) / 1e6, peak_decode_blocks=peak)
                    results.append(row)
                    print(table.row(way, wall, row["output_tokens_per_s"], row["prompt_tokens_computed"],
                                    row["prompt_tokens_requested"], row["kv_transfers"], row["kv_mb"], peak))
                group, separate = answers["group (n)"], answers["separate (n x 1)"]
                assert group == separate, "a sample of a group differs from its separate request"
                assert answers[f"group, logprobs {args.logprobs}"] == group
            print(f"every sample of the groups equals its separate request ({args.prompts * n} samples x "
                  f"{args.repeat} repeats)")

    asyncio.run(measure())
    if args.json:
        write_json(args.json, dict(args=vars(args), results=results))


if __name__ == "__main__":
    main()
