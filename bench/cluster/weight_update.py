"""A trainer's weight update of the default model (SmolLM2-135M, fp32: 0.54 GB) pushed over gloo into a 1P1D
cluster, against the raw gloo broadcast of the same bytes to as many processes, measured in the same run;
and the same update loaded by the workers from a checkpoint path.

    .venv/bin/python -m bench.cluster.weight_update [--repeat 3] [--bucket-mb 64] [--streams 4] [--stream-tokens 160]
                                                    [--json out.json]

The cluster (router, one prefill and one decode worker) runs on a local Ray cluster; this process is the
trainer (pdserve.weights.trainer.WeightSync: rank 0 of a gloo group whose other ranks are the two workers).
Each repeat pushes every tensor of the model, perturbed (a new version), in `pause` mode with nothing in
flight, and times the whole push (the metadata check, the bucketed broadcast, each worker's staging and the
switch). The raw figure: this process broadcasting one buffer of the same size to two spawned processes
(pdserve.weights.group.measure_bandwidth, best of 3). Then the same update from a checkpoint directory
(`pdserve weights update`), the workers reading it themselves. Every version's greedy tokens are checked
against the offline engine loaded with the same weights. Last, a push in each mode (`pause`, `rolling`) with
--streams greedy streams in flight: the push's time and the longest gap it puts into a stream, against the
streams' median gap before it.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Table, local_cluster, local_router, parser, write_json

PROMPT = [1, 504, 3458, 314, 253, 1892, 30, 2, 198, 504]


def default_tensors() -> dict[str, torch.Tensor]:
    """The default model's tensors, Hugging Face-named, fp32 (its GGUF dequantized, as the workers load it)."""
    from pdserve.model.loader import _safetensors_weights, _weights_dir, resolve_format

    path, fmt = resolve_format(None, "auto")
    return {name: t.to(torch.float32) for name, t in _safetensors_weights(_weights_dir(path, fmt))}


def _raw_receiver(address, rank: int, nbytes: int) -> None:
    from pdserve.weights.group import WeightGroup, measure_bandwidth

    group = WeightGroup.join(address, rank, 120.0)
    try:
        measure_bandwidth(group, nbytes)
    finally:
        group.close()


def raw_gloo(nbytes: int, receivers: int) -> float:
    """Bytes/s of one gloo broadcast of nbytes from this process to `receivers` spawned processes."""
    from pdserve.weights.group import GroupAddress, WeightGroup, free_port, measure_bandwidth

    address = GroupAddress("127.0.0.1", free_port(), receivers + 1, f"raw-{time.time_ns()}")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_raw_receiver, args=(address, r, nbytes)) for r in range(1, receivers + 1)]
    for p in procs:
        p.start()
    group = WeightGroup.join(address, 0, 120.0)
    try:
        return measure_bandwidth(group, nbytes)
    finally:
        group.close()
        for p in procs:
            p.join(60)


