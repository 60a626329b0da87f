"""The HTTP door's guards, before a request reaches its handler: who may call what (roles), and request bodies bounded
while they are read (one body's bytes, and a budget for all the bodies held at once). Plain ASGI middleware:
Starlette's BaseHTTPMiddleware would wrap `receive` and hide a client's disconnect from the handler (and
with it the cancel on the workers)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

from router.openai_schema import HTTPError
from router.security import NEEDS_PEER, Access, Refusal
from router.tracking import Timeline


class Roles:
    """Who may call what on the HTTP door (router.security.Access): /health needs nothing, a control route
    (`is_control(path)`) the admin role, every other path the inference role; decided before the body is
    read. A plain ASGI middleware: Starlette's BaseHTTPMiddleware would wrap `receive` and hide a client's
    disconnect from the handler (and with it the cancel on the workers)."""

    def __init__(self, app, access: Access, is_control: Callable[[str], bool]):
        self.app, self.access, self.is_control = app, access, is_control

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            control = self.is_control(scope["path"])
            bearer = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            verdict = self.access.by_key(control, bearer)
            if verdict is NEEDS_PEER:
                client = scope.get("client")
                verdict = self.access.by_peer(control, bearer, client[0] if client else "", ())
            if isinstance(verdict, Refusal):
                if verdict.code.name == "UNAUTHENTICATED":
                    error = HTTPError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                      code="invalid_api_key", grpc_code="UNAUTHENTICATED")
                else:
                    error = HTTPError(403, verdict.message, kind="permission_error", code="permission_denied",
                                      grpc_code="PERMISSION_DENIED")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyBudget:
    """The HTTP door's bounds on request bodies (one body's bytes, all bodies' bytes, the seconds a body may
    take to arrive), and the bytes of them it holds now."""

    def __init__(self, limit: int, total: int, read_timeout_s: float = 30.0):
        self.limit, self.total, self.read_timeout_s = limit, total, read_timeout_s
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


class BodyLimit:
    """Request bodies bounded while they are read (plain ASGI, as Roles). A Content-Length over the
    bound is answered 413 before a byte of the body is read; a body without one (chunked) is counted as
    it arrives and answered 413 the moment it passes the bound, what was read of it dropped at once. The
    bodies the door holds at once (being read, or read and their request not yet answered) have a budget
    in bytes: a request that would pass it is answered 503 at once (Retry-After: 1), never kept waiting.
    A body that has not arrived whole within the read timeout of the request's start is answered 408 and
    dropped: a stalled upload gives its share of the budget back (16 stalled ones held all of it, for ever).
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
        deadline = time.monotonic() + bodies.read_timeout_s
        try:
            length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
            error = bodies.check(int(length), int(length)) if length is not None and length.isdigit() else None
            while error is None:
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    error = HTTPError(408, f"the request body did not arrive within {bodies.read_timeout_s:g} s "
                                           "(--http-read-timeout)", code="request_timeout",
                                      grpc_code="DEADLINE_EXCEEDED", headers={"Connection": "close"})
                    break
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


def head_deadline(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's head: a connection that opens (or is kept
    alive after a response) and has not sent a whole request line and headers within read_timeout_s is
    closed. uvicorn times out only a kept-alive connection that sends nothing: one that sends a byte at a time
    held its place (and a connection of --max-connections) for ever."""

    class DeadlineH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._arm()

        def _arm(self) -> None:
            self._waiting_for = self.cycle  # a new cycle is the next request's head, whole
            self._head_timer = self.loop.call_later(read_timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def handle_events(self) -> None:
            super().handle_events()
            if self._head_timer is not None and self.cycle is not self._waiting_for:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._head_timer is None:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.cycle is self._waiting_for and not self.transport.is_closing():
                self.transport.close()

    return DeadlineH11
