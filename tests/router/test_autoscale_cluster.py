"""Autoscaled pools on a real local Ray cluster behind the real gRPC router: a pool grows under load,
its new workers take requests, a drained worker finishes what it has and leaves, nothing is dropped or
retried because of scaling, and `pdserve status --json` and /metrics say so.

The cost model here is a profile written by the test (the policy's arithmetic on it is
tests/planner/test_autoscale.py's subject): it makes one decode worker hold two requests within the TPOT
target and a prompt slower than the TTFT target, so eight streams call for both pools' maximum.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import time
import urllib.request

import grpc
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import AsyncClient
from pdserve.config import AutoscaleConfig, CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.perf.costs import MeasuredCosts, Transport
from pdserve.model.loader import load_info
from router.config import RouterConfig

from conftest import wait_for
from served import Served, Streams, assert_exact, prompts


def write_profile(path, engine: EngineConfig) -> str:
    info = load_info(engine)
    costs = MeasuredCosts({"overhead_s": 0.0, "per_token_s": 0.05, "per_pair_s": 0.0, "per_seq_s": 0.0},
                          (1, 64), (0.01, 0.01 + 63 * 0.02), 0.0, Transport(0.001, 1e9),
                          kv_bytes_per_token=1024, weight_bytes=10**6)
    m = info.config
    path.write_text(json.dumps({
        "version": 1, "kv_cache_bytes": 1 << 20, "block_size": 4, "costs": costs.to_dict(),
        "model": {"name": "tiny", "vocab_size": m.vocab_size, "eos_token_ids": list(info.eos_token_ids),
                  "max_model_len": info.max_model_len, "num_params": m.num_params}}))
    return str(path)


def autoscaled_config(model, tmp_path, **autoscale) -> ClusterConfig:
    cache = CacheConfig(block_size=4, num_blocks=1024)
    scheduler = SchedulerConfig(max_num_batched_tokens=64)
    engine = EngineConfig(model=str(model), cache=cache, scheduler=scheduler)
    pool = PoolConfig(1, max_workers=2, num_cpus=0.25, cache=cache, scheduler=scheduler)
    opts = dict(profile=write_profile(tmp_path / "profile.json", engine), tpot_target_s=0.035, ttft_target_s=1.0,
                interval_s=0.25, window_s=2.0, scale_down_delay_s=2.0)
    opts.update(autoscale)
    return ClusterConfig(engine=engine, prefill=pool, decode=pool, stats_interval_s=0.5,
                         autoscale=AutoscaleConfig(**opts))


class Load:
    """A closed loop of `n` greedy streams at once through the router until stopped; every outcome kept."""

    def __init__(self, served: Served, n: int, max_tokens: int):
        self.served, self.max_tokens = served, max_tokens
        self.outcomes: list[tuple[grpc.StatusCode, str, str]] = []  # (code, details, decode worker)
        self.stopping = False
        self.future = asyncio.run_coroutine_threadsafe(self._run(n), served.aloop.loop)

    async def _run(self, n: int) -> None:
        async with AsyncClient(self.served.target) as c:
            await asyncio.gather(*(self._loop(c, k) for k in range(n)))

    async def _loop(self, c: AsyncClient, k: int) -> None:
        batch = prompts(200, seed=k)
        for i in range(200):
            if self.stopping:
                return
            decode = ""
            try:
                async for r in c.generate(token_ids=batch[i], max_tokens=self.max_tokens, temperature=0.0,
                                          ignore_eos=True, timeout=120):
                    decode = r.timings.decode_worker or decode
            except grpc.aio.AioRpcError as e:
                self.outcomes.append((e.code(), e.details(), decode))
                continue
            self.outcomes.append((grpc.StatusCode.OK, "", decode))

    def stop(self) -> None:
        self.stopping = True
        self.future.result(120)


def status_json(target: str) -> dict:
    from pdserve.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", "--json", "--target", target]) == 0
    return json.loads(out.getvalue())


def test_pools_grow_under_load_and_drain_back(ray_local, aloop, tiny_checkpoints, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="router")
    config = autoscaled_config(tiny_checkpoints["llama"], tmp_path)
    s = Served(aloop, config, RouterConfig(port=0, metrics_port=0))
    pools = s.cluster.scaling
    first = {p: pools.by_name[p][0].worker_id for p in ("prefill", "decode")}
    try:
        st = status_json(s.target)
        assert [(p["name"], p["current_workers"], p["min_workers"], p["max_workers"]) for p in st["pools"]] == \
            [("prefill", 1, 1, 2), ("decode", 1, 1, 2)]
        load = Load(s, 8, 48)
        try:
            # Eight streams at once: both pools grow to their maximum.
            wait_for(lambda: all(len(pools.by_name[p]) == 2 for p in ("prefill", "decode")), 120,
                     what="both pools to have two ready workers")
            st = status_json(s.target)
            for p in st["pools"]:
                assert (p["current_workers"], p["desired_workers"]) == (2, 2), p
                assert [w["state"] for w in p["workers"]] == ["ready", "ready"], p
            new_decode = next(w.worker_id for w in pools.by_name["decode"] if w.worker_id != first["decode"])
            # The new worker takes requests.
            wait_for(lambda: any(o[2] == new_decode for o in load.outcomes), 60,
                     what=f"a request served by {new_decode}")
        finally:
            load.stop()
        # No load: both pools drain back to one; the drained workers finish and leave.
        s.settle()
        # A drained worker stays listed as draining until its actor has shut down (its link closed, then killed).
        wait_for(lambda: not pools.draining and not any(pools.starting.values()), 30,
                 what="the drained workers to have left and nothing to be starting")
        outcomes = load.outcomes
        assert outcomes and all(code == grpc.StatusCode.OK for code, _, _ in outcomes), \
            [o for o in outcomes if o[0] != grpc.StatusCode.OK][:3]
        assert sum(s.cluster.retries.values()) == 0 and sum(s.cluster.restarts.values()) == 0
        assert pools.scale_events[("prefill", "up", "maximum")] + pools.scale_events[("prefill", "up", "rate")] \
            + pools.scale_events[("prefill", "up", "backlog")] >= 1
        assert sum(n for (p, d, _), n in pools.scale_events.items() if p == "decode" and d == "down") >= 1
        # Each drained worker leaves (its actor shut down) and says so: one per pool at least.
        wait_for(lambda: {p for p in ("prefill", "decode") for r in caplog.records
                          if "drained in" in r.getMessage() and f"left the {p} pool" in r.getMessage()}
                 == {"prefill", "decode"}, 30, what="a drained worker of each pool to have left")
        assert all(len(pools.start_seconds[p]) >= 2 for p in ("prefill", "decode"))
        # No task left behind by the workers that came and went: the heartbeat and one link watch per worker.
        wait_for(lambda: len(pools._tasks) == 1 + len(pools.workers), 30,
                 what="the pools' tasks of the workers that left to end")
        st = status_json(s.target)
        assert [(p["current_workers"], p["desired_workers"]) for p in st["pools"]] == [(1, 1), (1, 1)]
        # The metrics tell the same story.
        body = urllib.request.urlopen(f"http://127.0.0.1:{s.router.metrics_port}/metrics", timeout=10).read().decode()
        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for f in text_string_to_metric_families(body) for x in f.samples}
        assert samples[("pdserve_pool_workers", (("pool", "decode"), ("state", "ready")))] == 1
        assert samples[("pdserve_pool_workers", (("pool", "decode"), ("state", "draining")))] == 0
        assert samples[("pdserve_pool_desired_workers", (("pool", "decode"),))] == 1
        assert samples[("pdserve_pool_max_workers", (("pool", "prefill"),))] == 2
        downs = [v for (name, labels), v in samples.items() if name == "pdserve_scale_events_total"
                 and ("direction", "down") in labels and ("pool", "decode") in labels]
        assert sum(downs) == sum(n for (p, d, _), n in pools.scale_events.items() if p == "decode" and d == "down")
        assert samples[("pdserve_worker_start_seconds_count", (("pool", "decode"),))] >= 2
    finally:
        s.close()


def test_a_drained_worker_finishes_its_streams_token_exact(ray_local, aloop, tiny_checkpoints, tmp_path):
    """Drained mid-stream (caught inside a decode step): its streams end on it, token-exact, with no
    retry, and then it leaves and its peers drop their KV channels to it."""
    config = autoscaled_config(tiny_checkpoints["llama"], tmp_path)
    # Two decode workers from the start, the autoscaler idle (its interval beyond the test).
    config = ClusterConfig(engine=config.engine, prefill=config.prefill,
                           decode=PoolConfig(2, max_workers=3, num_cpus=0.25, cache=config.decode.cache,
                                             scheduler=config.decode.scheduler),
                           stats_interval_s=0.5, autoscale=AutoscaleConfig(profile=config.autoscale.profile,
                                                                           interval_s=3600))
    s = Served(aloop, config)
    try:
        pools = s.cluster.scaling
        batch = prompts(6, seed=3)
        reference = s.reference(batch, 40)
        victim = pools.by_name["decode"][0]
        ray.get(victim.handle.inject_fault.remote("step", 1.0, skip=3))
        streams = Streams(s, batch, 40)
        assert ray.get(victim.handle.fault_reached.remote("step", 60))
        on_victim = len(victim.requests)
        assert on_victim >= 1
        t = time.monotonic()
        aloop.run(_drain(pools, victim))
        assert victim.state == "draining" and victim not in pools.by_name["decode"]
        assert_exact(streams.result(60, t, "drain"), reference)
        wait_for(lambda: victim not in pools.draining, 60, what="the drained worker to leave")
        wait_for(lambda: all(st.kv_peers <= 1 for st in s.stats() if st.pool == "prefill"), 30,
                 what="the prefill worker to drop its channel to the drained one")
        assert sum(s.cluster.retries.values()) == 0 and sum(s.cluster.restarts.values()) == 0
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(victim.handle.stats.remote(), timeout=30)
        # The pool's last ready worker is never drained.
        aloop.run(_drain_some(pools, "decode", 5))
        assert len(pools.by_name["decode"]) == 1 and not pools.draining
    finally:
        s.close()


async def _drain(pools, worker) -> None:
    pools.drain_worker(worker, "test")


async def _drain_some(pools, pool: str, n: int) -> None:
    pools.drain(pool, n, "test")


def test_prompts_wait_at_the_router_until_a_prefill_worker_has_room(ray_local, aloop, tiny_checkpoints, tmp_path):
    """A prefill worker holds at most two token budgets of prompts (64 tokens a step here); the rest wait
    at the router, where a worker that joins later can take them. Caught with the worker stalled in its
    first step: four 40-token prompts on it (160 >= 128), four in line."""
    config = autoscaled_config(tiny_checkpoints["llama"], tmp_path)
    fixed = PoolConfig(1, num_cpus=0.25, cache=config.prefill.cache, scheduler=config.prefill.scheduler)
    s = Served(aloop, ClusterConfig(engine=config.engine, prefill=fixed, decode=fixed, stats_interval_s=0.5))
    try:
        batch = [[k + 1] * 40 for k in range(8)]
        reference = s.reference(batch, 8)
        prefill = s.worker("prefill")
        ray.get(prefill.handle.inject_fault.remote("step", 8.0))
        streams = Streams(s, batch, 8)
        assert ray.get(prefill.handle.fault_reached.remote("step", 60))
        wait_for(lambda: s.cluster.waiting_prompt_tokens == 4 * 40 and prefill.queued_tokens == 4 * 40, 5,
                 what="four prompts on the prefill worker and four in line at the router")
        assert s.cluster.load(time.monotonic()).prefill_backlog_tokens == 8 * 40  # the autoscaler sees both
        # Two more join the line, and their clients go away while they wait: they leave it, the rest go on.
        gone = asyncio.run_coroutine_threadsafe(_wait_then_cancel(s, [[7] * 40, [9] * 40]), aloop.loop)
        assert gone.result(30) == [grpc.StatusCode.CANCELLED] * 2
        wait_for(lambda: s.cluster.waiting_prompt_tokens == 4 * 40, 5, what="the cancelled prompts to leave the line")
        assert_exact(streams.result(60, time.monotonic(), "prefill room"), reference)
        assert s.cluster.waiting_prompt_tokens == 0
        s.settle()
    finally:
        s.close()


async def _wait_then_cancel(s: Served, batch) -> list[grpc.StatusCode]:
    """Send the prompts, cancel them once they are all in line at the router; their status codes."""
    from pdserve.client import build_request

    async with AsyncClient(s.target) as c:
        calls = [c.stub.Generate(build_request(token_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True), timeout=60)
                 for p in batch]
        reads = [asyncio.ensure_future(call.read()) for call in calls]  # start them
        deadline = asyncio.get_running_loop().time() + 5
        while s.cluster.waiting_prompt_tokens < 6 * 40:  # four in line before them, now six
            assert asyncio.get_running_loop().time() < deadline, "the two prompts never joined the line"
            await asyncio.sleep(0.01)
        for call in calls:
            call.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        return [await call.code() for call in calls]


def test_demand_is_measured_from_when_the_cluster_serves(tiny_checkpoints, aloop, monkeypatch):
    """The arrival rate the autoscaler sees is over the time since the cluster began serving, not since it was
    made: requests that come at once after a slow start are a burst, not a trickle diluted by the start-up.
    (The pools' start is replaced by a one-second wait: no workers are needed to read the rate.)"""
    from router.cluster import Cluster

    config = ClusterConfig(engine=EngineConfig(model=str(tiny_checkpoints["llama"])), prefill=PoolConfig(1),
                           decode=PoolConfig(1))
    cluster = Cluster(config)

    async def slow_start(info) -> None:
        await asyncio.sleep(1.0)

    monkeypatch.setattr(cluster._pools, "start", slow_start)
    aloop.run(cluster.start())
    now = time.monotonic()
    for _ in range(10):
        cluster.demand.arrived(now, 100, 10)
    rate, _, _ = cluster.demand.observe(now + 0.5)
    assert rate == pytest.approx(10 / 0.5, rel=0.1)  # over 0.5 s, not 1.5 s and more
