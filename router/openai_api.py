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

Completions' prompt may be a list (of texts or of token-id lists, at most MAX_PROMPTS): each prompt is a
request of its own (_Run), all run side by side (_Runs); prompt i's sample j is choice i * n + j, usage sums
them, and one prompt's failure fails the request and cancels the others. echo: each choice's text and
logprobs begin with the prompt's (router.openai_choices); with max_tokens 0, the prompt alone (the request
runs for one token, which the front drops: Ask.prompt_only). return_tokens_as_token_ids names every token
of the logprobs "token_id:<id>".

Chat's tools and reasoning (tools, tool_choice, parallel_tool_calls, chat_template_kwargs; message.tool_calls,
reasoning_content) are router.chat_tools' and router.chat_reply's, shared with gRPC. Structured output
(response_format json_object / json_schema, and the guided_* and structured_outputs extensions:
router.openai_schema; tool_choice "required" or a named function) is compiled before any work: a spec that
does not compile is a 400 naming its field.

A field a body does not declare, and what OpenAI's API has and pdserve does not (suffix, best_of, the legacy
functions, logit bias, ...), is a 400 that names the field, and so is a value out of range (the field as
the request named it: top_logprobs, presence_penalty, min_tokens, ...). Every error uses OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 bad input (a body that is not a JSON object
included), 401 missing or wrong key, 403 a control route without the admin credential, 404 unknown model or path, 405 wrong method, 413 a body over
the bound, 429 admission queue full, 503 draining, the workers failed the request, or the door holds
its budget of request bodies. The request bodies and the error are in router.openai_schema.

