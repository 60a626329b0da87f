"""Logprobs, prompt logprobs, token ids, penalties and min_tokens on the OpenAI-compatible HTTP API, driven
by the official `openai` SDK (and plain httpx where the SDK hides what is checked) against a real router
over a real local Ray cluster serving SmolLM2, beside gRPC through the same router."""
from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from pdserve.client import Client
from router.openai_choices import MIN_LOGPROB, Vocab
from router.compose import build_router
from router.config import RouterConfig
from router.server import Router

pytestmark = pytest.mark.slow
MODEL = "smollm2"
CHAT = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"
REPETITIVE = "I like cats. I like dogs. I like"  # greedy repeats itself: each penalty changes its tokens
TOLERANCE = 1e-4  # gRPC carries logprobs as float32, HTTP as the engine's float


@pytest.fixture(scope="module")
def cluster(smol_1p1d):
    """SmolLM2 on one prefill and one decode worker: the cluster this module shares with the other API modules
    (conftest.smol_1p1d)."""
    return smol_1p1d


def start(aloop, cluster, **kw) -> Router:
    r = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name=MODEL, **kw))
    aloop.run(r.start())
    return r


@pytest.fixture(scope="module")
def router(aloop, cluster):
    r = start(aloop, cluster)
    yield r
    aloop.run(r.stop(grace=5))


def sdk_of(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def sdk(router):
    return sdk_of(router)


@pytest.fixture(scope="module")
def grpc_client(router):
    with Client(f"127.0.0.1:{router.port}") as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(cluster):
    return cluster.info.tokenizer


def descending(values) -> bool:
    values = list(values)
    return values == sorted(values, reverse=True)


def wire(x: float) -> float:
    """A logprob as the HTTP API writes it."""
    return max(x, MIN_LOGPROB)


# -- token strings and bytes ----------------------------------------------------------------------------------

def test_token_bytes_are_the_tokens_raw_bytes(tokenizer):
    """A character split across byte-level tokens: each token's text is U+FFFD, its bytes are exact, and the
    tokens' bytes together are the text's UTF-8. Special tokens are shown; without a tokenizer, ids are."""
    text = "héllo 日本語 wörld"
    ids = tokenizer.encode(text)
    vocab = Vocab(tokenizer)
    assert any(vocab(i)[0] == "\ufffd" for i in ids)  # the text does split a character
    assert b"".join(bytes(vocab(i)[1]) for i in ids) == text.encode()
    assert vocab(tokenizer.eos_token_ids[0])[0] == tokenizer.decode([tokenizer.eos_token_ids[0]],
                                                                    skip_special_tokens=False) != ""
    assert Vocab(None)(42) == ("token_id:42", list(b"token_id:42"))


# -- chat ---------------------------------------------------------------------------------------------------

def chat_answer(sdk, streamed: bool, **kw):
    """(text, content logprobs, token ids, prompt token ids, finish reason) of a chat completion, streamed or
    not; a stream's chunks are checked on the way (each chunk's logprobs belong to its own token ids)."""
    args = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=5,
                extra_body={"return_token_ids": True})
    args.update(kw)
    if not streamed:
        r = sdk.chat.completions.create(**args)
        c = r.choices[0]
        assert c.index == 0 and len(r.choices) == 1
        return c.message.content, c.logprobs.content, c.token_ids, r.prompt_token_ids, c.finish_reason
    chunks = list(sdk.chat.completions.create(stream=True, **args))
    text, content, ids, finish = "", [], [], None
    prompt_ids = [c.prompt_token_ids for c in chunks if getattr(c, "prompt_token_ids", None) is not None]
    assert len(prompt_ids) == 1 and chunks[0].prompt_token_ids is not None  # once, on the first chunk
    for chunk in chunks:
        c = chunk.choices[0]
        text += c.delta.content or ""
        ids += c.token_ids
        if c.logprobs is not None:
            assert len(c.logprobs.content) == len(c.token_ids)
            content += c.logprobs.content
        finish = c.finish_reason or finish
    return text, content, ids, prompt_ids[0], finish


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_under_greedy(sdk, grpc_client, tokenizer, streamed):
    text, content, ids, prompt_ids, finish = chat_answer(sdk, streamed)
    ref = grpc_client.complete(messages=CHAT, max_tokens=12, temperature=0.0, timeout=120)
    assert (text, ids, finish) == (ref.text, ref.token_ids, ref.finish_reason)
    assert prompt_ids == tokenizer.apply_chat_template(CHAT)
    assert len(content) == len(ids) == ref.usage["completion_tokens"]
    for token_id, e in zip(ids, content):
        assert len(e.top_logprobs) == 5
        assert descending(t.logprob for t in e.top_logprobs)
        # Greedy: the sampled token is the most likely one.
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
        assert e.token == tokenizer.decode([token_id], skip_special_tokens=False)
        assert e.logprob <= 0 and e.bytes == e.top_logprobs[0].bytes
    # The tokens' bytes are the text's, and the end-of-turn token's when it ended the answer.
    special = set(tokenizer.eos_token_ids)
    assert b"".join(bytes(e.bytes) for t, e in zip(ids, content) if t not in special) == text.encode()


