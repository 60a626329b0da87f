"""n samples of a prompt on both doors, the router alone: a real Router (gRPC and HTTP on loopback) over a
scripted cluster that streams a group's samples interleaved, in an order of its choosing (a later sample
ending first), driven by the real Python client, `pdserve generate` and the official openai SDK. What each
door makes of the interleaved outputs is checked here message by message; tests/router/test_openai_logprobs.py
checks the same doors over a real SmolLM2 cluster (the samples' tokens and logprobs against n = 1 requests)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc
import openai
import pytest

from pdserve.client import Client
from pdserve.config import ClusterConfig, EngineConfig
from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import MAX_N
from pdserve.tiers import ServiceTier
from pdserve.v1 import generation_pb2 as pb
from router.admission import Samples
from router.compose import build_router
from router.config import RouterConfig

pytestmark = pytest.mark.slow  # it reads SmolLM2's tokenizer (and chat template) from its file
MODEL = "scripted"
PROMPT_IDS = [1, 2, 3, 4, 5]
LENGTHS = (3, 1, 4, 2)  # sample i's tokens: LENGTHS[i % 4]; sample 1 ends first, sample 2 last


def token(i: int, j: int) -> int:
    return 1000 + 37 * i + j  # token j of sample i: distinct across samples


def logprob(i: int, j: int, k: int) -> TokenLogprob:
    """Token j of sample i, with the k most likely beside it (values exact in float32)."""
    t = token(i, j)
    return TokenLogprob(t, -0.5 - j - i / 8, 1 + i, tuple((t + m, -0.25 - m) for m in range(k)))


class ScriptedCluster:
    """What the router needs of router.cluster.Cluster, streaming each request's samples round-robin, one
    token an output, as the cluster's contract has them: out.index, the sample's own token count, its
    finish reason on its last output (odd samples STOP, even LENGTH), the prompt's logprobs on sample 0's
    first output; the iterator ends when every sample has."""

    def __init__(self, info):
        self.info = info
        self.config = ClusterConfig()
        self.scaling = SimpleNamespace(workers=[], catch_up=None)  # the pools, as router.weights reads them: none
        self.params = []  # the SamplingParams of every request it was given

    def queued(self, tier: ServiceTier) -> int:
        return 0

    async def generate(self, prompt, params, request_id=None, tier=ServiceTier.DEFAULT, session=None):
        self.params.append(params)
        k = params.logprobs
        done = [0] * params.n
        while any(done[i] < LENGTHS[i % 4] for i in range(params.n)):
            for i in range(params.n):
                j = done[i]
                if j == LENGTHS[i % 4]:
                    continue
                done[i] += 1
                last = j + 1 == LENGTHS[i % 4]
                reason = (FinishReason.STOP if i % 2 else FinishReason.LENGTH) if last else None
                prompt_logprobs = None
                if i == 0 and j == 0 and params.prompt_logprobs is not None:
                    prompt_logprobs = (None, *(TokenLogprob(t, -1.5, 2, ((7, -1.0),) * params.prompt_logprobs)
                                               for t in prompt[1:]))
                await asyncio.sleep(0)
                yield RequestOutput(request_id or "r", [token(i, j)], f"<{i}.{j}>", reason, len(prompt), j + 1,
                                    num_cached_tokens=2, placement=("p0", "d0") if last else (),
                                    service_tier=tier.value, logprobs=[logprob(i, j, k)] if k is not None else None,
                                    prompt_logprobs=prompt_logprobs, index=i)


def script(i: int) -> tuple[list[int], str, str]:
    """Sample i's token ids, text and finish reason as the scripted cluster streams them."""
    n = LENGTHS[i % 4]
    return [token(i, j) for j in range(n)], "".join(f"<{i}.{j}>" for j in range(n)), "stop" if i % 2 else "length"


@pytest.fixture(scope="module")
def served(aloop):
    from pdserve.model.loader import default_model_path, load_info

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cluster = ScriptedCluster(load_info(EngineConfig()))  # the model's shapes and tokenizer; no weights
    router = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name=MODEL))
    aloop.run(router.start())
    yield cluster, router
    aloop.run(router.stop(grace=5))


@pytest.fixture(scope="module")
def client(served):
    with Client(f"127.0.0.1:{served[1].port}") as c:
        yield c


@pytest.fixture(scope="module")
def sdk(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[1].http_port}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_samples_count_the_last_output():
    s = Samples(2)
    outs = [RequestOutput("r", [1], "", None, 3, 1, index=1), RequestOutput("r", [2], "", FinishReason.STOP, 3, 1),
            RequestOutput("r", [3], "", FinishReason.LENGTH, 3, 2, index=1)]
    assert [s.add(o) for o in outs] == [False, False, True]
    assert s.completion_tokens == 3 and s.done


