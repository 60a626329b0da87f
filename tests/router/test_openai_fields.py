"""What evals and RL clients send to the OpenAI-compatible HTTP API (#49): echo with logprobs and max_tokens 0
(the request lm-evaluation-harness scores every multiple-choice task with), several prompts in one request, the
sampling and text fields of other servers (top_k -1, min_p, include_stop_str_in_output, skip_special_tokens,
spaces_between_special_tokens, return_tokens_as_token_ids), and every field of the official SDK's request types
honoured or refused by name. Against a real router over the shared SmolLM2 cluster (conftest.smol_1p1d), beside
gRPC through the same router."""
from __future__ import annotations

import json
import typing
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdserve.client import Client
from router.config import MAX_PROMPTS

from conftest import SMOL_MODEL, wait_for

pytestmark = pytest.mark.slow
MODEL = SMOL_MODEL
PROMPT = "The capital of France is"
OTHER = "Once upon a time"
CHAT = [{"role": "user", "content": "Name three colours."}]
TOLERANCE = 1e-4  # the same logprobs through two paths of the same server (batching may reorder sums)


@pytest.fixture(scope="module")
def cluster(smol_1p1d):
    return smol_1p1d


@pytest.fixture(scope="module")
def router(smol_router):
    return smol_router


@pytest.fixture(scope="module")
def http(router):
    with httpx.Client(base_url=f"http://127.0.0.1:{router.http_port}/v1", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(router):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def grpc_client(router):
    with Client(f"127.0.0.1:{router.port}") as c:
        yield c


@pytest.fixture(scope="module")
def tok(cluster):
    return cluster.info.tokenizer


def complete(http, **body) -> dict:
    r = http.post("/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(http, path: str = "/completions", **body) -> dict:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def events(http, **body) -> list[dict]:
    with http.stream("POST", "/completions", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def idle(aloop, cluster) -> bool:
    return all(s.running == 0 and s.waiting == 0 for s in aloop.run(cluster.stats()))


# -- echo ---------------------------------------------------------------------------------------------------------

def test_echo_with_logprobs_is_the_prompts_then_the_completions(http, tok):
    """echo with logprobs k: the text is prompt + completion; logprobs cover the prompt's tokens (the first's
    logprob and top null; the others' equal to prompt_logprobs of the same server) and then the generated
    ones, each with the k most likely and the chosen one, at their offsets in the text."""
    ids = tok.encode(PROMPT)
    plain = complete(http, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=2)["choices"][0]
    echoed = complete(http, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    lp, ref = echoed["logprobs"], plain["logprobs"]
    n = len(ids)
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ids] + ref["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n):
        want = plain["prompt_logprobs"][i][str(ids[i])]["logprob"]
        assert abs(lp["token_logprobs"][i] - want) <= TOLERANCE
        assert 2 <= len(lp["top_logprobs"][i]) <= 3 and lp["tokens"][i] in lp["top_logprobs"][i]
    assert lp["token_logprobs"][n:] == pytest.approx(ref["token_logprobs"], abs=TOLERANCE)
    assert lp["top_logprobs"][n:] == [pytest.approx(t, abs=TOLERANCE) for t in ref["top_logprobs"]]
    # Offsets: the prompt's tokens' in the prompt's text, the generated ones' after it.
    assert lp["text_offset"][:n] == [len(tok.decode(ids[:i])) for i in range(n)]
    assert lp["text_offset"][n:] == [len(PROMPT) + o for o in ref["text_offset"]]
    assert "prompt_logprobs" not in echoed  # the extension's field only when asked


def test_echo_with_max_tokens_0_is_the_prompt_alone(http, tok, aloop, cluster):
    """max_tokens 0 with echo (what lm-evaluation-harness's loglikelihood requests may send): the choice is the
    prompt, no token generated anywhere in the response (usage's completion_tokens 0); streamed, the same."""
    ids = tok.encode(OTHER)
    body = dict(prompt=ids, max_tokens=0, echo=True, logprobs=1)
    r = complete(http, **body)
    choice = r["choices"][0]
    assert choice["text"] == OTHER and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                          "prompt_tokens_details": {"cached_tokens": 0}}
    chunks = events(http, stream_options={"include_usage": True}, **body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == OTHER
    got = [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
           for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert got == choice["logprobs"]["token_logprobs"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    assert refused(http, prompt=ids, max_tokens=0)["param"] == "max_tokens"  # without echo: no token to give


def test_streamed_echo_sends_the_prompt_first(http):
    chunks = [c for c in events(http, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=0)
              if c["choices"]]
    whole = complete(http, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=0)["choices"][0]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT) and first["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(whole["logprobs"]["token_logprobs"], abs=TOLERANCE)


def test_echo_with_n_samples_echoes_every_choice(http, tok):
    r = complete(http, prompt=PROMPT, max_tokens=3, temperature=1.0, seed=5, n=3, echo=True, logprobs=1)
    n = len(tok.encode(PROMPT))
    heads = [c["logprobs"]["token_logprobs"][:n] for c in r["choices"]]
    assert all(c["text"].startswith(PROMPT) for c in r["choices"]) and heads[0] == heads[1] == heads[2]
    assert r["usage"]["prompt_tokens"] == n  # the prompt counted once


# -- several prompts ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_a_list_of_prompts_is_one_choice_per_prompt_and_sample(http, tok, as_ids):
    """Prompts [a, b] with n 2: choices prompt_index * n + sample_index, each the tokens of its prompt's request
    alone; usage sums the prompts and every choice's tokens; streamed, the same choices by index."""
    prompts = [PROMPT, OTHER]
    sent = [tok.encode(p) for p in prompts] if as_ids else prompts
    body = dict(max_tokens=6, temperature=0.8, seed=11, n=2, logprobs=0, return_token_ids=True)
    r = complete(http, prompt=sent, **body)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    alone = [complete(http, prompt=p, **body) for p in sent]
    for i, one in enumerate(alone):
        for j in range(2):
            got, want = r["choices"][i * 2 + j], one["choices"][j]
            assert (got["text"], got["token_ids"]) == (want["text"], want["token_ids"])
        assert r["choices"][i * 2]["prompt_token_ids"] == tok.encode(prompts[i])
    assert r["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert r["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    texts = ["" for _ in range(4)]
    for c in events(http, prompt=sent, **body):
        if c["choices"]:
            texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == [c["text"] for c in r["choices"]]


def test_the_openai_sdk_sends_a_list_of_prompts(sdk):
    r = sdk.completions.create(model=MODEL, prompt=[PROMPT, OTHER, PROMPT], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.choices[0].text == r.choices[2].text


def test_prompts_are_bounded(http):
    error = refused(http, prompt=[[1]] * (MAX_PROMPTS + 1), max_tokens=1)
    assert error["param"] == "prompt" and str(MAX_PROMPTS) in error["message"]
    assert refused(http, prompt=[], max_tokens=1)["param"] == "prompt"


def test_one_failing_prompt_fails_the_request_and_cancels_the_others(http, aloop, cluster):
    """A prompt too long for the context (found once tokenized, after admission) beside a long-running one: the
    request is a 400 naming the context, and nothing is left running on the workers."""
    too_long = "hello " * 9000
    r = http.post("/completions", json={"model": MODEL, "prompt": [PROMPT, too_long], "max_tokens": 2000,
                                        "ignore_eos": True})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
    wait_for(lambda: idle(aloop, cluster), timeout=30, what="the workers to run nothing")
    assert complete(http, prompt=PROMPT, max_tokens=2)["choices"][0]["text"]  # still serving


# -- sampling and text fields ---------------------------------------------------------------------------------------

def test_top_k_minus_one_is_off_at_both_doors(http, grpc_client):
    body = dict(prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3)
    off = complete(http, top_k=0, **body)["choices"][0]["text"]
    assert complete(http, top_k=-1, **body)["choices"][0]["text"] == off
    assert grpc_client.complete(PROMPT, max_tokens=8, temperature=1.0, seed=3, top_k=-1, timeout=120).text == off
    assert refused(http, top_k=-2, **body)["param"] == "top_k"


def test_min_p(http, grpc_client):
    """min_p 1 keeps the most likely token alone: a sampled request is then greedy's; the processed logprobs
    of a min_p request mask the tokens below it; out of [0, 1] is refused naming it."""
    greedy = complete(http, prompt=PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
    body = dict(prompt=PROMPT, max_tokens=8, temperature=1.5, seed=9)
    assert complete(http, min_p=1.0, **body)["choices"][0]["text"] == greedy
    assert grpc_client.complete(PROMPT, min_p=1.0, timeout=120, max_tokens=8, temperature=1.5, seed=9).text == greedy
    lp = complete(http, min_p=0.5, logprobs=5, logprobs_mode="processed", **body)["choices"][0]["logprobs"]
    assert any(x <= -9999.0 for top in lp["top_logprobs"] for x in top.values())  # masked: MIN_LOGPROB
    assert refused(http, min_p=1.5, **body)["param"] == "min_p"


def test_include_stop_str_in_output(http, grpc_client):
    text = complete(http, prompt=PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    stop = text.strip().split()[0]
    cut = complete(http, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])["choices"][0]
    kept = complete(http, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                    include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == cut["text"] + stop and kept["finish_reason"] == cut["finish_reason"] == "stop"
    over_grpc = grpc_client.complete(PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                     include_stop_str_in_output=True, timeout=120)
    assert over_grpc.text == kept["text"]


def test_skip_special_tokens_and_stop_token_text(http, grpc_client, tok):
    """skip_special_tokens false shows special tokens (the chat template's, echoed); with
    include_stop_str_in_output the end-of-turn token that stopped a chat shows too."""
    ids = tok.apply_chat_template(CHAT)
    shown = complete(http, prompt=ids, max_tokens=1, echo=True, skip_special_tokens=False)["choices"][0]["text"]
    hidden = complete(http, prompt=ids, max_tokens=1, echo=True)["choices"][0]["text"]
    assert "<|im_start|>" in shown and "<|im_start|>" not in hidden
    # The three greedy replies at once, so the decode worker batches them (one after another they took ~20 s).
    with ThreadPoolExecutor(3) as pool:
        r = pool.submit(http.post, "/chat/completions", json={
            "model": MODEL, "messages": CHAT, "max_tokens": 200, "temperature": 0, "skip_special_tokens": False,
            "include_stop_str_in_output": True})
        plain = pool.submit(grpc_client.complete, messages=CHAT, max_tokens=200, temperature=0, timeout=120)
        shown_stop = pool.submit(grpc_client.complete, messages=CHAT, max_tokens=200, temperature=0,
                                 skip_special_tokens=False, include_stop_str_in_output=True, timeout=120)
        r, plain, shown_stop = r.result(), plain.result(), shown_stop.result()
    message = r.json()["choices"][0]
    assert message["finish_reason"] == "stop" and message["message"]["content"].endswith("<|im_end|>"), r.text
    assert message["message"]["content"] == plain.text + "<|im_end|>"
    assert shown_stop.text == plain.text + "<|im_end|>"


def test_spaces_between_special_tokens(http):
    """The tokenizer decodes special tokens without spaces: false is what it does, and true is taken where no
    special token is shown; true with skip_special_tokens false is refused naming it."""
    base = dict(prompt=PROMPT, max_tokens=2, temperature=0)
    assert complete(http, spaces_between_special_tokens=False, skip_special_tokens=False, **base)["choices"]
    assert complete(http, spaces_between_special_tokens=True, **base)["choices"]
    error = refused(http, spaces_between_special_tokens=True, skip_special_tokens=False, **base)
    assert error["param"] == "spaces_between_special_tokens"


def test_return_tokens_as_token_ids(http, sdk):
    r = complete(http, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True, return_token_ids=True,
                 return_tokens_as_token_ids=True)["choices"][0]
    ids = r["prompt_token_ids"] + r["token_ids"]
    assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in r["logprobs"]["top_logprobs"][1:] for k in top)
    chat = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                                   "return_token_ids": True})
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)


# -- every field honoured or refused by name ----------------------------------------------------------------------

def test_an_unknown_field_is_refused_by_name(http):
    error = refused(http, prompt=PROMPT, frobnicate=3)
    assert error["param"] == "frobnicate" and "frobnicate" in error["message"]
    error = refused(http, "/chat/completions", messages=CHAT, use_beam_search=True)
    assert error["param"] == "use_beam_search"
    assert refused(http, prompt=PROMPT, stream_options={"include_usage": True, "x": 1})["param"] == "stream_options.x"


# The SDK's fields this server honours, each with the test that shows it (in this module or another).
HONOURED = {
    "model": "test_openai_api.py::test_unknown_model_is_404_and_wrong_key_is_401",
    "prompt": "test_a_list_of_prompts_is_one_choice_per_prompt_and_sample",
    "messages": "test_openai_api.py::test_streamed_chat_equals_grpc",
    "echo": "test_echo_with_logprobs_is_the_prompts_then_the_completions",
    "logprobs": "test_openai_logprobs.py", "top_logprobs": "test_openai_logprobs.py",
    "max_tokens": "test_echo_with_max_tokens_0_is_the_prompt_alone",
    "max_completion_tokens": "test_openai_logprobs.py",
    "n": "test_a_list_of_prompts_is_one_choice_per_prompt_and_sample",
    "seed": "test_top_k_minus_one_is_off_at_both_doors", "temperature": "test_min_p",
    "top_p": "test_openai_api.py::test_streamed_chat_equals_grpc",
    "stop": "test_include_stop_str_in_output",
    "stream": "test_streamed_echo_sends_the_prompt_first",
    "stream_options": "test_echo_with_max_tokens_0_is_the_prompt_alone",
    "presence_penalty": "test_openai_logprobs.py", "frequency_penalty": "test_openai_logprobs.py",
    "service_tier": "test_tiers_cluster.py",
    "user": "test_fields_with_a_meaning_here", "safety_identifier": "test_fields_with_a_meaning_here",
    "store": "test_fields_with_a_meaning_here", "modalities": "test_fields_with_a_meaning_here",
    "prompt_cache_key": "test_fields_with_a_meaning_here",
    "tools": "test_tools_door.py::test_streamed_calls_accumulate_to_the_whole_reply",
    "tool_choice": "test_tools_door.py::test_forced_choices_are_read_from_their_json",
    "parallel_tool_calls": "test_tools_door.py::test_calls_and_finish_reasons",
    "response_format": "test_structured_api.py::test_json_schema_replies_validate",
}
# A value for each of the others, which must be refused naming the field.
REFUSED_VALUES = {
    "best_of": 2, "suffix": "!", "logit_bias": {"1": 5}, "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto", "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "metadata": {"a": "b"},
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {}, "moderation": True,
    "prompt_cache_retention": "24h", "prompt_cache_options": {},
}


def sdk_fields(params_type) -> set[str]:
    return {name for member in typing.get_args(params_type) for name in typing.get_type_hints(member)}


@pytest.mark.parametrize("path,params_type", [
    ("/completions", openai.types.CompletionCreateParams),
    ("/chat/completions", openai.types.chat.CompletionCreateParams)], ids=["completions", "chat"])
def test_every_field_of_the_sdk_is_honoured_or_refused_by_name(http, path, params_type):
    fields = sdk_fields(params_type)
    assert {"model", "stream"} <= fields
    body = dict(prompt=PROMPT) if path == "/completions" else dict(messages=CHAT)
    for name in sorted(fields):
        if name in HONOURED:
            where = HONOURED[name]
            assert "::" in where or where.endswith(".py") or where in globals(), (name, where)
            continue
        assert name in REFUSED_VALUES, f"{name}: neither honoured nor refused"
        error = refused(http, path, max_tokens=1, **body, **{name: REFUSED_VALUES[name]})
        assert error["param"] == name, (name, error)


def test_fields_with_a_meaning_here(http):
    """user and safety_identifier: taken (they change no output, as with OpenAI); store: false (nothing is
    stored), true refused; modalities: ["text"], others refused; prompt_cache_key: a session key."""
    chat = dict(messages=CHAT, max_tokens=2, temperature=0)
    ok = http.post("/chat/completions", json={"model": MODEL, **chat, "user": "u1", "safety_identifier": "s",
                                              "store": False, "modalities": ["text"], "prompt_cache_key": "k"})
    assert ok.status_code == 200, ok.text
    assert refused(http, "/chat/completions", store=True, **chat)["param"] == "store"
    assert refused(http, "/chat/completions", modalities=["text", "audio"], **chat)["param"] == "modalities"
    assert refused(http, "/chat/completions", priority=5, **chat)["param"] == "priority"
    assert complete(http, prompt=PROMPT, max_tokens=1, priority=0, user="u1")["choices"]