def test_chat_without_logprobs_has_the_old_shape(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0.0)
    assert r.choices[0].logprobs is None
    assert not {"prompt_token_ids", "prompt_logprobs"} & set(r.model_extra or {})
    assert "token_ids" not in (r.choices[0].model_extra or {})
    r = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0.0, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)  # no top_logprobs: the token's alone
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens


# -- completions ----------------------------------------------------------------------------------------------

def completion_answer(sdk, streamed: bool, **kw):
    """(text, logprobs as one dict of lists, token ids, the choice's extra fields merged) of a completion."""
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0, logprobs=5,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    args.update(kw)
    choices = [sdk.completions.create(**args).choices[0]] if not streamed else \
        [chunk.choices[0] for chunk in sdk.completions.create(stream=True, **args)]
    text, merged, ids, extra = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, [], {}
    for c in choices:
        text += c.text
        ids += c.token_ids
        assert len(c.logprobs.tokens) == len(c.token_ids)
        for key in merged:
            merged[key] += getattr(c.logprobs, key)
        for key in ("prompt_token_ids", "prompt_logprobs"):
            if (c.model_extra or {}).get(key) is not None:
                assert key not in extra, f"{key} came twice"
                extra[key] = c.model_extra[key]
    return text, merged, ids, extra


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_under_greedy(sdk, grpc_client, tokenizer, streamed):
    text, lp, ids, extra = completion_answer(sdk, streamed)
    ref = grpc_client.complete(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True, timeout=120)
    assert (text, ids) == (ref.text, ref.token_ids)
    assert extra["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) == 12
    for token_id, token, logprob, top in zip(ids, lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert token == tokenizer.decode([token_id], skip_special_tokens=False)
        assert 5 <= len(top) <= 6 and descending(top.values())  # the top 5 and the chosen token, by text
        assert next(iter(top.items())) == (token, logprob)  # greedy: the chosen token is the most likely
    # Offsets into the completion's text, continuing across a stream's chunks: each token's text is there.
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for i, token in enumerate(lp["tokens"]):
        end = offsets[i + 1] if i + 1 < len(offsets) else len(text)
        assert text[offsets[i]:end] == token, (i, offsets, text)


def test_streamed_and_whole_completions_agree(sdk):
    whole, streamed = completion_answer(sdk, False), completion_answer(sdk, True)
    assert whole[0] == streamed[0] and whole[2] == streamed[2] and whole[3] == streamed[3]
    assert whole[1]["tokens"] == streamed[1]["tokens"] and whole[1]["text_offset"] == streamed[1]["text_offset"]
    assert whole[1]["token_logprobs"] == pytest.approx(streamed[1]["token_logprobs"], abs=TOLERANCE)


def test_completion_without_logprobs_has_the_old_shape(router):
    r = httpx.post(f"http://127.0.0.1:{router.http_port}/v1/completions", timeout=120,
                   json=dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.0))
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["logprobs"] is None
    assert set(choice) == {"index", "text", "finish_reason", "logprobs"}


# -- prompt logprobs ------------------------------------------------------------------------------------------

def check_prompt_logprobs(entries, prompt_ids, k, tokenizer) -> None:
    assert entries is not None and len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry in zip(prompt_ids[1:], entries[1:]):
        assert str(token_id) in entry and k <= len(entry) <= k + 1  # the prompt's token and the top k
        own = entry[str(token_id)]
        assert own["decoded_token"] == tokenizer.decode([token_id], skip_special_tokens=False)
        others = [v for t, v in entry.items() if t != str(token_id)]
        assert own["rank"] >= 1 and all(v["rank"] >= 1 for v in others)
        assert descending(v["logprob"] for v in others)
        # The token's rank counts the tokens strictly likelier: the top entries above its logprob.
        assert own["rank"] == 1 + sum(v["logprob"] > own["logprob"] for v in others) or own["rank"] > k


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_prompt_logprobs(router, tokenizer, streamed):
    """The extension's shape, read from the raw JSON (where each field lies is what is checked): on the completion's
    choice, on the chat response; streamed, once, on the first chunk that has them."""
    base = f"http://127.0.0.1:{router.http_port}/v1"
    for path, body, where in (
            ("completions", dict(prompt=PROMPT), "choice"),
            ("chat/completions", dict(messages=CHAT), "response")):
        body = dict(model=MODEL, max_tokens=4, temperature=0.0, prompt_logprobs=3, stream=streamed, **body)
        with httpx.stream("POST", f"{base}/{path}", json=body, timeout=120) as r:
            assert r.status_code == 200
            raw = r.read().decode()
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")] if streamed \
            else [json.loads(raw)]
        holders = [e["choices"][0] if where == "choice" else e for e in events]
        carrying = [i for i, h in enumerate(holders) if h.get("prompt_logprobs") is not None]
        assert len(carrying) == 1, (path, carrying)
        prompt_ids = tokenizer.encode(PROMPT) if where == "choice" else tokenizer.apply_chat_template(CHAT)
        check_prompt_logprobs(holders[carrying[0]]["prompt_logprobs"], prompt_ids, 3, tokenizer)


# -- equal to gRPC --------------------------------------------------------------------------------------------

def test_logprobs_equal_grpcs(sdk, grpc_client):
    """The same request by both doors, seeded sampling: the same tokens and the same logprobs."""
    sampling = dict(max_tokens=10, temperature=0.8, top_p=0.95, seed=1234)
    ref = grpc_client.complete(PROMPT, logprobs=4, prompt_logprobs=2, timeout=120, **sampling)
    assert len(ref.logprobs) == len(ref.token_ids), "the gRPC API returned no logprobs"
    r = sdk.completions.create(model=MODEL, prompt=PROMPT, logprobs=4, **sampling,
                               extra_body={"return_token_ids": True, "prompt_logprobs": 2})
    c = r.choices[0]
    assert (c.text, c.token_ids) == (ref.text, ref.token_ids)
    assert c.logprobs.token_logprobs == pytest.approx([wire(e.logprob) for e in ref.logprobs], abs=TOLERANCE)
    for top, e in zip(c.logprobs.top_logprobs, ref.logprobs):
        assert list(top.values())[:4] == pytest.approx([wire(x) for _, x in e.top], abs=TOLERANCE)
    for got, want in zip(c.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert got[str(want.token_id)]["rank"] == want.rank
        assert got[str(want.token_id)]["logprob"] == pytest.approx(wire(want.logprob), abs=TOLERANCE)
        assert [int(t) for t in list(got)[1:]] == [t for t, _ in want.top if t != want.token_id]
    chat = sdk.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=3, **sampling)
    ref = grpc_client.complete(messages=CHAT, logprobs=3, timeout=120, **sampling)
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == ref.text and len(content) == len(ref.logprobs)
    for e, want in zip(content, ref.logprobs):
        assert e.logprob == pytest.approx(wire(want.logprob), abs=TOLERANCE)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([wire(x) for _, x in want.top], abs=TOLERANCE)


def test_processed_logprobs_write_minus_infinity_as_min_logprob(sdk):
    """top_k=3 with 5 alternatives asked, in the processed mode: the two outside the top 3 were masked out
    (-inf), written as MIN_LOGPROB; the raw mode's are finite."""
    args = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0.7, seed=5, logprobs=True, top_logprobs=5,
                extra_body={"top_k": 3, "logprobs_mode": "processed"})
    content = sdk.chat.completions.create(**args).choices[0].logprobs.content
    assert content
    for e in content:
        values = [t.logprob for t in e.top_logprobs]
        assert values[3:] == [MIN_LOGPROB] * 2 and all(v > MIN_LOGPROB for v in values[:3])
        assert math.isclose(sum(math.exp(v) for v in values[:3]), 1.0, rel_tol=1e-4)
    args["extra_body"] = {"top_k": 3, "logprobs_mode": "raw"}
    raw = sdk.chat.completions.create(**args).choices[0].logprobs.content
    assert all(t.logprob > MIN_LOGPROB for e in raw for t in e.top_logprobs)


