"""A bounded fuzz of both doors: hypothesis over every field of every request type (gRPC's GenerateRequest,
the OpenAI bodies of /v1/completions and /v1/chat/completions, the Weights service's control RPCs), then
random and truncated bytes on the wire, against the real router over a real cluster of the tiny checkpoint,
with an inference key and an admin key.

Every call must end with a proper answer (OK, or a clear error that says what is wrong: INVALID_ARGUMENT /
a 4xx in OpenAI's shape; never INTERNAL, UNKNOWN, a 5xx or a hang past its deadline), the greedy streams
running beside the fuzz (the neighbours) must each come out token-exact, the server must keep serving, and
nothing may be left behind: no KV block, no admission slot, no stream in the router.

The suite runs FUZZ_CASES cases in all; PDSERVE_FUZZ_CASES=5000 runs more (docs/benchmarks.md has the
5,000-case run).
"""
from __future__ import annotations

import collections
import json
import os
import threading

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.client import Client
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from router.cluster import Cluster
from router.compose import build_router
from router.config import RouterConfig
from router.grpc_api import SERVICE_NAME
from router.server import Router
from router.weights_api import WEIGHTS_SERVICE_NAME

KEY, ADMIN = "fuzz-inference-key", "fuzz-admin-key"
FUZZ_CASES = int(os.environ.get("PDSERVE_FUZZ_CASES", "900"))
# The cases, shared out: gRPC fields, HTTP bodies, control RPCs, raw bytes (gRPC and control).
SHARES = {"grpc": 0.3, "http": 0.3, "control": 0.2, "bytes": 0.2}
PROPER = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
INT32 = st.integers(-2**31, 2**31 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
EXTREME_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, 10**30])


def cases(kind: str) -> int:
    return max(20, int(FUZZ_CASES * SHARES[kind]))


def fuzz_settings(kind: str):
    return settings(max_examples=cases(kind), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def served(ray_local, aloop, tiny_checkpoints):
    cache = CacheConfig(block_size=4, num_blocks=256)
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=cache,
                          scheduler=SchedulerConfig(max_num_batched_tokens=256))
    cluster = Cluster(ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.25),
                                    decode=PoolConfig(1, num_cpus=0.25)))
    aloop.run(cluster.start(), timeout=600)
    router = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name="tiny", api_key=KEY,
                                                admin_api_key=ADMIN))
    aloop.run(router.start())
    with Client(f"127.0.0.1:{router.port}", api_key=KEY) as client:
        yield cluster, router, client
    aloop.run(router.stop(grace=2))
    aloop.run(cluster.shutdown())


class Neighbours:
    """Greedy streams beside the fuzz, one after another on each of `width` threads until stopped: each must
    come out exactly as the offline engine's."""

    PROMPTS = [[5, 6, 7, 8, 9], [100, 101, 102], [250, 3, 77, 12, 9, 31]]
    MAX_TOKENS = 24

    def __init__(self, target: str, engine: EngineConfig, width: int = 2):
        params = SamplingParams(max_tokens=self.MAX_TOKENS, temperature=0.0, ignore_eos=True)
        self.reference = [c.token_ids for c in LLMEngine(engine).generate(self.PROMPTS, params)]
        self.target, self.done, self.failures = target, 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(width)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        with Client(self.target, api_key=KEY) as c:
            while not self._stop.is_set():
                j = (i + self.done) % len(self.PROMPTS)
                try:
                    got = c.complete(token_ids=self.PROMPTS[j], max_tokens=self.MAX_TOKENS, temperature=0.0,
                                     ignore_eos=True, timeout=120).token_ids
                    if got != self.reference[j]:
                        self.failures.append(f"prompt {j}: {got} != {self.reference[j]}")
                except grpc.RpcError as e:
                    self.failures.append(f"prompt {j}: {e.code().name}: {e.details()}")
                self.done += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)
        assert not self.failures, self.failures[:5]
        assert self.done > 0


@pytest.fixture
def neighbours(served, tiny_checkpoints):
    _, router, _ = served
    n = Neighbours(f"127.0.0.1:{router.port}", EngineConfig(model=str(tiny_checkpoints["llama"]),
                                                           cache=CacheConfig(block_size=4, num_blocks=256)))
    yield n
    n.stop()
    print(f"\nneighbour streams beside the fuzz: {n.done}, all token-exact")


# -- gRPC Generate ------------------------------------------------------------------------------------------

