"""Logprobs, penalties and min_tokens on the gRPC API: the request's fields down to SamplingParams, the
response's logprobs up to the client, and real gRPC over loopback to a real router over a real local Ray
cluster serving SmolLM2, checked against the offline engine."""
from __future__ import annotations

import json
import math

import grpc
import pytest

from pdserve.client import Client, Completion, build_request
from pdserve.client.grpc_client import TokenLogprob as ClientLogprob
from pdserve.config import EngineConfig
from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling import MAX_N, SamplingParams, sample_seed
from pdserve.v1 import generation_pb2 as pb
from router.admission import ask_from_grpc, parse_wire, prepare
from router.compose import build_router
from router.config import RouterConfig
from router.grpc_api import response_message
from router.server import Router

from conftest import smol_1p1d_engine_config

TOLERANCE = 1e-4
PROMPT = "The capital of France is"
NEW_FIELDS = dict(logprobs=5, prompt_logprobs=3, logprobs_mode="processed", presence_penalty=0.5,
                  frequency_penalty=-0.25, repetition_penalty=1.5, min_tokens=2)


# -- the request's fields, without a cluster ----------------------------------------------------------------
@pytest.fixture(scope="module")
def info():
    from pdserve.model.loader import load_info

    return load_info(EngineConfig(model="smollm2-135m", load_format="dummy"))  # shapes only: no weights read


def parse(info, default_mode="raw", **fields) -> SamplingParams:
    """A request as the client builds it, through its wire bytes, to what the router makes of it."""
    wire = parse_wire(build_request(token_ids=[1, 2, 3], max_tokens=8, **fields).SerializeToString())
    return prepare(info, 1000, ask_from_grpc(wire), dict(logprobs_mode=default_mode))[1]


def test_new_request_fields_reach_the_sampling_params(info):
    p = parse(info, **NEW_FIELDS)
    assert (p.logprobs, p.prompt_logprobs, p.logprobs_mode, p.min_tokens) == (5, 3, "processed", 2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.5)  # exact in float32
    # The request's mode wins over the server's; an empty one is the server's.
    assert parse(info, "processed", logprobs=1, logprobs_mode="raw").logprobs_mode == "raw"
    assert parse(info, "processed", logprobs=1).logprobs_mode == "processed"
    # 0 is a value, not "unset": the sampled token's logprob alone; no penalty, explicitly.
    p = parse(info, logprobs=0, prompt_logprobs=0, presence_penalty=0.0, repetition_penalty=1.0, min_tokens=0)
    assert (p.logprobs, p.prompt_logprobs, p.presence_penalty, p.repetition_penalty) == (0, 0, 0.0, 1.0)
    assert parse(info, n=4).n == 4 and parse(info, n=MAX_N).n == MAX_N


def test_a_request_without_the_new_fields_gets_the_defaults(info):
    p = parse(info)
    assert (p.logprobs, p.prompt_logprobs, p.logprobs_mode) == (None, None, "raw")
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens, p.n) == (0.0, 0.0, 1.0, 0, 1)
    assert not p.penalized
    assert parse(info, "processed").logprobs_mode == "processed"


BAD = [
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(min_tokens=9), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(logprobs=1, logprobs_mode="x"), "logprobs_mode"),
    (dict(n=0), "n"), (dict(n=MAX_N + 1), "n"),  # 0 is a value, not "unset": refused
]


@pytest.mark.parametrize("fields, named", BAD, ids=[f"{k}={v}" for f, _ in BAD for k, v in list(f.items())[-1:]])
def test_bad_values_are_refused_naming_the_field(info, fields, named):
    with pytest.raises(ValueError, match=rf"^{named} must"):
        parse(info, **fields)


# -- the response's logprobs, without a cluster -------------------------------------------------------------
def lp(token_id: int, logprob: float, rank: int, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id, logprob, rank, tuple(top))


