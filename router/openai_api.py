"""The OpenAI-compatible HTTP door beside gRPC: /v1/models, /v1/completions, /v1/chat/completions, /health.

A FastAPI app, served by uvicorn on the router's own event loop, over the front both doors share
(router.frontend): the same admission, the same cluster, the same request checks, the same metrics
(labelled protocol="http"), the same API key and TLS. This module translates: a body to an Ask (its
`ask()`, router.openai_schema), outputs to choices (router.openai_choices), errors to OpenAI's shape. Streams are server-sent events
(`data: {json}` ... `data: [DONE]`); a client that goes away cancels its request on every worker.

Logprobs are OpenAI's: on chat, logprobs: true with top_logprobs k gives each choice
logprobs.content, one {token, logprob, bytes, top_logprobs} per generated token; on completions,
logprobs k gives logprobs {tokens, token_logprobs, top_logprobs (the k most likely and the chosen token,
by text), text_offset}. A logprob of -inf (a token the "processed" distribution masked out) is written
as router.openai_choices.MIN_LOGPROB, JSON having no -inf. Extensions, by vLLM's names: prompt_logprobs (a list, None for
the first prompt token, then {"<id>": {logprob, rank, decoded_token}} for the token and the k most
likely there; chat: on the response, completions: on the choice; streamed: on the first chunk that has
them), return_token_ids (token_ids on each choice or chunk, with weight_versions: the weight version that
sampled each; prompt_token_ids beside them: chat on the response, completions on the choice),
logprobs_mode, repetition_penalty, min_tokens, version_policy and max_staleness (router.weights; a request
a weight update aborts finishes "abort"). Token strings are
the tokenizer's text of each id alone (special tokens shown), bytes their raw bytes where the tokenizer
is byte-level; a model without a tokenizer names a token "token_id:<id>".

n: n samples of the prompt (n in [1, 128]; the prompt is computed once; sample i is seeded (seed + i)
mod 2**63, so it has the tokens of the n = 1 request with that seed) are n choices, choice i sample i,
each with its own text, finish_reason, logprobs and token_ids. Streamed, a chunk holds one choice, the
one its tokens are of, and every choice has a chunk with its finish reason, in whatever order the
samples end (chat: each choice's first chunk says the role, all of them before any token). The prompt's
fields come once: on choice 0 (completions) or on the response (chat). usage counts the prompt once
and the completion tokens of every choice, as OpenAI's does.

Structured output (response_format json_object / json_schema, and the guided_* and structured_outputs
extensions: router.openai_schema) is compiled here before any work: a spec that does not compile is a 400
naming its field.

What OpenAI's API has and pdserve does not (echo, suffix, best_of, tools, logit bias) is a
400 that names the field, and so is a value out of range (the field as the request named
it: top_logprobs, presence_penalty, min_tokens, ...). Every error uses OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 bad input (a body that is not a JSON object
included), 401 missing or wrong key, 403 a control route without the admin credential, 404 unknown model or path, 405 wrong method, 413 a body over
the bound, 429 admission queue full, 503 draining, the workers failed the request, or the door holds
its budget of request bodies. The request bodies and the error are in router.openai_schema.

Request bodies are bounded while they are read (router.http_limits), so bad input cannot take the router's
memory: RouterConfig.max_request_body_bytes for one body, request_body_budget_bytes for all of them.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.engine.output import RequestOutput
from router.admission import Overloaded, RequestFailed, Samples
from router.frontend import Frontend, Prepared
from router.http_limits import BodyBudget, BodyLimit, Roles
from router.openai_choices import FINISH, Choice, Vocab
from router.openai_schema import BaseCompletionRequest, ChatCompletionRequest, CompletionRequest, HTTPError
from router.security import Access
from router.tracking import Timeline

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def _guarded_app(access: Access, control: APIRouter | None, metrics, max_body_bytes: int,
                 body_budget_bytes: int, read_timeout_s: float) -> FastAPI:
    """An app with the door's guards (router.http_limits: roles, then bounded bodies), OpenAI's error shape,
    and the control routes, if given (admin only)."""
    app = FastAPI(title="pdserve (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.bodies = BodyBudget(max_body_bytes, body_budget_bytes, read_timeout_s)
    app.add_middleware(BodyLimit, bodies=app.state.bodies, metrics=metrics)
    routes = list(control.routes) if control is not None else []
    # Added last, so it runs first: a request refused reads nothing of its body.
    app.add_middleware(Roles, access=access, is_control=lambda path: any(r.path_regex.match(path) for r in routes))
    if control is not None:
        app.include_router(control)
    _error_handlers(app)
    return app


def build_control_app(control: APIRouter, access: Access, metrics, max_body_bytes: int, body_budget_bytes: int,
                      read_timeout_s: float = 30.0) -> FastAPI:
    """The HTTP control routes alone, for the control HTTP port (RouterConfig.control_http_port)."""
    return _guarded_app(access, control, metrics, max_body_bytes, body_budget_bytes, read_timeout_s)


def build_app(front: Frontend, model_name: str, access: Access, max_body_bytes: int, body_budget_bytes: int,
              control: APIRouter | None = None, read_timeout_s: float = 30.0) -> FastAPI:
    """The app over the router's front (router.frontend). access: who may call what (router.security);
    max_body_bytes: the most one request body may have; body_budget_bytes: the most all the bodies the door
    holds at once may have (app.state.bodies counts them); control: the HTTP control routes, if served here;
    read_timeout_s: a body must arrive whole within it (RouterConfig.read_timeout_s)."""
    app = _guarded_app(access, control, front.metrics, max_body_bytes, body_budget_bytes, read_timeout_s)
    info = front.info
    names = {model_name, info.path}
    vocab = Vocab(info.tokenizer)
    created = int(time.time())

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok" if front.serving else "draining"},
                            status_code=200 if front.serving else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(model_name, created, info)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        if name not in names:
            raise HTTPError(404, f"the model {name!r} does not exist; this server has {model_name!r}",
                            param="model", code="model_not_found")
        return _model_card(model_name, created, info)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(body, request, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await _serve(body, request, "chat.completion")

    async def _serve(body: BaseCompletionRequest, request: Request, kind: str):
        t = Timeline("http")
        try:
            if body.model not in names:
                raise HTTPError(404, f"the model {body.model!r} does not exist; this server has {model_name!r}",
                                param="model", code="model_not_found", grpc_code="NOT_FOUND")
            for field, why in body.refused():
                raise HTTPError(400, why, param=field)
            if not front.serving:
                raise HTTPError(503, "the router is draining; retry on another replica", kind="server_error",
                                grpc_code="UNAVAILABLE")
            try:
                ask = body.ask()
                ask.session_id = ask.session_id or request.headers.get("x-session-id")
                prepared = front.prepare(ask)
            except ValueError as e:
                raise _invalid_value(body, e) from None
            try:
                await front.check_structured(prepared.params)
            except ValueError as e:  # a spec that does not compile
                param = body.structured_param()
                raise HTTPError(400, f"{param}: {e}" if param else str(e), param=param) from None
        except HTTPError as e:
            t.code, t.finish_reason = e.grpc_code, "none"
            t.record(front.metrics)
            raise
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
        prepared = replace(prepared, request_id=rid)
        run = _Run(front, t, prepared)
        chat = kind == "chat.completion"

        def choices() -> list[Choice]:  # once the run has started: a text prompt is tokenized once admitted
            return [Choice(chat, vocab, info.tokenizer, prepared.prompt, prepared.params, bool(body.return_token_ids),
                           i) for i in range(prepared.params.n)]

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            first = await run.start()  # errors before the first token are plain HTTP errors
            return StreamingResponse(_sse(run, first, kind, rid, body.model, include_usage, choices()),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(run, request, kind, rid, body.model, choices)

    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: the app's own HTTPError, a body that does not validate, FastAPI's own
    (a body it could not read, no such path, a method the path does not take), and anything else (500)."""

    @app.exception_handler(HTTPError)
    async def _error(request: Request, e: HTTPError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            why = (first.get("ctx") or {}).get("error", "JSON decode error")
            return HTTPError(400, f"the body is not valid JSON: {why} at position {first['loc'][-1]}").response()
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        if not where and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            return HTTPError(400, "the body must be a JSON object, sent with Content-Type: application/json").response()
        return HTTPError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                         param=where or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = {400: f"the body could not be read as JSON in UTF-8 ({e.detail})",
                   404: f"invalid URL ({request.method} {request.url.path}): this server has /v1/models, "
                        "/v1/completions, /v1/chat/completions and /health",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return HTTPError(e.status_code, message, kind=kind, headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:  # logged by the server as well
        return HTTPError(500, f"internal error: {type(e).__name__}", kind="server_error",
                         grpc_code="INTERNAL").response()


def _model_card(name: str, created: int, info) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "pdserve",
            "max_model_len": info.max_model_len}


def _invalid_value(body: BaseCompletionRequest, e: ValueError) -> HTTPError:
    """The 400 for a value the request checks refused (router.admission.prepare, SamplingParams), naming the
    body's field where the message begins with the name of one ("min_tokens must be ...")."""
    message = str(e)
    unknown = re.match(r"unknown (\w+) ", message)  # "unknown service_tier 'x'; expected ..."
    if unknown is not None and unknown[1] in type(body).model_fields:
        return HTTPError(400, message, param=unknown[1])
    m = re.match(r"(\w+) (?:must|is|has) ", message)
    if m is None or (param := body.param(m[1])) not in type(body).model_fields:
        return HTTPError(400, message)
    return HTTPError(400, param + message[len(m[1]):], param=param)


class _Run:
    """One request through the front's run (admission, cluster, timeline), with the errors it raises as HTTP
    errors; recorded once, when closed. samples.done: its last output is in."""

    def __init__(self, front: Frontend, t: Timeline, prepared: Prepared):
        self.front, self.t, self.request = front, t, prepared
        self._outs: AsyncIterator[RequestOutput] = front.run(prepared, t)
        self._closed = False
        self.last: RequestOutput | None = None
        self.samples = Samples(prepared.params.n)

    async def start(self) -> RequestOutput | None:
        """Admit and place the request; its first output (None if it produced nothing)."""
        try:
            return await self.next()
        except HTTPError as e:
            await self.close(e.grpc_code)
            raise
        except BaseException:
            await self.close("CANCELLED", "cancelled")
            raise

    async def next(self) -> RequestOutput | None:
        """The next output; HTTPError 429 (admission full), 400 (the cluster refused it) or 503 (the
        workers failed it)."""
        try:
            out = await self._outs.__anext__()
        except StopAsyncIteration:
            return None
        except Overloaded as e:
            raise HTTPError(429, str(e), kind="rate_limit_error", code="rate_limit_exceeded",
                            grpc_code="RESOURCE_EXHAUSTED") from None
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        except RequestFailed as e:
            raise HTTPError(503, str(e), kind="server_error", grpc_code="UNAVAILABLE") from None
        self.last = out
        self.samples.add(out)
        return out

    async def close(self, code: str = "OK", finish_reason: str | None = None) -> None:
        """Leave the cluster (cancelling the request there if it is still running) and record it, once."""
        if self._closed:
            return
        self._closed = True
        self.t.code = code
        if finish_reason is not None:
            self.t.finish_reason = finish_reason
        try:
            await self._outs.aclose()
        finally:
            self.t.record(self.front.metrics)

    def usage(self) -> dict:
        """The prompt counted once, the completion tokens of every sample (OpenAI's usage with n > 1)."""
        out = self.last
        n = self.samples.completion_tokens
        cached = out.num_cached_tokens if out is not None else 0  # prompt tokens served by the prefix cache
        prompt = len(self.request.prompt or ())
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached}}


