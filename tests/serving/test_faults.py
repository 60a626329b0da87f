"""Faults on a real local Ray cluster beyond the failure matrix (tests/serving/test_failure_matrix.py): the
`fail` policy for a lost decode worker, and a soak with cancellations and a killed worker."""
from __future__ import annotations

import asyncio
import logging
import random

import grpc
import ray
import torch

from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams
from router.cluster import Cluster

from conftest import wait_for

N_STREAMS = 16
MAX_TOKENS = 40


def configs(path, **cluster_kw):
    cache = CacheConfig(block_size=4, num_blocks=1024)
    engine = EngineConfig(model=str(path), cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    pool = PoolConfig(1, num_cpus=0.25, cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    kw = dict(engine=engine, prefill=pool, decode=pool, stats_interval_s=0.5, worker_timeout_s=10.0,
              transfer_timeout_s=5.0)
    kw.update(cluster_kw)
    return engine, ClusterConfig(**kw)


def prompts(n=N_STREAMS, seed=21):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (int(torch.randint(4, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def start(aloop, config) -> Cluster:
    c = Cluster(config)
    aloop.run(c.start(), timeout=600)
    return c


def settle(aloop, cluster: Cluster, sizes: dict[str, int]) -> None:
    """Pools back to their configured size, every worker answering, no KV block in use anywhere."""
    wait_for(lambda: all(len(cluster.pools[p]) == n for p, n in sizes.items()), timeout=120,
             what="the pools to be back to their configured size")
    wait_for(lambda: sum(s.kv_blocks_used for s in aloop.run(cluster.stats())) == 0, timeout=60,
             what="zero used KV blocks in both pools")


def test_decode_killed_fail_policy_ends_with_unavailable(ray_local, aloop, tiny_checkpoints, caplog):
    """A decode worker killed under 16 streams, with `--on-decode-failure fail`: every stream ends with
    UNAVAILABLE naming the decode side, before its own deadline; the loss is seen at once (the worker's
    calls fail), not when the heartbeat times out; the pool is whole again and no KV block is left used."""
    from pdserve.client import AsyncClient
    from router.compose import build_router
    from router.config import RouterConfig

    _, config = configs(tiny_checkpoints["llama"], on_decode_failure="fail")
    cluster = start(aloop, config)
    caplog.set_level(logging.WARNING, logger="router.pools")  # "worker <id> lost (<why>)": how the router saw it
    router = build_router(cluster, RouterConfig(port=0))
    aloop.run(router.start())
    try:
        async def run():
            async with AsyncClient(f"127.0.0.1:{router.port}") as c:
                counts = [0] * N_STREAMS

                async def one(i, p):
                    try:
                        async for r in c.generate(token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0,
                                                  ignore_eos=True, timeout=60):
                            counts[i] += len(r.token_ids)
                    except grpc.aio.AioRpcError as e:
                        return e.code(), e.details()
                    return grpc.StatusCode.OK, ""

                # The decode worker stops inside its fourth step and stays there until it is killed: every
                # stream has begun (its first token comes from the prefill worker) and none can end first.
                victim = cluster.pools["decode"][0]
                victims.append(victim.worker_id)
                await victim.handle.inject_fault.remote("step", 60.0, skip=3)
                tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts())]
                assert await victim.handle.fault_reached.remote("step", 60), "the decode worker never stepped"
                wait = asyncio.get_running_loop().time() + 60
                while min(counts) < 1 and asyncio.get_running_loop().time() < wait:
                    await asyncio.sleep(0.05)
                assert min(counts) >= 1, counts
                t0 = asyncio.get_running_loop().time()
                aloop.loop.call_soon_threadsafe(ray.kill, victim.handle)
                out = await asyncio.gather(*tasks)
                return out, asyncio.get_running_loop().time() - t0

        victims: list[str] = []
        results, elapsed = asyncio.run(run())
        print(f"every stream ended {elapsed:.2f} s after the kill")
        # Bounded: each stream ended with the router's UNAVAILABLE, none at its 60 s deadline (that would be
        # DEADLINE_EXCEEDED) ...
        assert all(code == grpc.StatusCode.UNAVAILABLE for code, _ in results), results
        assert all("decode" in detail for _, detail in results)
        # ... and the loss was seen at once, from the worker's failed calls, not at a timeout: the heartbeat
        # (worker_timeout_s) did not have to declare it stuck. (No wall-clock bound: a loaded machine decides it.)
        losses = [r.args[:2] for r in caplog.records if r.msg.startswith("worker %s lost")]
        assert [w for w, _ in losses] == victims and not losses[0][1].startswith("stuck"), losses
        settle(aloop, cluster, {"prefill": 1, "decode": 1})
    finally:
        aloop.run(router.stop(grace=5))
        aloop.run(cluster.shutdown())


def test_soak_with_cancellations_and_a_killed_worker(ray_local, aloop, tiny_checkpoints):
    _, config = configs(tiny_checkpoints["llama"])
    cluster = start(aloop, config)
    rng = random.Random(5)
    n = 240
    batch = prompts(n, seed=33)
    plan = [rng.random() < 0.25 for _ in range(n)]  # requests the client abandons midway
    outcome: dict[int, str] = {}
    try:
        async def one(i, p, gate: asyncio.Semaphore):
            async with gate:
                got = 0
                params = SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.0, ignore_eos=True)
                gen = cluster.generate(p, params)
                try:
                    async for out in gen:
                        got += len(out.new_token_ids)
                        if plan[i] and got >= 2:
                            outcome[i] = "cancelled"
                            return
                        if out.finished:
                            outcome[i] = "failed" if out.finish_reason is FinishReason.ERROR else "completed"
                finally:
                    await gen.aclose()

        async def run():
            gate = asyncio.Semaphore(32)
            tasks = [asyncio.create_task(one(i, p, gate)) for i, p in enumerate(batch)]
            while len(outcome) < n // 2:
                await asyncio.sleep(0.05)
            ray.kill(cluster.pools["decode"][0].handle)  # midway
            await asyncio.wait_for(asyncio.gather(*tasks), 240)

        aloop.run(run(), timeout=300)
        assert len(outcome) == n  # every request accounted for: none hung, none dropped
        counts = {k: sum(1 for v in outcome.values() if v == k) for k in ("completed", "cancelled", "failed")}
        assert counts["cancelled"] == sum(plan) and counts["completed"] + counts["failed"] == n - sum(plan)
        assert counts["failed"] == 0  # the resume policy recovers every request of the killed worker
        settle(aloop, cluster, {"prefill": 1, "decode": 1})
        assert cluster.restarts["decode"] == 1
    finally:
        aloop.run(cluster.shutdown())
