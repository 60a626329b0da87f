"""A bounded fuzz of the gRPC API: hypothesis over every field of GenerateRequest, then random and
truncated bytes on the wire, against the real router over a real cluster of the tiny checkpoint.

Every call must end with a proper status (OK, or INVALID_ARGUMENT naming what is wrong; never INTERNAL,
UNKNOWN or a hang past its deadline), the server must keep serving, and nothing may be left behind:
no KV block, no admission slot, no stream in the router.
"""
from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.client import Client
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.v1 import generation_pb2 as pb
from router.cluster import Cluster
from router.compose import build_router
from router.config import RouterConfig
from router.grpc_api import SERVICE_NAME
from router.server import Router

STRUCTURED_CASES = 250
BYTES_CASES = 250
PROPER = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
INT32 = st.integers(-2**31, 2**31 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


@pytest.fixture(scope="module")
def served(ray_local, aloop, tiny_checkpoints):
    cache = CacheConfig(block_size=4, num_blocks=256)
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=cache,
                          scheduler=SchedulerConfig(max_num_batched_tokens=256))
    cluster = Cluster(ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.25),
                                    decode=PoolConfig(1, num_cpus=0.25)))
    aloop.run(cluster.start(), timeout=600)
    router = build_router(cluster, RouterConfig(port=0))
    aloop.run(router.start())
    with Client(f"127.0.0.1:{router.port}") as client:
        yield cluster, router, client
    aloop.run(router.stop(grace=2))
    aloop.run(cluster.shutdown())


def sampling() -> st.SearchStrategy[pb.SamplingParams]:
    def build(t, p, k, seed):
        s = pb.SamplingParams()
        for name, v in (("temperature", t), ("top_p", p), ("top_k", k), ("seed", seed)):
            if v is not None:
                setattr(s, name, v)
        return s

    return st.builds(build, st.none() | st.sampled_from([0.0, 0.7]) | FLOATS, st.none() | st.sampled_from([0.9, 1.0]) | FLOATS,
                     st.none() | st.integers(0, 50) | INT32, st.none() | st.integers(0, 2**64 - 1))


def requests() -> st.SearchStrategy[pb.GenerateRequest]:
    # Each field mixes values the API accepts with ones it must refuse, so both kinds of request occur.
    ids = st.lists(st.integers(0, 319), min_size=1, max_size=40) | st.lists(st.integers(-5, 400) | INT32, max_size=40)
    text = st.text(max_size=60)
    messages = st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "", "tool"]) | text, text),
                        max_size=4)

    def build(kind, prompt, msgs, token_ids, params, max_tokens, stop, stop_ids, ignore_eos, rid):
        r = pb.GenerateRequest(stop=stop, stop_token_ids=stop_ids, ignore_eos=ignore_eos, request_id=rid)
        if kind == "prompt":
            r.prompt = prompt
        elif kind == "messages":
            r.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(role=a, content=b) for a, b in msgs]))
        elif kind == "token_ids":
            r.token_ids.CopyFrom(pb.TokenIds(ids=token_ids))
        if params is not None:
            r.sampling.CopyFrom(params)
        if max_tokens is not None:
            r.max_tokens = max_tokens
        return r

    return st.builds(build, st.sampled_from(["token_ids", "token_ids", "prompt", "messages", "none"]), text, messages,
                     ids, st.none() | sampling(), st.none() | st.integers(1, 8) | st.integers(-3, 12) | INT32,
                     st.lists(text, max_size=3), st.lists(st.integers(0, 319), max_size=2) | st.lists(INT32, max_size=3),
                     st.booleans(), st.just("") | text)


def call(client: Client, data: bytes) -> grpc.StatusCode:
    raw = client.channel.unary_stream(f"/{SERVICE_NAME}/Generate", request_serializer=None,
                                      response_deserializer=pb.GenerateResponse.FromString)
    try:
        for _ in raw(data, timeout=30):
            pass
    except grpc.RpcError as e:
        assert e.code() in PROPER, (e.code(), e.details(), data[:200])
        assert e.details(), "an error must say what is wrong"
        return e.code()
    return grpc.StatusCode.OK


def assert_nothing_left(aloop, cluster: Cluster, router: Router, client: Client) -> None:
    from conftest import wait_for

    assert client.health(timeout=10) == "SERVING"
    wait_for(lambda: sum(s.kv_blocks_used for s in aloop.run(cluster.stats())) == 0, 30, what="zero used KV blocks")
    assert router.front.admission.running == 0 and router.front.admission.queued == 0
    assert cluster.streams.empty
    ok = client.complete(token_ids=[1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True, timeout=30)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4


def test_fuzz_request_fields(served, aloop):
    cluster, router, client = served
    seen: collections.Counter[str] = collections.Counter()

    @settings(max_examples=STRUCTURED_CASES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(requests())
    def one(req: pb.GenerateRequest) -> None:
        seen[call(client, req.SerializeToString()).name] += 1

    one()
    print(f"\nfuzzed request fields: {sum(seen.values())} calls, {dict(seen)}")
    assert sum(seen.values()) >= STRUCTURED_CASES
    assert seen["OK"] > 0 and seen["INVALID_ARGUMENT"] > 0  # both kinds of request were reached
    assert_nothing_left(aloop, cluster, router, client)


def test_fuzz_random_and_truncated_bytes(served, aloop):
    cluster, router, client = served
    seen: collections.Counter[str] = collections.Counter()
    valid = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 300]), max_tokens=3, stop=["é"],
                               request_id="r").SerializeToString()

    @settings(max_examples=BYTES_CASES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.binary(max_size=200) | st.integers(0, len(valid)).map(lambda n: valid[:n])
           | st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
               lambda t: valid[:t[0]] + bytes([t[1]]) + valid[t[0] + 1:]))
    def one(data: bytes) -> None:
        seen[call(client, data).name] += 1

    one()
    print(f"\nfuzzed bytes: {sum(seen.values())} calls, {dict(seen)}")
    assert sum(seen.values()) >= BYTES_CASES
    assert_nothing_left(aloop, cluster, router, client)


def test_max_tokens_defaults_per_protocol(tiny_checkpoints):
    """gRPC and /v1/completions default to 16 new tokens; /v1/chat/completions, like OpenAI's, to the rest
    of the context. An explicit value wins, and one past the context is refused."""
    from pdserve.model.loader import load_info
    from router.admission import DEFAULT_MAX_TOKENS, Ask, prepare

    info = load_info(EngineConfig(model=str(tiny_checkpoints["llama"])))
    ids = [5, 6, 7]
    assert prepare(info, 1000, Ask(token_ids=ids))[1].max_tokens == DEFAULT_MAX_TOKENS
    assert prepare(info, 1000, Ask(token_ids=ids, default_max_tokens=None))[1].max_tokens == info.max_model_len - 3
    assert prepare(info, 1000, Ask(token_ids=ids, sampling=dict(max_tokens=4), default_max_tokens=None)
                   )[1].max_tokens == 4
    with pytest.raises(ValueError, match="context"):
        prepare(info, 1000, Ask(token_ids=ids, sampling=dict(max_tokens=info.max_model_len)))
    with pytest.raises(ValueError, match="one input"):
        prepare(info, 1000, Ask(token_ids=ids, prompt="x"))