def under_load(target: str, mode: str, policy: str, version: int, tensors: dict, args) -> dict:
    """A trainer's push in `mode` while greedy streams of version policy `policy` are in flight: the push's
    time, each stream's gaps between messages (the median before the push, the largest overlapping it), and
    how many streams saw two versions. keep: a stream's gap is the switch alone; recompute (the server's
    default policy): the switch and the recomputation of the stream's KV by the new weights."""
    import threading

    import numpy as np

    from pdserve.client import Client
    from pdserve.weights.trainer import WeightSync

    times: list[list[float]] = [[] for _ in range(args.streams)]
    seen: list[set[int]] = [set() for _ in range(args.streams)]

    def stream(i: int) -> None:
        with Client(target) as c:
            for r in c.generate(token_ids=PROMPT[i:] + PROMPT[:i], max_tokens=args.stream_tokens, temperature=0.0,
                                ignore_eos=True, timeout=600, version_policy=policy):
                times[i].append(time.perf_counter())
                seen[i].update(r.weight_versions)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(args.streams)]
    with WeightSync(target, bucket_bytes=args.bucket_mb << 20) as sync:
        sync.connect()  # the group is made before the streams: only the push itself overlaps them
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(len(ts) for ts in times) < 8:
            if time.monotonic() > deadline:
                raise TimeoutError("the streams did not start within 120 s")
            time.sleep(0.01)
        t0 = time.perf_counter()
        sync.push(tensors, version, mode=mode)
        t1 = time.perf_counter()
    for t in threads:
        t.join(600)
    before = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b < t0]
    during = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > t0 and a < t1]
    # The push stalls a stream at most for its commit; the largest gap while it ran, and the part of it spent
    # inside the push's window.
    in_push = [min(b, t1) - max(a, t0) for ts in times for a, b in zip(ts, ts[1:]) if b > t0 and a < t1]
    return dict(mode=mode, policy=policy, version=version, push_s=t1 - t0, gap_p50_s=float(np.median(before)),
                max_gap_s=max(during, default=0.0), in_push_gap_s=max(in_push, default=0.0), streams=args.streams,
                two_versions=sum(len(v) > 1 for v in seen))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--streams", type=int, default=4, help="streams in flight across the pushes under load")
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pdserve.client import Client
    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from pdserve.model.loader import _weights_dir, resolve_format
    from pdserve.weights.trainer import WeightSync
    from router.pools import init_local_ray

    init_local_ray(num_cpus=2)
    # The checkpoints written below go to the temporary directory: the workers may read them there.
    engine = EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=512), weights_root=tempfile.gettempdir())
    config = ClusterConfig(engine=engine, mode="disaggregated", prefill=PoolConfig(1, num_cpus=0.5),
                           decode=PoolConfig(1, num_cpus=0.5))
    base = default_tensors()
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    offline = LLMEngine(engine)
    g = torch.Generator().manual_seed(0)

    def version_of(v: int) -> dict[str, torch.Tensor]:
        return {k: t + 1e-3 * torch.randn(t.shape, generator=g) for k, t in base.items()}

    def reference(tensors) -> list[int]:
        offline.update_weights(tensors.items(), offline.weight_version + 1)
        return offline.generate([PROMPT], params)[0].token_ids

    rows, loaded = [], []

    async def measure():
        async with local_cluster(config) as cluster, local_router(cluster) as router:
            target = f"127.0.0.1:{router.port}"

            def trainer() -> None:
                with Client(target) as client, WeightSync(target, bucket_bytes=args.bucket_mb << 20) as sync:
                    for v in range(1, args.repeat + 1):
                        tensors = version_of(v)
                        t0 = time.perf_counter()
                        r = sync.push(tensors, v)
                        wall = time.perf_counter() - t0
                        got = client.complete(token_ids=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
                        assert got.token_ids == reference(tensors), "the cluster's tokens are not the offline engine's"
                        assert set(got.choices[0].weight_versions) == {v}
                        rows.append(dict(way="trainer push (gloo)", version=v, seconds=wall, bytes=nbytes,
                                         stage_s=max(w.stage_seconds for w in r.workers),
                                         commit_s=max(w.commit_seconds for w in r.workers)))
                    with tempfile.TemporaryDirectory() as tmp:
                        from safetensors.torch import save_file

                        v = args.repeat + 1
                        tensors = version_of(v)
                        save_file({k: t.contiguous() for k, t in tensors.items()}, str(Path(tmp) / "model.safetensors"))
                        path, fmt = resolve_format(None, "auto")
                        shutil.copy(_weights_dir(path, fmt) / "config.json", Path(tmp) / "config.json")
                        t0 = time.perf_counter()
                        r = client.update_weights(tmp, v, timeout=600)
                        wall = time.perf_counter() - t0
                        got = client.complete(token_ids=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
                        assert got.token_ids == reference(tensors)
                        rows.append(dict(way="checkpoint path", version=v, seconds=wall, bytes=nbytes,
                                         stage_s=max(w.stage_seconds for w in r.workers),
                                         commit_s=max(w.commit_seconds for w in r.workers)))

            await asyncio.to_thread(trainer)
            for policy in ("keep", "recompute") if args.streams else ():  # --streams 0: no pushes under load
                for mode in ("pause", "rolling"):
                    v = args.repeat + 2 + len(loaded)  # after the pushes and the checkpoint's version
                    loaded.append(await asyncio.to_thread(under_load, target, mode, policy, v, version_of(v), args))


    asyncio.run(measure())
    raw = raw_gloo(nbytes, 2)
    t = Table(("way", 22, "<s"), ("version", 7, "d"), ("seconds", 8, ".2f"), ("GB/s", 6, ".2f"),
              ("of raw gloo", 11, ".0%"), ("stage s", 8, ".2f"), ("commit s", 8, ".3f"))
    print(f"model bytes {nbytes / 1e9:.3f} GB; raw gloo broadcast to 2 processes: {raw / 1e9:.2f} GB/s")
    print(t.header())
    for r in rows:
        rate = r["bytes"] / r["seconds"]
        r.update(gb_per_s=rate / 1e9, of_raw=rate / raw)
        print(t.row(r["way"], r["version"], r["seconds"], rate / 1e9, rate / raw, r["stage_s"], r["commit_s"]))
    warm = sorted(r["of_raw"] for r in rows[1:args.repeat])  # the first push writes its buffers for the first time
    if warm:
        print(f"warm pushes (versions 2..{args.repeat}): median {warm[len(warm) // 2]:.0%} of raw gloo, best "
              f"{warm[-1]:.0%}")
    if loaded:
        t = Table(("mode", 8, "<s"), ("policy", 9, "<s"), ("push s", 7, ".2f"), ("gap p50 ms", 10, ".0f"),
                  ("max gap ms", 10, ".0f"), ("in push", 8, ".0f"), ("streams", 7, "d"), ("2 versions", 10, "d"))
        print(f"\nan update under load: {args.streams} greedy streams of {args.stream_tokens} tokens in flight "
              f"across a push; gaps between a stream's messages (ms): the median before the push, the largest while "
              f"it ran")
        print(t.header())
        for r in loaded:
            print(t.row(r["mode"], r["policy"], r["push_s"], 1e3 * r["gap_p50_s"], 1e3 * r["max_gap_s"],
                        1e3 * r["in_push_gap_s"], r["streams"], r["two_versions"]))
    if args.json:
        write_json(args.json, dict(args=vars(args), raw_gloo_bytes_per_s=raw, model_bytes=nbytes, rows=rows,
                                   under_load=loaded))


if __name__ == "__main__":
    main()