def test_grpc_messages_of_a_group(client, served):
    """Every message says its sample; a sample's finish reason is on its last message; the usage (prompt once,
    completion tokens summed), timings and tier served are on the stream's last message alone."""
    n = 4
    msgs = list(client.generate(token_ids=PROMPT_IDS, max_tokens=8, n=n, seed=3, logprobs=2, prompt_logprobs=1,
                                timeout=60))
    assert served[0].params[-1].n == n and served[0].params[-1].seed == 3
    for i in range(n):
        mine = [r for r in msgs if r.index == i]
        ids, text, reason = script(i)
        assert [t for r in mine for t in r.token_ids] == ids and "".join(r.text for r in mine) == text
        finish = pb.FINISH_REASON_STOP if reason == "stop" else pb.FINISH_REASON_LENGTH
        assert [r.finish_reason for r in mine] == [0] * (len(mine) - 1) + [finish]
        assert [lp.token_id for r in mine for lp in r.logprobs] == ids
    assert msgs[-1].index == 2  # the longest sample ends last
    carrying = [r.HasField("usage") or r.HasField("timings") or bool(r.service_tier) for r in msgs]
    assert carrying == [False] * (len(msgs) - 1) + [True]
    usage = msgs[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (5, sum(LENGTHS), 2)
    assert msgs[-1].service_tier == "default" and msgs[-1].timings.end_to_end_seconds > 0
    assert [bool(r.prompt_logprobs) for r in msgs] == [i == 0 for i in range(len(msgs))]


def test_the_client_gathers_a_group_by_index(client):
    out = client.complete(token_ids=PROMPT_IDS, max_tokens=8, n=3, logprobs=1, prompt_logprobs=0, timeout=60)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        ids, text, reason = script(c.index)
        assert (c.token_ids, c.text, c.finish_reason) == (ids, text, reason)
        assert [(lp.token_id, lp.logprob, lp.rank) for lp in c.logprobs] == \
            [(t.token_id, t.logprob, t.rank) for t in (logprob(c.index, j, 1) for j in range(len(ids)))]
    # The first sample's fields read directly, as a request of one sample's always have.
    ids, text, reason = script(0)
    assert (out.text, out.token_ids, out.finish_reason) == (text, ids, reason)
    assert out.usage == {"prompt_tokens": 5, "completion_tokens": 3 + 1 + 4, "cached_prompt_tokens": 2}
    assert len(out.prompt_logprobs) == 5 and out.prompt_logprobs[0] is None


def test_a_request_without_n_streams_the_messages_it_always_has(client, served):
    msgs = list(client.generate(token_ids=PROMPT_IDS, max_tokens=8, timeout=60))
    assert served[0].params[-1].n == 1
    assert all("index" not in {f.name for f, _ in r.ListFields()} for r in msgs)  # nothing new on the wire
    assert [r.finish_reason != 0 for r in msgs] == [r.HasField("usage") for r in msgs] == [False, False, True]
    assert msgs[-1].usage.completion_tokens == 3
    out = client.complete(token_ids=PROMPT_IDS, max_tokens=8, timeout=60)
    assert (out.token_ids, out.text, out.finish_reason) == script(0) and len(out.choices) == 1


@pytest.mark.parametrize("n", [0, MAX_N + 1])
def test_n_out_of_range_is_invalid_argument(client, served, n):
    asked = len(served[0].params)
    with pytest.raises(grpc.RpcError) as e:
        client.complete(token_ids=PROMPT_IDS, max_tokens=8, n=n, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("n must")
    assert len(served[0].params) == asked  # refused before the cluster


def test_pdserve_generate_prints_each_sample(served, capsys):
    from pdserve.cli import main

    args = ["generate", "--target", f"127.0.0.1:{served[1].port}", "--n", "3", "--max-tokens", "8", "hello"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(c["index"], c["token_ids"], c["text"], c["finish_reason"]) for c in out["choices"]] == \
        [(i, *script(i)) for i in range(3)]
    assert out["usage"]["completion_tokens"] == 8 and served[0].params[-1].n == 3
    assert main(args) == 0
    text = capsys.readouterr().out
    for i in range(3):
        _, sample_text, reason = script(i)
        assert f"--- sample {i} ({reason}) ---\n{sample_text}\n" in text
    assert main([*args[:3], "--n", "0", "hello"]) == 2  # refused before any call
    assert "n must be" in capsys.readouterr().err


def test_openai_completion_has_a_choice_per_sample(sdk):
    r = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=8, n=4, logprobs=2,
                               extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        ids, text, reason = script(c.index)
        assert (c.token_ids, c.text, c.finish_reason) == (ids, text, reason)
        assert c.logprobs.token_logprobs == [logprob(c.index, j, 2).logprob for j in range(len(ids))]
        # The prompt's fields once, on choice 0.
        assert ((c.model_extra or {}).get("prompt_token_ids") is not None) == (c.index == 0)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 10, 15)


def test_openai_streamed_chat_accumulates_by_index(sdk):
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                         n=3, logprobs=True, top_logprobs=2, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    texts, roles, finishes, content = {}, {}, {}, {}
    for chunk in chunks[:-1]:
        (c,) = chunk.choices  # one choice a chunk
        if c.delta.role:
            assert c.index not in texts, "a choice's role comes first, once"
            roles[c.index] = c.delta.role
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        content.setdefault(c.index, []).extend(c.logprobs.content if c.logprobs else [])
        if c.finish_reason:
            assert c.index not in finishes, "one finish chunk a choice"
            finishes[c.index] = c.finish_reason
    assert [chunk.choices[0].delta.role for chunk in chunks[:3]] == ["assistant"] * 3  # before any token
    assert roles == {i: "assistant" for i in range(3)}
    assert texts == {i: script(i)[1] for i in range(3)} and finishes == {i: script(i)[2] for i in range(3)}
    assert {i: [e.logprob for e in content[i]] for i in range(3)} == \
        {i: [logprob(i, j, 2).logprob for j in range(LENGTHS[i])] for i in range(3)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == chunks[-1].usage.total_tokens - 8 > 0


def test_best_of_stays_refused(sdk):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=8, n=2, best_of=2)
    assert e.value.body["param"] == "best_of"
