"""The OpenAI-compatible HTTP door beside gRPC: /v1/models, /v1/completions, /v1/chat/completions, /health.

A FastAPI app, served by uvicorn on the router's own event loop, over the same GenerationService as
gRPC: the same admission, the same cluster, the same request checks (router.admission.prepare), the
same metrics (labelled protocol="http"), the same API key and TLS. Streams are server-sent events
(`data: {json}` ... `data: [DONE]`); a client that goes away cancels its request on every worker.

Logprobs are OpenAI's: on chat, logprobs: true with top_logprobs k gives each choice
logprobs.content, one {token, logprob, bytes, top_logprobs} per generated token; on completions,
logprobs k gives logprobs {tokens, token_logprobs, top_logprobs (the k most likely and the chosen token,
by text), text_offset}. A logprob of -inf (a token the "processed" distribution masked out) is written
as MIN_LOGPROB, JSON having no -inf. Extensions, by vLLM's names: prompt_logprobs (a list, None for
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

What OpenAI's API has and pdserve does not (echo, suffix, best_of, tools, logit bias, JSON mode) is a
400 that names the field, and so is a value out of range (the field as the request named
it: top_logprobs, presence_penalty, min_tokens, ...). Every error uses OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 bad input (a body that is not a JSON object
included), 401 missing or wrong key, 404 unknown model or path, 405 wrong method, 413 a body over
the bound, 429 admission queue full, 503 draining, the workers failed the request, or the door holds
its budget of request bodies. The request bodies and the error are in router.openai_schema.

Request bodies are bounded while they are read (_BodyLimit), so bad input cannot take the router's
memory: RouterConfig.max_request_body_bytes for one body, request_body_budget_bytes for all of them.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.tiers import ServiceTier, parse_tier
from router.admission import DEFAULT_MAX_TOKENS, Overloaded, RequestFailed, Samples, prepare
from router.openai_schema import BaseCompletionRequest, ChatCompletionRequest, CompletionRequest, HTTPError
from router.tracking import Timeline

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
MIN_LOGPROB = -9999.0  # what a logprob of -inf is written as: JSON has no -inf


def build_app(service, model_name: str, api_key: str | None, max_body_bytes: int, body_budget_bytes: int) -> FastAPI:
    """service: the router's GenerationService (cluster, admission, metrics, serving flag, limits).
    max_body_bytes: the most one request body may have; body_budget_bytes: the most all the bodies the
    door holds at once may have (app.state.bodies counts them)."""
    app = FastAPI(title="pdserve (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.bodies = BodyBudget(max_body_bytes, body_budget_bytes)
    app.add_middleware(_BodyLimit, bodies=app.state.bodies, metrics=service.metrics)
    if api_key:  # added last, so it runs first: a request without the key reads nothing of its body
        app.add_middleware(_ApiKey, expected=f"Bearer {api_key}".encode())
    info = service.cluster.info
    names = {model_name, info.path}
    vocab = _Vocab(info.tokenizer)
    created = int(time.time())

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
        # FastAPI's own: a body it could not read (not UTF-8), no such path, a method the path does not take.
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

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok" if service.serving else "draining"},
                            status_code=200 if service.serving else 503)

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
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise HTTPError(400, "a batch of prompts is not supported: send one prompt per request", param="prompt")
            prompt = prompt[0]
        fields = dict(token_ids=list(prompt)) if isinstance(prompt, list) else dict(prompt=prompt)
        return await _serve(body, request, "text_completion", fields, body.max_tokens, DEFAULT_MAX_TOKENS)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        messages = [{"role": m.role, "content": _text(m.content, i)} for i, m in enumerate(body.messages)]
        # As OpenAI's chat API: with no limit given, up to the end of the context.
        return await _serve(body, request, "chat.completion", dict(messages=messages),
                            body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
                            None)

    async def _serve(body: BaseCompletionRequest, request: Request, kind: str, fields: dict, max_tokens: int | None,
                     default_max_tokens: int | None):
        t = Timeline("http")
        try:
            if body.model not in names:
                raise HTTPError(404, f"the model {body.model!r} does not exist; this server has {model_name!r}",
                                param="model", code="model_not_found", grpc_code="NOT_FOUND")
            for field, why in body.refused():
                raise HTTPError(400, why, param=field)
            if not service.serving:
                raise HTTPError(503, "the router is draining; retry on another replica", kind="server_error",
                                grpc_code="UNAVAILABLE")
            stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
            try:
                tier = parse_tier(body.service_tier)
            except ValueError as e:
                raise HTTPError(400, str(e), param="service_tier") from None
            try:
                prompt, params = prepare(info, service.config.max_input_chars, max_tokens=max_tokens,
                                         temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                         seed=body.seed, stop=stop, stop_token_ids=tuple(body.stop_token_ids or ()),
                                         ignore_eos=body.ignore_eos, default_max_tokens=default_max_tokens,
                                         logprobs=body.logprobs_k(), prompt_logprobs=body.prompt_logprobs,
                                         logprobs_mode=body.logprobs_mode,
                                         default_logprobs_mode=service.config.logprobs_mode,
                                         version_policy=body.version_policy,
                                         default_version_policy=service.config.version_policy,
                                         max_staleness=body.max_staleness,
                                         presence_penalty=body.presence_penalty,
                                         frequency_penalty=body.frequency_penalty,
                                         repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                                         n=body.n, **fields)
            except ValueError as e:
                raise _invalid_value(body, e) from None
        except HTTPError as e:
            t.code, t.finish_reason = e.grpc_code, "none"
            t.record(service.metrics)
            raise
        t.prompt_tokens = len(prompt)
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
        run = _Run(service, t, prompt, params, rid, tier)
        chat = kind == "chat.completion"
        choices = [_Choice(chat, vocab, info.tokenizer, prompt, params, bool(body.return_token_ids), i)
                   for i in range(params.n)]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            first = await run.start()  # errors before the first token are plain HTTP errors
            return StreamingResponse(_sse(run, first, kind, rid, body.model, include_usage, choices),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(run, request, kind, rid, body.model, choices)

    return app


class _ApiKey:
    """Every path but /health needs `Authorization: Bearer <key>`, checked before the body is read. A
    plain ASGI middleware: Starlette's BaseHTTPMiddleware would wrap `receive` and hide a client's
    disconnect from the handler (and with it the cancel on the workers)."""

    def __init__(self, app, expected: bytes):
        self.app, self.expected = app, expected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                error = HTTPError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                  code="invalid_api_key", grpc_code="UNAUTHENTICATED")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyBudget:
    """The HTTP door's bounds on request bodies, and the bytes of them it holds now."""

    def __init__(self, limit: int, total: int):
        self.limit, self.total = limit, total
        self.held = 0  # bytes of bodies being read, or read and their request not yet answered

    def check(self, size: int, more: int) -> HTTPError | None:
        """The answer to a request whose body has reached `size` bytes (or says it will) and needs `more`
        of the budget now; None: go on."""
        if size > self.limit:
            return HTTPError(413, f"the request body has more than {self.limit} bytes, the most this server reads "
                                  "(--max-request-body-bytes)", code="request_too_large",
                             grpc_code="RESOURCE_EXHAUSTED")
        if self.held + more > self.total:
            return HTTPError(503, f"the server holds {self.held} bytes of request bodies and this one would pass its "
                                  f"budget of {self.total} (--request-body-budget-bytes); retry shortly",
                             kind="server_error", code="server_busy", grpc_code="UNAVAILABLE",
                             headers={"Retry-After": "1"})
        return None


