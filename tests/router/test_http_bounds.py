"""The HTTP door's bounds on request bodies (#37) without a cluster: the default's arithmetic, the setting
(flag, config-file key, RouterConfig), and router.openai_api's BodyLimit driven as plain ASGI. The bounds
against a real router over loopback are in test_openai_api.py."""
from __future__ import annotations

import asyncio

import pytest

from router.cli import parse_args
from router.http_limits import BodyBudget, BodyLimit
from router.config import RouterConfig, request_size_bounds

MiB = 1 << 20


def test_the_default_is_what_the_largest_valid_request_can_take():
    # 1 Mi characters of text, at most 12 bytes each in JSON (a surrogate pair of \uXXXX escapes), 4 in
    # UTF-8; 32 bytes of JSON (8 of protobuf) a token of the context; 1 MiB for the rest.
    assert request_size_bounds(MiB, 8192) == (12 * MiB + 256 * 1024 + MiB, 4 * MiB + 64 * 1024 + MiB)
    assert request_size_bounds(MiB, 8192) == (13_893_632, 5_308_416)
    http, grpc_, budget = RouterConfig().request_bounds(8192)
    assert (http, grpc_, budget) == (13_893_632, 5_308_416, 16 * 13_893_632)
    # A JSON body as a client that escapes non-ASCII writes it: 1 Mi characters outside the BMP, with the
    # context's worth of chat messages beside them, fits.
    import json

    messages = [{"role": "user", "content": "\U0001F600" * MiB}] + [{"role": "u", "content": ""}] * 8191
    assert len(json.dumps({"model": "m", "messages": messages}).encode()) < http
    # Given, one number bounds both doors; the budget must hold one body.
    assert RouterConfig(max_request_body_bytes=MiB).request_bounds(8192) == (MiB, MiB, 16 * MiB)
    with pytest.raises(ValueError, match="request_body_budget_bytes"):
        RouterConfig(max_request_body_bytes=2 * MiB, request_body_budget_bytes=MiB)
    with pytest.raises(ValueError, match="below one request body"):
        RouterConfig(request_body_budget_bytes=MiB).request_bounds(8192)
    with pytest.raises(ValueError, match=">= 1"):
        RouterConfig(max_request_body_bytes=0)


def test_the_flags_and_the_config_file_keys(tmp_path):
    assert parse_args(["serve"]).max_request_body_bytes is None  # derived at start
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-request-body-bytes: 8388608\nrequest_body_budget_bytes: 67108864\n")
    args = parse_args(["serve", "--config", str(cfg), "--max-request-body-bytes", "4194304"])
    assert (args.max_request_body_bytes, args.request_body_budget_bytes) == (4 * MiB, 64 * MiB)


# -- BodyLimit as plain ASGI ---------------------------------------------------------------------------------------

def drive(limit: int, total: int, messages: list[dict], headers=(), held: int = 0):
    """Runs one request through BodyLimit over an app that reads its body and answers 200 (then asks
    receive once more). Returns (the statuses sent, what the app read, the budget after, held inside)."""
    bodies = BodyBudget(limit, total)
    bodies.held = held
    seen: dict = {}

    async def app(scope, receive, send):
        seen["message"] = await receive()
        seen["held"] = bodies.held
        seen["then"] = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    queue = list(messages) + [{"type": "http.disconnect"}]
    sent: list[int] = []

    async def receive():
        return queue.pop(0)

    async def send(message):
        if message["type"] == "http.response.start":
            sent.append(message["status"])

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": list(headers)}
    asyncio.run(BodyLimit(app, bodies, None)(scope, receive, send))
    return sent, seen, bodies


def test_a_normal_body_is_handed_on_as_it_came():
    body = b'{"model": "m", "prompt": "' + b"x" * 100_000 + b'"}'
    sent, seen, bodies = drive(MiB, 4 * MiB, [{"type": "http.request", "body": body, "more_body": False}],
                               [(b"content-length", str(len(body)).encode())])
    assert sent == [200] and seen["message"]["body"] is body  # the very object: not copied
    assert seen["held"] == len(body) and bodies.held == 0  # counted while its request runs, then given back
    assert seen["then"] == {"type": "http.disconnect"}  # later receives pass through
    parts = [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.request", "body": b"cd"}]
    sent, seen, _ = drive(MiB, 4 * MiB, parts)
    assert sent == [200] and seen["message"] == {"type": "http.request", "body": b"abcd", "more_body": False}


def test_a_body_over_the_bound_or_the_budget_is_answered_without_the_app():
    chunk = {"type": "http.request", "body": b"x" * 1000, "more_body": True}
    sent, seen, bodies = drive(2500, 10_000, [chunk] * 5)  # chunked: cut at the third chunk
    assert sent == [413] and not seen and bodies.held == 0
    sent, seen, _ = drive(2500, 10_000, [], [(b"content-length", b"3000")])  # declared: nothing read
    assert sent == [413] and not seen
    sent, seen, bodies = drive(2500, 10_000, [chunk] * 2, held=9000)  # the budget would be passed
    assert sent == [503] and not seen and bodies.held == 9000
    sent, seen, bodies = drive(2500, 10_000, [chunk])  # the client goes away mid-body: no answer, nothing held
    assert sent == [] and not seen and bodies.held == 0