# -- n samples -----------------------------------------------------------------------------------------------

GROUP = dict(max_tokens=10, temperature=1.0, seed=4321)


def stream_by_index(chunks, chat: bool) -> dict[int, dict]:
    """A stream's choices accumulated by index, as a client of the SDK does: each one's text, token ids,
    logprobs (chat: content entries; completions: token_logprobs) and its finish reasons (exactly one)."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = out.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": [], "finish": []})
            got["text"] += (c.delta.content or "") if chat else c.text
            got["token_ids"] += c.token_ids
            if c.logprobs is not None:
                got["logprobs"] += c.logprobs.content if chat else c.logprobs.token_logprobs
            if c.finish_reason:
                got["finish"].append(c.finish_reason)
    return out


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_chat_n_choices_equal_grpcs_samples(sdk, grpc_client, streamed):
    """logprobs with top_logprobs=5 and n=4: choice i has sample i's tokens and logprobs as gRPC streams
    them for the same request; the usage counts the prompt once."""
    ref = grpc_client.complete(messages=CHAT, n=4, logprobs=5, timeout=180, **GROUP)
    assert len({tuple(c.token_ids) for c in ref.choices}) > 1, "the samples are all alike: nothing is tested"
    args = dict(model=MODEL, messages=CHAT, n=4, logprobs=True, top_logprobs=5, extra_body={"return_token_ids": True},
                **GROUP)
    if streamed:
        chunks = list(sdk.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        got = stream_by_index(chunks, chat=True)
        usage = chunks[-1].usage
        assert all(g["finish"] and len(g["finish"]) == 1 for g in got.values())
        # Each choice's first chunk says the role, every one of them before any token.
        roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:4]]
        assert roles == [(i, "assistant") for i in range(4)]
    else:
        r = sdk.chat.completions.create(**args)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        got = {c.index: {"text": c.message.content, "token_ids": c.token_ids, "logprobs": c.logprobs.content,
                         "finish": [c.finish_reason]} for c in r.choices}
        usage = r.usage
    assert sorted(got) == [0, 1, 2, 3]
    for want in ref.choices:
        g = got[want.index]
        assert (g["text"], g["token_ids"], g["finish"]) == (want.text, want.token_ids, [want.finish_reason])
        assert len(g["logprobs"]) == len(want.logprobs)
        for e, w in zip(g["logprobs"], want.logprobs):
            assert e.logprob == pytest.approx(wire(w.logprob), abs=TOLERANCE)
            assert [t.logprob for t in e.top_logprobs] == pytest.approx([wire(x) for _, x in w.top], abs=TOLERANCE)
    assert usage.prompt_tokens == ref.usage["prompt_tokens"]  # once, not once a choice
    assert usage.completion_tokens == ref.usage["completion_tokens"] == sum(len(c.token_ids) for c in ref.choices)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_completion_n_choices_equal_grpcs_samples(sdk, grpc_client, streamed):
    ref = grpc_client.complete(PROMPT, n=3, logprobs=2, timeout=180, **GROUP)
    args = dict(model=MODEL, prompt=PROMPT, n=3, logprobs=2, extra_body={"return_token_ids": True}, **GROUP)
    if streamed:
        got = stream_by_index(sdk.completions.create(stream=True, **args), chat=False)
    else:
        r = sdk.completions.create(**args)
        got = {c.index: {"text": c.text, "token_ids": c.token_ids, "logprobs": c.logprobs.token_logprobs,
                         "finish": [c.finish_reason]} for c in r.choices}
        assert r.usage.completion_tokens == ref.usage["completion_tokens"]
        assert r.usage.prompt_tokens == ref.usage["prompt_tokens"]
        # The prompt's fields once: on choice 0.
        assert [(c.model_extra or {}).get("prompt_token_ids") is not None for c in r.choices] == [True, False, False]
    assert sorted(got) == [0, 1, 2]
    for want in ref.choices:
        g = got[want.index]
        assert (g["text"], g["token_ids"], g["finish"]) == (want.text, want.token_ids, [want.finish_reason])
        assert g["logprobs"] == pytest.approx([wire(e.logprob) for e in want.logprobs], abs=TOLERANCE)


# -- penalties and min_tokens ---------------------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [dict(presence_penalty=1.5), dict(frequency_penalty=1.0),
                                     dict(repetition_penalty=1.8)], ids=lambda p: next(iter(p)))
def test_penalties_change_greedy_tokens_as_on_grpc(sdk, grpc_client, penalty):
    args = dict(model=MODEL, prompt=REPETITIVE, max_tokens=16, temperature=0.0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    plain = sdk.completions.create(**args, extra_body=extra).choices[0].token_ids
    if "repetition_penalty" in penalty:  # an extension: the SDK sends it in the body's extra fields
        got = sdk.completions.create(**args, extra_body={**extra, **penalty})
    else:
        got = sdk.completions.create(**args, **penalty, extra_body=extra)
    got = got.choices[0].token_ids
    assert got != plain, f"{penalty} changed nothing"
    ref = grpc_client.complete(REPETITIVE, max_tokens=16, temperature=0.0, ignore_eos=True, timeout=120, **penalty)
    assert got == ref.token_ids


def test_min_tokens_holds_the_stop_back(sdk):
    """The first greedy token as a stop id ends the request at once; with min_tokens=3 it cannot before 3."""
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0)
    first = sdk.completions.create(**args, extra_body={"return_token_ids": True}).choices[0].token_ids[0]
    stop = {"stop_token_ids": [first], "return_token_ids": True}
    assert sdk.completions.create(**args, extra_body=stop).choices[0].token_ids == [first]
    held = sdk.completions.create(**args, extra_body={**stop, "min_tokens": 3})
    assert held.usage.completion_tokens >= 3 and first not in held.choices[0].token_ids[:3]


# -- bad values -----------------------------------------------------------------------------------------------

CHAT_BAD = [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),  # without logprobs: true
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0.0}), "repetition_penalty"),
    (dict(extra_body={"min_tokens": -1}), "min_tokens"),
    (dict(extra_body={"min_tokens": 5}), "min_tokens"),  # more than max_tokens (4)
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    (dict(logprobs=True, extra_body={"logprobs_mode": "sorted"}), "logprobs_mode"),
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(n=0), "n"),
    (dict(n=129), "n"),
]
COMPLETION_BAD = [
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(extra_body={"repetition_penalty": -1.0}), "repetition_penalty"),
    (dict(extra_body={"min_tokens": 9}), "min_tokens"),
    (dict(n=0), "n"),
    (dict(n=129), "n"),
]


def ids_of(cases):
    return [f"{param}:{json.dumps(kw.get('extra_body', kw))}" for kw, param in cases]


@pytest.mark.parametrize("kwargs, param", CHAT_BAD, ids=ids_of(CHAT_BAD))
def test_bad_chat_values_are_400_naming_the_field(sdk, kwargs, param):
    args = dict(model=MODEL, messages=CHAT, max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(**args)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert e.value.body["message"].startswith(param), e.value.body


@pytest.mark.parametrize("kwargs, param", COMPLETION_BAD, ids=ids_of(COMPLETION_BAD))
def test_bad_completion_values_are_400_naming_the_field(sdk, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert e.value.body["message"].startswith(f"{param} must"), e.value.body
    assert sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].finish_reason == "length"


def test_the_servers_logprobs_mode_is_the_default(aloop, cluster):
    """A router whose default is processed: a request without logprobs_mode gets masked alternatives at
    MIN_LOGPROB; one that asks for raw gets finite ones."""
    r = start(aloop, cluster, logprobs_mode="processed")
    try:
        sdk = sdk_of(r)
        args = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.7, seed=9, logprobs=4)
        default = sdk.completions.create(**args, extra_body={"top_k": 2}).choices[0].logprobs.top_logprobs
        assert default and all(sorted(top.values())[:2] == [MIN_LOGPROB] * 2 for top in default)
        raw = sdk.completions.create(**args, extra_body={"top_k": 2, "logprobs_mode": "raw"})
        assert all(v > MIN_LOGPROB for top in raw.choices[0].logprobs.top_logprobs for v in top.values())
    finally:
        aloop.run(r.stop(grace=5))