async def _whole(run: _Run, request: Request, kind: str, rid: str, model: str,
                 make_choices: Callable[[], list[Choice]]) -> JSONResponse:
    """A non-streamed request: collect it, cancelling it if the client goes away meanwhile."""

    choices: list[Choice] = []

    async def collect() -> None:
        out = await run.start()
        choices.extend(make_choices())
        while out is not None:
            choices[out.index].add(out)
            if run.samples.done:
                return
            out = await run.next()

    async def gone() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    task, watch = asyncio.create_task(collect()), asyncio.create_task(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():  # the client went away (or this handler was cancelled): stop the request
            task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        await run.close("CANCELLED", "cancelled")
        raise
    except HTTPError as e:
        await run.close(e.grpc_code)
        raise
    await run.close()
    answers = [c.whole() for c in choices]
    own = answers[0][1]  # the prompt's fields (chat), which choice 0 gathers
    return JSONResponse({"id": rid, "object": kind, "created": int(time.time()), "model": model,
                         "choices": [answer for answer, _ in answers], "usage": run.usage(),
                         "service_tier": run.t.served_tier, **own})


async def _sse(run: _Run, first: RequestOutput | None, kind: str, rid: str, model: str,
               include_usage: bool, choices: list[Choice]) -> AsyncIterator[str]:
    """A streamed request as server-sent events, a chunk holding the choice of one sample. Cancelled when
    the client disconnects: the request is then cancelled on every worker (run.close)."""
    chat = kind == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def chunk(index: int, text: str | None, finish: str | None, fields: dict[str, Any], prompt: dict[str, Any],
              role: bool = False) -> str:
        """fields: the choice's (logprobs, token_ids); prompt: the prompt's, if this chunk carries them."""
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            one = {"index": index, "delta": delta, "finish_reason": finish, **fields}
        else:
            one = {"index": index, "text": text or "", "finish_reason": finish, **fields, **prompt}
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [one],
                                "service_tier": run.t.served_tier}
        if chat:
            body.update(prompt)
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    code, reason = "CANCELLED", "cancelled"
    try:
        if chat:  # each choice's first chunk says the role (as OpenAI's do with n > 1)
            for c in choices:
                yield chunk(c.index, None, None, c.no_tokens(), c.prompt_fields(first), role=True)
        out = first
        while out is not None:
            choice = choices[out.index]
            finish = FINISH.get(out.finish_reason) if out.finished else None
            fields, prompt = choice.piece(out)
            # An output without text still goes out if it has tokens whose logprobs or ids were asked.
            if out.new_text or finish or prompt or choice.extras and out.new_token_ids:
                yield chunk(out.index, out.new_text, finish, fields, prompt)
            if run.samples.done:
                break
            out = await run.next()
        if include_usage:
            last = {'id': rid, 'object': obj, 'created': created, 'model': model, 'choices': [], 'usage': run.usage(),
                    'service_tier': run.t.served_tier}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
        code, reason = "OK", None
    except HTTPError as e:  # the workers failed it mid-stream: the status line is long gone, say so in the stream
        code, reason = e.grpc_code, None
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind, 'param': None, 'code': None}})}\n\n"
    finally:
        await run.close(code, reason)

