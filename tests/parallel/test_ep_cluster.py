"""Expert-parallel workers of a mixture of experts on a real local Ray cluster: a prefill pool and a decode pool
of different expert-parallel sizes serve token-exact against the offline engine on one rank, and a decode
worker's expert rank killed from outside (SIGKILL) mid-stream: its streams resume token-exact elsewhere.

The checkpoint is a tiny Qwen3-MoE (8 experts, top 2, a dense first layer) that transformers' own config class
builds. At expert-parallel size 2 each rank holds 4 experts whole and every token goes to its experts' ranks and
back over gloo (all-to-all); attention is tensor-parallel over the same 2 ranks, so the KV moves between pools
exactly as between TP workers of those sizes.
"""
from __future__ import annotations

import os
import signal

import pytest

from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from router.cluster import Cluster

from conftest import wait_for
from moe_models import build
from served import collect_all
from test_tp_cluster import assert_worker_replaced, prompts, rank_pids, streams_through_a_fault, used_blocks

TIMEOUT_S = 20.0
NEW_TOKENS = 12


def test_the_expert_rank_row_is_in_docs_faults():
    from pathlib import Path

    assert "`ep-decode-rank-killed`" in (Path(__file__).resolve().parents[2] / "docs" / "faults.md").read_text()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return build(tmp_path_factory.mktemp("ep-cluster") / "qwen3-moe", "qwen3_moe-mixed", packed=False)


def engine_config(path) -> EngineConfig:
    return EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
                        tensor_parallel_timeout_s=TIMEOUT_S)


def start(aloop, path, prefill_ep: int, decode_ep: int, decode_workers: int = 1) -> Cluster:
    pool = lambda n, ep: PoolConfig(n, num_cpus=0.1, expert_parallel_size=ep, torch_threads=1)  # noqa: E731
    cluster = Cluster(ClusterConfig(engine=engine_config(path), prefill=pool(1, prefill_ep),
                                    decode=pool(decode_workers, decode_ep), transfer_timeout_s=TIMEOUT_S,
                                    stats_interval_s=0.5, worker_timeout_s=30.0))
    aloop.run(cluster.start(), timeout=600)
    return cluster


def reference(path, max_tokens: int) -> tuple[SamplingParams, list[list[int]]]:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLMEngine(engine_config(path)) as engine:
        return greedy, [o.token_ids for o in engine.generate(prompts(), greedy)]


@pytest.mark.parametrize("prefill_ep, decode_ep", [(2, 1), (1, 2)])
def test_pools_of_different_expert_parallel_sizes_are_token_exact(ray_local, aloop, moe, prefill_ep, decode_ep):
    greedy, expected = reference(moe, NEW_TOKENS)
    cluster = start(aloop, moe, prefill_ep, decode_ep)
    try:
        for name, ep in (("prefill", prefill_ep), ("decode", decode_ep)):
            worker = cluster.pools[name][0]
            assert len(rank_pids(aloop, worker)) == ep  # an expert-parallel worker is that many ranks
        got = [toks for toks, _, _ in aloop.run(collect_all(cluster, prompts(), [greedy] * len(expected)), timeout=300)]
        assert got == expected
        stats = {s.pool: s for s in aloop.run(cluster.stats())}
        # Every rank routes every token: the decode worker's counts are its whole batch's, k per token per MoE layer.
        assert sum(stats["decode"].expert_tokens) == stats["decode"].tokens_processed * 2 * 2
        wait_for(lambda: used_blocks(aloop, cluster) == 0, timeout=30, what="zero used KV blocks")
    finally:
        aloop.run(cluster.shutdown())


def test_an_expert_rank_killed_mid_stream_resumes_token_exact(ray_local, aloop, moe):
    """Two decode workers of expert-parallel size 2. Rank 1 of one that is streaming (it holds experts 4..7:
    every step needs it) is killed from outside: its worker goes down with every rank, its streams resume on
    the other decode worker token-exact, a replacement joins, no KV block is left used."""
    greedy, expected = reference(moe, 48)
    batch = prompts()
    cluster = start(aloop, moe, prefill_ep=1, decode_ep=2, decode_workers=2)
    victim = cluster.pools["decode"][0]
    pids = rank_pids(aloop, victim)
    got: list[list[int]] = [[] for _ in batch]
    lost: list[float] = []
    ended: list[float] = []
    restarts = cluster.restarts["decode"]
    run = lambda: streams_through_a_fault(  # noqa: E731
        cluster, batch, greedy, got, victim, lambda: os.kill(pids[1], signal.SIGKILL), lost, ended, bound_s=120)

    try:
        assert aloop.run(run(), timeout=300) == [None] * len(batch)
        assert got == expected
        print(f"SIGKILL of expert rank 1: worker lost after {lost[0]:.2f} s, every stream ended after {ended[0]:.2f} s")
        assert lost[0] < TIMEOUT_S  # seen by the rank's end, not by a collective's timeout
        assert_worker_replaced(aloop, cluster, victim, pids, restarts)
    finally:
        aloop.run(cluster.shutdown())
