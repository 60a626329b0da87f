"""The step outputs' own channel, from each streaming worker (decode, fast lane, colocated) to the router.

Every step's tokens cross from a worker to the router. As a Ray streaming generator each item cost the
router about 1.3 ms of CPU (the item's object, its ref, the futures and wake-ups between Ray's threads
and the event loop: docs/benchmarks.md), more than all the rest of a step's work there together. Here
a worker holds one TCP connection to the router and sends each output as one frame: a 4-byte length,
then the pickled StepOutput. A sender thread takes the outputs from the step thread's queue and merges
those already waiting into one frame, so a router that falls behind gets several steps in one read.

Trust is Ray's: both ends are processes of one cluster. The router accepts a connection only after
its first frame carries the cluster's random token and a worker id it expects (compared in constant
time), and unpickles nothing before that. A worker that dies closes its socket: the router sees the
end of its stream at once, as it saw a Ray stream raise.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import queue
import secrets
import socket
import threading
from collections.abc import Callable

from pdserve.serving.messages import StepOutput

log = logging.getLogger(__name__)

_LEN = 4  # bytes of a frame's length, big-endian
MAX_HELLO_BYTES = 4096
CONNECT_TIMEOUT_S = 10.0


def merge(outs: list[StepOutput]) -> StepOutput:
    """Outputs of one worker, in order, as one: events and failures in order, the latest stats."""
    if len(outs) == 1:
        return outs[0]
    stats = next((o.stats for o in reversed(outs) if o.stats is not None), None)
    return StepOutput(outs[0].worker_id, tuple(e for o in outs for e in o.events),
                      tuple(f for o in outs for f in o.failed), stats)


class OutputSender:
    """A worker's end: connects to the router and sends what is put in `outputs` until close()."""

    def __init__(self, outputs: queue.SimpleQueue, host: str, port: int, token: bytes, worker_id: str):
        self._outputs = outputs
        self._sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = token + worker_id.encode()
        self._sock.sendall(len(hello).to_bytes(_LEN, "big") + hello)
        self._thread = threading.Thread(target=self._run, name=f"outputs-{worker_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
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
        except OSError as e:  # the router is gone or closed the connection: it replaces this worker
            log.warning("step outputs: the router's connection ended: %s", e)
        finally:
            self._sock.close()

    def _send(self, out: StepOutput) -> None:
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        self._sock.sendall(len(data).to_bytes(_LEN, "big") + data)

    def close(self) -> None:
        self._outputs.put(None)
        self._thread.join(5.0)


class OutputServer:
    """The router's end: one connection per streaming worker, each read on the event loop.

    expect(worker_id, on_output) before the worker is told to connect; the future it returns resolves
    with why its stream ended (the connection closed, or a malformed frame)."""

    def __init__(self, host: str):
        self.host = host
        self.port = 0
        self.token = secrets.token_bytes(32)
        self._server: asyncio.Server | None = None
        self._expected: dict[str, tuple[Callable[[StepOutput], None], asyncio.Future[str]]] = {}
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def expect(self, worker_id: str, on_output: Callable[[StepOutput], None]) -> asyncio.Future[str]:
        ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._expected[worker_id] = (on_output, ended)
        return ended

    def forget(self, worker_id: str) -> None:
        self._expected.pop(worker_id, None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._connections):
            w.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        ended = None
        try:
            n = int.from_bytes(await reader.readexactly(_LEN), "big")
            if n > MAX_HELLO_BYTES:
                return
            hello = await reader.readexactly(n)
            token, worker_id = hello[:len(self.token)], hello[len(self.token):].decode(errors="replace")
            if not hmac.compare_digest(token, self.token) or worker_id not in self._expected:
                log.warning("step outputs: refused a connection from %s (not a worker of this cluster)",
                            writer.get_extra_info("peername"))
                return
            on_output, ended = self._expected[worker_id]
            while True:
                n = int.from_bytes(await reader.readexactly(_LEN), "big")
                on_output(pickle.loads(await reader.readexactly(n)))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if ended is not None and not ended.done():
                ended.set_result(f"stream ended: {type(e).__name__}")
        except Exception as e:  # noqa: BLE001 - a malformed frame: the worker's stream cannot be trusted
            if ended is not None and not ended.done():
                ended.set_result(f"stream ended: {type(e).__name__}: {e}")
        finally:
            self._connections.discard(writer)
            writer.close()
