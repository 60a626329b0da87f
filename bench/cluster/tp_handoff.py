"""The prefill -> decode hand-off between workers of different tensor-parallel sizes, on this machine.

    .venv/bin/python -m bench.cluster.tp_handoff [--layouts 1:1,2:1,1:2,2:2] [--prompt-len 512] [--requests 12]

In one run, for each (prefill TP A, decode TP B), a local Ray cluster of one prefill and one decode
worker serves the same seeded prompts one at a time (greedy, 4 tokens each), on a random checkpoint of
SmolLM2-135M's size with 8 heads over 2 KV heads (made here with transformers; TP 2 splits its KV
heads). Reported per layout: the median time to the first token, the median gap from the first token to
the second (the hand-off shows there: the second token needs the KV on the decode worker), the decode
worker's own hand-off time (first token sampled -> KV usable there, its histogram's mean), and the KV
bytes its ranks received. Tokens are checked equal across layouts.

On a 2-core machine every rank shares the same two cores, so this shows what the protocol costs (more
channels, a Ray call per other rank per transfer), not what more devices buy.
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Table, local_cluster, parser, smollm2_sized_checkpoint


async def run_layout(model: str, a: int, b: int, prompts: list[list[int]]) -> dict:
    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from pdserve.engine.sampling import SamplingParams

    engine = EngineConfig(model=model, cache=CacheConfig(block_size=16, num_blocks=512),
                          scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8))
    threads = lambda tp: max(1, 2 // tp)  # noqa: E731 - one worker's ranks split the 2 cores
    config = ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.1, tensor_parallel_size=a,
                                                             torch_threads=threads(a)),
                           decode=PoolConfig(1, num_cpus=0.1, tensor_parallel_size=b, torch_threads=threads(b)))
    async with local_cluster(config) as cluster:
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        ttft, gap, tokens = [], [], []
        for i, prompt in enumerate(prompts):
            t0, times, out = time.perf_counter(), [], []
            async for o in cluster.generate(prompt, greedy):
                assert o.error is None, o.error
                for t in o.new_token_ids:
                    times.append(time.perf_counter())
                    out.append(t)
            tokens.append(out)
            if i >= 2:  # the first requests warm up the channels
                ttft.append(times[0] - t0)
                gap.append(times[1] - times[0])
        (decode,) = [s for s in await cluster.stats() if s.pool == "decode"]
        h = decode.handoff
        return dict(layout=f"{a}:{b}", ttft=statistics.median(ttft), gap=statistics.median(gap),
                    handoff=h["sum"] / max(sum(h["counts"]), 1), bytes=decode.transfer["bytes"],
                    channels=decode.transfer["transfers"], tokens=tokens)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default=None, help="a checkpoint whose heads the layouts can split (default: made here)")
    ap.add_argument("--layouts", default="1:1,2:1,1:2,2:2")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=12)
    args = ap.parse_args()
    from router.pools import init_local_ray

    model = args.model or str(smollm2_sized_checkpoint(Path(tempfile.mkdtemp(prefix="pdserve-tp-"))))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    init_local_ray(num_cpus=2)
    rows = []
    for layout in args.layouts.split(","):
        a, b = (int(x) for x in layout.split(":"))
        rows.append(asyncio.run(run_layout(model, a, b, prompts)))
        print(f"{layout} done", flush=True)
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"\nprompt {args.prompt_len} tokens, {args.requests} requests one at a time (medians of the last "
          f"{args.requests - 2}); tokens equal across layouts: {same}")
    t = Table(("A:B", 5, ""), ("TTFT ms", 9, ".1f"), ("1st->2nd ms", 12, ".1f"), ("hand-off ms", 12, ".1f"),
              ("KV MiB received", 16, ".1f"), ("channel transfers", 18, ""))
    print(t.header())
    for r in rows:
        print(t.row(r["layout"], r["ttft"] * 1e3, r["gap"] * 1e3, r["handoff"] * 1e3, r["bytes"] / 2**20,
                    r["channels"]))
    if not same:
        sys.exit("tokens differ between layouts")


if __name__ == "__main__":
    main()
