"""Tensor-parallel workers on a real local Ray cluster: prefill and decode pools of different TP sizes,
token-exact against the offline engine at TP 1, and a rank killed from outside.

The checkpoint is built in the test: 8 attention heads over 2 KV heads, so TP 2 splits the KV heads and
TP 4 replicates each on two ranks. Each rank is a Ray actor of its worker's placement group; KV moves
between the ranks of the two workers over gloo, each decode rank receiving the heads it holds.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
import urllib.request

import pytest
import ray
import torch

from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.parallel.layout import TPLayout
from router.cluster import Cluster

from conftest import wait_for
from served import assert_same_logprobs, collect_all, collect_logprobs, logprob_params, mixed_params

LAYOUTS = [(1, 2), (2, 1), (2, 2), (4, 1), (1, 4)]
LENS = [5, 40, 13, 70, 2, 33]  # 40 and 70 are longer than the token budget: chunked prefill
NEW_TOKENS = 12
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    from conftest import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tp-cluster") / "gqa", "llama", num_attention_heads=8,
                                 num_key_value_heads=2)


def engine_config(path) -> EngineConfig:
    return EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
                        tensor_parallel_timeout_s=TIMEOUT_S)


def cluster_config(path, prefill_tp: int, decode_tp: int, decode_workers: int = 1, mode: str = "disaggregated",
                   **kw) -> ClusterConfig:
    engine = engine_config(path)
    pool = lambda n, tp: PoolConfig(n, num_cpus=0.1, tensor_parallel_size=tp, torch_threads=1)  # noqa: E731
    pools = dict(colocated=pool(1, prefill_tp)) if mode == "colocated" else \
        dict(prefill=pool(1, prefill_tp), decode=pool(decode_workers, decode_tp))
    return ClusterConfig(engine=engine, mode=mode, transfer_timeout_s=TIMEOUT_S, **pools, **kw)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 320, (n,), generator=g).tolist() for n in LENS]


@pytest.fixture(scope="module")
def reference(gqa):
    params = mixed_params(len(LENS), NEW_TOKENS)
    with LLMEngine(engine_config(gqa)) as engine:
        return params, [o.token_ids for o in engine.generate(prompts(), params)]


def rank_pids(aloop, worker) -> list[int]:
    return ray.get(worker.handle.rank_pids.remote(), timeout=60)


def used_blocks(aloop, cluster) -> int:
    return sum(s.kv_blocks_used for s in aloop.run(cluster.stats()))


@pytest.fixture(scope="module")
def logprob_reference(gqa):
    params = logprob_params(len(LENS), NEW_TOKENS)
    with LLMEngine(engine_config(gqa)) as engine:
        return params, engine.generate(prompts(), params)


@pytest.mark.parametrize("prefill_tp, decode_tp", LAYOUTS)
def test_tp_pair_is_token_exact(ray_local, aloop, gqa, reference, logprob_reference, prefill_tp, decode_tp):
    """Prefill of TP A, decode of TP B: every request's tokens (greedy and seeded sampling) equal the
    offline engine's at TP 1, each worker runs as A or B processes, each decode rank received exactly
    its KV heads, and no KV block is left used. The block allocator is rank 0's alone and every rank's
    block tables are rank 0's, so rank 0's count is every rank's."""
    params, expected = reference
    checksum = (prefill_tp, decode_tp) in ((2, 2), (1, 4))  # every rank's channel checks its own KV
    cluster = Cluster(cluster_config(gqa, prefill_tp, decode_tp, kv_checksum=checksum))
    aloop.run(cluster.start(), timeout=600)
    try:
        outs = aloop.run(collect_all(cluster, prompts(), params), timeout=300)
        assert [o[0] for o in outs] == expected
        for pool, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            pids = rank_pids(aloop, cluster.pools[pool][0])
            assert len(set(pids)) == tp, (pool, pids)
        wait_for(lambda: used_blocks(aloop, cluster) == 0, timeout=30, what="zero used KV blocks")
        # Every decode rank received exactly its KV heads of every prompt block (replicated heads once per
        # rank that holds them), counted over all the worker's channels; the rest is the trailers.
        (decode,) = [s.transfer for s in aloop.run(cluster.stats()) if s.pool == "decode"]
        layout = TPLayout(8, 2, decode_tp)
        heads = sum(len(layout.kv_heads(r)) for r in range(decode_tp))
        kv = sum(-(-n // 4) for n in LENS) * 2 * 2 * 4 * 8 * 4 * heads  # blocks x K,V x layers x block x dim x fp32
        assert kv <= decode["bytes"] <= kv + 8 * (len(LENS) + 2) * decode["transfers"], (decode, kv)
        assert decode["failures"] == 0

        async def with_logprobs():  # logprobs, the prompt's (computed by the prefill ranks), penalties
            return await asyncio.gather(*(collect_logprobs(cluster, p, sp)
                                          for p, sp in zip(prompts(), logprob_reference[0])))

        for (tokens, logprobs, prompt_logprobs), want in zip(aloop.run(with_logprobs(), timeout=300),
                                                             logprob_reference[1]):
            assert tokens == want.token_ids
            assert_same_logprobs(logprobs, want.logprobs)
            assert_same_logprobs(prompt_logprobs, want.prompt_logprobs)
    finally:
        aloop.run(cluster.shutdown())


def test_colocated_tp2_is_token_exact_and_reported(ray_local, aloop, gqa, reference):
    """A colocated worker of TP 2 behind the gRPC router: token-exact, two processes, and the cluster
    status says TP 2."""
    from pdserve.client import Client
    from router.config import RouterConfig

    from served import Served

    params, expected = reference
    s = Served(aloop, cluster_config(gqa, 2, 2, mode="colocated"), RouterConfig(port=0, metrics_port=0))
    try:
        outs = aloop.run(collect_all(s.cluster, prompts(), params), timeout=300)
        assert [o[0] for o in outs] == expected
        assert len(set(rank_pids(aloop, s.cluster.pools["colocated"][0]))) == 2
        (pool,) = Client(s.target).cluster_status().pools
        assert (pool.name, pool.tensor_parallel_size, pool.current_workers) == ("colocated", 2, 1)
        body = urllib.request.urlopen(f"http://127.0.0.1:{s.router.metrics_port}/metrics", timeout=10).read().decode()
        assert 'pdserve_pool_tensor_parallel_size{pool="colocated"} 2.0' in body
        wait_for(lambda: used_blocks(aloop, s.cluster) == 0, timeout=30, what="zero used KV blocks")
    finally:
        s.close()


def test_a_tp_size_the_model_cannot_take_fails_the_start(ray_local, aloop, gqa):
    cluster = Cluster(cluster_config(gqa, 1, 3))
    with pytest.raises(ValueError, match="the decode pool: tensor-parallel size 3 does not divide the model's 8"):
        aloop.run(cluster.start(), timeout=120)
    aloop.run(cluster.shutdown())


# -- a rank lost mid-stream ------------------------------------------------------------------------------

FAULT_TIMEOUT_S = 8.0  # the ranks' collective timeout in the fault tests: a hung rank is given up after it
RESUME_BOUND_S = 45.0  # every stream ends within this of the fault (the failure matrix's resume row)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"  # a zombie is gone


@pytest.fixture(scope="module")
def tp_fault_engine(gqa):
    return EngineConfig(model=str(gqa), cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
                        tensor_parallel_timeout_s=FAULT_TIMEOUT_S)


_GREEDY: dict[tuple[str, int], list[list[int]]] = {}


def greedy_reference(path, max_tokens: int):
    """The prompts, greedy parameters and the offline engine's tokens for them at TP 1 (computed once per
    checkpoint and length: the fault tests ask for the same ones)."""
    batch = prompts()
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    key = (str(path), max_tokens)
    if key not in _GREEDY:
        with LLMEngine(engine_config(path)) as engine:
            _GREEDY[key] = [o.token_ids for o in engine.generate(batch, greedy)]
    return batch, greedy, [list(t) for t in _GREEDY[key]]


def fault_cluster(aloop, engine: EngineConfig, prefill_tp: int, decode_workers: int, decode_tp: int) -> Cluster:
    pool = lambda n, tp: PoolConfig(n, num_cpus=0.1, tensor_parallel_size=tp, torch_threads=1)  # noqa: E731
    cluster = Cluster(ClusterConfig(engine=engine, prefill=pool(1, prefill_tp), decode=pool(decode_workers, decode_tp),
                                    transfer_timeout_s=TIMEOUT_S, stats_interval_s=0.5, worker_timeout_s=30.0))
    aloop.run(cluster.start(), timeout=600)
    return cluster


def test_the_rank_rows_are_in_docs_faults():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "faults.md").read_text()
    rows = ("tp-decode-rank-killed", "tp-decode-rank-stuck", "tp-decode-rank0-killed", "tp-prefill-rank-killed")
    assert all(f"`{row}`" in text for row in rows)


def assert_worker_replaced(aloop, cluster, victim, pids: list[int], restarts: int) -> None:
    """After a decode worker's loss: every process of it ended, a replacement joined its pool of 2 (one
    restart more than the `restarts` before it), and no KV block is left used."""
    wait_for(lambda: not any(_alive(p) for p in pids), timeout=30, what="every rank of the lost worker to end")
    wait_for(lambda: len(cluster.pools["decode"]) == 2 and victim not in cluster.pools["decode"], timeout=120,
             what="a replacement decode worker")
    assert cluster.restarts["decode"] == restarts + 1
    wait_for(lambda: used_blocks(aloop, cluster) == 0, timeout=30, what="zero used KV blocks")


async def streams_through_a_fault(cluster, batch, params, got: list[list[int]], victim, fault,
                                  lost: list[float], ended: list[float], bound_s: float = 0.0) -> list[str | None]:
    """Stream every prompt (tokens into got); once all are mid-stream with some on the victim worker, call
    fault(); record the seconds from it to the victim out of its pool (lost) and to the last stream's end
    (ended). Returns each stream's error, None where it ended well."""
    async def stream(i: int) -> str | None:
        async for out in cluster.generate(batch[i], params):
            got[i] += out.new_token_ids
            if out.error is not None:
                return out.error
        return None

    tasks = [asyncio.create_task(stream(i)) for i in range(len(batch))]
    deadline = time.monotonic() + 120
    while not (victim.requests and all(len(g) >= 4 for g in got)):  # mid-stream, some on the victim
        assert time.monotonic() < deadline, "the streams never got going"
        await asyncio.sleep(0.01)
    t_fault = time.monotonic()
    fault()
    while victim.alive:
        await asyncio.sleep(0.01)
    lost.append(time.monotonic() - t_fault)
    out = await asyncio.wait_for(asyncio.gather(*tasks), bound_s or RESUME_BOUND_S)
    ended.append(time.monotonic() - t_fault)
    return out


def test_a_prefill_rank_killed_mid_prefill(ray_local, aloop, gqa, tp_fault_engine):
    """Rank 1 of a TP 2 prefill worker is killed (SIGKILL) while its rank 0 is inside a step with
    prompts queued: the worker goes down with all its ranks, its prompts are placed again on the
    replacement, and every stream ends token-exact."""
    batch, greedy, expected = greedy_reference(gqa, 16)
    cluster = fault_cluster(aloop, tp_fault_engine, prefill_tp=2, decode_workers=1, decode_tp=1)
    victim = cluster.pools["prefill"][0]
    pids = rank_pids(aloop, victim)
    try:
        ray.get(victim.handle.inject_fault.remote("step", 30.0), timeout=30)  # the next step stalls, inside

        async def run():
            tasks = [asyncio.create_task(collect_tokens(cluster, p, greedy)) for p in batch]
            assert await asyncio.to_thread(ray.get, victim.handle.fault_reached.remote("step", 60), timeout=90)
            t0 = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            out = await asyncio.wait_for(asyncio.gather(*tasks), RESUME_BOUND_S)
            return out, time.monotonic() - t0

        outs, took = aloop.run(run(), timeout=RESUME_BOUND_S + 120)
        assert outs == expected
        print(f"SIGKILL of a prefill rank mid-step: every stream ended after {took:.2f} s")
        wait_for(lambda: not any(_alive(p) for p in pids), timeout=30, what="every rank of the lost worker to end")
        assert cluster.restarts["prefill"] == 1
        wait_for(lambda: used_blocks(aloop, cluster) == 0, timeout=60, what="zero used KV blocks")
    finally:
        aloop.run(cluster.shutdown())


async def collect_tokens(cluster, prompt, params) -> list[int]:
    tokens = []
    async for out in cluster.generate(prompt, params):
        assert out.error is None, out.error
        tokens += out.new_token_ids
    return tokens


def test_a_failed_share_is_retried_and_every_rank_settles(ray_local, aloop, gqa, tp_fault_engine):
    """Prefill TP 1 to decode TP 2 with checksums: the lead channel's share is corrupted once (the other
    rank's share arrives whole), then a transfer stalls past the transfer timeout once. Each failed
    transfer is retried and every stream is token-exact; the corrupted one keeps the channels (all of it
    arrived, in order), the stalled one breaks them on every rank; no KV block is left used."""
    batch, greedy, expected = greedy_reference(gqa, 12)
    engine = tp_fault_engine
    pool = lambda tp: PoolConfig(1, num_cpus=0.1, tensor_parallel_size=tp, torch_threads=1)  # noqa: E731
    cluster = Cluster(ClusterConfig(engine=engine, prefill=pool(1), decode=pool(2), transfer_timeout_s=3.0,
                                    kv_checksum=True, stats_interval_s=0.5))
    aloop.run(cluster.start(), timeout=600)
    prefill = cluster.pools["prefill"][0]

    def decode_transfer() -> dict:
        return next(s.transfer for s in aloop.run(cluster.stats()) if s.pool == "decode")

    async def run(prompts_):
        return await asyncio.gather(*(collect_tokens(cluster, p, greedy) for p in prompts_))

    try:
        ray.get(prefill.handle.inject_fault.remote("corrupt"), timeout=30)
        assert aloop.run(run(batch[:3]), timeout=120) == expected[:3]
        after_corrupt = decode_transfer()
        assert after_corrupt["checksum_failures"] == 1
        assert after_corrupt["channels_opened"] == 1  # the corrupted share kept the pair's channels
        # A send held past the 3 s transfer timeout: until the router has retried for it, then it goes on, late.
        failed = cluster.retries["transfer_failed"]
        ray.get(prefill.handle.inject_fault.remote("send", math.inf), timeout=30)
        stalled = asyncio.run_coroutine_threadsafe(run(batch[3:]), aloop.loop)
        assert ray.get(prefill.handle.fault_reached.remote("send", 60), timeout=90)
        wait_for(lambda: cluster.retries["transfer_failed"] > failed, 60, what="the transfer's timeout to fail it")
        ray.get(prefill.handle.release_fault.remote("send"), timeout=30)
        assert stalled.result(120) == expected[3:]
        after_stall = decode_transfer()
        assert after_stall["failures"] > after_corrupt["failures"]
        assert after_stall["checksum_failures"] == 1  # the stall is not a checksum failure
        # The stalled transfer broke the channels: the next generation was built, every rank's channels in it.
        assert after_stall["channels_opened"] == 2
        assert cluster.restarts == {}  # no worker was lost: the transfers failed, not the workers
        wait_for(lambda: used_blocks(aloop, cluster) == 0, timeout=30, what="zero used KV blocks")
    finally:
        aloop.run(cluster.shutdown())


# -- one prefill worker and two decode workers of TP 2, shared by the tests below ---------------------------------
# Each test leaves it as it found it (a lost worker replaced, every KV block free) and checks so, reading restarts
# as a delta; the drain, which leaves one decode worker, comes last.

@pytest.fixture(scope="module")
def one_two_tp2(ray_local, aloop, tp_fault_engine):
    cluster = fault_cluster(aloop, tp_fault_engine, prefill_tp=1, decode_workers=2, decode_tp=2)
    yield cluster
    aloop.run(cluster.shutdown())


@pytest.mark.parametrize("rank, how", [(1, "SIGKILL"), (1, "SIGSTOP"), (0, "SIGKILL")])
def test_a_decode_rank_lost_mid_stream(aloop, gqa, one_two_tp2, rank, how, caplog):
    """One prefill worker, two decode workers of TP 2. Rank 1 of a decode worker that is streaming is
    killed (SIGKILL) or stopped (SIGSTOP) from outside, or its rank 0 is killed: its worker goes down,
    every one of its ranks with it, each of its streams resumes on the other decode worker and ends
    token-exact within the bound, a replacement joins, and no KV block is left used. The worker itself
    ends (its ranks see the loss), the router does not have to wait out its heartbeat for it."""
    batch, greedy, expected = greedy_reference(gqa, 64)
    cluster = one_two_tp2
    caplog.set_level(logging.WARNING, logger="router.pools")  # "worker <id> lost (<why>)": how the router saw it
    victim = cluster.pools["decode"][0]
    pids = rank_pids(aloop, victim)
    restarts = cluster.restarts["decode"]
    got: list[list[int]] = [[] for _ in batch]
    lost: list[float] = []  # seconds from the fault to the worker out of its pool
    ended: list[float] = []  # to the last stream's end
    run = lambda: streams_through_a_fault(  # noqa: E731
        cluster, batch, greedy, got, victim, lambda: os.kill(pids[rank], getattr(signal, how)), lost, ended)

    try:
        errors = aloop.run(run(), timeout=RESUME_BOUND_S + 180)
        assert errors == [None] * len(batch)
        assert got == expected
        print(f"{how} of decode rank {rank}: worker lost after {lost[0]:.2f} s, every stream ended after "
              f"{ended[0]:.2f} s")
        # The worker ended itself and the router saw it end ("dead: ..." or "stream ended: ..."): it was not
        # declared stuck by the heartbeat.
        losses = [r.args[:2] for r in caplog.records if r.msg.startswith("worker %s lost")]
        assert [w for w, _ in losses] == [victim.worker_id] and not losses[0][1].startswith("stuck"), losses
        # How it ended, told apart by the configured timeouts rather than by a speed: a killed rank is seen
        # at once (rank 0 watches it; a killed rank 0 is the worker), before any collective could time out;
        # a stopped one when rank 0's collective times out, long before the router's heartbeat would have.
        # (How fast, on this machine: bench.cluster.kill_decode and docs/faults.md's measured column.)
        assert lost[0] < (FAULT_TIMEOUT_S if how == "SIGKILL" else cluster.config.worker_timeout_s), lost
        if how == "SIGSTOP":  # nothing saw the stopped rank before its hung collective had waited most of its timeout
            assert lost[0] >= FAULT_TIMEOUT_S / 2, lost
        assert_worker_replaced(aloop, cluster, victim, pids, restarts)
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGCONT)


