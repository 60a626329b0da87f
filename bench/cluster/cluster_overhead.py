"""The whole serving path versus the offline engine: same requests, same machine, one run.

    .venv/bin/python -m bench.cluster.cluster_overhead [--num-prompts 32] [--min-len 16] [--max-len 256]
                                                       [--output-len 64] [--prefill-workers 1] [--decode-workers 1]

The offline engine (one process, all cores) runs the batch first; then a local Ray cluster with the
given pools and the gRPC router on loopback serve the same token-id prompts, all sent at once by an
asyncio client. Both outputs must be identical (greedy); prints output tokens/s of each and the ratio.
Each worker gets cores // (prefill + decode) torch threads so the cluster uses the same cores.
After one untimed batch through the cluster (the workers' first steps), the cluster path runs
--repeats times with the router's metrics off and on, alternating, to give the cost of metrics
(recording every request and serving /metrics, scraped once a second here).
"""
from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
import urllib.request

from bench.common import Table, add_prompt_args, local_cluster, local_router, parser


def main() -> None:
    ap = parser(__doc__)
    add_prompt_args(ap, max_len=256, output_len=64)
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="cluster runs per metrics setting")
    args = ap.parse_args()

    from pdserve.client import AsyncClient
    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from router.pools import init_local_ray

    sched = SchedulerConfig(max_num_seqs=max(64, args.num_prompts), max_num_batched_tokens=2048)
    engine_cfg = EngineConfig(model=args.model, scheduler=sched, cache=CacheConfig(memory_bytes=512 << 20))
    engine = LLMEngine(engine_cfg)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    out_tokens = args.num_prompts * args.output_len

    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    ref = [c.token_ids for c in engine.generate(prompts, params)]
    offline_s = time.perf_counter() - t0
    del engine

    workers = args.prefill_workers + args.decode_workers
    threads = max(1, (os.cpu_count() or 2) // workers)
    pool = lambda n: PoolConfig(n, num_cpus=0.25, scheduler=sched, cache=engine_cfg.cache, torch_threads=threads)  # noqa: E731
    init_local_ray()

    async def run_batch(port: int) -> tuple[list, float]:
        async with AsyncClient(f"127.0.0.1:{port}") as c:
            await c.complete(token_ids=prompts[0][:8], max_tokens=2, temperature=0.0)  # warm-up
            t = time.perf_counter()
            outs = await asyncio.gather(*(c.complete(token_ids=p, max_tokens=args.output_len, temperature=0.0,
                                                     ignore_eos=True) for p in prompts))
            return outs, time.perf_counter() - t

    async def scrape(port: int, stop: asyncio.Event) -> None:
        while not stop.is_set():  # what a Prometheus server at a 1 s interval would cost
            await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
            await asyncio.sleep(1.0)

    async def serve_and_run() -> dict[bool, list[float]]:
        times: dict[bool, list[float]] = {False: [], True: []}
        async with local_cluster(ClusterConfig(engine=engine_cfg, prefill=pool(args.prefill_workers),
                                               decode=pool(args.decode_workers))) as cluster:
            async with local_router(cluster) as warm:  # one untimed batch: the workers' first steps
                await run_batch(warm.port)
            for _ in range(args.repeats):
                for metrics in (False, True):
                    async with local_router(cluster, metrics_port=0 if metrics else None) as router:
                        stop = asyncio.Event()
                        scraper = asyncio.create_task(scrape(router.metrics_port, stop)) if metrics else None
                        try:
                            outs, seconds = await run_batch(router.port)
                        finally:
                            stop.set()
                            if scraper:
                                await scraper
                    assert [o.token_ids for o in outs] == ref, "the cluster's tokens differ from the offline engine's"
                    times[metrics].append(seconds)
        return times

    times = asyncio.run(serve_and_run())
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.output_len} output tokens each; "
          f"cluster {args.prefill_workers}P{args.decode_workers}D with {threads} torch thread(s) per worker; "
          f"outputs identical; cluster runs: median of {args.repeats}")
    t = Table(("", 40, "<"), ("wall s", 9, ".2f"), ("output tok/s", 14, ".1f"), sep="")
    print(t.header())
    print(t.row("offline engine (in process)", offline_s, out_tokens / offline_s))
    print(t.row("gRPC + router + Ray workers, metrics off", off, out_tokens / off))
    print(t.row("gRPC + router + Ray workers, metrics on", on, out_tokens / on))
    print(f"cluster (metrics off) / offline throughput: {offline_s / off:.2f}")
    print(f"metrics on / off throughput: {off / on:.3f}")


if __name__ == "__main__":
    main()
