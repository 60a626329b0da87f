"""Bounds on every field that sizes work, and a request that cannot fail its neighbours (#47, findings 2 and 4).

The checks alone first (router.admission.prepare, SamplingParams); then through both doors of a real router
over a real cluster of the tiny checkpoint, beside streams that must come out token-exact; then requests
the checks miss, injected past them: an object built past the router's checks, and a fault point that makes
one request's data fail every step it is in. The bad request fails alone, as the client's error; nobody
else's attempt fails (the router's retry count does not move)."""
from __future__ import annotations

import asyncio
import math

import grpc
import httpx
import pytest
import ray

from pdserve.client import Client
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine.sampling import MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, SamplingParams
from pdserve.model.loader import load_info
from router.admission import Ask, prepare
from router.config import RouterConfig

from conftest import wait_for
from served import Served, Streams, assert_exact, prompts, streams_in_flight

BIG = 2**63  # finding 2: 9223372036854775808, past int64
STOPS = 100_000  # finding 4


@pytest.fixture(scope="module")
def info(tiny_checkpoints):
    return load_info(EngineConfig(model=str(tiny_checkpoints["llama"])))


def refused(info, **ask) -> str:
    with pytest.raises(ValueError) as e:
        prepare(info, 1 << 20, Ask(**ask))
    return str(e.value)


def test_every_field_that_sizes_work_is_bounded(info):
    vocab, ctx = info.config.vocab_size, info.max_model_len
    ids = [5, 6, 7]
    why = refused(info, token_ids=ids, sampling=dict(top_k=BIG, temperature=1.0))
    assert why.startswith("top_k must be an integer in [0, 2147483647]") and why.endswith(str(BIG))
    assert refused(info, token_ids=ids, sampling=dict(top_k=vocab + 1)).startswith(f"top_k must be at most {vocab}")
    assert prepare(info, 1 << 20, Ask(token_ids=ids, sampling=dict(top_k=vocab)))[1].top_k == vocab
    why = refused(info, token_ids=ids, sampling=dict(stop=tuple(f"s{i}" for i in range(STOPS))))
    assert why == f"stop has {STOPS} strings; the most is {MAX_STOP}"
    why = refused(info, token_ids=ids, sampling=dict(stop=("x" * (MAX_STOP_CHARS + 1),)))
    assert why == f"stop has a string of {MAX_STOP_CHARS + 1} characters; the most is {MAX_STOP_CHARS}"
    why = refused(info, token_ids=ids, sampling=dict(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))))
    assert why.startswith(f"stop_token_ids has {MAX_STOP_TOKEN_IDS + 1} ids; the most is {MAX_STOP_TOKEN_IDS}")
    assert refused(info, token_ids=ids, sampling=dict(stop_token_ids=(2**40,))).startswith("stop_token_ids must be")
    assert refused(info, token_ids=ids, sampling=dict(max_staleness=2**70)).startswith("max_staleness must be")
    for rid in ("", "x" * 129, "a b", "a/b", "a~1", "a#0", "é", "\n"):
        assert refused(info, token_ids=ids, request_id=rid).startswith("request_id must be"), rid
    assert prepare(info, 1 << 20, Ask(token_ids=ids, request_id="A-z_0.9:x"))
    # A session key (#48): 1 to 256 characters.
    for sid in ("", "s" * 257):
        assert refused(info, token_ids=ids, session_id=sid).startswith("session_id must have 1 to 256"), sid
    assert prepare(info, 1 << 20, Ask(token_ids=ids, session_id="s" * 256))
    # n x logprobs x tokens: at most MAX_N samples of the context's entries.
    why = refused(info, token_ids=ids, sampling=dict(n=128, logprobs=20, max_tokens=ctx - 3))
    assert why.startswith("logprobs asks for") and str(128 * ctx) in why
    assert prepare(info, 1 << 20, Ask(token_ids=ids, sampling=dict(n=128, logprobs=0, max_tokens=ctx - 3)))
    # Finding 7's bound on messages: the context's tokens (each message takes at least one).
    messages = [{"role": "user", "content": ""}] * (ctx + 1)
    assert refused(info, messages=messages).startswith(f"messages has {ctx + 1} messages; the most is {ctx}")


def test_sampling_params_checked_again():
    """What the worker runs on an object it unpickled (which runs no __post_init__)."""
    p = SamplingParams(top_k=5)
    object.__setattr__(p, "top_k", BIG)
    with pytest.raises(ValueError, match="top_k"):
        p.checked()
    with pytest.raises(ValueError, match="stop has"):
        SamplingParams(stop=("a",) * (MAX_STOP + 1))


# -- through the doors, beside streams ------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(ray_local, aloop, tiny_checkpoints):
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=4, num_blocks=512),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512))
    # A worker held at a fault point misses heartbeats: give it time.
    s = Served(aloop, ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.25),
                                    decode=PoolConfig(1, num_cpus=0.25), worker_timeout_s=300,
                                    local_prefill_max_tokens=0),  # every prompt on the prefill worker's steps
               RouterConfig(port=0, http_port=0, served_model_name="tiny"))
    yield s
    s.close()


MAX_TOKENS = 48


