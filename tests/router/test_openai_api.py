"""The OpenAI-compatible HTTP API, driven by the official `openai` SDK (and plain httpx where the SDK
hides what is checked), against a real router over a real local cluster serving SmolLM2, beside gRPC."""
from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from pdserve.client import Client
from router.compose import build_router
from router.config import RouterConfig, request_size_bounds
from router.server import Router

from conftest import wait_for
from served import CANCEL_WITHIN_STEPS_SMOL, CancelWatch

pytestmark = pytest.mark.slow
KEY = "test-key"
MODEL = "smollm2"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def cluster(smol_1p1d):
    """SmolLM2 on one prefill and one decode worker: the cluster this module shares with the other API modules
    (conftest.smol_1p1d)."""
    return smol_1p1d


def start(aloop, cluster, **kw) -> Router:
    r = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name=MODEL, metrics_port=0, **kw))
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
    (dict(n=0), "n"),  # n in [1, 128]; n > 1 is served (tests/router/test_group_api.py)
    (dict(temperature=-1.0), None),
    (dict(functions=[{"name": "f", "parameters": {}}]), "functions"),  # the legacy form: tools is served
    (dict(top_logprobs=3), "top_logprobs"),  # without logprobs: true
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
    """A client that goes away mid-answer cancels its request on the decode worker: by the worker's record,
    the request, which asks for the whole context (minutes of tokens), left its batch within a few steps
    of the disconnect (a non-streamed request notices it by polling, every DISCONNECT_POLL_S = 0.25 s: about
    8 SmolLM2 steps more)."""
    url = f"http://127.0.0.1:{router.http_port}/v1/completions"
    prompt = cluster.info.tokenizer.encode("Once upon a time")
    max_tokens = cluster.info.max_model_len - len(prompt)
    body = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                stream=streamed)
    headers = {"Authorization": f"Bearer {KEY}"}

    async def go():
        watch = await CancelWatch.of(cluster.pools["decode"][0])
        rid = None  # the response's id is the request's: a non-streamed one goes away before it has one
        async with httpx.AsyncClient(timeout=120) as client:
            if streamed:
                async with client.stream("POST", url, json=body, headers=headers) as resp:
                    assert resp.status_code == 200
                    seen = 0
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            chunk = json.loads(line[6:])
                            rid = chunk["id"]
                            seen += bool(chunk["choices"][0]["text"])
                        if seen >= 3:
                            break  # leaving the block closes the connection mid-stream
                await watch.client_cancelled()
            else:
                task = asyncio.create_task(client.post(url, json=body, headers=headers))
                await asyncio.sleep(0)
                wait = asyncio.get_running_loop().time() + 60
                while router.front.admission.running == 0 and asyncio.get_running_loop().time() < wait:
                    await asyncio.sleep(0.02)
                assert router.front.admission.running == 1
                task.cancel()  # the client gives up before the answer: the connection closes
                with pytest.raises(asyncio.CancelledError):
                    await task
                await watch.client_cancelled()
        within = CANCEL_WITHIN_STEPS_SMOL + (0 if streamed else 8)
        return await watch.arrived(max_tokens, rid and f"{rid}#0", within)

    record = asyncio.run(go())
    assert record.status == "running" or not streamed, record
    wait_for(lambda: router.front.admission.running == 0, 10, what="the request to leave admission")
    wait_for(lambda: used_blocks(aloop, cluster) == 0, 30, what="zero used KV blocks")


def test_metrics_are_labelled_by_protocol(router, sdk, grpc_client):
    sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    grpc_client.complete("Hi", max_tokens=2, timeout=60)
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=0)
    text = httpx.get(f"http://127.0.0.1:{router.metrics_port}/metrics").text
    # Series with a count: every door's OK series exists at 0 from the start, so presence alone proves nothing.
    samples = {line.split(" ")[0] for line in text.splitlines()
               if line.startswith("pdserve_requests_total{") and float(line.split(" ")[1]) > 0}
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
    assert not r.front.serving


# -- bad input at the edge (#37): request bodies bounded while they are read ------------------------------------------

MiB = 1 << 20