Request bodies are bounded while they are read (router.http_limits), so bad input cannot take the router's
memory: RouterConfig.max_request_body_bytes for one body, request_body_budget_bytes for all of them.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.engine.grammar import GrammarError
from pdserve.engine.logprobs import PromptLogprobs
from pdserve.engine.output import RequestOutput
from router.admission import Overloaded, RequestFailed, Samples
from router.chat_tools import FieldError
from router.frontend import Frontend, Prepared
from router.http_limits import BodyBudget, BodyLimit, Roles
from router.openai_choices import Choice, Shape, Vocab
from router.openai_schema import BaseCompletionRequest, ChatCompletionRequest, CompletionRequest, HTTPError, unknown_field
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
    vocab, ids_vocab = Vocab(info.tokenizer), Vocab(None)  # the latter: return_tokens_as_token_ids
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
                asks = body.asks()
                for ask in asks:
                    ask.session_id = ask.session_id or request.headers.get("x-session-id")
                prepared = [await front.prepare_compiled(ask) for ask in asks]
            except ValueError as e:
                raise _invalid_value(body, e) from None
        except HTTPError as e:
            t.code, t.finish_reason = e.grpc_code, "none"
            t.record(front.metrics)
            raise
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
        chat = kind == "chat.completion"
        shape = Shape(bool(body.return_token_ids), bool(getattr(body, "echo", False)), body.prompt_logprobs)
        shown = ids_vocab if body.return_tokens_as_token_ids else vocab
        # Each prompt is a request of its own (its own admission, placement and timeline), run side by side. An
        # echo with logprobs: a prompt's samples after the first wait for its logprobs, which the first carries.
        wait = shape.echo and body.logprobs_k() is not None
        runs = _Runs([_Run(front, t if i == 0 else Timeline("http"),
                           replace(p, request_id=rid if len(prepared) == 1 else f"{rid}.{i}"), wait)
                      for i, p in enumerate(prepared)])

        def choices() -> list[Choice]:  # once the runs have started: a text prompt is tokenized once admitted
            return _choices(runs, chat, shown, info.tokenizer, shape)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            await runs.start()  # errors before the first token are plain HTTP errors
            return StreamingResponse(_sse(runs, kind, rid, body.model, include_usage, choices()),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(runs, request, kind, rid, body.model, choices)

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
        if first.get("type") == "extra_forbidden":  # a field the body does not declare: refused by name
            return HTTPError(400, unknown_field(where), param=where).response()
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
    if isinstance(e, FieldError):
        return HTTPError(400, message, param=e.param)
    if isinstance(e, GrammarError):  # a structured output's spec that does not compile: the field that sent it
        param = body.structured_param() or ("tools" if getattr(body, "tools", None) else None)
        return HTTPError(400, f"{param}: {message}" if param else message, param=param)
    unknown = re.match(r"unknown (\w+) ", message)  # "unknown service_tier 'x'; expected ..."
    if unknown is not None and unknown[1] in type(body).model_fields:
        return HTTPError(400, message, param=unknown[1])
    m = re.match(r"(\w+) (?:must|is|has) ", message)
    if m is None or (param := body.param(m[1])) not in type(body).model_fields:
        return HTTPError(400, message)
    return HTTPError(400, param + message[len(m[1]):], param=param)


class _Run:
    """One request through the front's run (admission, cluster, timeline), with the errors it raises as HTTP
    errors; recorded once, when closed. samples.done: its last output is in. prompt_logprobs: the prompt's,
    once an output has carried them; wait_for_prompt: a sample after the first is not given out before them
    (an echo's logprobs begin with them)."""

    def __init__(self, front: Frontend, t: Timeline, prepared: Prepared, wait_for_prompt: bool = False):
        self.front, self.t, self.request = front, t, prepared
        self._outs: AsyncIterator[RequestOutput] = front.run(prepared, t)
        self._closed = False
        self.last: RequestOutput | None = None
        self.samples = Samples(prepared.params.n)
        self.prompt_logprobs: PromptLogprobs | None = None
        self._wait = wait_for_prompt
        self._held: collections.deque[RequestOutput] = collections.deque()

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
        while True:
            if self._held and (self.prompt_logprobs is not None or not self._wait):
                out = self._held.popleft()
                break
            out = await self._read()
            if out is None:
                if not self._held:
                    return None
                out = self._held.popleft()
                break
            if out.prompt_logprobs is not None:
                self.prompt_logprobs = out.prompt_logprobs
            if not (self._wait and self.prompt_logprobs is None and out.index > 0):
                break
            self._held.append(out)
        self.last = out
        self.samples.add(out)
        return out

    async def _read(self) -> RequestOutput | None:
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
        return out

    async def _one(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """outputs() of a single run: what the many-run loop yields for it, in the same order."""
        run, out = self.runs[0], self.firsts[0]
        while out is not None:
            yield 0, out
            if run.samples.done:
                return
            out = await self._read(0, run.next())

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

    def usage(self) -> tuple[int, int, int]:
        """(prompt, completion, cached prompt tokens): the prompt counted once, the completion tokens of every
        sample (OpenAI's usage with n > 1)."""
        out = self.last
        cached = out.num_cached_tokens if out is not None else 0  # prompt tokens served by the prefix cache
        return len(self.request.prompt or ()), self.samples.completion_tokens, cached


class _Runs:
    """The runs of one request's prompts (a completions request may send several; one prompt, one run), admitted
    and placed side by side, their outputs merged as they come. A failure of one fails the request: the error
    is that run's, and the others are cancelled on every worker."""

    def __init__(self, runs: list[_Run]):
        self.runs = runs
        self.failed: int | None = None  # the run whose error fails the request
        self.firsts: list[RequestOutput | None] = []  # each run's first output (None: it produced nothing)

    async def _read(self, i: int, step) -> RequestOutput | None:
        try:
            return await step
        except HTTPError:
            if self.failed is None:
                self.failed = i
            raise

    async def start(self) -> None:
        """Admit and place every run at once; return once each has its first output. One failing: the others
        are cancelled and its error raised."""
        tasks = [asyncio.ensure_future(self._read(i, run.start())) for i, run in enumerate(self.runs)]
        try:
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # this handler was cancelled (its client went away)
            await _cancel(tasks)
            raise
        await _cancel(pending)
        errors = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if errors:
            raise tasks[self.failed].exception() if self.failed is not None else errors[0]
        self.firsts = [t.result() for t in tasks]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(run, output) for every output after start(), the first ones first, until every run is done."""
        if len(self.runs) == 1:  # one prompt (most requests): its outputs awaited in turn, no task per output
            async for pair in self._one():
                yield pair
            return
        reads: dict[asyncio.Future, int] = {}

        def more(i: int) -> None:
            if not self.runs[i].samples.done:
                reads[asyncio.ensure_future(self._read(i, self.runs[i].next()))] = i

        try:
            for i, out in enumerate(self.firsts):
                if out is not None:
                    yield i, out
                    more(i)
            while reads:
                done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=reads.__getitem__):
                    i = reads.pop(fut)
                    out = fut.result()
                    if out is not None:
                        yield i, out
                        more(i)
        finally:
            await _cancel(list(reads))

    async def _one(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """outputs() of a single run: what the many-run loop yields for it, in the same order."""
        run, out = self.runs[0], self.firsts[0]
        while out is not None:
            yield 0, out
            if run.samples.done:
                return
            out = await self._read(0, run.next())

    async def close(self, code: str = "OK", finish_reason: str | None = None) -> None:
        """Close every run (cancelling those still running): the failed one with `code`, the others cancelled
        if the request did not end well."""
        for i, run in enumerate(self.runs):
            if code == "OK" or i == self.failed:
                await run.close(code, finish_reason)
            else:
                await run.close("CANCELLED", "cancelled")

    async def whole(self, request: Request, collect: Callable[[], Awaitable[None]]) -> None:
        """A non-streamed request: run collect() (which starts the runs and reads their outputs), cancelling it
        if the client goes away meanwhile; then close the runs with how it ended."""
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
            await self.close("CANCELLED", "cancelled")
            raise
        except HTTPError as e:
            await self.close(e.grpc_code)
            raise
        await self.close()

    def usage(self) -> dict:
        """Every prompt's tokens and every sample's completion tokens, summed over the runs."""
        prompt, completion, cached = (sum(x) for x in zip(*(run.usage() for run in self.runs)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @property
    def served_tier(self) -> str:
        return self.runs[0].t.served_tier


async def _cancel(tasks) -> None:
    """Cancel tasks and wait for them to end (their exceptions retrieved)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _choices(runs: _Runs, chat: bool, vocab: Vocab, tokenizer, shape: Shape) -> list[Choice]:
    """Every run's choices, in the response's order: prompt i's sample j is choice i * n + j."""
    out = []
    for i, run in enumerate(runs.runs):
        p = run.request
        echo_text = _prompt_text(p, tokenizer) if shape.echo else ""
        out += [Choice(chat, vocab, tokenizer, p.prompt, p.params, shape, i * p.params.n + j, j, echo_text,
                       p.reply.reply(tokenizer, p.prompt) if p.reply is not None else None)
                for j in range(p.params.n)]
    return out


def _prompt_text(request: Prepared, tokenizer) -> str:
    """An echo's text: the prompt as sent (text), or its token ids decoded as the output's text is."""
    if request.checked.ask.prompt is not None:
        return request.checked.ask.prompt
    if tokenizer is None:
        return ""
    return tokenizer.decode(request.prompt, skip_special_tokens=request.params.skip_special_tokens)


async def _whole(runs: _Runs, request: Request, kind: str, rid: str, model: str,
                 make_choices: Callable[[], list[Choice]]) -> JSONResponse:
    """A non-streamed request: collect it, cancelling it if the client goes away meanwhile."""

    choices: list[Choice] = []

    async def collect() -> None:
        await runs.start()
        choices.extend(make_choices())
        async with contextlib.aclosing(runs.outputs()) as outs:
            async for i, out in outs:
                run = runs.runs[i]
                choices[i * run.request.params.n + out.index].add(out, run.prompt_logprobs)

    await runs.whole(request, collect)
    answers = [c.whole() for c in choices]
    own = answers[0][1]  # the prompt's fields (chat), which choice 0 gathers
    return JSONResponse({"id": rid, "object": kind, "created": int(time.time()), "model": model,
                         "choices": [answer for answer, _ in answers], "usage": runs.usage(),
                         "service_tier": runs.served_tier, **own})


async def _sse(runs: _Runs, kind: str, rid: str, model: str, include_usage: bool,
               choices: list[Choice]) -> AsyncIterator[str]:
    """A streamed request as server-sent events, a chunk holding the choice of one sample. Cancelled when
    the client disconnects: the request is then cancelled on every worker (run.close)."""
    chat = kind == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def chunk(index: int, said: dict[str, Any], finish: str | None, fields: dict[str, Any], prompt: dict[str, Any],
              role: bool = False) -> str:
        """said: chat's delta fields (content, reasoning_content, tool_calls), completions' {"content": text};
        fields: the choice's (logprobs, token_ids); prompt: the prompt's, if this chunk carries them."""
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": choices[index].first_content} if role else {}
            delta.update(said)
            one = {"index": index, "delta": delta, "finish_reason": finish, **fields}
        else:
            one = {"index": index, "text": said.get("content", ""), "finish_reason": finish, **fields, **prompt}
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [one],
                                "service_tier": runs.served_tier}
        if chat:
            body.update(prompt)
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    code, reason = "CANCELLED", "cancelled"
    try:
        if chat:  # each choice's first chunk says the role (as OpenAI's do with n > 1); chat has one prompt
            for c in choices:
                yield chunk(c.index, {}, None, c.no_tokens(), c.prompt_fields(runs.firsts[0]), role=True)
        async with contextlib.aclosing(runs.outputs()) as outs:
            async for i, out in outs:
                run = runs.runs[i]
                choice = choices[i * run.request.params.n + out.index]
                text, fields, prompt = choice.piece(out, run.prompt_logprobs)
                said = choice.delta(text, out) if chat else {"content": text} if text else {}
                finish = choice.finish_of(out)  # after the delta: the reply's last piece may hold its calls
                # An output without text still goes out if it has tokens whose logprobs or ids were asked.
                if said or finish or prompt or choice.extras and out.new_token_ids:
                    yield chunk(choice.index, said, finish, fields, prompt)
        if include_usage:
            last = {'id': rid, 'object': obj, 'created': created, 'model': model, 'choices': [], 'usage': runs.usage(),
                    'service_tier': runs.served_tier}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
        code, reason = "OK", None
    except HTTPError as e:  # the workers failed it mid-stream: the status line is long gone, say so in the stream
        code, reason = e.grpc_code, None
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind, 'param': None, 'code': None}})}\n\n"
    finally:
        await runs.close(code, reason)