def test_a_drained_tp_worker_leaves_no_rank_behind(aloop, gqa, one_two_tp2):
    """Scaling a pool of TP 2 decode workers down drains one: its ranks stop, its processes end and its
    placement group is removed, and the other worker goes on serving token-exact. (Last on the module's
    cluster: its decode pool is one worker after it.)"""
    from ray.util import placement_group_table

    batch, greedy, expected = greedy_reference(gqa, 8)
    cluster = one_two_tp2
    assert len(cluster.pools["decode"]) == 2 and not cluster.scaling.draining
    leaving = cluster.pools["decode"][1]
    pids = rank_pids(aloop, leaving)
    group_id = leaving.placement_group.id.hex()

    async def drain() -> None:  # on the cluster's event loop, as the autoscaler does it
        cluster.scaling.drain_worker(leaving, "test")

    aloop.run(drain())
    wait_for(lambda: not any(_alive(p) for p in pids), timeout=60, what="every rank of the drained worker to end")
    wait_for(lambda: placement_group_table().get(group_id, {}).get("state") == "REMOVED", timeout=30,
             what="the drained worker's placement group to be removed")

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(collect_tokens(cluster, p, greedy) for p in batch))

    assert aloop.run(run(), timeout=120) == expected
    wait_for(lambda: used_blocks(aloop, cluster) == 0, timeout=30, what="zero used KV blocks")