def sampling(wild: bool = True) -> st.SearchStrategy[pb.SamplingParams]:
    def build(t, p, k, seed, pen, rep, mt):
        s = pb.SamplingParams()
        for name, v in (("temperature", t), ("top_p", p), ("top_k", k), ("seed", seed), ("presence_penalty", pen),
                        ("frequency_penalty", pen), ("repetition_penalty", rep), ("min_tokens", mt)):
            if v is not None:
                setattr(s, name, v)
        return s

    w = (lambda plausible, extreme: plausible | extreme) if wild else (lambda plausible, extreme: plausible)
    return st.builds(build, st.none() | w(st.sampled_from([0.0, 0.7]), FLOATS), st.none() | w(st.sampled_from([0.9, 1.0]), FLOATS),
                     st.none() | w(st.integers(0, 50), INT32), st.none() | st.integers(0, 2**64 - 1) if wild else st.none(),
                     st.none() | w(st.sampled_from([0.5, -0.5]), FLOATS), st.none() | w(st.sampled_from([1.0, 1.2]), FLOATS),
                     st.none() | w(st.integers(0, 4), INT32))


def requests(wild: bool = True) -> st.SearchStrategy[pb.GenerateRequest]:
    """wild: each field mixes values the API accepts with ones it must refuse (most such requests are refused);
    otherwise values it accepts, so that the requests that run are many too."""
    valid = st.lists(st.integers(0, 319), min_size=1, max_size=40)
    ids = valid | st.lists(st.integers(-5, 400) | INT32, max_size=40) if wild else valid
    text = st.text(max_size=60)
    messages = st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "", "tool"]) | text, text),
                        max_size=4)
    u32 = st.integers(0, 2**32 - 1)

    def build(kind, prompt, msgs, token_ids, params, max_tokens, stop, stop_ids, ignore_eos, rid, extra):
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
        n, logprobs, prompt_logprobs, staleness, tier, mode, policy, session = extra
        r.session_id = session
        for name, v in (("n", n), ("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs),
                        ("max_staleness", staleness)):
            if v is not None:
                setattr(r, name, v)
        r.service_tier, r.logprobs_mode, r.version_policy = tier, mode, policy
        return r

    w = (lambda plausible, extreme: plausible | extreme) if wild else (lambda plausible, extreme: plausible)
    extra = st.tuples(st.none() | w(st.integers(1, 3), u32), st.none() | w(st.integers(0, 5), INT32),
                      st.none() | w(st.integers(0, 2), INT32), st.none() | w(st.integers(0, 3), u32),
                      w(st.sampled_from(["", "auto", "default", "priority", "flex"]), text),
                      w(st.sampled_from(["", "raw", "processed"]), text), w(st.sampled_from(["", "keep", "abort"]), text),
                      w(st.sampled_from(["", "chat-1", "agent-7"]), text | st.just("s" * 257)))
    return st.builds(build, st.sampled_from(["token_ids", "token_ids", "prompt", "messages", "none"] if wild else
                                            ["token_ids"]), text, messages, ids, st.none() | sampling(wild),
                     st.none() | w(st.integers(1, 8), st.integers(-3, 12) | INT32),
                     w(st.lists(st.text(min_size=1, max_size=8), max_size=3),
                       st.lists(text, max_size=3) | st.lists(st.just("x"), min_size=17, max_size=20)),
                     w(st.lists(st.integers(0, 319), max_size=2), st.lists(INT32, max_size=3)),
                     st.booleans(), st.just("") | w(st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True), text),
                     extra)


def call(client: Client, data: bytes, method: str = f"/{SERVICE_NAME}/Generate", unary: bool = False,
         key: str | None = KEY, proper=PROPER) -> grpc.StatusCode:
    md = (("authorization", f"Bearer {key}"),) if key else ()
    if unary:
        raw = client.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    else:
        raw = client.channel.unary_stream(method, request_serializer=None, response_deserializer=None)
    try:
        out = raw(data, timeout=60, metadata=md)
        if not unary:
            for _ in out:
                pass
    except grpc.RpcError as e:
        assert e.code() in proper, (method, e.code(), e.details(), data[:200])
        assert e.details(), "an error must say what is wrong"
        return e.code()
    return grpc.StatusCode.OK


