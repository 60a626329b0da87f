"""Service tiers on this machine: 1 prefill, 1 default decode and 1 fast-lane decode worker, one table.

    .venv/bin/python -m bench.cluster.tiers_local [--output tiers.json] [any `pdserve bench` flag ...]

In one run: start a local Ray cluster (loopback) with the pools and the gRPC router in this process;
check that one prompt with one seed gives the same tokens on every tier (priority on the fast lane,
default and flex on the decode pool); then run `pdserve bench --service-tier-mix` in a separate process
with a load that keeps the default decode pool full, sampling flex's queue depth meanwhile; read each
tier's device seconds from the workers. Prints, per tier: completed / failed / refused, the tier served,
median and p99 TTFT and TPOT, and device seconds per output token; then priority's ratios to default.

Flags this script does not know go to `pdserve bench` after its defaults (DEFAULT_BENCH_ARGS).

Speculation on the fast lane (`--fast-lane-speculative-config JSON`, as `pdserve serve` takes it): the same
seeded load runs twice, on a cluster whose fast lane speculates and on one where nothing does, and the tables
are printed side by side with priority's median TPOT over default's in each; the fast lane's acceptance rate;
and whether a few priority prompts answered greedily are token-identical on both (speculation is exact).
`--workload copy` replaces the random token prompts with copy-heavy ones (an agent's edit of a file it was
given, a summary quoting its source: replies prompt lookup can draft; COPY_BENCH_ARGS).

    .venv/bin/python -m bench.cluster.tiers_local --workload copy \
        --fast-lane-speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

bench.simulated.tiers_sim weighs one shared cluster against separate ones in GPU-hours, on GPUs at scale
through the planner's simulator; this script measures what each tier gets from real workers here.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import tempfile
from pathlib import Path

from bench.common import (ARTICLE, agent_edit, bench_report, local_cluster, local_router, parser, pdserve_bench,
                          quoting_summary, write_json)

# Poisson at 1.5 req/s, 100 requests of 24-40 prompt and 144-240 output tokens: decode is the
# bottleneck, the default pool (32 running) stays full and a line forms at the router; priority is 10 %,
# flex 30 %. (With longer prompts and shorter outputs the single prefill worker is the bottleneck, the
# default batch stays small, and on a CPU, whose decode step is bound by reading the weights up to
# batches of ~8, a smaller batch buys no speed: docs/benchmarks.md.)
DEFAULT_BENCH_ARGS = ["--num-prompts", "100", "--request-rate", "1.5", "--lengths", "uniform", "--input-len", "32",
                      "--output-len", "192", "--range-ratio", "0.25", "--seed", "0", "--temperature", "0",
                      "--service-tier-mix", "priority=0.1,default=0.6,flex=0.3", "--slo-ttft-ms", "4000",
                      "--slo-tpot-ms", "150", "--tier-slo", "priority=4000:60", "--tier-slo", "flex=120000:1000",
                      "--timeout", "600"]
# The copy-heavy load: 60 requests at 1 req/s, replies of up to 160 tokens (greedy, ending at EOS), 20 % priority.
COPY_BENCH_ARGS = ["--num-prompts", "60", "--request-rate", "1", "--seed", "0", "--temperature", "0",
                   "--output-len", "160", "--service-tier-mix", "priority=0.2,default=0.5,flex=0.3",
                   "--slo-ttft-ms", "4000", "--slo-tpot-ms", "150", "--tier-slo", "priority=4000:60",
                   "--tier-slo", "flex=120000:1000", "--timeout", "600"]
RENAMES = [("put", "set"), ("get", "fetch"), ("delete", "remove"), ("save", "store"), ("put", "write"),
           ("get", "read"), ("delete", "drop"), ("save", "flush")]
SENTENCES = ["two", "three", "four"]


def copy_prompts() -> list[str]:
    """The copy-heavy prompts, in turn: the agent's edit of store.py (one of RENAMES) and the quoting summary
    (one of SENTENCES long), varied so that replies differ."""
    summaries = [quoting_summary(ARTICLE, n) for n in SENTENCES]
    edits = [agent_edit(a, b) for a, b in RENAMES]
    return [p for pair in itertools.zip_longest(edits, summaries) for p in pair if p is not None]


def copy_trace(path: Path, n: int = 60) -> None:
    """A JSONL trace (pdserve.loadgen) of n chat requests cycling through copy_prompts()."""
    with path.open("w") as f:
        for text in itertools.islice(itertools.cycle(copy_prompts()), n):
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")


def cluster_config(args, speculative=None):
    """1 prefill, 1 default decode and 1 fast-lane decode worker; the fast lane speculates if speculative is set."""
    from dataclasses import replace

    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from pdserve.tiers import TiersConfig

    cores = os.cpu_count() or 1
    cache = CacheConfig(memory_bytes=args.kv_cache_mib << 20)

    def pool(seqs: int) -> PoolConfig:
        return PoolConfig(1, num_cpus=min(0.5, cores / 4), cache=cache, torch_threads=max(1, cores // 3),
                          scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=512))

    return ClusterConfig(engine=EngineConfig(cache=cache), prefill=pool(64), decode=pool(args.decode_max_running),
                         fast=replace(pool(args.fast_lane_max_running), speculative=speculative),
                         tiers=TiersConfig(fast_lane_max_running=args.fast_lane_max_running,
                                           flex_max_queued=args.flex_max_queued))


async def run(config, cmd_args: list[str], out: Path, probes: list[str]) -> dict:
    """One cluster: the same-seed check on every tier, greedy priority replies to probes, then `pdserve bench`
    with flex's queue depth sampled; the workers' device seconds by tier and their speculation stats."""
    from pdserve.client import AsyncClient
    from pdserve.tiers import ServiceTier

    async with local_cluster(config) as cluster, local_router(cluster) as router:
        port = router.port
        seen, replies = {}, []
        async with AsyncClient(f"127.0.0.1:{port}") as c:
            for tier in ("priority", "default", "flex"):  # the same tokens for the same seed, whatever the tier
                done = await c.complete(prompt="The service tier of a request decides", max_tokens=32,
                                        temperature=1.0, seed=1234, ignore_eos=True, service_tier=tier, timeout=120)
                seen[tier] = (done.token_ids, done.service_tier, done.timings["decode_worker"])
            for text in probes:
                done = await c.complete(messages=[{"role": "user", "content": text}], max_tokens=96,
                                        temperature=0.0, service_tier="priority", timeout=300)
                replies.append(list(done.token_ids))
        before = {s.worker_id: dict(s.tier_seconds) for s in await cluster.stats()}
        depth, stop = [0], asyncio.Event()

        async def sample() -> None:
            while not stop.is_set():
                depth[0] = max(depth[0], router.front.queued(ServiceTier.FLEX))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        rc = await pdserve_bench(port, cmd_args, "tiers", out)
        stop.set()
        await sampler
        stats = await cluster.stats()
    seconds: dict[str, float] = {}
    for s in stats:
        for tier, v in s.tier_seconds.items():
            seconds[tier] = seconds.get(tier, 0.0) + v - before.get(s.worker_id, {}).get(tier, 0.0)
    return dict(seen=seen, replies=replies, seconds=seconds, max_flex_queued=depth[0],
                preemptions={k: sum(s.tier_preemptions.get(k, 0) for s in stats)
                             for k in ("flex/kept", "flex/recomputed")},
                speculation={s.worker_id: s.speculation for s in stats if s.speculation},
                report=bench_report(out, rc, "pdserve bench failed"))


def show(label: str, res: dict, flex_bound: int) -> dict:
    """Print one cluster's table; priority's ratios to default."""
    seen = res["seen"]
    same = len({tuple(v[0]) for v in seen.values()}) == 1
    print(f"\n== {label}\nsame seed on every tier: " + ("same tokens" if same else "DIFFERENT tokens") + "; "
          + ", ".join(f"{t}: served {s}, decoded on {w}" for t, (_, s, w) in seen.items()))
    tiers = res["report"]["by_service_tier"]
    print(f"{'tier':10}{'done':>6}{'failed':>8}{'refused':>9}  {'served':24}{'med TTFT':>10}{'p99 TTFT':>10}"
          f"{'med TPOT':>10}{'p99 TPOT':>10}{'SLO met':>9}{'dev-s/tok':>11}")
    per_token = {}
    for tier, r in tiers.items():
        tokens = r["total_output_tokens"]
        per_token[tier] = res["seconds"].get(tier, 0.0) / tokens if tokens else float("nan")
        served = ",".join(f"{k}={v}" for k, v in sorted(r.get("served", {}).items()))
        print(f"{tier:10}{r['completed']:>6}{r['failed'] - r.get('refused', 0):>8}{r.get('refused', 0):>9}  {served:24}"
              f"{r['median_ttft_ms']:>10.0f}{r['p99_ttft_ms']:>10.0f}{r['median_tpot_ms']:>10.1f}{r['p99_tpot_ms']:>10.1f}"
              f"{r['slo_attainment']:>9.1%}{per_token[tier] * 1000:>9.2f}ms")
    p, d = tiers["priority"], tiers["default"]
    ratios = dict(tpot=p["median_tpot_ms"] / d["median_tpot_ms"], ttft=p["median_ttft_ms"] / d["median_ttft_ms"],
                  device=per_token["priority"] / per_token["default"])
    print(f"priority / default: median TPOT {ratios['tpot']:.2f}x, median TTFT {ratios['ttft']:.2f}x, device seconds "
          f"per output token {ratios['device']:.2f}x")
    print(f"flex: most waiting at once {res['max_flex_queued']} (bound {flex_bound}); preemptions {res['preemptions']}")
    for worker, sp in res["speculation"].items():
        rate = sp["accepted"] / sp["drafted"] if sp["drafted"] else float("nan")
        print(f"speculation on {worker}: drafted {sp['drafted']}, accepted {sp['accepted']} ({rate:.2f}), "
              f"verifications {sp['verifications']}")
    return dict(same_tokens=same, ratios=ratios)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--decode-max-running", type=int, default=32, help="running requests on the default decode worker")
    ap.add_argument("--fast-lane-max-running", type=int, default=2)
    ap.add_argument("--flex-max-queued", type=int, default=8)
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--workload", choices=("random", "copy"), default="random",
                    help="random token prompts (DEFAULT_BENCH_ARGS) or copy-heavy chat prompts (COPY_BENCH_ARGS)")
    ap.add_argument("--fast-lane-speculative-config", default=None, metavar="JSON",
                    help="the fast lane speculates so; the same load then runs again with no speculation")
    ap.add_argument("--plain-first", action="store_true", help="run the cluster without speculation first")
    ap.add_argument("--output", default=None, metavar="FILE.json")
    args, bench_args = ap.parse_known_args()

    from pdserve.engine.speculative import SpeculativeConfig
    from router.pools import init_local_ray

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-tiers-"))
    probes: list[str] = []
    if args.workload == "copy":
        copy_trace(tmp / "copy.jsonl")
        cmd_args = [*COPY_BENCH_ARGS, "--trace", str(tmp / "copy.jsonl"), *bench_args]
        probes = copy_prompts()[:4]
    else:
        cmd_args = [*DEFAULT_BENCH_ARGS, *bench_args]
    spec = SpeculativeConfig.parse(args.fast_lane_speculative_config)
    runs = [("fast lane speculating", spec), ("no speculation", None)] if spec else [("no speculation", None)]
    runs = runs[::-1] if args.plain_first else runs
    print(f"{os.cpu_count()} cores; 3 workers; decode max running {args.decode_max_running}, fast lane "
          f"{args.fast_lane_max_running}; flex queue bound {args.flex_max_queued}\npdserve bench {' '.join(cmd_args)}",
          flush=True)
    init_local_ray()
    results = {label: asyncio.run(run(cluster_config(args, s), cmd_args, tmp / f"bench-{i}.json", probes))
               for i, (label, s) in enumerate(runs)}
    summary = {label: show(label, res, args.flex_max_queued) for label, res in results.items()}
    if spec:
        a, b = (results[label]["replies"] for label, _ in runs)
        print(f"\npriority's greedy replies to {len(a)} prompts with and without speculation: "
              + ("identical" if a == b else "DIFFERENT"))
        print("priority median TPOT / default's: " + ", ".join(f"{label} {summary[label]['ratios']['tpot']:.2f}x"
                                                                for label, _ in runs))
    if args.output:
        write_json(args.output, {"bench_args": cmd_args, "summary": summary, "results": results})


if __name__ == "__main__":
    main()
