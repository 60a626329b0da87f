"""The one-GPU cluster (needs Ray): colocated and disaggregated 1P1D token-exact against the offline engine,
then the KV hand-off against the prefill step on longer prompts."""
from __future__ import annotations

import random
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.gpu.core import build_hf_checkpoint
from bench.gpu.timing import GiB, RESULTS, section


def _start_ray(device: torch.device) -> None:
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=1 if device.type == "cuda" else 0, include_dashboard=False,
             _node_ip_address="127.0.0.1", object_store_memory=128 << 20, log_to_driver=True)


async def _generate(cluster, prompt: list[int], params) -> tuple[list[int], str | None]:
    toks, err = [], None
    async for out in cluster.generate(prompt, params):
        toks += out.new_token_ids
        err = out.error or err
    return toks, err


def _by_pool(stats: list, pool: str):
    (s,) = [x for x in stats if x.pool == pool]
    return s


def _hist_count(h: dict) -> int:
    return sum(h.get("counts", ()))


@section("cluster")
def bench_cluster(args, device: torch.device) -> dict:
    """The Ray cluster on ONE GPU: colocated, then disaggregated 1P1D (both workers on the same GPU,
    num_gpus 0.4 each, KV staged through host memory); then hand-off vs prefill on longer prompts."""
    import ray

    res: dict = {}
    _start_ray(device)
    try:
        try:
            res.update(_cluster_tokens(args, device))
        except Exception as e:  # noqa: BLE001 - the hand-off workload still runs
            print(traceback.format_exc(), flush=True)
            res["tokens"] = dict(exception=f"{type(e).__name__}: {e}")
        try:
            res["handoff"] = _cluster_handoff(args, device)
        except Exception as e:  # noqa: BLE001
            print(traceback.format_exc(), flush=True)
            res["handoff"] = dict(exception=f"{type(e).__name__}: {e}")
    finally:
        ray.shutdown()
    bad = [k for k, r in res.items() if isinstance(r, dict) and ("exception" in r or r.get("errors")
                                                                  or not all(r.get("equal", [True])))]
    bad += [f"handoff {r['prompt_tokens']}" for r in res.get("handoff", {}).get("rows", []) if r["errors"]]
    if bad:  # the section ran to its end; its table lines say what failed
        RESULTS["errors"]["cluster"] = f"failed parts: {bad}"
    return res


def _cluster_tokens(args, device: torch.device) -> dict:
    import asyncio

    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from router.cluster import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-tiny-"))
    shape = build_hf_checkpoint(tmp, True, 0.3)
    cache = CacheConfig(block_size=16, num_blocks=256)
    sched = SchedulerConfig(max_num_batched_tokens=64)
    engine = EngineConfig(model=str(tmp), dtype="float32", device=str(device), cache=cache, scheduler=sched)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, shape["vocab_size"], (n,), generator=g).tolist() for n in (5, 40, 100, 17)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)] * 2
    ref = [c.token_ids for c in LLMEngine(engine).generate(prompts, params)]
    gpus = 0.4 if device.type == "cuda" else 0.0
    res = {}

    async def run(mode: str) -> dict:
        pool = PoolConfig(1, num_cpus=0.5, num_gpus=gpus, cache=cache, scheduler=sched)
        pools = dict(colocated=pool) if mode == "colocated" else dict(prefill=pool, decode=pool)
        cfg = ClusterConfig(engine=engine, mode=mode, **pools,
                            transfer_timeout_s=args.transfer_timeout, max_retries=0)
        cluster = Cluster(cfg)
        t = time.perf_counter()
        await asyncio.wait_for(cluster.start(), 180)
        started = time.perf_counter() - t
        try:
            got = await asyncio.wait_for(asyncio.gather(*(_generate(cluster, p, sp) for p, sp in zip(prompts, params))),
                                         4 * args.transfer_timeout + 60)
            stats = await asyncio.wait_for(cluster.stats(), 30)
        finally:
            await asyncio.wait_for(cluster.shutdown(), 60)
        out = dict(start_s=started, equal=[g[0] == r for g, r in zip(got, ref)],
                   errors=[g[1] for g in got if g[1]])
        line = (f"cluster {mode}: start {started:.1f} s, tokens equal to offline {out['equal']}, "
                f"errors {out['errors'][:2]}")
        if mode == "disaggregated":
            d = _by_pool(stats, "decode")
            h, n = d.handoff, _hist_count(d.handoff)
            out.update(handoff_count=n, handoff_sum_s=h.get("sum", 0.0),
                       handoff_mean_s=h["sum"] / n if n else float("nan"), handoff_hist=h,
                       transfer=d.transfer)
            line += (f"; hand-off (decode worker's histogram) count {n}, mean "
                     f"{out['handoff_mean_s'] * 1e3:.2f} ms (sum/count)")
        print(line, flush=True)
        return out

    for mode in ("colocated", "disaggregated"):
        try:
            res[mode] = asyncio.run(run(mode))
        except Exception as e:  # noqa: BLE001
            print(traceback.format_exc(), flush=True)
            res[mode] = dict(exception=f"{type(e).__name__}: {e}")
    return res