def assert_nothing_left(aloop, cluster: Cluster, router: Router, client: Client,
                        neighbours: Neighbours | None = None) -> None:
    """The server serves, and nothing is held: KV blocks, admission slots, streams, paused weights, HTTP bodies.
    The neighbours are stopped first (their own streams would hold slots and blocks while they run)."""
    from conftest import wait_for

    assert client.health(timeout=10) == "SERVING"
    if neighbours is not None:
        neighbours.stop()
    wait_for(lambda: sum(s.kv_blocks_used for s in aloop.run(cluster.stats())) == 0, 60, what="zero used KV blocks")
    wait_for(lambda: router.front.admission.running == 0 and router.front.admission.queued == 0, 30,
             what="no admission slot held")
    assert cluster.streams.empty
    assert not router.weights.paused and router.http_app.state.bodies.held == 0
    ok = client.complete(token_ids=[1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True, timeout=30)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4


def test_fuzz_request_fields(served, aloop, neighbours):
    cluster, router, client = served
    seen: collections.Counter[str] = collections.Counter()

    @fuzz_settings("grpc")
    @given(requests(wild=False) | requests(wild=True))
    def one(req: pb.GenerateRequest) -> None:
        seen[call(client, req.SerializeToString()).name] += 1

    one()
    print(f"\nfuzzed gRPC request fields: {sum(seen.values())} calls, {dict(seen)}")
    assert sum(seen.values()) >= cases("grpc")
    assert seen["OK"] > 0 and seen["INVALID_ARGUMENT"] > 0  # both kinds of request were reached
    assert_nothing_left(aloop, cluster, router, client, neighbours)


# -- the OpenAI door ----------------------------------------------------------------------------------------

JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | EXTREME_INTS
                       | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                       max_leaves=6)


def bodies() -> st.SearchStrategy[tuple[str, dict]]:
    """(path, body): bodies of plausible values (absent or accepted), the same with one field set to anything
    at all (extremes included), or every field anything at all."""
    return _bodies(False) | _bodies(False).flatmap(_one_field_wild) | _bodies(True)


def _one_field_wild(case: tuple[str, dict]) -> st.SearchStrategy[tuple[str, dict]]:
    path, body = case
    fields = sorted({*body, "prompt" if path == "/v1/completions" else "messages", "top_k", "stop", "n"})
    return st.tuples(st.sampled_from(fields), JSONISH).map(lambda fv: (path, {**body, fv[0]: fv[1]}))


def _bodies(wild: bool) -> st.SearchStrategy[tuple[str, dict]]:
    def maybe(plausible: st.SearchStrategy) -> st.SearchStrategy:  # absent (None: dropped), plausible, or wild
        return st.none() | plausible | JSONISH if wild else st.none() | plausible

    ids = st.lists(st.integers(0, 319), min_size=1, max_size=30)
    common = {
        "model": st.just("tiny") | st.text(max_size=8) if wild else st.just("tiny"), "max_tokens": maybe(st.integers(1, 8)),
        "temperature": maybe(st.sampled_from([0, 0.7, 1.0])), "top_p": maybe(st.sampled_from([0.5, 1.0])),
        "top_k": maybe(st.integers(0, 320) | (st.sampled_from([2**63, 2**64]) if wild else st.nothing())),
        "seed": maybe(st.integers(0, 99)),
        "stop": maybe(st.lists(st.text(min_size=1, max_size=5), max_size=3)
                      | (st.lists(st.just("s"), min_size=17, max_size=20) if wild else st.nothing())),
        "stop_token_ids": maybe(st.lists(st.integers(0, 319), max_size=3)), "ignore_eos": maybe(st.booleans()),
        "n": maybe(st.integers(1, 3)), "stream": maybe(st.booleans()), "presence_penalty": maybe(st.just(0.5)),
        "frequency_penalty": maybe(st.just(-0.5)), "repetition_penalty": maybe(st.just(1.1)),
        "min_tokens": maybe(st.integers(0, 4)), "prompt_logprobs": maybe(st.integers(0, 3)),
        "logprobs_mode": maybe(st.sampled_from(["raw", "processed"])), "return_token_ids": maybe(st.booleans()),
        "version_policy": maybe(st.sampled_from(["keep", "abort", "recompute"])),
        "max_staleness": maybe(st.integers(0, 3)), "service_tier": maybe(st.sampled_from(["auto", "flex"])),
        "logit_bias": maybe(st.just({})), "user": maybe(st.text(max_size=5)),
        "stream_options": maybe(st.just({"include_usage": True})),
        "session_id": maybe(st.sampled_from(["chat-1", "agent-7"]) | (st.just("s" * 257) if wild else st.nothing())),
    }
    completion = st.fixed_dictionaries({**common, "prompt": ids | st.text(max_size=20) | JSONISH if wild else ids,
                                        "logprobs": maybe(st.integers(0, 5)), "echo": maybe(st.booleans()),
                                        "best_of": maybe(st.just(1)), "suffix": maybe(st.just(""))})
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | (JSONISH if wild else st.nothing()),
                                     "content": st.text(max_size=20) | (JSONISH if wild else st.nothing())})
    chat = st.fixed_dictionaries({**common, "messages": st.lists(message, max_size=3) | JSONISH if wild else
                                  st.lists(message, max_size=3),
                                  "max_completion_tokens": maybe(st.integers(1, 8)), "logprobs": maybe(st.booleans()),
                                  "top_logprobs": maybe(st.integers(0, 5)), "tools": maybe(st.just([])),
                                  "response_format": maybe(st.just({"type": "text"}))})
    drop_none = lambda d: {k: v for k, v in d.items() if v is not None}  # noqa: E731
    return st.tuples(st.just("/v1/completions"), completion.map(drop_none)) \
        | st.tuples(st.just("/v1/chat/completions"), chat.map(drop_none))


