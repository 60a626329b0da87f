"""The OpenAI-compatible HTTP API, driven by the official `openai` SDK (and plain httpx where the SDK
hides what is checked), against a real router over a real local cluster serving SmolLM2, beside gRPC."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pdserve.client import Client
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from router.cluster import Cluster
from router.server import Router, RouterConfig

from conftest import wait_for

pytestmark = pytest.mark.slow
KEY = "test-key"
MODEL = "smollm2"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def cluster(ray_local, aloop):
    from pdserve.model.loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    engine = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=512),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64))
    c = Cluster(ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.25), decode=PoolConfig(1, num_cpus=0.25)))
    aloop.run(c.start(), timeout=600)
    yield c
    aloop.run(c.shutdown())


def start(aloop, cluster, **kw) -> Router:
    r = Router(cluster, RouterConfig(port=0, http_port=0, served_model_name=MODEL, metrics_port=0, **kw))
    aloop.run(r.start())
    return r


@pytest.fixture(scope="module")
def router(aloop, cluster):
    r = start(aloop, cluster, api_key=KEY)
    yield r
    aloop.run(r.stop(grace=5))


@pytest.fixture(scope="module")
def sdk(router):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(router):
    with Client(f"127.0.0.1:{router.port}", api_key=KEY) as c:
        yield c


def used_blocks(aloop, cluster) -> int:
    return sum(s.kv_blocks_used for s in aloop.run(cluster.stats()))


def test_models_lists_the_model(sdk):
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=77)],
                         ids=["greedy", "seeded"])
def test_streamed_chat_equals_grpc(sdk, grpc_client, sampling):
    ref = grpc_client.complete(messages=CHAT, max_tokens=24, timeout=120, **sampling)
    stream = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, stream=True,
                                         stream_options={"include_usage": True}, **sampling)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == ref.text
    assert finish == [ref.finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage  # include_usage: a last chunk with no choices carries it
    assert chunks[-1].choices == [] and usage.completion_tokens == len(ref.token_ids)
    assert usage.prompt_tokens == ref.usage["prompt_tokens"]


def test_completion_reports_usage_and_equals_grpc(sdk, grpc_client):
    ref = grpc_client.complete("The capital of France is", max_tokens=12, temperature=0.0, ignore_eos=True,
                               timeout=120)
    r = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0.0,
                               extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (ref.usage["prompt_tokens"], 12, ref.usage["prompt_tokens"] + 12)
    # A long prompt asked twice: the second time its full blocks come from the prefix cache, and usage says so.
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    first, again = (sdk.completions.create(model=MODEL, prompt=long, max_tokens=2) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    # Token ids as the prompt, and a non-streamed chat.
    ids = sdk.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=3, temperature=0.0,
                                 extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 3
    chat = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0.0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 8


@pytest.mark.parametrize("kwargs, param", [
    (dict(n=2), "n"),
    (dict(temperature=-1.0), None),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    (dict(logprobs=True), "logprobs"),
    (dict(max_tokens=0), None),
    (dict(max_tokens=10**6), None),
    (dict(messages=[]), None),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.0.content"),
])
def test_bad_input_is_400(sdk, kwargs, param):
    args = dict(model=MODEL, messages=CHAT, max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(**args)
    assert e.value.status_code == 400 and e.value.body["message"]
    if param:
        assert e.value.body["param"] == param


def test_unknown_model_is_404_and_wrong_key_is_401(router, sdk):
    with pytest.raises(openai.NotFoundError) as e:
        sdk.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"http://127.0.0.1:{router.http_port}/health").status_code == 200  # needs no key


def test_admission_full_is_429(aloop, cluster):
    r = start(aloop, cluster, max_running=1, max_queued=0)
    try:
        base = f"http://127.0.0.1:{r.http_port}/v1"
        sdk = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        stream = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, stream=True,
                                             extra_body={"ignore_eos": True})
        next(iter(stream))  # it holds the only slot
        with pytest.raises(openai.RateLimitError) as e:
            sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        assert e.value.status_code == 429
        stream.close()
    finally:
        aloop.run(r.stop(grace=5))
        wait_for(lambda: used_blocks(aloop, cluster) == 0, 30, what="zero used KV blocks")


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
def test_client_disconnect_cancels_and_frees_kv(aloop, cluster, router, streamed):
    url = f"http://127.0.0.1:{router.http_port}/v1/completions"
    body = dict(model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0.0, ignore_eos=True,
                stream=streamed)
    headers = {"Authorization": f"Bearer {KEY}"}

    async def go():
        async with httpx.AsyncClient(timeout=120) as client:
            if streamed:
                async with client.stream("POST", url, json=body, headers=headers) as resp:
                    assert resp.status_code == 200
                    seen = 0
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                            seen += 1
                        if seen >= 3:
                            break  # leaving the block closes the connection mid-stream
            else:
                task = asyncio.create_task(client.post(url, json=body, headers=headers))
                await asyncio.sleep(0)
                wait = asyncio.get_running_loop().time() + 60
                while router.service.admission.running == 0 and asyncio.get_running_loop().time() < wait:
                    await asyncio.sleep(0.02)
                assert router.service.admission.running == 1
                task.cancel()  # the client gives up before the answer: the connection closes
                with pytest.raises(asyncio.CancelledError):
                    await task

    asyncio.run(go())
    # The router noticed, cancelled it on both workers, and freed the KV long before 400 tokens were done.
    wait_for(lambda: router.service.admission.running == 0, 10, what="the request to leave admission")
    wait_for(lambda: used_blocks(aloop, cluster) == 0, 30, what="zero used KV blocks")


def test_metrics_are_labelled_by_protocol(router, sdk, grpc_client):
    sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    grpc_client.complete("Hi", max_tokens=2, timeout=60)
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=3)
    text = httpx.get(f"http://127.0.0.1:{router.metrics_port}/metrics").text
    samples = {line.split(" ")[0] for line in text.splitlines() if line.startswith("pdserve_requests_total{")}
    assert any('protocol="http"' in s and 'code="OK"' in s for s in samples), samples
    assert any('protocol="grpc"' in s and 'code="OK"' in s for s in samples), samples
    assert any('protocol="http"' in s and 'code="INVALID_ARGUMENT"' in s for s in samples), samples


def test_drain_lets_http_streams_finish(aloop, cluster):
    r = start(aloop, cluster)
    url = f"http://127.0.0.1:{r.http_port}/v1/completions"
    body = dict(model=MODEL, prompt="Tell me a story", max_tokens=30, temperature=0.0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})

    async def run():
        async with httpx.AsyncClient(timeout=120) as h:
            async with h.stream("POST", url, json=body) as resp:
                lines = resp.aiter_lines()
                events = []
                async for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                        break  # streaming: now shut the router down under it
                stop = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(r.stop(grace=60), aloop.loop))
                async for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
            await stop
            return events

    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 30  # the whole answer, not cut by the drain
    assert not r.service.serving