def read_answer(s: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the HTTP response on `s`."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = s.recv(1 << 16)
        assert more, f"the connection closed before an answer: {data!r}"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = int(next(v for k, _, v in (x.partition(":") for x in lines[1:]) if k.lower() == "content-length"))
    while len(body) < length:
        body += s.recv(1 << 16)
    return int(lines[0].split()[1]), json.loads(body[:length])


def post_big(port: int, size: int, *, chunked: bool, declared: int | None = None, stop_at: int | None = None,
             piece: int = 1 << 16):
    """POST a body of `size` bytes to /v1/completions over a raw socket, never held whole (one 64 KiB piece
    sent again and again), with a Content-Length (`declared`, default `size`) or chunked, and stop sending
    as soon as an answer comes, as curl does. (status, error body, seconds from the headers to the answer,
    body bytes sent). stop_at: send that many bytes, then return the open socket without an answer."""
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size if declared is None else declared}"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{framing}\r\n\r\n")
    frame = b"%x\r\n" % piece + b"x" * piece + b"\r\n" if chunked else b"x" * piece
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(head.encode())
    t0, sent = time.monotonic(), 0
    try:
        while sent < min(size, stop_at or size) and not select.select([s], [], [], 0)[0]:
            s.sendall(frame)
            sent += piece
        if stop_at is not None:
            return s
        if chunked and sent >= size:
            s.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may close once it has answered: the answer is still there to read
    with s:
        status, body = read_answer(s)
    return status, body, time.monotonic() - t0, sent


