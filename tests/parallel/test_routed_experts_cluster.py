"""Routed experts (pdserve.engine.routed_experts) through a real 1P1D cluster on the tiny seeded Qwen3-MoE (a
dense first layer) and Mixtral checkpoints: every position's expert ids, the prompt's (computed on the prefill
worker, sent with the first token) and the generated tokens' (the decode worker's), equal transformers' router
top-k (output_router_logits) for the same tokens; streamed over gRPC (the first message carries the prompt's
entries, each later one its tokens' predecessors'), whole over the OpenAI door and SGLang's /generate; with
expert parallelism 2 on both pools; and after the decode worker streaming them is killed (SIGKILL) mid-stream,
exact through the resume (the router keeps what it sent, the resumed prefill's recomputed positions are
dropped, none is repeated or missing); from a colocated worker too; refused on a dense model and with n > 1."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import signal

import httpx
import numpy as np
import pytest
import torch
import transformers

from pdserve.client import AsyncClient
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine.routed_experts import join
from pdserve.engine.sampling import SamplingParams
from router.cluster import Cluster
from router.compose import build_router
from router.config import RouterConfig

from conftest import wait_for
from moe_models import TOP_K, assert_routed_like_hf, build
from served import prompts
from test_tp_cluster import rank_pids, used_blocks

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("r3-cluster")
    return {kind: build(root / kind, kind, packed=False) for kind in ("qwen3_moe-mixed", "mixtral")}


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def start(aloop, path, prefill_ep: int = 1, decode_ep: int = 1, decode_workers: int = 1,
          colocated: bool = False) -> Cluster:
    engine = EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
                          tensor_parallel_timeout_s=TIMEOUT_S)
    pool = lambda n, ep: PoolConfig(n, num_cpus=0.1, expert_parallel_size=ep, torch_threads=1)  # noqa: E731
    pools = dict(mode="colocated", colocated=pool(1, 1)) if colocated else \
        dict(prefill=pool(1, prefill_ep), decode=pool(decode_workers, decode_ep))
    cluster = Cluster(ClusterConfig(engine=engine, transfer_timeout_s=TIMEOUT_S, stats_interval_s=0.5,
                                    worker_timeout_s=30.0, **pools))
    aloop.run(cluster.start(), timeout=600)
    return cluster


def batch_of(n: int = 4) -> list[list[int]]:
    return prompts(n, seed=52)


async def grpc_streams(target: str, batch, max_tokens: int):
    """Each prompt streamed greedily with routed experts: (its tokens, its entries, each message's (start,
    entries, tokens))."""
    async def one(c, prompt):
        tokens, entries, messages = [], [], []
        async for r in c.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                  return_routed_experts=True, timeout=300):
            e = r.routed_experts
            n = len(e.expert_ids) // (e.num_layers * e.top_k) if r.HasField("routed_experts") else 0
            messages.append((e.start if n else None, n, len(r.token_ids)))
            if n:
                assert e.start == len(entries), "a position sent twice or skipped"
                assert e.top_k == TOP_K
                entries += np.asarray(e.expert_ids).reshape(n, e.num_layers, e.top_k).tolist()
            tokens += r.token_ids
        return tokens, entries, messages

    async with AsyncClient(target) as c:
        return await asyncio.gather(*(one(c, p) for p in batch))


@pytest.mark.parametrize("kind", ["qwen3_moe-mixed", "mixtral"])
def test_1p1d_streamed_and_whole_equal_transformers(ray_local, aloop, checkpoints, kind):
    hf = hf_model(checkpoints[kind])
    cluster = start(aloop, checkpoints[kind])
    router = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name="moe"))
    aloop.run(router.start())
    batch, new = batch_of(), 10
    try:
        streamed = aloop.run(grpc_streams(f"127.0.0.1:{router.port}", batch, new), timeout=300)
        for prompt, (tokens, entries, messages) in zip(batch, streamed):
            assert len(tokens) == new
            assert_routed_like_hf(hf, prompt + tokens, entries)
            # The prompt's entries come with the first token; then each token brings its predecessor's.
            assert messages[0] == (0, len(prompt), 1)
            assert sum(n for _, n, _ in messages) == len(prompt) + new - 1
        with httpx.Client(base_url=f"http://127.0.0.1:{router.http_port}", timeout=120) as http:
            body = {"model": "moe", "prompt": batch[0], "max_tokens": new, "temperature": 0, "ignore_eos": True,
                    "return_routed_experts": True}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["routed_experts"]
            ids = np.frombuffer(base64.b64decode(got["expert_ids"]), dtype="<i4").reshape(-1, got["num_layers"],
                                                                                           got["top_k"])
            assert got["start"] == 0 and ids.tolist() == streamed[0][1]
            # Streamed: each chunk's new positions, consecutive, the first chunk's the prompt's.
            entries = []
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    part = json.loads(line[6:])["choices"][0].get("routed_experts")
                    if part is not None:
                        assert part["start"] == len(entries)
                        ids = np.frombuffer(base64.b64decode(part["expert_ids"]), dtype="<i4")
                        entries += ids.reshape(-1, part["num_layers"], part["top_k"]).tolist()
            assert entries == streamed[0][1]
            r = http.post("/generate", json={"input_ids": batch[1], "return_routed_experts": True,
                                             "sampling_params": {"max_new_tokens": new, "temperature": 0,
                                                                 "ignore_eos": True}})
            assert r.status_code == 200, r.text
            ids = np.frombuffer(base64.b64decode(r.json()["meta_info"]["routed_experts"]), dtype="<i4")
            assert ids.reshape(len(batch[1]) + new - 1, -1, TOP_K).tolist() == streamed[1][1]
        wait_for(lambda: used_blocks(aloop, cluster) == 0, timeout=30, what="zero used KV blocks")
    finally:
        aloop.run(router.stop(grace=5))
        aloop.run(cluster.shutdown())


@pytest.mark.parametrize("kind", ["qwen3_moe-mixed", "mixtral"])
def test_expert_parallel_pools_and_a_decode_worker_killed_mid_stream(ray_local, aloop, checkpoints, kind):
    """Prefill and decode workers of expert-parallel size 2, two decode workers; once every stream is under way,
    with some on it, one decode worker is killed (its rank 0, SIGKILL): its streams resume elsewhere and every
    request's routed experts, streamed across the fault, equal transformers' for its tokens."""
    hf = hf_model(checkpoints[kind])
    cluster = start(aloop, checkpoints[kind], prefill_ep=2, decode_ep=2, decode_workers=2)
    batch, new = batch_of(6), 40
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    victim = cluster.pools["decode"][0]
    pids = rank_pids(aloop, victim)
    got = [([], []) for _ in batch]

    async def stream(i: int) -> str | None:
        async for out in cluster.generate(batch[i], params):
            got[i][0].extend(out.new_token_ids)
            if out.routed_experts is not None:
                got[i][1].append(out.routed_experts)
            if out.error is not None:
                return out.error
        return None

    async def run():
        tasks = [asyncio.create_task(stream(i)) for i in range(len(batch))]
        deadline = asyncio.get_running_loop().time() + 120
        while not (victim.requests and all(len(t) >= 4 for t, _ in got)):
            assert asyncio.get_running_loop().time() < deadline, "the streams never got going"
            await asyncio.sleep(0.01)
        on_victim = len(victim.requests)
        os.kill(pids[0], signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 180), on_victim

    try:
        errors, on_victim = aloop.run(run(), timeout=300)
        assert errors == [None] * len(batch)
        assert on_victim, "no stream was on the killed worker"
        for prompt, (tokens, parts) in zip(batch, got):
            assert len(tokens) == new
            routed = join(parts)  # asserts the parts are consecutive: no position repeated or skipped
            assert routed.start == 0
            assert_routed_like_hf(hf, prompt + tokens, routed.ids)
        stats = aloop.run(cluster.stats())
        assert any(s.pool == "decode" and s.pid != pids[0] for s in stats)
        wait_for(lambda: used_blocks(aloop, cluster) == 0, timeout=60, what="zero used KV blocks")
    finally:
        aloop.run(cluster.shutdown())


def test_a_colocated_worker_streams_them_too(ray_local, aloop, checkpoints):
    """One worker computes the prompt and the tokens: its first event carries the prompt's entries."""
    hf = hf_model(checkpoints["mixtral"])
    cluster = start(aloop, checkpoints["mixtral"], colocated=True)
    router = build_router(cluster, RouterConfig(port=0))
    aloop.run(router.start())
    batch, new = batch_of(3), 8
    try:
        for prompt, (tokens, entries, messages) in zip(batch, aloop.run(
                grpc_streams(f"127.0.0.1:{router.port}", batch, new), timeout=300)):
            # The prompt's entries come with the first token. One worker makes the first tokens in successive
            # steps: a client that lags (a loaded machine) gets the first two in one message, which then carries the
            # first token's entries too: each token but a message's last brings its own.
            first = messages[0][2]
            assert len(tokens) == new and messages[0] == (0, len(prompt) + first - 1, first), messages[:2]
            assert sum(n for _, n, _ in messages) == len(prompt) + new - 1
            assert_routed_like_hf(hf, prompt + tokens, entries)
    finally:
        aloop.run(router.stop(grace=5))
        aloop.run(cluster.shutdown())


