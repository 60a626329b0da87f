"""bench.cluster.rl_loop's loop, tiny, on a real 1P1D cluster: a reward per step, versions strictly increasing,
the staleness bounds held, and in sync mode the trainer's logprobs equal to pdserve's at the sampling weights."""
from __future__ import annotations

import pytest

from bench.cluster import rl_loop as rl


@pytest.mark.slow
def test_rl_loop_sync_and_async(ray_local, aloop, tmp_path):
    from router.cluster import Cluster
    from router.compose import build_router
    from router.config import RouterConfig

    s = rl.Settings(steps=3, prompts=2, n=2, max_tokens=4)
    model = rl.build_policy(tmp_path, s.seed)
    cluster = Cluster(rl.cluster_config(tmp_path))
    aloop.run(cluster.start(), timeout=600)
    router = build_router(cluster, RouterConfig(port=0))
    try:
        port = aloop.run(router.start())
        results = rl.run(f"127.0.0.1:{port}", model, s, ["sync", "async-1"])
    finally:
        aloop.run(router.stop(grace=5))
        aloop.run(cluster.shutdown())
    assert list(results) == ["sync", "async-1"]
    versions = [v for r in results.values() for v in r["versions"]]
    assert all(a < b for a, b in zip(versions, versions[1:])), versions
    for r in results.values():
        assert len(r["rewards"]) == s.steps and all(0 <= x <= 1 for x in r["rewards"])
        assert len(r["versions"]) == s.steps + 1  # the initial weights again, then one a step
        assert r["output_tokens"] == s.steps * s.prompts * s.n * s.max_tokens
        assert 0 <= r["staleness_max"] <= r["staleness_bound"]
        assert 0 <= r["cluster_idle"] <= 1 and 0 <= r["trainer_idle"] <= 1
    sync = results["sync"]
    assert sync["staleness_counts"] == {0: sync["output_tokens"]}
    assert sync["on_version_tokens"] == sync["output_tokens"] and sync["logprob_gap"] < 1e-3
