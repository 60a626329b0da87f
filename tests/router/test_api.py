"""The public API: real gRPC over loopback to a real router over a real local Ray cluster (SmolLM2)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.client import AsyncClient, Client, build_request
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from router.compose import build_router
from router.config import RouterConfig
from router.grpc_api import SERVICE_NAME
from router.server import Router

from conftest import smol_1p1d_engine_config, wait_for
from served import CANCEL_WITHIN_STEPS_SMOL, CancelWatch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def offline():
    return LLMEngine(smol_1p1d_engine_config())


@pytest.fixture(scope="module")
def cluster(smol_1p1d):
    """SmolLM2 on one prefill and one decode worker: the cluster this module shares with the other API modules
    (conftest.smol_1p1d)."""
    return smol_1p1d


def start_router(aloop, cluster, **kw) -> Router:
    r = build_router(cluster, RouterConfig(port=0, **kw))
    aloop.run(r.start())
    return r


@pytest.fixture(scope="module")
def router(aloop, cluster):
    r = start_router(aloop, cluster)
    yield r
    aloop.run(r.stop(grace=5))


@pytest.fixture(scope="module")
def client(router):
    with Client(f"127.0.0.1:{router.port}") as c:
        yield c


def used_blocks(client) -> int:
    return sum(w.kv_blocks_used for p in client.cluster_status(timeout=10).pools for w in p.workers)


def chat(text):
    return [{"role": "user", "content": text}]


# -- equality with the offline engine ---------------------------------------------------------------
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=77)],
                         ids=["greedy", "seeded"])
def test_stream_equals_offline_engine(client, offline, sampling):
    tok = offline.tokenizer
    cases = [dict(messages=chat("Name three colours.")), dict(prompt="The quick brown fox"),
             dict(token_ids=tok.encode("Counting: one, two, three,"))]
    for case in cases:
        prompt = (tok.apply_chat_template(case["messages"]) if "messages" in case else
                  tok.encode(case["prompt"]) if "prompt" in case else case["token_ids"])
        ref = offline.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, **sampling))[0]
        chunks = list(client.generate(max_tokens=20, ignore_eos=True, **sampling, **case))
        got_ids = [t for r in chunks for t in r.token_ids]
        assert got_ids == ref.token_ids
        assert "".join(r.text for r in chunks) == ref.text
        last = chunks[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 20)
        assert 0 < last.timings.time_to_first_token_seconds <= last.timings.end_to_end_seconds
        assert (last.timings.prefill_worker, last.timings.decode_worker) == ("prefill-0", "decode-0")
        assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in chunks[:-1])
        assert len(chunks) > 1  # streamed, not one message at the end


def test_stop_string_and_request_id(client, offline):
    ref = offline.generate([offline.tokenizer.apply_chat_template(chat("What is the capital of France?"))],
                           SamplingParams(max_tokens=30, temperature=0.0, stop=("Paris",)))[0]
    out = client.complete(messages=chat("What is the capital of France?"), max_tokens=30, temperature=0.0,
                          stop=["Paris"], request_id="my-id-1")
    assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, "stop")
    assert out.request_id == "my-id-1" and "Paris" not in out.text
    wait_for(lambda: used_blocks(client) == 0, what="blocks freed after a stop string")


def test_64_concurrent_streams(router, offline):
    prompts = [f"Write a number: {i}" for i in range(64)]
    refs = offline.generate([offline.tokenizer.encode(p) for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))

    async def run():
        async with AsyncClient(f"127.0.0.1:{router.port}") as c:
            return await asyncio.gather(*(c.complete(p, max_tokens=8, temperature=0.0, ignore_eos=True, timeout=300)
                                          for p in prompts))

    outs = asyncio.run(run())
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert all(o.finish_reason == "length" for o in outs)


# -- admission, cancel, deadline, drain -------------------------------------------------------------
def test_queue_bound_answers_resource_exhausted_at_once(aloop, cluster):
    # One connection's streams past max_running + max_queued would wait client-side (the default bound on a
    # connection's streams): here all five reach admission at once.
    small = start_router(aloop, cluster, max_running=1, max_queued=1, max_streams_per_connection=8)
    try:
        async def run():
            async with AsyncClient(f"127.0.0.1:{small.port}") as c:
                async def one():
                    try:
                        return await c.complete("Tell me a long story", max_tokens=40, ignore_eos=True, timeout=120)
                    except grpc.aio.AioRpcError as e:
                        return e
                return await asyncio.gather(*(one() for _ in range(5)))

        outs = asyncio.run(run())
        refused = [o for o in outs if isinstance(o, grpc.aio.AioRpcError)]
        assert len(refused) == 3 and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
        assert "queue is full" in refused[0].details()
        assert sum(1 for o in outs if not isinstance(o, grpc.aio.AioRpcError) and len(o.token_ids) == 40) == 2
    finally:
        aloop.run(small.stop(grace=5))


def whole_context(cluster, offline, text: str) -> tuple[list[int], int]:
    """A prompt and the max_tokens that fill the context: minutes of SmolLM2 tokens here, so a request's
    end can never explain what a cancel did."""
    prompt = offline.tokenizer.encode(text)
    return prompt, cluster.info.max_model_len - len(prompt)


def test_cancel_mid_stream_frees_blocks(aloop, cluster, client, offline):
    """The client's cancel reaches the decode worker: by its record, the request left its batch within a
    few steps of the cancel, long before its end; then every block is free."""
    prompt, max_tokens = whole_context(cluster, offline, "Tell me a long story")
    watch = aloop.run(CancelWatch.of(cluster.pools["decode"][0]))
    stream = client.stub.Generate(build_request(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                                request_id="cancelled-mid-stream"))
    got = [next(stream) for _ in range(3)]
    assert all(r.token_ids for r in got)
    assert used_blocks(client) > 0
    stream.cancel()
    aloop.run(watch.client_cancelled())
    # By its first attempt's worker-side id (router.cluster: <id>#<attempt>).
    record = aloop.run(watch.arrived(max_tokens, "cancelled-mid-stream#0", CANCEL_WITHIN_STEPS_SMOL))
    assert record.status == "running"
    wait_for(lambda: used_blocks(client) == 0, what="blocks freed after a client cancel")


def test_deadline_exceeded_frees_blocks(aloop, cluster, client, offline):
    """A deadline cancels the request on the decode worker as a client's cancel does."""
    prompt, max_tokens = whole_context(cluster, offline, "Tell me a long story")
    watch = aloop.run(CancelWatch.of(cluster.pools["decode"][0]))
    with pytest.raises(grpc.RpcError) as e:
        client.complete(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, timeout=1.0,
                        request_id="past-its-deadline")
    aloop.run(watch.client_cancelled())
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    aloop.run(watch.arrived(max_tokens, "past-its-deadline#0", CANCEL_WITHIN_STEPS_SMOL))
    wait_for(lambda: used_blocks(client) == 0, what="blocks freed after a deadline")
    assert client.complete("Hi", max_tokens=2).finish_reason in ("length", "stop")