def rss() -> int:
    """This process's resident memory in bytes: the router runs in it (the workers are Ray's processes)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


class PeakRSS:
    """The highest rss() seen while the block runs, sampled every 2 ms."""

    def __enter__(self):
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def test_bounds_default_to_what_a_valid_request_can_need(cluster, router, grpc_client):
    """One body bound for HTTP, one message bound for gRPC, from the text limit and the context (server.py
    says the arithmetic); an oversized body is refused before it is read, and a body under the bound
    reaches the checks that name the real limit."""
    max_chars, context = RouterConfig().max_input_chars, cluster.info.max_model_len
    http_bound, grpc_bound = request_size_bounds(max_chars, context)
    assert http_bound == 12 * max_chars + 32 * context + MiB and grpc_bound == 4 * max_chars + 8 * context + MiB
    assert (router.max_request_body_bytes, router.grpc_max_receive_bytes) == (http_bound, grpc_bound)
    assert router.request_body_budget_bytes == 16 * http_bound
    status, body, seconds, sent = post_big(router.http_port, 200 * MiB, chunked=False)
    assert status == 413 and f"more than {http_bound} bytes" in body["error"]["message"]
    assert body["error"]["code"] == "request_too_large" and sent < 16 * MiB and seconds < 5
    r = httpx.post(f"http://127.0.0.1:{router.http_port}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json=dict(model=MODEL, prompt="x" * (2 * max_chars), max_tokens=2), timeout=60)
    assert r.status_code == 400 and f"the limit is {max_chars}" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:  # over the gRPC bound: grpc refuses it from its length prefix
        grpc_client.complete("x" * (grpc_bound + MiB), max_tokens=2, timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as e:  # over gRPC's own 4 MiB default, under the bound: the text limit answers
        grpc_client.complete("x" * (4 * MiB + 100_000), max_tokens=2, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"the limit is {max_chars}" in e.value.details()


@pytest.mark.parametrize("request_kw, status, message", [
    (dict(method="POST", url="/v1/completions", content=b'{"model": "smollm2", "prompt": ',
          headers={"Content-Type": "application/json"}), 400, "not valid JSON"),
    (dict(method="POST", url="/v1/chat/completions", content=b'{"model": "\xff"}',
          headers={"Content-Type": "application/json"}), 400, "UTF-8"),
    (dict(method="POST", url="/v1/completions", content=b'{"model": "smollm2", "prompt": "Hi"}',
          headers={"Content-Type": "text/plain"}), 400, "Content-Type: application/json"),
    (dict(method="POST", url="/v1/completions", json=[1, 2]), 400, "a JSON object"),
    (dict(method="POST", url="/v1/embeddings", json={}), 404, "invalid URL (POST /v1/embeddings)"),
    (dict(method="GET", url="/v1/completions"), 405, "GET is not allowed"),
], ids=["malformed-json", "not-utf8", "wrong-content-type", "not-an-object", "unknown-path", "wrong-method"])
def test_every_error_has_openais_shape(router, request_kw, status, message):
    kw = dict(request_kw)
    kw["headers"] = {**kw.get("headers", {}), "Authorization": f"Bearer {KEY}"}
    kw["url"] = f"http://127.0.0.1:{router.http_port}{kw['url']}"
    r = httpx.request(**kw, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert message in error["message"], error


def test_oversized_bodies_are_cut_off_and_their_memory_is_not_kept(aloop, cluster):
    """A 200 MB body with a Content-Length, a 200 MB chunked one and four concurrent 128 MB chunked ones,
    against a 4 MiB bound and a 16 MiB budget: each is answered 413 as soon as it passes the bound, the
    router's memory grows by less than twice the budget (reading any one body whole would pass that), and
    the same request before and after gets the same tokens."""
    bound, budget = 4 * MiB, 16 * MiB
    r = start(aloop, cluster, max_request_body_bytes=bound, request_body_budget_bytes=budget)
    try:
        port, bodies = r.http_port, r.http_app.state.bodies
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        ask = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0.0,
                   extra_body={"ignore_eos": True})
        before = sdk.completions.create(**ask).choices[0].text
        rss_before = rss()
        with PeakRSS() as peak:
            declared = post_big(port, 200 * MiB, chunked=False)
            chunked = post_big(port, 200 * MiB, chunked=True)
            with ThreadPoolExecutor(4) as pool:  # four at once
                burst = list(pool.map(lambda _: post_big(port, 128 * MiB, chunked=True), range(4)))
        wait_for(lambda: bodies.held == 0, 10, what="the door to hold no body")
        rss_after = rss()
        for status, body, seconds, sent in [declared, chunked, *burst]:
            assert status == 413 and body["error"]["code"] == "request_too_large", body
            # Cut off at the bound, not read to the end: the client sent the bound and what the kernel's socket
            # buffers on both sides took (a few MiB on loopback) before the answer came.
            assert seconds < 10 and sent < bound + 32 * MiB
        growth = peak.peak - rss_before
        print(f"\nRSS before {rss_before / MiB:.0f} MiB, peak {peak.peak / MiB:.0f} MiB (+{growth / MiB:.1f}), "
              f"after {rss_after / MiB:.0f} MiB; to 413: Content-Length {declared[2] * 1000:.0f} ms, chunked "
              f"{chunked[2] * 1000:.0f} ms, burst of 4 {max(b[2] for b in burst) * 1000:.0f} ms at most; "
              f"sent {declared[3] / MiB:.1f}/{chunked[3] / MiB:.1f}/{max(b[3] for b in burst) / MiB:.1f} MiB")
        assert growth < 2 * budget, f"the router grew by {growth / MiB:.0f} MiB"
        assert rss_after - rss_before < 2 * budget

        # The budget: four bodies being read hold 15 MiB of the 16; a fifth that would pass it is 503 at once.
        held = [post_big(port, bound, chunked=False, stop_at=bound - MiB // 4) for _ in range(4)]
        wait_for(lambda: bodies.held == 4 * (bound - MiB // 4), 30, what="four bodies held")
        status, body, seconds, _ = post_big(port, 2 * MiB, chunked=False)
        assert status == 503 and body["error"]["code"] == "server_busy" and seconds < 5
        for s in held:  # their clients go away: what they held is given back
            s.close()
        wait_for(lambda: bodies.held == 0, 10, what="the held bodies to be dropped")

        assert sdk.completions.create(**ask).choices[0].text == before  # token-exact after all of it
        text = httpx.get(f"http://127.0.0.1:{r.metrics_port}/metrics").text
        assert 'code="RESOURCE_EXHAUSTED"' in text and 'code="UNAVAILABLE"' in text
    finally:
        aloop.run(r.stop(grace=5))