def http_call(h: httpx.Client, url: str, path: str, body, raw: bytes | None = None) -> int:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = raw if raw is not None else json.dumps(body).encode()
    with h.stream("POST", url + path, content=content, headers=headers) as r:
        data = r.read()
    assert r.status_code < 500, (r.status_code, data[:300], content[:300])
    if r.status_code >= 400:
        error = json.loads(data)["error"]
        assert error["message"] and error["type"], data[:300]
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert data.endswith(b"data: [DONE]\n\n") and b'"error"' not in data, data[-300:]
    return r.status_code


def test_fuzz_the_openai_door(served, aloop, neighbours):
    cluster, router, client = served
    url = f"http://127.0.0.1:{router.http_port}"
    seen: collections.Counter[int] = collections.Counter()
    with httpx.Client(timeout=60) as h:
        @fuzz_settings("http")
        @given(bodies())
        def one(case) -> None:
            path, body = case
            seen[http_call(h, url, path, body)] += 1

        one()
    print(f"\nfuzzed OpenAI bodies: {sum(seen.values())} calls, {dict(seen)}")
    assert seen[200] > 0 and seen[400] > 0
    assert_nothing_left(aloop, cluster, router, client, neighbours)


# -- the Weights service (control) --------------------------------------------------------------------------

DOUBLES = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.1, 0.5, -1.0, 1e9])
TEXT = st.text(max_size=30)
U64 = st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1])
U32 = st.integers(0, 2**32 - 1)
CONTROL = {
    "UpdateWeights": st.builds(pb.UpdateWeightsRequest, path=TEXT | st.sampled_from(["/etc/passwd", "/", "../x", "/tmp"]),
                               version=U64, mode=st.sampled_from(["", "pause", "rolling"]) | TEXT,
                               pause_mode=st.sampled_from(["", "keep", "wait", "abort"]) | TEXT),
    "GetWeightVersions": st.just(pb.GetWeightVersionsRequest()),
    "Pause": st.builds(lambda m, t: pb.PauseRequest(mode=m, timeout_seconds=t) if t is not None else pb.PauseRequest(mode=m),
                       st.sampled_from(["", "keep", "wait", "abort"]) | TEXT, st.none() | DOUBLES),
    "Resume": st.just(pb.ResumeRequest()),
    "InitWeightGroup": st.builds(
        lambda h, p, w, n, t: pb.InitWeightGroupRequest(host=h, port=p, world_size=w, name=n, timeout_seconds=t),
        st.sampled_from(["127.0.0.1", "", "localhost"]) | TEXT, U32 | st.integers(1, 65535), U32 | st.just(3),
        st.sampled_from(["g", "a/b"]) | TEXT, st.floats(0.05, 0.5) | DOUBLES),
    "BeginWeightUpdate": st.builds(
        lambda v, ts, b: pb.BeginWeightUpdateRequest(version=v, tensors=ts, bucket_bytes=b), U64,
        st.lists(st.builds(lambda n, s, d: pb.TensorMeta(name=n, shape=s, dtype=d),
                           st.sampled_from(["model.norm.weight"]) | TEXT,
                           st.lists(st.integers(-2**63, 2**63 - 1), max_size=3),
                           st.sampled_from(["float32", "bfloat16", "int8"]) | TEXT), max_size=3), U64),
    "FinishWeightUpdate": st.builds(pb.FinishWeightUpdateRequest, version=U64,
                                    mode=st.sampled_from(["", "pause", "rolling"]) | TEXT, pause_mode=TEXT),
    "DestroyWeightGroup": st.just(pb.DestroyWeightGroupRequest()),
}
# Proper answers of a control call: its own checks (INVALID_ARGUMENT, FAILED_PRECONDITION: not newer, no group),
# a pause whose wait ended first (DEADLINE_EXCEEDED), and a trainer's group the workers could not join within
# its timeout (UNAVAILABLE, no trainer listens at the fuzzed address).
CONTROL_PROPER = PROPER | {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED,
                           grpc.StatusCode.UNAVAILABLE}


