"""The step outputs' channel (pdserve.serving.outputs): real sockets on loopback, no Ray."""
from __future__ import annotations

import asyncio
import pickle
import queue
import socket

import pytest

from pdserve.serving.messages import Failure, FailureReason, StepOutput, TokenEvent, WorkerStats
from pdserve.serving.outputs import OutputSender, OutputServer, merge


def _stats(steps: int) -> WorkerStats:
    return WorkerStats(worker_id="d", pool="decode", waiting=0, waiting_tokens=0, running=1, kv_blocks_used=steps,
                       kv_blocks_total=9, steps=steps)


def test_merge_keeps_order_and_the_latest_stats() -> None:
    a = StepOutput("d", (TokenEvent("r1", 1, None, "a"),), (), _stats(1))
    b = StepOutput("d", (TokenEvent("r1", 2, None, "b"), TokenEvent("r2", 3, None, "c")),
                   (Failure("r3", FailureReason.STEP_FAILED, "x"),), None)
    c = StepOutput("d", (TokenEvent("r2", 4, None, "d"),), (), _stats(3))
    m = merge([a, b, c])
    assert [(e.request_id, e.token) for e in m.events] == [("r1", 1), ("r1", 2), ("r2", 3), ("r2", 4)]
    assert [f.request_id for f in m.failed] == ["r3"] and m.stats.steps == 3
    assert merge([b]) is b


def test_outputs_arrive_in_order_and_the_end_is_reported(aloop) -> None:
    async def run():
        server = OutputServer("127.0.0.1")
        await server.start()
        got: list[StepOutput] = []
        ended = server.expect("decode-0", got.append)
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        sender = await asyncio.to_thread(OutputSender, outputs, "127.0.0.1", server.port, server.token, "decode-0")
        for step in range(50):
            outputs.put(StepOutput("decode-0", (TokenEvent("r", step, None, str(step)),), (), _stats(step)))
        deadline = asyncio.get_running_loop().time() + 30
        while sum(len(o.events) for o in got) < 50 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert [e.token for o in got for e in o.events] == list(range(50))
        assert got[-1].stats.steps == 49
        await asyncio.to_thread(sender.close)  # the worker's end closes: the router hears it at once
        why = await asyncio.wait_for(ended, 10)
        await server.close()
        return why

    assert "stream ended" in aloop.run(run())


@pytest.mark.parametrize("right_token,worker_id", [(False, "decode-0"), (True, "decode-9")])
def test_a_stranger_is_refused_unread(aloop, right_token: bool, worker_id: str) -> None:
    """Nothing a stranger sends is unpickled: a wrong token, or a worker id the router does not expect,
    closes the connection after the hello, whatever follows it."""

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))

    async def run() -> tuple[bytes, list]:
        server = OutputServer("127.0.0.1")
        await server.start()
        got: list = []
        server.expect("decode-0", got.append)
        token = server.token if right_token else bytes(32)

        def stranger() -> bytes:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                hello = token + worker_id.encode()
                payload = pickle.dumps(Boom())
                s.sendall(len(hello).to_bytes(4, "big") + hello + len(payload).to_bytes(4, "big") + payload)
                return s.recv(1)  # b"": the router closed it

        closed = await asyncio.to_thread(stranger)
        await server.close()
        return closed, got

    assert aloop.run(run()) == (b"", [])