def test_response_logprobs_reach_the_client_as_the_engine_gave_them():
    # Values exact in float32, so the wire's rounding is not what is tested; -inf is a masked-out token.
    first = RequestOutput("r", [7, 9], "ab", None, 3, 2,
                          logprobs=[lp(7, -0.5, 1, (7, -0.5), (3, -1.25), (4, -math.inf)),
                                    lp(9, -math.inf, 40, (2, -0.125), (8, -0.25), (1, -3.0))],
                          prompt_logprobs=(None, lp(5, -2.0, 3, (1, -0.75)), lp(6, -0.25, 1, (6, -0.25))))
    then = RequestOutput("r", [4], "c", None, 3, 3, logprobs=[lp(4, -1.5, 2, (1, -1.0), (4, -1.5), (0, -2.0))])
    out = Completion()
    for o in (first, then):
        r = pb.GenerateResponse.FromString(response_message(o, None).SerializeToString())
        assert len(r.logprobs) == len(r.token_ids)
        out.add(r)
    assert out.token_ids == [7, 9, 4]
    as_client = lambda e: ClientLogprob(e.token_id, e.logprob, e.rank, e.top)  # noqa: E731
    assert out.logprobs == [as_client(e) for e in first.logprobs + then.logprobs]
    assert out.prompt_logprobs == [None, *map(as_client, first.prompt_logprobs[1:])]


def test_a_response_without_logprobs_is_the_old_message():
    out = RequestOutput("r", [7, 9], "ab", None, 3, 2)
    r = response_message(out, None)
    assert r.SerializeToString() == pb.GenerateResponse(request_id="r", text="ab", token_ids=[7, 9]).SerializeToString()
    # Asked for, with no token in this message: nothing either.
    assert not response_message(RequestOutput("r", [], "", None, 3, 2, logprobs=[]), None).logprobs


# -- a served cluster ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def offline():
    from pdserve.engine import LLMEngine

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


def close(got, want) -> bool:
    return got == want or abs(got - want) <= TOLERANCE  # == for -inf


def assert_matches(got: list[ClientLogprob | None], want, what: str) -> None:
    """The cluster's logprobs (through gRPC) against the offline engine's, position by position."""
    assert want is not None, f"the offline engine returned no {what}"
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what}[{i}]"
            continue
        assert g is not None, f"{what}[{i}]"
        assert (g.token_id, g.rank) == (w.token_id, w.rank), f"{what}[{i}]: {g} != {w}"
        assert close(g.logprob, w.logprob), f"{what}[{i}]: {g} != {w}"
        # Which of several masked-out (-inf) tokens fill the last places of the top is a tie: not compared.
        ids = lambda top: [t if math.isfinite(v) else None for t, v in top]  # noqa: E731
        assert ids(g.top) == ids(w.top), f"{what}[{i}]: {g} != {w}"
        assert all(close(a, b) for (_, a), (_, b) in zip(g.top, w.top)), f"{what}[{i}]: {g} != {w}"


@pytest.mark.slow
def test_greedy_logprobs_per_message_and_equal_to_the_offline_engine(client, offline):
    prompt = offline.tokenizer.encode(PROMPT)
    chunks = list(client.generate(token_ids=prompt, max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5,
                                  prompt_logprobs=3))
    assert len(chunks) > 1
    for r in chunks:
        assert len(r.logprobs) == len(r.token_ids)
        for token, e in zip(r.token_ids, r.logprobs):
            assert e.token_id == token and e.rank == 1  # greedy: the most likely token
            assert len(e.top) == 5
            assert [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
            assert (e.top[0].token_id, e.top[0].logprob) == (token, e.logprob)
    # The prompt's, on the message that carries the first token only: one per prompt token, the first empty.
    first = next(i for i, r in enumerate(chunks) if r.token_ids)
    assert [bool(r.prompt_logprobs) for r in chunks] == [i == first for i in range(len(chunks))]
    entries = chunks[first].prompt_logprobs
    assert len(entries) == len(prompt)
    assert [e.HasField("token") for e in entries] == [False] + [True] * (len(prompt) - 1)
    assert [e.token.token_id for e in entries[1:]] == prompt[1:]
    assert all(len(e.token.top) == 3 and e.token.rank >= 1 for e in entries[1:])

    out = Completion()
    for r in chunks:
        out.add(r)
    ref = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5,
                                                    prompt_logprobs=3))[0]
    assert out.token_ids == ref.token_ids
    assert_matches(out.logprobs, ref.logprobs, "logprobs")
    assert_matches(out.prompt_logprobs, ref.prompt_logprobs, "prompt_logprobs")


