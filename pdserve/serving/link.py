"""Each worker's own connection to the router: the router's per-request calls out, step outputs and replies in.

Every step's tokens cross from a worker to the router, and every request costs the router a few calls
on its workers (a prefill, a reservation, a cancel). As a Ray streaming generator each step's item cost
the router about 1.3 ms of CPU, and each Ray actor call about 1 ms with its result (the task's pickling,
a gRPC call to the actor, a future completed on the event loop: docs/benchmarks.md), more than all the
rest of the router's work for them. So each worker holds one TCP connection to the router, and both
directions carry frames: a 4-byte big-endian length, then a pickled object.

- Worker to router: a StepOutput (a step's tokens, failures and stats, and the replies to calls that
  completed). A sender thread takes the outputs from the worker's queue and merges those already
  waiting into one frame, so a router that falls behind gets several steps in one read.
- Router to worker: a call `(call_id, op, args)`, call_id 0 when no reply is wanted (a cancel). A reader
  thread on the worker runs the op's handler (WorkerActor.handlers) in arrival order; a handler returns
  its value, or a concurrent Future whose result is sent when it completes (a prefill's first token).

The calls themselves (names, arguments, results) are defined once in pdserve.serving.calls.

Ray stays the control plane (start, ready, stats, drain, shutdown, the workers' calls to each other).
Calls on one link run in the order they were sent, which Ray's calls did not promise: a cancel can no
longer overtake the call that adds its request on the same worker.

Trust is Ray's: both ends are processes of one cluster. The router accepts a connection only after its
first frame carries the cluster's random token and a worker id it expects (compared in constant time),
and unpickles nothing before that. A worker that dies closes its socket: the router sees the link end at
once, and every call still waiting on it fails with LinkClosed.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import pickle
import queue
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pdserve.serving.messages import Reply, StepOutput

log = logging.getLogger(__name__)

_LEN = 4  # bytes of a frame's length, big-endian
MAX_HELLO_BYTES = 4096
CONNECT_TIMEOUT_S = 10.0


class LinkClosed(ConnectionError):
    """The worker's link ended (the worker died or left) before a call's reply came."""


class CallFailed(RuntimeError):
    """The worker failed a call (not the caller's error: e.g. the step that ran its request raised)."""


def merge(outs: list[StepOutput]) -> StepOutput:
    """Outputs of one worker, in order, as one: events, failures and replies in order, the latest stats, the
    prefix cache's changes merged."""
    if len(outs) == 1:
        return outs[0]
    stats = next((o.stats for o in reversed(outs) if o.stats is not None), None)
    kv = None
    for o in outs:
        if o.kv is not None:
            kv = o.kv if kv is None else kv.merged(o.kv)
    return StepOutput(outs[0].worker_id, tuple(e for o in outs for e in o.events),
                      tuple(f for o in outs for f in o.failed), stats, tuple(r for o in outs for r in o.replies), kv)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the router closed the link")
        buf += chunk
    return bytes(buf)


class WorkerLink:
    """A worker's end: connects to the router, sends what is put in `outputs` until close(), and runs
    the router's calls with `handlers` (op -> function of the call's args)."""

    def __init__(self, outputs: queue.SimpleQueue, host: str, port: int, token: bytes, worker_id: str,
                 handlers: dict[str, Callable[..., Any]], on_end: Callable[[], None] | None = None):
        """on_end is called (on the reader thread) when the router ends the link, not when close() does."""
        self._outputs = outputs
        self._worker_id = worker_id
        self._handlers = handlers
        self._on_end = on_end
        self._sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = token + worker_id.encode()
        self._sock.sendall(len(hello).to_bytes(_LEN, "big") + hello)
        self._closing = False
        self._sender = threading.Thread(target=self._send_loop, name=f"link-out-{worker_id}", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"link-in-{worker_id}", daemon=True)
        self._sender.start()
        self._reader.start()

    # -- out: step outputs and replies ------------------------------------------------------------
    def _send_loop(self) -> None:
        try:
            while True:
                outs = [self._outputs.get()]
                while True:
                    try:
                        outs.append(self._outputs.get_nowait())
                    except queue.Empty:
                        break
                if any(o is None for o in outs):  # close(): what came before it still goes
                    outs = outs[:outs.index(None)]
                    if outs:
                        self._send(merge(outs))
                    return
                self._send(merge(outs))
        except OSError as e:  # the router is gone or closed the link: it replaces this worker
            log.warning("link: the router's connection ended: %s", e)
        finally:
            self._closing = True
            try:  # wakes the reader thread, whose recv would otherwise keep the socket open
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()

    def _send(self, out: StepOutput) -> None:
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        self._sock.sendall(len(data).to_bytes(_LEN, "big") + data)

    def _reply(self, call_id: int, value: Any = None, error: BaseException | None = None) -> None:
        if not call_id:
            if error is not None:
                log.warning("link: a call that wants no reply failed: %r", error)
            return
        if error is None:
            r = Reply(call_id, value)
        else:
            invalid = isinstance(error, ValueError)  # the request's own fault: its message is the caller's
            r = Reply(call_id, None, str(error) if invalid else f"{type(error).__name__}: {error}", invalid)
        self._outputs.put(StepOutput(self._worker_id, (), replies=(r,)))

    # -- in: the router's calls -------------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while True:
                n = int.from_bytes(_recv_exactly(self._sock, _LEN), "big")
                call_id, op, args = pickle.loads(_recv_exactly(self._sock, n))
                self._run(call_id, op, args)
        except (OSError, EOFError) as e:
            if not self._closing:
                log.warning("link: the router's calls ended: %s", e)
                self._closing = True
                self._outputs.put(None)  # the sender stops; what waits for this router goes nowhere
                if self._on_end is not None:
                    self._on_end()

    @property
    def alive(self) -> bool:
        return not self._closing

    def _run(self, call_id: int, op: str, args: tuple) -> None:
        handler = self._handlers.get(op)
        if handler is None:
            self._reply(call_id, error=ValueError(f"unknown call {op!r}"))
            return
        try:
            result = handler(*args)
        except Exception as e:  # noqa: BLE001 - the router hears of it; the link goes on
            self._reply(call_id, error=e)
            return
        if isinstance(result, Future):
            def done(f: Future) -> None:
                try:
                    self._reply(call_id, f.result())
                except BaseException as e:  # noqa: BLE001 - failed or cancelled: the router hears why
                    self._reply(call_id, error=e)

            result.add_done_callback(done)
        else:
            self._reply(call_id, result)

    def close(self) -> None:
        self._outputs.put(None)
        self._sender.join(5.0)


class Link:
    """The router's end of one worker's link: call() and send() to it; its outputs go to on_output."""

    def __init__(self, worker_id: str, on_output: Callable[[StepOutput], None]):
        self.worker_id = worker_id
        self._on_output = on_output
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future[None] = loop.create_future()  # the worker's hello was accepted
        self.ended: asyncio.Future[str] = loop.create_future()  # why it ended
        self._writer: asyncio.StreamWriter | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)

    async def wait_open(self, timeout: float) -> None:
        """Until the worker's hello has been accepted; LinkClosed if the link ended or timed out first."""
        await asyncio.wait([self.opened, self.ended], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not self.opened.done():
            raise LinkClosed(f"worker {self.worker_id}: its link did not open ({self._why()})")

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self.ended.done()

    def call(self, op: str, *args: Any) -> asyncio.Future:
        """Run op(*args) on the worker; the future resolves with its value, or raises ValueError (the
        worker refused it), CallFailed, or LinkClosed."""
        fut = asyncio.get_running_loop().create_future()
        # Retrieved here so that a call whose caller gave up (its attempt ended) is not reported as an
        # exception never retrieved; a caller that awaits it still gets it.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        if not self.connected:
            fut.set_exception(LinkClosed(f"worker {self.worker_id}: no link ({self._why()})"))
            return fut
        call_id = next(self._ids)
        self._calls[call_id] = fut
        self._write(call_id, op, args)
        return fut

    def send(self, op: str, *args: Any) -> None:
        """Run op(*args) on the worker, no reply wanted (nothing happens if the link has ended)."""
        if self.connected:
            self._write(0, op, args)

    def _write(self, call_id: int, op: str, args: tuple) -> None:
        data = pickle.dumps((call_id, op, args), protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(len(data).to_bytes(_LEN, "big") + data)

    def _why(self) -> str:
        return self.ended.result() if self.ended.done() else "not connected yet"

    def _take(self, out: StepOutput) -> None:
        for r in out.replies:
            fut = self._calls.pop(r.call_id, None)
            if fut is None or fut.done():  # its caller gave up on it
                continue
            if r.error is None:
                fut.set_result(r.value)
            elif r.invalid:
                fut.set_exception(ValueError(r.error))
            else:
                fut.set_exception(CallFailed(f"worker {self.worker_id}: {r.error}"))
        if out.events or out.failed or out.stats is not None or out.kv is not None:
            self._on_output(out)

    def close(self, why: str) -> None:
        """The link is over: every call still waiting fails with LinkClosed."""
        if not self.ended.done():
            self.ended.set_result(why)
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(LinkClosed(f"worker {self.worker_id}: {why}"))
        if self._writer is not None:
            self._writer.close()


class LinkServer:
    """The router's listening end: one connection per worker, each read on the event loop.

    expect(worker_id, on_output) before the worker is told to connect (WorkerActor.link_to); the Link it
    returns opens once the worker's hello has been checked (Link.wait_open)."""

    def __init__(self, host: str):
        self.host = host
        self.port = 0
        self.token = secrets.token_bytes(32)
        self._server: asyncio.Server | None = None
        self._expected: dict[str, Link] = {}
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def expect(self, worker_id: str, on_output: Callable[[StepOutput], None]) -> Link:
        link = self._expected[worker_id] = Link(worker_id, on_output)
        return link

    def forget(self, worker_id: str) -> None:
        self._expected.pop(worker_id, None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._expected.values()):
            link.close("the router is shutting down")
        for w in list(self._connections):
            w.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        link = None
        why = "link ended"
        try:
            n = int.from_bytes(await reader.readexactly(_LEN), "big")
            if n > MAX_HELLO_BYTES:
                return
            hello = await reader.readexactly(n)
            token, worker_id = hello[:len(self.token)], hello[len(self.token):].decode(errors="replace")
            candidate = self._expected.get(worker_id)
            if not hmac.compare_digest(token, self.token) or candidate is None or candidate._writer is not None \
                    or candidate.ended.done():
                log.warning("link: refused a connection from %s (not a worker of this cluster)",
                            writer.get_extra_info("peername"))
                return
            link = candidate
            link._writer = writer
            link.opened.set_result(None)
            while True:
                n = int.from_bytes(await reader.readexactly(_LEN), "big")
                link._take(pickle.loads(await reader.readexactly(n)))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            why = f"link ended: {type(e).__name__}"
        except asyncio.CancelledError:  # the router's loop is ending: a cancelled handler is not an error
            why = "link ended: the router is shutting down"
        except Exception as e:  # noqa: BLE001 - a malformed frame: the worker's link cannot be trusted
            why = f"link ended: {type(e).__name__}: {e}"
        finally:
            self._connections.discard(writer)
            if link is not None:
                link.close(why)
            writer.close()
