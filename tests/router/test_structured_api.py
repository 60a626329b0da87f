"""Structured output through the doors, driven by the `openai` SDK and gRPC, against real routers over real local
clusters serving SmolLM2: response_format json_schema on the disaggregated cluster (every prompt handed off) and on
a colocated one, streamed and not; n samples each valid; the extensions; a decode worker killed mid-reply, the
reply resumed elsewhere still valid; and specs that do not compile refused before any work (HTTP 400 naming the
field, gRPC INVALID_ARGUMENT)."""
from __future__ import annotations

import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import openai
import pytest
import ray

from pdserve.client import Client
from pdserve.config import ClusterConfig, PoolConfig
from pdserve.v1 import generation_pb2 as pb
from router.cluster import Cluster
from router.compose import build_router
from router.config import RouterConfig

from conftest import smol_1p1d_engine_config, wait_for

pytestmark = pytest.mark.slow
MODEL = "smollm2"
# Bounded strings and numbers: every reply completes well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 160


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe person number {i} as JSON: name, age, favourite colour, tags."}]


def assert_valid(text: str, finish: str) -> None:
    assert finish == "stop", (finish, text)
    jsonschema.validate(json.loads(text), SCHEMA)


def start_router(aloop, cluster):
    r = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name=MODEL))
    aloop.run(r.start())
    return r


def sdk_of(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="none", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def disaggregated(smol_1p1d, aloop):
    """The shared SmolLM2 1P1D cluster (conftest.smol_1p1d: every prompt handed off) behind a router of its own."""
    r = start_router(aloop, smol_1p1d)
    yield r
    aloop.run(r.stop(grace=5))


@pytest.fixture(scope="module")
def colocated(smol_colocated, aloop):
    """The shared colocated SmolLM2 cluster (conftest.smol_colocated) behind a router of its own."""
    r = start_router(aloop, smol_colocated)
    yield r
    aloop.run(r.stop(grace=5))


def chat(sdk: openai.OpenAI, i: int, stream: bool, **kw) -> tuple[str, str]:
    """One chat reply under FORMAT, sampled (seed i): its text and finish reason."""
    args = dict(model=MODEL, messages=messages(i), max_tokens=MAX_TOKENS, temperature=0.8, seed=i,
                response_format=FORMAT, **kw)
    if not stream:
        c = sdk.chat.completions.create(**args).choices[0]
        return c.message.content, c.finish_reason
    text, finish = "", None
    for chunk in sdk.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.usefixtures("smol_colocated")  # reached through `colocated`, by name below
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("where", ["disaggregated", "colocated"])
def test_json_schema_replies_validate(request, where, stream):
    sdk = sdk_of(request.getfixturevalue(where))
    with ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda i: chat(sdk, i, stream), range(10)))
    for text, finish in replies:
        assert_valid(text, finish)
    assert len({text for text, _ in replies}) > 1  # sampled: the mask shapes the replies, it does not fix them


def test_n_samples_each_valid_on_completions(disaggregated):
    """n = 3 on /v1/completions, response_format as the extension there: each sample (forked on the decode worker
    from the prefill worker's first tokens, each drawn under the mask) validates."""
    out = sdk_of(disaggregated).completions.create(
        model=MODEL, prompt="A person described as JSON: ", max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=3,
        extra_body={"response_format": FORMAT})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for c in out.choices:
        assert_valid(c.text, c.finish_reason)