def _cluster_handoff(args, device: torch.device) -> dict:
    """Disaggregated 1P1D on one GPU, longer prompts one at a time: hand-off vs prefill step per request."""
    import asyncio

    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from pdserve.engine.sampling import SamplingParams
    from router.cluster import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-hf-"))
    shape = build_hf_checkpoint(tmp, args.small, args.init_range)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    lengths = args.handoff_lengths
    cache = CacheConfig(memory_bytes=int(args.handoff_kv_gib * GiB))
    engine = EngineConfig(model=str(tmp), dtype=dtype, device=str(device), cache=cache)
    gpus = 0.4 if device.type == "cuda" else 0.0
    prefill = PoolConfig(1, num_cpus=0.5, num_gpus=gpus, cache=cache,
                         scheduler=SchedulerConfig(max_num_batched_tokens=max(lengths)))  # a prompt: one step
    decode = PoolConfig(1, num_cpus=0.5, num_gpus=gpus, cache=cache)
    cfg = ClusterConfig(engine=engine, mode="disaggregated", prefill=prefill, decode=decode,
                        transfer_timeout_s=args.transfer_timeout, max_retries=0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rng = random.Random(11)
    res: dict = dict(checkpoint="random SmolLM2-135M shape" if not args.small else "random tiny llama",
                     dtype=dtype, shape=shape, max_tokens=8, rows=[])

    async def run() -> None:
        cluster = Cluster(cfg)
        await asyncio.wait_for(cluster.start(), 180)
        try:
            for n in lengths:
                handoffs, steps, kv_bytes, errors = [], [], [], []
                for rep in range(args.handoff_reps + 1):  # the first is a warm-up
                    prompt = [rng.randrange(3, shape["vocab_size"]) for _ in range(n)]  # no prefix-cache hits
                    before = await asyncio.wait_for(cluster.stats(), 30)
                    toks, err = await asyncio.wait_for(_generate(cluster, prompt, params), 2 * args.transfer_timeout + 60)
                    after = await asyncio.wait_for(cluster.stats(), 30)
                    if err or len(toks) != params.max_tokens:
                        errors.append(err or f"{len(toks)} tokens")
                        continue
                    d0, d1 = _by_pool(before, "decode"), _by_pool(after, "decode")
                    p0, p1 = _by_pool(before, "prefill"), _by_pool(after, "prefill")
                    landed = _hist_count(d1.handoff) - _hist_count(d0.handoff)
                    assert landed == 1, f"{landed} hand-offs observed for one request"
                    if rep:
                        handoffs.append(d1.handoff["sum"] - d0.handoff["sum"])
                        steps.append(p1.busy_seconds - p0.busy_seconds)
                        kv_bytes.append(d1.transfer.get("bytes", 0) - d0.transfer.get("bytes", 0))
                row = dict(prompt_tokens=n, requests=len(handoffs), handoff_s=handoffs, prefill_step_s=steps,
                           kv_bytes=kv_bytes, errors=errors)
                if handoffs:
                    row.update(handoff_mean_s=statistics.mean(handoffs), prefill_step_mean_s=statistics.mean(steps),
                               handoff_over_step=statistics.mean(handoffs) / statistics.mean(steps),
                               kv_bytes_per_request=statistics.mean(kv_bytes))
                    print(f"hand-off {n} tokens: {len(handoffs)} requests, hand-off mean "
                          f"{row['handoff_mean_s'] * 1e3:.2f} ms {[round(x * 1e3, 2) for x in handoffs]}, prefill step "
                          f"mean {row['prefill_step_mean_s'] * 1e3:.2f} ms {[round(x * 1e3, 2) for x in steps]}, "
                          f"hand-off/step {row['handoff_over_step']:.2f}, KV {row['kv_bytes_per_request'] / 2**20:.1f} "
                          f"MiB/request, errors {errors[:2]}", flush=True)
                else:
                    print(f"hand-off {n} tokens: no request completed; errors {errors[:2]}", flush=True)
                res["rows"].append(row)
        finally:
            await asyncio.wait_for(cluster.shutdown(), 60)

    asyncio.run(run())
    return res
