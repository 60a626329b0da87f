"""Faults on a real local Ray cluster: killed workers, a stalled transfer, a soak with cancellations."""
from __future__ import annotations

import asyncio
import os
import random
import signal

import grpc
import pytest
import ray
import torch
from conftest import wait_for

from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.request import FinishReason
from pdserve.sampling import SamplingParams
from router.cluster import Cluster

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


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    engine, _ = configs(tiny_checkpoints["llama"])
    return [c.token_ids for c in LLMEngine(engine).generate(prompts(), GREEDY)]


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


async def stream_all(cluster: Cluster, batch, params, started: asyncio.Event | None = None, min_tokens: int = 3):
    """Run every request; set `started` once each has streamed min_tokens. Returns (tokens, finish reason, error)."""
    progress = [0] * len(batch)

    async def one(i, p):
        tokens, last = [], None
        async for out in cluster.generate(p, params):
            tokens += out.new_token_ids
            last = out
            progress[i] = len(tokens)
            if started is not None and min(progress) >= min_tokens:
                started.set()
        return tokens, last.finish_reason, last.error

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))


def kill_when_started(aloop, cluster, pool: str, batch, params):
    async def run():
        started = asyncio.Event()
        task = asyncio.create_task(stream_all(cluster, batch, params, started))
        await asyncio.wait_for(started.wait(), 120)
        victim = cluster.pools[pool][0]
        ray.kill(victim.handle)
        return await asyncio.wait_for(task, 180), victim.worker_id

    return aloop.run(run(), timeout=300)


def test_decode_killed_streams_resume_and_match(ray_local, aloop, tiny_checkpoints, reference):
    _, config = configs(tiny_checkpoints["llama"])
    cluster = start(aloop, config)
    try:
        results, victim = kill_when_started(aloop, cluster, "decode", prompts(), GREEDY)
        assert [r[0] for r in results] == reference  # nothing repeated, nothing skipped
        assert all(r[1] is FinishReason.LENGTH and r[2] is None for r in results)
        assert cluster.restarts["decode"] == 1 and cluster.retries["decode_lost"] == N_STREAMS
        settle(aloop, cluster, {"prefill": 1, "decode": 1})
        assert cluster.pools["decode"][0].worker_id != victim
    finally:
        aloop.run(cluster.shutdown())


def test_decode_killed_fail_policy_ends_with_unavailable(ray_local, aloop, tiny_checkpoints):
    from pdserve.client import AsyncClient
    from router.server import Router, RouterConfig

    _, config = configs(tiny_checkpoints["llama"], on_decode_failure="fail")
    cluster = start(aloop, config)
    router = Router(cluster, RouterConfig(port=0))
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

                tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts())]
                wait = asyncio.get_running_loop().time() + 120
                while min(counts) < 3 and asyncio.get_running_loop().time() < wait:
                    await asyncio.sleep(0.05)
                victim = cluster.pools["decode"][0]
                t0 = asyncio.get_running_loop().time()
                aloop.loop.call_soon_threadsafe(ray.kill, victim.handle)
                out = await asyncio.gather(*tasks)
                return out, asyncio.get_running_loop().time() - t0

        results, elapsed = asyncio.run(run())
        assert all(code == grpc.StatusCode.UNAVAILABLE for code, _ in results), results
        assert all("decode" in detail for _, detail in results)
        assert elapsed < 30  # bounded: the loss is seen at once, not at a timeout
        settle(aloop, cluster, {"prefill": 1, "decode": 1})
    finally:
        aloop.run(router.stop(grace=5))
        aloop.run(cluster.shutdown())


def test_prefill_killed_with_queued_requests_all_complete(ray_local, aloop, tiny_checkpoints, reference):
    _, config = configs(tiny_checkpoints["llama"])
    cluster = start(aloop, config)
    try:
        async def run():
            task = asyncio.create_task(stream_all(cluster, prompts(), GREEDY))
            # Kill once the prefill worker has prompts queued (budget 64 tokens per step: they queue).
            await asyncio.sleep(0)
            deadline = asyncio.get_running_loop().time() + 60
            while cluster.pools["prefill"][0].queued_tokens == 0 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.005)
            queued = cluster.pools["prefill"][0].queued_tokens
            ray.kill(cluster.pools["prefill"][0].handle)
            return await asyncio.wait_for(task, 180), queued

        results, queued = aloop.run(run(), timeout=300)
        assert queued > 0
        assert [r[0] for r in results] == reference
        assert cluster.restarts["prefill"] == 1 and cluster.retries["prefill_lost"] >= 1
        settle(aloop, cluster, {"prefill": 1, "decode": 1})
    finally:
        aloop.run(cluster.shutdown())