def test_bad_requests_at_both_doors_are_refused_and_streams_go_on(served):
    """Finding 2 as found (top_k 2**63 on /v1/completions: 503 after 3 attempts, each failing the step it was
    batched in) and finding 4 (100,000 stop strings accepted), beside 4 streams in flight."""
    batch = prompts(4, seed=5)
    reference = served.reference(batch, MAX_TOKENS)
    retries = sum(served.cluster.retries.values())
    # The decode worker held while the bad requests come (48 tokens of the tiny model take about 0.3 s: a
    # loaded machine's poll could miss them).
    with streams_in_flight(served, batch, MAX_TOKENS) as streams:
        refuse_at_both_doors(served)
        assert not streams.future.done()
    assert_exact(streams.future.result(300), reference)
    assert sum(served.cluster.retries.values()) == retries  # no attempt of anyone's failed


def refuse_at_both_doors(served):
    url = f"http://127.0.0.1:{served.router.http_port}/v1/completions"
    with httpx.Client(timeout=120) as h:
        r = h.post(url, json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1.0,
                              "top_k": BIG})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
        assert "[0, 2147483647]" in r.json()["error"]["message"]
        r = h.post(url, json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8,
                              "stop": [f"stop-{i}" for i in range(STOPS)]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        assert f"the most is {MAX_STOP}" in r.json()["error"]["message"]
    with Client(served.target) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=[5, 6, 7], max_tokens=8, stop=[f"stop-{i}" for i in range(STOPS)], timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop has" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=[5, 6, 7], max_tokens=8, request_id="no spaces please", timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()


async def _collect(cluster, prompt, params, rid):
    tokens = []
    async for out in cluster.generate(prompt, params, rid):
        tokens += out.new_token_ids
        if out.error:
            raise RuntimeError(out.error)
    return tokens


def run_beside_streams(served, bad_prompt, bad_params, rid, arm=None, together: bool = False):
    """The bad request sent past the router's checks (Cluster.generate) while 4 streams run; the streams must
    come out token-exact with no attempt of theirs failed. together: the 4 prompts and the bad one are
    prefilled in one step (the prefill worker held on a filler's step while they all arrive). Returns what
    the bad request ended with (its tokens, or the exception it raised)."""
    batch = prompts(4, seed=9)
    reference = served.reference(batch, MAX_TOKENS)
    retries = sum(served.cluster.retries.values())
    prefill = served.worker("prefill")
    steps = served.stats_of(prefill).steps

    def send():  # the fault armed, then the bad request sent
        if arm is not None:
            arm()
        return asyncio.run_coroutine_threadsafe(_collect(served.cluster, bad_prompt, bad_params, rid),
                                                served.aloop.loop)

    if together:
        ray.get(prefill.handle.inject_fault.remote("step", math.inf, 1, 0))
        filler = Streams(served, prompts(1, seed=3), 4)
        assert ray.get(prefill.handle.fault_reached.remote("step", 60))
        streams = Streams(served, batch, MAX_TOKENS)
        fut = send()
    else:  # the streams in flight (the decode worker held) when the bad request is armed and sent
        with streams_in_flight(served, batch, MAX_TOKENS) as streams:
            fut = send()
    if together:  # all placed on the held worker: the step after the filler's takes them all
        # The filler, the 4 streams and the bad request (unless the worker refused it at once) on the worker.
        wait_for(lambda: ray.get(prefill.handle.prompts_submitted.remote()) >= 5 + (not fut.done()), 60,
                 what="the streams and the bad request on the prefill worker")
        ray.get(prefill.handle.release_fault.remote("step"))
        assert filler.future.result(120)[0].code == grpc.StatusCode.OK
    try:
        outcome = fut.result(120)
    except BaseException as e:  # noqa: BLE001 - returned for the test to judge
        outcome = e
    assert_exact(streams.future.result(300), reference)
    assert sum(served.cluster.retries.values()) == retries, dict(served.cluster.retries)
    if together:  # the filler's step, then one with the 4 prompts (the bad one's failure not counted)
        assert served.stats_of(prefill).steps == steps + 2
    served.settle()
    return outcome


def test_a_request_built_past_the_checks_fails_alone(served):
    """The router's checks bypassed (an object whose __post_init__ never ran): the worker checks it again at
    intake, so it never reaches a step. Before, it failed every step it was batched in and was retried."""
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=5, seed=1)
    object.__setattr__(params, "top_k", BIG)
    outcome = run_beside_streams(served, [5, 6, 7, 8], params, "past-the-checks", together=True)
    assert isinstance(outcome, ValueError) and "top_k" in str(outcome), repr(outcome)


@pytest.mark.parametrize("pool", ["decode", "prefill"])
def test_a_step_that_fails_on_one_requests_data_fails_that_request_only(served, pool):
    """A bad value the checks missed (fault point request_data on the worker, keyed to the request): the step
    it is in raises; the worker finds it, fails it alone (INVALID_ARGUMENT: the client's error, not retried)
    and runs the step again without it. On the prefill worker it shares its step with the 4 streams' prompts
    (and their KV pushes); on the decode worker, their decode steps."""
    worker = served.worker(pool)
    rid = f"bad-data-{pool}"
    arm = lambda: ray.get(worker.handle.inject_fault.remote("request_data", 0.0, 1000, 0, f"{rid}#"))  # noqa: E731
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        outcome = run_beside_streams(served, prompts(1, seed=77)[0], params, rid, arm, together=pool == "prefill")
    finally:
        ray.get(worker.handle.disarm_fault.remote("request_data"))
    assert isinstance(outcome, ValueError), repr(outcome)
    assert "own data failed the" in str(outcome) and "request_data" in str(outcome)