def test_graceful_shutdown_drains_in_flight(aloop, cluster):
    r = start_router(aloop, cluster)
    target = f"127.0.0.1:{r.port}"

    async def run():
        async with AsyncClient(target) as c:
            inflight = asyncio.create_task(c.complete("Tell me a story", max_tokens=30, ignore_eos=True, timeout=120))
            async for _ in c.generate("Wait for me", max_tokens=1):  # the router is up and streaming
                pass
            await asyncio.sleep(0)
            stop = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(r.stop(grace=60), aloop.loop))
            done = await inflight
            await stop
            return done

    out = asyncio.run(run())
    assert len(out.token_ids) == 30 and out.finish_reason == "length"
    with Client(target) as c, pytest.raises(grpc.RpcError) as e:
        c.complete("Hello", max_tokens=2, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# -- bad input --------------------------------------------------------------------------------------
BAD = [
    ("empty prompt", dict(prompt=""), "empty"),
    ("no input", None, "no input"),
    ("empty messages", dict(messages=[]), "empty"),
    ("prompt past context", dict(token_ids=[100] * 8200), "context"),
    ("max_tokens 0", dict(prompt="Hi", max_tokens=0), "max_tokens"),
    ("max_tokens past context", dict(prompt="Hi", max_tokens=9000), "context"),
    ("negative temperature", dict(prompt="Hi", temperature=-0.5), "temperature"),
    ("top_p 0", dict(prompt="Hi", top_p=0.0), "top_p"),
    ("top_p above 1", dict(prompt="Hi", top_p=1.5), "top_p"),
    ("negative top_k", dict(prompt="Hi", top_k=-2), "top_k"),
    ("unknown token id", dict(token_ids=[1, 2, 49152]), "unknown token ids"),
    ("negative token id", dict(token_ids=[-1]), "unknown token ids"),
    ("unknown stop token id", dict(prompt="Hi", stop_token_ids=[10**6]), "unknown token ids"),
    ("oversized messages", dict(messages=chat("x" * (1 << 20) + "y")), "exceed"),
    ("oversized prompt", dict(prompt="x" * ((1 << 20) + 1)), "characters"),
    ("empty stop string", dict(prompt="Hi", stop=[""]), "stop"),
]


@pytest.mark.parametrize("name,kwargs,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument_and_server_stays_up(client, name, kwargs, match):
    request = pb.GenerateRequest() if kwargs is None else build_request(**kwargs)
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert match in e.value.details()
    assert client.complete("Hello", max_tokens=2, timeout=60).finish_reason in ("length", "stop")


def test_invalid_utf8_is_invalid_argument(client, router):
    # Field 1 (prompt) with bytes that are not UTF-8: a client library would refuse to build this.
    raw = b"\x0a\x03\xff\xfe\xfd"
    call = grpc.insecure_channel(f"127.0.0.1:{router.port}").unary_stream(
        f"/{SERVICE_NAME}/Generate", request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as e:
        list(call(raw, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in e.value.details()
    assert client.complete("Hello", max_tokens=2).finish_reason in ("length", "stop")


# -- health, reflection, info, status ---------------------------------------------------------------
def test_health_and_reflection(client, router):
    assert client.health() == "SERVING"
    assert client.health(SERVICE_NAME) == "SERVING"
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(f"127.0.0.1:{router.port}"))
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


def test_model_info_and_status(client):
    info = client.model_info()
    assert (info.architecture, info.num_layers, info.vocab_size, info.num_kv_heads) == ("llama", 30, 49152, 3)
    assert info.has_chat_template and 2 in info.eos_token_ids and info.max_model_len == 8192
    st = client.cluster_status()
    assert st.mode == "disaggregated" and st.serving
    assert {p.name for p in st.pools} == {"prefill", "decode"}
    for p in st.pools:
        assert len(p.workers) == 1 and p.workers[0].kv_blocks_total == 512
    assert any(w.steps > 0 for p in st.pools for w in p.workers)


# -- the CLI against the router ---------------------------------------------------------------------
def test_cli_generate_and_status(router, offline):
    target = f"127.0.0.1:{router.port}"
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--target", target, "--json", "--chat",
                           "--temperature", "0", "--max-tokens", "24", "What is the capital of France?"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = offline.generate([offline.tokenizer.apply_chat_template(chat("What is the capital of France?"))],
                           SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert (out["text"], out["token_ids"], out["finish_reason"]) == (ref.text, ref.token_ids, "stop")
    status = subprocess.run([sys.executable, "-m", "pdserve.cli", "status", "--target", target],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "prefill-0" in status.stdout and "decode-0" in status.stdout
    bad = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--target", target, "--top-p", "2", "Hi"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "top_p" in bad.stderr