def test_fuzz_the_control_rpcs(served, aloop):
    """With the admin key, every field of every Weights RPC (alone: a valid Pause may abort what runs, as an
    operator may); the inference key's control calls are in test_fuzz_random_and_truncated_bytes, beside
    the neighbours."""
    cluster, router, client = served
    seen: collections.Counter[str] = collections.Counter()

    @fuzz_settings("control")
    @given(st.sampled_from(sorted(CONTROL)).flatmap(lambda m: st.tuples(st.just(m), CONTROL[m])))
    def one(case) -> None:
        method, req = case
        code = call(client, req.SerializeToString(), f"/{WEIGHTS_SERVICE_NAME}/{method}", unary=True, key=ADMIN,
                    proper=CONTROL_PROPER)
        if code == grpc.StatusCode.UNAVAILABLE:  # only a join that found no trainer
            assert method == "InitWeightGroup", method
        seen[f"{method}:{code.name}"] += 1
        if router.weights.paused:  # a valid Pause: resume, for the next case's sake
            _resume(client)

    one()
    print(f"\nfuzzed control RPCs: {sum(seen.values())} calls, {dict(seen)}")
    assert any(k.endswith(":OK") for k in seen) and any(k.endswith(":INVALID_ARGUMENT") for k in seen)
    assert router.weights.version == 0  # no update could come through: no checkpoint under the root is fuzzed
    assert_nothing_left(aloop, cluster, router, client)


def _resume(client: Client) -> None:
    client.weights.Resume(pb.ResumeRequest(), timeout=30, metadata=(("authorization", f"Bearer {ADMIN}"),))


# -- raw bytes ----------------------------------------------------------------------------------------------

def test_fuzz_random_and_truncated_bytes(served, aloop, neighbours):
    """Bytes that may be no message at all, to Generate (inference key) and to every control RPC (the admin
    key, and the inference key, which is refused before anything is parsed: PERMISSION_DENIED)."""
    cluster, router, client = served
    seen: collections.Counter[str] = collections.Counter()
    valid = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 300]), max_tokens=3, stop=["é"],
                               request_id="r").SerializeToString()
    methods = [f"/{SERVICE_NAME}/Generate"] + [f"/{WEIGHTS_SERVICE_NAME}/{m}" for m in sorted(CONTROL)
                                               if m not in ("Pause", "InitWeightGroup")]

    @fuzz_settings("bytes")
    @given(st.sampled_from(methods), st.sampled_from([KEY, ADMIN]),
           st.binary(max_size=200) | st.integers(0, len(valid)).map(lambda n: valid[:n])
           | st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
               lambda t: valid[:t[0]] + bytes([t[1]]) + valid[t[0] + 1:]))
    def one(method: str, key: str, data: bytes) -> None:
        control = method.startswith(f"/{WEIGHTS_SERVICE_NAME}/")
        if control and key == KEY:
            code = call(client, data, method, unary=True, key=KEY, proper={grpc.StatusCode.PERMISSION_DENIED})
        elif control:
            code = call(client, data, method, unary=True, key=ADMIN, proper=CONTROL_PROPER - {grpc.StatusCode.UNAVAILABLE})
        else:
            code = call(client, data, method, key=key)
        seen[code.name] += 1
        if router.weights.paused:
            _resume(client)

    one()
    print(f"\nfuzzed bytes: {sum(seen.values())} calls, {dict(seen)}")
    assert sum(seen.values()) >= cases("bytes")
    assert seen["PERMISSION_DENIED"] > 0
    # Bytes to the HTTP door too: a body that is no JSON, or no object.
    with httpx.Client(timeout=60) as h:
        for raw in (b"\xff{not json", b"[]", b"1e999", b'{"model": "tiny", "prompt": [1], "max_tokens": 1e400}',
                    b'{"model": "tiny", "prompt": [1], "top_k": 9223372036854775808, "temperature": 1}'):
            assert http_call(h, f"http://127.0.0.1:{router.http_port}", "/v1/completions", None, raw) == 400
    assert_nothing_left(aloop, cluster, router, client, neighbours)


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