def test_the_extensions(disaggregated):
    sdk = sdk_of(disaggregated)
    regex = sdk.completions.create(model=MODEL, prompt="A code: ", max_tokens=20, temperature=1.0, seed=1,
                                   extra_body={"guided_regex": r"[A-Z]{3}-\d{2}"}).choices[0]
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", regex.text) and regex.finish_reason == "stop", regex
    choice = sdk.chat.completions.create(model=MODEL, messages=messages(0), max_tokens=20, temperature=0.0,
                                         extra_body={"guided_choice": ["yes", "no", "maybe"]}).choices[0]
    assert choice.message.content in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    newer = sdk.chat.completions.create(model=MODEL, messages=messages(1), max_tokens=MAX_TOKENS, temperature=0.0,
                                        extra_body={"structured_outputs": {"json": SCHEMA}}).choices[0]
    assert_valid(newer.message.content, newer.finish_reason)
    grammar = sdk.completions.create(model=MODEL, prompt="Answer: ", max_tokens=20, temperature=1.0, seed=2,
                                     extra_body={"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}).choices[0]
    assert re.fullmatch(r"x\d\d?", grammar.text), grammar


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "([a-"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs.regex"),
], ids=["schema", "regex", "json-text", "grammar", "no-choice", "two-fields", "two-keys"])
def test_a_spec_that_does_not_compile_is_a_400_naming_the_field(disaggregated, body, param):
    r = httpx.post(f"http://127.0.0.1:{disaggregated.http_port}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages(0), "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error
    # The router still serves.
    ok = httpx.post(f"http://127.0.0.1:{disaggregated.http_port}/v1/completions", timeout=120,
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_grpc_structured_output(disaggregated):
    with Client(f"127.0.0.1:{disaggregated.port}") as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete("Hi", max_tokens=4, structured_output=pb.StructuredOutput(regex="([a-"), timeout=60)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()
        choices = pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=["alpha", "beta"]))
        out = c.complete(messages=messages(2), max_tokens=10, temperature=0.0, structured_output=choices, timeout=120)
        assert out.text in ("alpha", "beta") and out.finish_reason == "stop", (out.text, out.finish_reason)


# -- a decode worker killed mid-reply ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_two(ray_local, aloop):
    """SmolLM2 on one prefill and two decode workers, every prompt handed off."""
    engine = smol_1p1d_engine_config()
    cluster = Cluster(ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.25),
                                    decode=PoolConfig(2, num_cpus=0.25), local_prefill_max_tokens=0,
                                    stats_interval_s=0.5, worker_timeout_s=10.0))
    aloop.run(cluster.start(), timeout=600)
    r = start_router(aloop, cluster)
    yield cluster, r
    aloop.run(r.stop(grace=5))
    aloop.run(cluster.shutdown())


def test_a_decode_worker_killed_mid_reply_resumes_and_the_reply_validates(one_two):
    """The first decode worker to reach its seventh step holds there (the other goes on) and is SIGKILLed: its
    streams resume on another (the router's tokens replayed into a fresh matcher there, after the prefill worker
    replays them too), and every reply still validates."""
    cluster, router = one_two
    sdk = sdk_of(router)
    decodes = list(cluster.pools["decode"])
    pids = {w.worker_id: ray.get(w.handle.stats.remote(), timeout=30).pid for w in decodes}  # before they hold
    for w in decodes:
        ray.get(w.handle.inject_fault.remote("step", float("inf"), skip=6))
    progress = [0] * 4

    def run(i: int) -> tuple[str, str]:
        text, finish = "", None
        for chunk in sdk.chat.completions.create(model=MODEL, messages=messages(10 + i), max_tokens=MAX_TOKENS,
                                                 temperature=0.8, seed=i, response_format=FORMAT, stream=True):
            for c in chunk.choices:
                text += c.delta.content or ""
                progress[i] += 1
                finish = c.finish_reason or finish
        return text, finish

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run, i) for i in range(4)]
        held = lambda w: ray.get(w.handle.fault_reached.remote("step", 0.2))  # noqa: E731
        wait_for(lambda: any(held(w) for w in decodes), 120, what="a decode worker to hold at its seventh step")
        victim = next(w for w in decodes if held(w))
        for w in decodes:
            if w is not victim:
                ray.get(w.handle.release_fault.remote("step"))
        assert victim.requests, "no stream on the decode worker held"
        wait_for(lambda: max(progress) >= 3, 60, what="a stream to be mid-reply")
        os.kill(pids[victim.worker_id], signal.SIGKILL)
        replies = [f.result(timeout=300) for f in futures]
    for text, finish in replies:
        assert_valid(text, finish)
    assert cluster.retries["decode_lost"] >= 1
    wait_for(lambda: len(cluster.pools["decode"]) == 2, 180, what="the decode pool back to two workers")