class _BodyLimit:
    """Request bodies bounded while they are read (plain ASGI, as _ApiKey). A Content-Length over the
    bound is answered 413 before a byte of the body is read; a body without one (chunked) is counted as
    it arrives and answered 413 the moment it passes the bound, what was read of it dropped at once. The
    bodies the door holds at once (being read, or read and their request not yet answered) have a budget
    in bytes: a request that would pass it is answered 503 at once (Retry-After: 1), never kept waiting.
    Behind a refusal the server (uvicorn) reads the rest of the body and drops it, so a client that sends
    its whole body before it reads gets the answer too, and nothing of it stays in memory.

    The body is read here, whole, before the app runs (FastAPI reads it whole anyway): one message is
    handed on as it came, several are joined once (the join Starlette would do), so a normal body is not
    copied again; later receives pass through (disconnects)."""

    def __init__(self, app, bodies: BodyBudget, metrics):
        self.app, self.bodies, self.metrics = app, bodies, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        bodies, held, chunks = self.bodies, 0, []
        try:
            length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
            error = bodies.check(int(length), int(length)) if length is not None and length.isdigit() else None
            while error is None:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away before its body was whole: nobody to answer
                chunk = message.get("body", b"")
                error = bodies.check(held + len(chunk), len(chunk))
                if error is None:
                    bodies.held += len(chunk)
                    held += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
            if error is not None:
                chunks.clear()
                bodies.held -= held
                held = 0
                t = Timeline("http")
                t.code = error.grpc_code
                t.record(self.metrics)
                await error.response()(scope, receive, send)
                return
            body: bytes | None = b"".join(chunks)  # one chunk: that very object, no copy
            chunks.clear()

            async def replay():
                nonlocal body
                if body is None:
                    return await receive()
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message

            await self.app(scope, replay, send)
        finally:
            bodies.held -= held


