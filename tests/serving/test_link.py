"""A worker's link to the router (pdserve.serving.link): real sockets on loopback, no Ray."""
from __future__ import annotations

import asyncio
import pickle
import queue
import socket
import threading
from concurrent.futures import Future

import pytest

from pdserve.serving.link import CallFailed, LinkClosed, LinkServer, WorkerLink, merge
from pdserve.serving.messages import Failure, FailureReason, Reply, StepOutput, TokenEvent, WorkerStats


def _stats(steps: int) -> WorkerStats:
    return WorkerStats(worker_id="d", pool="decode", waiting=0, waiting_tokens=0, running=1, kv_blocks_used=steps,
                       kv_blocks_total=9, steps=steps)


def test_merge_keeps_order_and_the_latest_stats() -> None:
    a = StepOutput("d", (TokenEvent("r1", 1, None, "a"),), (), _stats(1))
    b = StepOutput("d", (TokenEvent("r1", 2, None, "b"), TokenEvent("r2", 3, None, "c")),
                   (Failure("r3", FailureReason.STEP_FAILED, "x"),), None)
    c = StepOutput("d", (TokenEvent("r2", 4, None, "d"),), (), _stats(3), (Reply(7, "x"),))
    m = merge([a, StepOutput("d", (), replies=(Reply(5, 1),)), b, c])
    assert [(e.request_id, e.token) for e in m.events] == [("r1", 1), ("r1", 2), ("r2", 3), ("r2", 4)]
    assert [f.request_id for f in m.failed] == ["r3"] and m.stats.steps == 3
    assert [r.call_id for r in m.replies] == [5, 7]
    assert merge([b]) is b


def test_outputs_arrive_in_order_and_the_end_is_reported(aloop) -> None:
    async def run():
        server = LinkServer("127.0.0.1")
        await server.start()
        got: list[StepOutput] = []
        ended = server.expect("decode-0", got.append).ended
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        sender = await asyncio.to_thread(WorkerLink, outputs, "127.0.0.1", server.port, server.token, "decode-0", {})
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

    assert "link ended" in aloop.run(run())


@pytest.mark.parametrize("right_token,worker_id", [(False, "decode-0"), (True, "decode-9")])
def test_a_stranger_is_refused_unread(aloop, right_token: bool, worker_id: str) -> None:
    """Nothing a stranger sends is unpickled: a wrong token, or a worker id the router does not expect,
    closes the connection after the hello, whatever follows it."""

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))

    async def run() -> tuple[bytes, list]:
        server = LinkServer("127.0.0.1")
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


class _Worker:
    """The worker's end of a link with a few handlers, as a worker actor has (WorkerActor.handlers)."""

    def __init__(self) -> None:
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()
        self.seen: list[tuple] = []  # calls in the order the handlers ran
        self.later: dict[str, Future] = {}  # "slow" calls, answered by the test
        self.link: WorkerLink | None = None

    def handlers(self) -> dict:
        def echo(x):
            self.seen.append(("echo", x))
            return x

        def refuse(why):
            raise ValueError(why)

        def crash():
            raise RuntimeError("step failed")

        def slow(key):
            self.seen.append(("slow", key))
            fut = self.later[key] = Future()
            return fut

        def note(x):
            self.seen.append(("note", x, threading.current_thread().name))

        return {"echo": echo, "refuse": refuse, "crash": crash, "slow": slow, "note": note}


async def _linked(server: LinkServer, worker_id: str = "prefill-0"):
    got: list[StepOutput] = []
    link = server.expect(worker_id, got.append)
    w = _Worker()
    w.link = await asyncio.to_thread(WorkerLink, w.outputs, "127.0.0.1", server.port, server.token, worker_id,
                                     w.handlers())
    await link.wait_open(10)
    return link, w, got


def test_calls_run_in_order_and_their_replies_and_errors_come_back(aloop) -> None:
    """The router's calls run on the worker in the order sent; a value, a refusal (ValueError: the
    caller's error, its message unchanged), a failure (CallFailed) and an unknown call each come back to
    their own caller; a reply does not reach the step outputs' consumer."""

    async def run():
        server = LinkServer("127.0.0.1")
        await server.start()
        link, w, got = await _linked(server)
        for i in range(20):
            link.send("note", i)  # no reply wanted
        values = await asyncio.wait_for(asyncio.gather(*(link.call("echo", i) for i in range(20))), 10)
        with pytest.raises(ValueError, match=r"^prompt too long$"):
            await asyncio.wait_for(link.call("refuse", "prompt too long"), 10)
        with pytest.raises(CallFailed, match="RuntimeError: step failed"):
            await asyncio.wait_for(link.call("crash"), 10)
        with pytest.raises(ValueError, match="unknown call 'nope'"):
            await asyncio.wait_for(link.call("nope"), 10)
        await asyncio.to_thread(w.link.close)
        await server.close()
        return values, w.seen, got

    values, seen, got = aloop.run(run())
    assert values == list(range(20))
    assert [s[1] for s in seen if s[0] == "note"] == list(range(20))
    assert seen.index(("echo", 0)) > max(i for i, s in enumerate(seen) if s[0] == "note")  # sent after every note
    assert {s[2] for s in seen if s[0] == "note"} == {"link-in-prefill-0"}  # the link's reader thread ran them
    assert got == []


def test_a_call_answered_later_and_the_calls_waiting_when_the_worker_dies(aloop) -> None:
    """A handler's Future is answered when it completes; calls still waiting when the worker's end goes
    away fail with LinkClosed at once (no caller hangs), and later calls fail the same way."""

    async def run():
        server = LinkServer("127.0.0.1")
        await server.start()
        link, w, _ = await _linked(server)
        first, second = link.call("slow", "a"), link.call("slow", "b")
        deadline = asyncio.get_running_loop().time() + 10
        while len(w.later) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        w.later["a"].set_result("first token")
        assert await asyncio.wait_for(first, 10) == "first token"
        assert not second.done()
        w.link._sock.shutdown(socket.SHUT_RDWR)  # the worker's process ends: its socket closes
        with pytest.raises(LinkClosed):
            await asyncio.wait_for(second, 10)
        why = await asyncio.wait_for(link.ended, 10)
        after = link.call("echo", 1)
        with pytest.raises(LinkClosed):
            await after
        await server.close()
        return why

    assert "link ended" in aloop.run(run())


def test_a_link_the_worker_never_opens_times_out(aloop) -> None:
    async def run():
        server = LinkServer("127.0.0.1")
        await server.start()
        link = server.expect("decode-3", lambda out: None)
        with pytest.raises(LinkClosed, match="did not open"):
            await link.wait_open(0.2)
        assert not link.connected
        await server.close()

    aloop.run(run())