@pytest.mark.slow
def test_processed_logprobs_mask_what_the_sampler_could_not_draw(aloop, cluster, client, offline):
    prompt = offline.tokenizer.encode(PROMPT)
    sampling = dict(max_tokens=10, temperature=0.7, top_k=3, seed=11, ignore_eos=True, logprobs=5)
    out = client.complete(token_ids=prompt, logprobs_mode="processed", **sampling)
    assert len(out.logprobs) == len(out.token_ids) == 10
    for token, e in zip(out.token_ids, out.logprobs):
        assert e.token_id == token and math.isfinite(e.logprob) and 1 <= e.rank <= 3
        assert all(math.isfinite(v) for _, v in e.top[:3]) and [v for _, v in e.top[3:]] == [-math.inf] * 2
        assert math.isclose(sum(math.exp(v) for _, v in e.top[:3]), 1.0, rel_tol=1e-4)  # top-k renormalized
    ref = offline.generate([prompt], SamplingParams(logprobs_mode="processed", **sampling))[0]
    assert out.token_ids == ref.token_ids
    assert_matches(out.logprobs, ref.logprobs, "processed logprobs")
    # The same request with no mode: raw on this router, processed on one whose default is processed.
    raw = client.complete(token_ids=prompt, **sampling)
    assert raw.token_ids == out.token_ids and all(math.isfinite(v) for e in raw.logprobs for _, v in e.top)
    assert_matches(raw.logprobs, offline.generate([prompt], SamplingParams(**sampling))[0].logprobs, "raw logprobs")
    processed_router = start_router(aloop, cluster, logprobs_mode="processed")
    try:
        with Client(f"127.0.0.1:{processed_router.port}") as c:
            assert_matches(c.complete(token_ids=prompt, **sampling).logprobs, ref.logprobs, "the server's default")
    finally:
        aloop.run(processed_router.stop(grace=5))


@pytest.mark.slow
def test_penalties_and_min_tokens_match_the_offline_engine(client, offline):
    prompt = offline.tokenizer.encode(PROMPT)
    plain = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    for penalties in (dict(presence_penalty=1.5), dict(frequency_penalty=1.0), dict(repetition_penalty=1.8),
                      dict(presence_penalty=-0.5, frequency_penalty=0.5, repetition_penalty=1.2)):
        ref = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                        **penalties))[0].token_ids
        assert ref != plain, f"{penalties} changed nothing offline: the prompt does not test it"
        got = client.complete(token_ids=prompt, max_tokens=16, temperature=0.0, ignore_eos=True, **penalties)
        assert got.token_ids == ref, penalties
    # min_tokens holds a stop id back: the first greedy token as a stop id ends the request at once without it.
    stop = [plain[0]]
    assert client.complete(token_ids=prompt, max_tokens=8, temperature=0.0, stop_token_ids=stop).token_ids == stop
    got = client.complete(token_ids=prompt, max_tokens=8, temperature=0.0, stop_token_ids=stop, min_tokens=3)
    ref = offline.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=tuple(stop),
                                                    min_tokens=3))[0]
    assert got.token_ids == ref.token_ids and len(got.token_ids) >= 3 and stop[0] not in got.token_ids[:3]