def _model_card(name: str, created: int, info) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "pdserve",
            "max_model_len": info.max_model_len}


def _text(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise HTTPError(400, f"messages[{index}]: only text content is supported, got {part.get('type')!r}",
                            param=f"messages.{index}.content")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _invalid_value(body: BaseCompletionRequest, e: ValueError) -> HTTPError:
    """The 400 for a value the request checks refused (router.admission.prepare, SamplingParams), naming the
    body's field where the message begins with the name of one ("min_tokens must be ...")."""
    message = str(e)
    m = re.match(r"(\w+) (?:must|is|has) ", message)
    if m is None or (param := body.param(m[1])) not in type(body).model_fields:
        return HTTPError(400, message)
    return HTTPError(400, param + message[len(m[1]):], param=param)


def _logprob(x: float) -> float:
    return max(x, MIN_LOGPROB)


class _Vocab:
    """Token ids as logprobs show them: each id's text (the tokenizer's decode of it alone, special tokens
    shown) and its bytes, made once per id. A byte-level BPE token gives its raw bytes, so a token holding
    part of a UTF-8 character (whose text is U+FFFD) still gives exact bytes; a byte-fallback piece
    (<0xE6>) gives its byte; other tokens the UTF-8 of their text. Without a tokenizer: "token_id:<id>"."""

    _BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer: Tokenizer | None):
        self._tok = tokenizer
        self._known: dict[int, tuple[str, list[int]]] = {}
        self._byte_level: dict[str, int] | None = None
        self._added: dict[int, str] = {}
        if tokenizer is not None:
            from tokenizers.decoders import ByteLevel

            hf = tokenizer.hf_tokenizer
            self._added = {int(i): t.content for i, t in hf.added_tokens_decoder.items()}
            backend = getattr(hf, "backend_tokenizer", None)
            if backend is not None and isinstance(backend.decoder, ByteLevel):
                self._byte_level = _byte_level_alphabet()

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of a token id."""
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._make(token_id)
        return known

    def text(self, token_id: int) -> str:
        return self(token_id)[0]

    def _make(self, token_id: int) -> tuple[str, list[int]]:
        if self._tok is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if token_id in self._added:
            return text, list(self._added[token_id].encode())
        piece = self._tok.hf_tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level is not None and all(c in self._byte_level for c in piece):
                return text, [self._byte_level[c] for c in piece]
            if (m := self._BYTE_PIECE.fullmatch(piece)) is not None:
                return text, [int(m[1], 16)]
        return text, list(text.encode())


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: printable bytes stand for themselves, the other
    68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


class _Choice:
    """A request's choice (the sample of its index) in the API's shape, built from that sample's outputs:
    streamed (piece() per output) or whole (add() per output, then whole()). Beside the text: logprobs
    (when asked), the token ids (return_token_ids), and, choice 0 alone, the prompt's fields once
    (prompt_token_ids, prompt_logprobs), which chat puts on the response and completions on the choice."""

    def __init__(self, chat: bool, vocab: _Vocab, tokenizer: Tokenizer | None, prompt: list[int],
                 params: SamplingParams, token_ids: bool, index: int = 0):
        self.chat, self.vocab, self.prompt, self.token_ids, self.index = chat, vocab, prompt, token_ids, index
        self.logprobs = params.logprobs is not None
        self.prompt_logprobs = params.prompt_logprobs is not None
        # Completions' text_offset: each token's offset is the length of the text of the tokens before it,
        # decoded as the completion's text is (with the prompt's last tokens as context). A token that ends
        # within a character the next completes is at that character's offset.
        self._offsets = (IncrementalDetokenizer(tokenizer, prompt)
                         if self.logprobs and not chat and tokenizer is not None else None)
        self._offset = 0  # characters of that text so far
        self._prompt_sent = index > 0 or not (token_ids or self.prompt_logprobs)
        self.text, self.finish = "", None
        # What add() gathers: the choice's fields, in their shape even if no token comes; the prompt's.
        empty = {"content": []} if chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self._fields: dict[str, Any] = {"logprobs": empty if self.logprobs else None}
        if token_ids:
            self._fields["token_ids"] = []
            self._fields["weight_versions"] = []
        self._prompt: dict[str, Any] = {}

    @property
    def extras(self) -> bool:
        """Whether an output without text still has something to send (its tokens' logprobs or ids)."""
        return self.logprobs or self.token_ids

    def piece(self, out: RequestOutput) -> tuple[dict[str, Any], dict[str, Any]]:
        """What `out` adds: the choice's fields (logprobs, token_ids) and the prompt's, the latter once: on the
        output that carries the prompt's logprobs if they were asked, else on the first (on the last at the
        latest)."""
        fields: dict[str, Any] = {"logprobs": None}
        if self.logprobs:
            fields["logprobs"] = self._chat_logprobs(out.logprobs) if self.chat else self._completion_logprobs(out)
        if self.token_ids:
            fields["token_ids"] = list(out.new_token_ids)
            fields["weight_versions"] = list(out.weight_versions)  # each token's (router.weights)
        return fields, self.prompt_fields(out, last=out.finished)

    def no_tokens(self) -> dict[str, Any]:
        """The choice's fields of a chunk without tokens (chat's first, which says the role)."""
        return {"logprobs": None, **({"token_ids": [], "weight_versions": []} if self.token_ids else {})}

    def prompt_fields(self, out: RequestOutput | None, last: bool = False) -> dict[str, Any]:
        """The prompt's fields if they are due with `out` (or, `last`, due at all) and not yet given."""
        if self._prompt_sent or not last and (out is None or self.prompt_logprobs and out.prompt_logprobs is None):
            return {}
        self._prompt_sent = True
        fields: dict[str, Any] = {}
        if self.token_ids:
            fields["prompt_token_ids"] = list(self.prompt)
        if self.prompt_logprobs:
            given = out.prompt_logprobs if out is not None else None
            fields["prompt_logprobs"] = None if given is None else self._prompt_logprobs(given)
        return fields

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        if out.finished:
            self.finish = _FINISH.get(out.finish_reason)
        fields, prompt = self.piece(out)
        for name, value in fields.items():
            if isinstance(value, list):  # token_ids, weight_versions
                self._fields[name].extend(value)
            elif isinstance(value, dict):  # logprobs: each of its lists grows
                for key, items in value.items():
                    self._fields[name][key].extend(items)
        self._prompt.update(prompt)

    def whole(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the choice, the response's own fields) once every output is in."""
        self._prompt.update(self.prompt_fields(None, last=True))
        choice: dict[str, Any] = {"index": self.index, "finish_reason": self.finish, **self._fields}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
            return choice, self._prompt
        return {**choice, "text": self.text, **self._prompt}, {}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.vocab(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": raw}

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, x) for t, x in lp.top]} for lp in logprobs or ()]}

    def _completion_logprobs(self, out: RequestOutput) -> dict[str, Any]:
        offsets = []
        for token_id in out.new_token_ids:
            offsets.append(self._offset)
            if self._offsets is not None:
                self._offset += len(self._offsets.add([token_id]))
        tokens, token_logprobs, tops = [], [], []
        for lp in out.logprobs or ():
            tokens.append(self.vocab.text(lp.token_id))
            token_logprobs.append(_logprob(lp.logprob))
            # The k most likely and the chosen token, by text (ids of the same text: the likelier one's).
            top: dict[str, float] = {}
            for t, x in (*lp.top, (lp.token_id, lp.logprob)):
                top.setdefault(self.vocab.text(t), _logprob(x))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets[:len(tokens)]}

    def _prompt_logprobs(self, logprobs: PromptLogprobs) -> list[dict[str, Any] | None]:
        """Per prompt token (None for the first) {"<id>": {logprob, rank, decoded_token}} for the token itself
        and the k most likely there."""
        out: list[dict[str, Any] | None] = []
        for lp in logprobs:
            if lp is None:
                out.append(None)
                continue
            ranked = {str(lp.token_id): {"logprob": _logprob(lp.logprob), "rank": lp.rank,
                                         "decoded_token": self.vocab.text(lp.token_id)}}
            higher = 0  # of the top entries before this one, those strictly likelier (ties share a rank)
            for i, (t, x) in enumerate(lp.top):
                if i and lp.top[i - 1][1] > x:
                    higher = i
                ranked.setdefault(str(t), {"logprob": _logprob(x), "rank": higher + 1,
                                           "decoded_token": self.vocab.text(t)})
            out.append(ranked)
        return out


