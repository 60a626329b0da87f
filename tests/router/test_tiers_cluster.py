"""Service tiers on a real local Ray cluster behind the real gRPC router and HTTP API: the field end to
end (400 / INVALID_ARGUMENT for a bad tier, the tier served echoed), the fast lane, a downgrade when it is
full, flex refused at once past its queue bound, flex preempted on a full decode worker by default work
and resumed token-exact, the same tokens whatever the tier, and zero used KV blocks after."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdserve.client import AsyncClient, Client
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.tiers import ServiceTier, TiersConfig
from router.cluster import Cluster
from router.compose import build_router
from router.config import RouterConfig

from conftest import wait_for

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(ray_local, aloop, tiny_checkpoints):
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=4, num_blocks=256))
    pool = dict(num_cpus=0.25, cache=engine.cache)
    config = ClusterConfig(
        engine=engine,
        prefill=PoolConfig(1, scheduler=SchedulerConfig(max_num_batched_tokens=256), **pool),
        decode=PoolConfig(1, scheduler=SchedulerConfig(max_num_seqs=2), **pool),
        fast=PoolConfig(1, **pool),
        tiers=TiersConfig(fast_lane_max_running=1, fast_lane_when_full="downgrade", flex_max_queued=2,
                          flex_min_share=0.5))
    cluster = Cluster(config)
    aloop.run(cluster.start(), timeout=600)
    router = build_router(cluster, RouterConfig(port=0, http_port=0))
    aloop.run(router.start())
    yield cluster, router, LLMEngine(engine)
    aloop.run(router.stop(grace=5))
    aloop.run(cluster.shutdown())


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 300 + 1 for j in range(12 + i)]


def model_name(cluster) -> str:
    return Path(cluster.info.path).name


def used_blocks(cluster, aloop) -> int:
    return sum(s.kv_blocks_used for s in aloop.run(cluster.stats()))


def http(port: int, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_tier_is_invalid_argument_and_400(served):
    cluster, router, _ = served
    with Client(f"127.0.0.1:{router.port}") as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=prompt(0), max_tokens=2, service_tier="gold", timeout=30)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "unknown service_tier 'gold'" in e.value.details()
    status, body = http(router.http_port, {"model": model_name(cluster), "prompt": prompt(0), "max_tokens": 2,
                                           "service_tier": "gold"})
    assert (status, body["error"]["param"]) == (400, "service_tier"), body


def test_same_tokens_whatever_the_tier_and_the_tier_served(served):
    """Sampled (temperature 1) with one seed: the same tokens on every tier; priority runs on the fast
    lane, the others on the decode pool; the HTTP API reports the tier served too."""
    cluster, router, offline = served
    ref = offline.generate([prompt(1)], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11,
                                                       ignore_eos=True))[0].token_ids
    with Client(f"127.0.0.1:{router.port}") as c:
        for tier, served_as, worker in (("priority", "priority", "fast-0"), ("default", "default", "decode-0"),
                                        ("auto", "default", "decode-0"), ("flex", "flex", "decode-0")):
            out = c.complete(token_ids=prompt(1), max_tokens=MAX_TOKENS, temperature=1.0, seed=11, ignore_eos=True,
                             service_tier=tier, timeout=60)
            assert out.token_ids == ref, tier
            assert (out.service_tier, out.timings["decode_worker"]) == (served_as, worker), tier
    status, body = http(router.http_port, {"model": model_name(cluster), "prompt": prompt(1), "max_tokens": MAX_TOKENS,
                                           "temperature": 1.0, "seed": 11, "ignore_eos": True,
                                           "service_tier": "priority"})
    assert status == 200 and body["service_tier"] == "priority"


def test_full_fast_lane_downgrades_and_says_so(served, aloop):
    """The lane runs one request; a second priority request that arrives meanwhile is served as default
    (fast_lane_when_full=downgrade) on the decode pool, token-exact."""
    cluster, router, offline = served
    ref = [c.token_ids for c in offline.generate([prompt(2), prompt(3)],
                                                 SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))]

    async def run():
        async with AsyncClient(f"127.0.0.1:{router.port}") as c:
            first_token = asyncio.Event()
            outs = {}

            async def one(i, p, event=None):
                tokens, last = [], None
                async for r in c.generate(token_ids=p, max_tokens=64, temperature=0.0, ignore_eos=True,
                                          service_tier="priority", timeout=120):
                    tokens += r.token_ids
                    last = r
                    if event is not None:
                        event.set()
                outs[i] = (tokens, last.service_tier, last.timings.decode_worker)

            a = asyncio.create_task(one(0, prompt(2), first_token))
            await first_token.wait()
            await one(1, prompt(3))
            await a
            return outs

    before = cluster.downgrades
    outs = aloop.run(run())
    assert outs[0] == (ref[0], "priority", "fast-0")
    assert outs[1] == (ref[1], "default", "decode-0")
    assert cluster.downgrades == before + 1


def test_flex_refused_past_its_bound_preempted_for_default_and_resumed_exact(served, aloop):
    """Decode has two slots, flex's floor one of them, flex's queue bound two. Six flex requests at once:
    two run, two wait in line, two are refused at once with RESOURCE_EXHAUSTED. A default request then
    takes a slot from the newer running flex request (kept KV); every admitted request ends token-exact
    and nothing is left in any KV cache. The default request is sent once both slots hold flex requests
    that decode (each has a token from the decode worker): sent earlier, its reservation could reach the
    decode worker beside theirs and be admitted first by tier, with nothing to preempt."""
    cluster, router, offline = served
    # Flex requests long enough (160 tokens) that neither running one ends before the default one is placed.
    lengths = {"flex": 160, "default": 48}
    batch = [prompt(10 + i) for i in range(6)]
    ref = [offline.generate([p], SamplingParams(max_tokens=lengths[tier], temperature=0.0, ignore_eos=True))[0]
           .token_ids for p, tier in [*((p, "flex") for p in batch), (prompt(20), "default")]]
    progress = [0] * len(batch)

    async def run():
        async with AsyncClient(f"127.0.0.1:{router.port}") as c:
            async def one(p, tier, i=None):
                tokens = []
                try:
                    async for r in c.generate(token_ids=p, max_tokens=lengths[tier], temperature=0.0,
                                              ignore_eos=True, service_tier=tier, timeout=180):
                        tokens += r.token_ids
                        if i is not None:
                            progress[i] = len(tokens)
                except grpc.aio.AioRpcError as e:
                    return tokens, e.code()
                return tokens, grpc.StatusCode.OK

            flex = [asyncio.create_task(one(p, "flex", i)) for i, p in enumerate(batch)]
            deadline = time.monotonic() + 60
            # Two in line, and two decoding on the decode worker (a second token: the decode worker's).
            while router.front.queued(ServiceTier.FLEX) < 2 or sum(n >= 2 for n in progress) < 2:
                assert time.monotonic() < deadline, "flex requests never filled the decode slots and the line"
                await asyncio.sleep(0.005)
            default = await one(prompt(20), "default")
            return [await f for f in flex], default

    flex, default = aloop.run(run())
    codes = [code for _, code in flex]
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2 and codes.count(grpc.StatusCode.OK) == 4
    for (tokens, code), r in zip(flex, ref):
        assert tokens == (r if code is grpc.StatusCode.OK else [])
    assert default == (ref[6], grpc.StatusCode.OK)
    stats = aloop.run(cluster.stats())
    decode = next(s for s in stats if s.pool == "decode")
    assert decode.tier_preemptions.get("flex/kept", 0) >= 1
    assert decode.tier_seconds["flex"] > 0 and decode.tier_seconds["default"] > 0
    wait_for(lambda: used_blocks(cluster, aloop) == 0, 30, what="zero used KV blocks")