@pytest.mark.slow
@pytest.mark.parametrize("fields, named", BAD, ids=[f"{k}={v}" for f, _ in BAD for k, v in list(f.items())[-1:]])
def test_bad_values_are_invalid_argument_and_the_server_keeps_serving(client, fields, named):
    with pytest.raises(grpc.RpcError) as e:
        client.complete(prompt=PROMPT, max_tokens=8, timeout=60, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(f"{named} must")
    assert client.health(timeout=10) == "SERVING"
    assert client.complete(prompt=PROMPT, max_tokens=2, timeout=120).finish_reason == "length"


@pytest.mark.slow
def test_a_request_without_the_new_fields_is_served_as_before(client, offline):
    prompt = offline.tokenizer.encode(PROMPT)
    request = build_request(token_ids=prompt, max_tokens=10, temperature=0.0, ignore_eos=True)
    # The bytes an older client sends: no field of this change set.
    assert not {f.name for f, _ in request.ListFields()} & {"logprobs", "prompt_logprobs", "logprobs_mode"}
    assert {f.name for f, _ in request.sampling.ListFields()} == {"temperature"}
    chunks = list(client.stub.Generate(request, timeout=120))
    assert all(not r.logprobs and not r.prompt_logprobs for r in chunks)
    ref = offline.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert [t for r in chunks for t in r.token_ids] == ref.token_ids
    assert "".join(r.text for r in chunks) == ref.text


@pytest.mark.slow
def test_each_sample_of_n_is_the_n1_request_of_its_seed(client, offline):
    """n=4 seeded s over gRPC: sample i has the tokens and logprobs of the n = 1 request seeded sample_seed(s, i),
    and of the offline engine's sample i."""
    prompt = offline.tokenizer.encode(PROMPT)
    sampling = dict(max_tokens=12, temperature=1.0, top_k=40, logprobs=5)
    seed = 2**63 - 2  # the last samples' seeds wrap around to 0
    group = client.complete(token_ids=prompt, n=4, seed=seed, timeout=180, **sampling)
    assert [c.index for c in group.choices] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in group.choices}) > 1, "the samples are all alike: nothing is tested"
    ref = offline.generate([prompt], SamplingParams(n=4, seed=seed, **sampling))
    for c, want in zip(group.choices, ref):
        alone = client.complete(token_ids=prompt, seed=sample_seed(seed, c.index), timeout=120, **sampling)
        assert (c.token_ids, c.text, c.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
        assert_matches(c.logprobs, alone.logprobs, f"sample {c.index}'s logprobs")
        assert c.token_ids == want.token_ids
        assert_matches(c.logprobs, want.logprobs, f"sample {c.index}'s logprobs offline")
    # The usage counts the prompt once and every sample's tokens.
    assert group.usage["prompt_tokens"] == len(prompt)
    assert group.usage["completion_tokens"] == sum(len(c.token_ids) for c in group.choices)


@pytest.mark.slow
def test_pdserve_generate_prints_logprobs(router, capsys):
    from pdserve.cli import main

    target = ["--target", f"127.0.0.1:{router.port}"]
    args = ["generate", *target, "--temperature", "0", "--max-tokens", "4", "--ignore-eos", "--logprobs", "2",
            "--prompt-logprobs", "1", "--logprobs-mode", "processed", "--repetition-penalty", "1.3", PROMPT]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["logprobs"]) == len(out["token_ids"]) == 4
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"]
    assert all(len(e["top"]) == 2 and e["rank"] == 1 for e in out["logprobs"])
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == out["usage"]["prompt_tokens"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("logprobs (position, token, logprob, rank, most likely):")
    rows = lines[at + 1:]
    assert len(rows) == 4
    for row, e in zip(rows, out["logprobs"]):
        position, token, logprob, rank, *top = row.split()
        assert (int(token), logprob, rank) == (e["token_id"], f"{e['logprob']:.4f}", "#1")
        assert [int(t) for t in top[::2]] == [t for t, _ in e["top"]]
    assert main(["generate", *target, "--logprobs", "21", PROMPT]) == 2  # refused before any call
    assert "logprobs must be" in capsys.readouterr().err


@pytest.mark.slow
def test_pdserve_generate_prints_each_sample(router, client, capsys):
    from pdserve.cli import main

    args = ["generate", "--target", f"127.0.0.1:{router.port}", "--n", "2", "--seed", "5", "--temperature", "1",
            "--max-tokens", "6", "--ignore-eos", PROMPT]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["usage"]["completion_tokens"] == 12
    for c in out["choices"]:
        alone = client.complete(PROMPT, seed=sample_seed(5, c["index"]), temperature=1.0, max_tokens=6,
                                ignore_eos=True, timeout=120)
        assert (c["token_ids"], c["text"], c["finish_reason"]) == (alone.token_ids, alone.text, "length")
    assert main(args) == 0
    printed = capsys.readouterr().out
    for c in out["choices"]:
        assert f"--- sample {c['index']} (length) ---\n{c['text']}\n" in printed