class _Run:
    """One request through the router's GenerationService.run (admission, cluster, timeline), with the
    errors it raises as HTTP errors; recorded once, when closed. samples.done: its last output is in."""

    def __init__(self, service, t: Timeline, prompt: list[int], params, rid: str, tier: ServiceTier):
        self.service, self.t, self.prompt = service, t, prompt
        self._outs: AsyncIterator[RequestOutput] = service.run(prompt, params, rid, t, tier)
        self._closed = False
        self.last: RequestOutput | None = None
        self.samples = Samples(params.n)

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
            self.t.record(self.service.metrics)

    def usage(self) -> dict:
        """The prompt counted once, the completion tokens of every sample (OpenAI's usage with n > 1)."""
        out = self.last
        n = self.samples.completion_tokens
        cached = out.num_cached_tokens if out is not None else 0  # prompt tokens served by the prefix cache
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n,
                "prompt_tokens_details": {"cached_tokens": cached}}


async def _whole(run: _Run, request: Request, kind: str, rid: str, model: str,
                 choices: list[_Choice]) -> JSONResponse:
    """A non-streamed request: collect it, cancelling it if the client goes away meanwhile."""

    async def collect() -> None:
        out = await run.start()
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
               include_usage: bool, choices: list[_Choice]) -> AsyncIterator[str]:
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
            finish = _FINISH.get(out.finish_reason) if out.finished else None
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