def test_refused_on_a_dense_model_naming_the_field(tiny_checkpoints):
    """Before any work: the router's check of every door (gRPC INVALID_ARGUMENT, HTTP 400 with its param)."""
    from pdserve.model.loader import load_info
    from router.admission import Ask, prepare
    from router.chat_tools import FieldError

    info = load_info(EngineConfig(model=str(tiny_checkpoints["llama"])))
    with pytest.raises(FieldError, match="mixture-of-experts") as e:
        prepare(info, 1 << 20, Ask(token_ids=[1, 2, 3], sampling=dict(return_routed_experts=True)))
    assert e.value.param == "return_routed_experts"


def test_refused_with_n_over_1_at_the_doors(ray_local, aloop, checkpoints):
    import grpc

    cluster = start(aloop, checkpoints["mixtral"])
    router = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name="moe"))
    aloop.run(router.start())

    async def grpc_n2():
        async with AsyncClient(f"127.0.0.1:{router.port}") as c:
            async for _ in c.generate(token_ids=[1, 2, 3], max_tokens=2, n=2, return_routed_experts=True):
                pass

    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            aloop.run(grpc_n2())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "return_routed_experts" in e.value.details()
        with httpx.Client(base_url=f"http://127.0.0.1:{router.http_port}", timeout=60) as http:
            r = http.post("/v1/completions", json={"model": "moe", "prompt": [1, 2, 3], "max_tokens": 2, "n": 2,
                                                   "return_routed_experts": True})
            assert r.status_code == 400 and "return_routed_experts" in r.json()["error"]["message"]
            r = http.post("/generate", json={"input_ids": [1, 2, 3], "return_routed_experts": True,
                                             "sampling_params": {"max_new_tokens": 2, "n": 2}})
            assert r.status_code == 400 and "return_routed_experts" in r.text
            # The server stays up: the same request of one sample is served.
            r = http.post("/generate", json={"input_ids": [1, 2, 3], "return_routed_experts": True,
                                             "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200 and r.json()["meta_info"]["routed_experts"]
    finally:
        aloop.run(router.stop(grace=5))
        aloop.run(cluster.shutdown())