def test_stalled_transfer_times_out_is_retried_and_frees_blocks(ray_local, aloop, tiny_checkpoints, reference):
    _, config = configs(tiny_checkpoints["llama"], transfer_timeout_s=2.0)
    cluster = start(aloop, config)
    try:
        ray.get(cluster.pools["prefill"][0].handle.inject_send_delay.remote(4.0, 1))
        (tokens, reason, error), = aloop.run(stream_all(cluster, prompts()[:1], GREEDY), timeout=120)
        assert (tokens, reason, error) == (reference[0], FinishReason.LENGTH, None)
        assert cluster.retries["transfer_failed"] == 1
        stats = {s.pool: s for s in aloop.run(cluster.stats())}
        assert stats["decode"].transfer["failures"] == 1
        settle(aloop, cluster, {"prefill": 1, "decode": 1})
        # Twice in a row: retried once, then UNAVAILABLE (the router maps ERROR to it).
        ray.get(cluster.pools["prefill"][0].handle.inject_send_delay.remote(4.0, 2))
        (tokens, reason, error), = aloop.run(stream_all(cluster, prompts()[1:2], GREEDY), timeout=120)
        assert reason is FinishReason.ERROR and "transfer" in error
        settle(aloop, cluster, {"prefill": 1, "decode": 1})
    finally:
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


# -- the hand-off's failures: a stalled push keeps the KV "in flight" while the test acts ------------

def worker_pid(aloop, cluster: Cluster, pool: str) -> int:
    return next(s.pid for s in aloop.run(cluster.stats()) if s.pool == pool)


def decode_waiting_for_kv(aloop, cluster: Cluster) -> int:
    return next(s.waiting for s in aloop.run(cluster.stats()) if s.pool == "decode")


def test_cancel_during_a_transfer_frees_both_sides(ray_local, aloop, tiny_checkpoints, reference):
    _, config = configs(tiny_checkpoints["llama"], transfer_timeout_s=10.0)
    cluster = start(aloop, config)
    try:
        ray.get(cluster.pools["prefill"][0].handle.inject_send_delay.remote(1.5, 1))

        async def run():
            gen = cluster.generate(prompts()[0], GREEDY)
            first = await gen.__anext__()  # the prompt is computed; its push is stalled on the way
            assert first.new_token_ids == reference[0][:1]
            return gen

        gen = aloop.run(run())
        wait_for(lambda: decode_waiting_for_kv(aloop, cluster) == 1, 10, what="the decode worker to wait for the KV")
        aloop.run(gen.aclose())  # the client goes away while the KV is in flight
        settle(aloop, cluster, {"prefill": 1, "decode": 1})
        (tokens, reason, _), = aloop.run(stream_all(cluster, prompts()[1:2], GREEDY), timeout=60)
        assert tokens == reference[1] and reason is FinishReason.LENGTH  # the pair still works
        settle(aloop, cluster, {"prefill": 1, "decode": 1})
    finally:
        aloop.run(cluster.shutdown())


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_worker_killed_by_sigkill_mid_transfer_all_complete(ray_local, aloop, tiny_checkpoints, reference, victim):
    """SIGKILL from outside while pushes are stalled: the prefill worker holds computed KV, the decode
    worker holds reservations. Every request completes, token for token, and nothing leaks."""
    _, config = configs(tiny_checkpoints["llama"], transfer_timeout_s=10.0)
    cluster = start(aloop, config)
    batch = prompts()[:6]
    try:
        ray.get(cluster.pools["prefill"][0].handle.inject_send_delay.remote(3.0, 1))
        pid = worker_pid(aloop, cluster, victim)

        async def run():
            started = asyncio.Event()
            task = asyncio.create_task(stream_all(cluster, batch, GREEDY, started, min_tokens=1))
            await asyncio.wait_for(started.wait(), 60)  # every prompt computed; the pushes wait behind the stall
            waiting = next(s.waiting for s in await cluster.stats() if s.pool == "decode")
            os.kill(pid, signal.SIGKILL)
            return await asyncio.wait_for(task, 180), waiting

        results, waiting = aloop.run(run(), timeout=300)
        assert waiting == len(batch)  # the decode worker held a reservation for each when the kill came
        assert [r[0] for r in results] == reference[:6]
        assert all(r[1] is FinishReason.LENGTH and r[2] is None for r in results)
        assert cluster.restarts[victim] == 1
        settle(aloop, cluster, {"prefill": 1, "decode": 1})
    finally:
        aloop.run(cluster.shutdown())
