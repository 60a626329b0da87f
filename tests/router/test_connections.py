"""What one client can hold open (#47, finding 8), against a real router over a real cluster of the tiny
checkpoint, with clients and raw sockets over loopback: gRPC calls per connection, connections at once, idle
and silent connections (the router's keepalive); HTTP request heads and bodies that stall (the read
deadline: 16 stalled uploads held the whole body budget for ever), connections at once."""
from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import grpc
import httpx
import pytest

from pdserve.client import Client
from router.cluster import Cluster

from conftest import wait_for
from served import Routers, tiny_1p1d

PROMPT = [5, 17, 99, 3, 42, 7]


@pytest.fixture(scope="module")
def cluster(ray_local, aloop, tiny_checkpoints):
    c = Cluster(tiny_1p1d(tiny_checkpoints["llama"], num_blocks=512))
    aloop.run(c.start(), timeout=600)
    yield c
    aloop.run(c.shutdown())


@pytest.fixture
def serve(aloop, cluster):
    routers = Routers(aloop, cluster)
    yield routers.start
    routers.close()


def stream(client: Client, max_tokens: int = 160) -> int:
    return len(client.complete(token_ids=PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                               timeout=120).token_ids)


class Peak:
    """The most requests the router had admitted at once, polled while it runs."""

    def __init__(self, router):
        self.router, self.most, self._stop = router, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            self.most = max(self.most, self.router.front.admitted)
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.most


def test_one_grpc_connection_carries_at_most_its_streams(serve):
    """Six streams on one connection bounded to two: never more than two admitted at once. The others wait
    client-side once the client knows the bound; one opened in the window where the server has freed a stream
    the client still counts (or before its SETTINGS are read) is refused by the server (RST_STREAM
    REFUSED_STREAM: UNAVAILABLE, which grpcio's client does not retry on its own), never failed midway."""
    r = serve(max_streams_per_connection=2)
    target = f"127.0.0.1:{r.port}"
    peak = Peak(r)

    def one(c: Client):
        try:
            return stream(c)
        except grpc.RpcError as e:
            return e

    with Client(target) as c, concurrent.futures.ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(lambda _: one(c), range(6)))  # one channel: one connection
    refused = [o for o in outcomes if not isinstance(o, int)]
    assert all(e.code() == grpc.StatusCode.UNAVAILABLE and "error code 7" in e.details() for e in refused), refused
    assert [o for o in outcomes if isinstance(o, int)] == [160] * (6 - len(refused)) and len(refused) <= 4
    assert peak.stop() == 2


def test_connections_past_the_bound_are_refused(serve):
    r = serve(max_connections=2)
    target = f"127.0.0.1:{r.port}"
    # Channels of their own (no subchannel shared between them): a connection each.
    clients = [Client(target) for _ in range(3)]
    for i, c in enumerate(clients):
        c.channel.close()
        c.channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1),
                                                           ("grpc.primary_user_agent", f"client-{i}")])
        c.stub = type(c.stub)(c.channel)
    try:
        assert stream(clients[0], 4) == 4 and stream(clients[1], 4) == 4
        with pytest.raises(grpc.RpcError) as e:
            stream(clients[2], 4)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        clients[0].channel.close()  # one goes: room for another
        wait_for(lambda: _tries(clients[2]), 30, what="the third client served once the first left")
    finally:
        for c in clients:
            c.channel.close()


def _tries(client: Client) -> bool:
    try:
        return stream(client, 4) == 4
    except grpc.RpcError:
        return False


def test_an_idle_grpc_connection_is_closed(serve):
    r = serve(idle_timeout_s=1.0)
    with Client(f"127.0.0.1:{r.port}") as c:
        states: list[grpc.ChannelConnectivity] = []
        c.channel.subscribe(states.append, try_to_connect=False)
        assert stream(c, 4) == 4
        wait_for(lambda: states and states[-1] == grpc.ChannelConnectivity.READY, 10, what="the connection up")
        wait_for(lambda: states[-1] == grpc.ChannelConnectivity.IDLE, 20, what="the router closing the idle connection")
        assert stream(c, 4) == 4  # a new connection, at the next call


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS, _SETTINGS_ACK = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00", b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


def _silent_http2_client(port: int, limit: float) -> float | None:
    """An HTTP/2 connection that acknowledges the router's settings, then answers nothing (its pings
    included): seconds until the router closed it, None if it did not within `limit`."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(_PREFACE + _SETTINGS)
        s.settimeout(0.5)
        t0, acked, buf = time.monotonic(), False, b""
        while time.monotonic() - t0 < limit:
            try:
                data = s.recv(65536)
            except socket.timeout:
                continue
            if not data:
                return time.monotonic() - t0
            buf += data
            while len(buf) >= 9:  # frames: 3-byte length, type, flags, 4-byte stream id, payload
                length = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + length:
                    break
                kind, flags, buf = buf[3], buf[4], buf[9 + length:]
                if kind == 4 and not flags & 1 and not acked:
                    s.sendall(_SETTINGS_ACK)
                    acked = True
    return None


def test_a_silent_grpc_client_is_dropped_by_the_keepalive(serve):
    """A client gone without a word (a half-open connection) used to be kept for ever."""
    r = serve(keepalive_s=0.5, keepalive_timeout_s=1.0, idle_timeout_s=3600)
    closed = _silent_http2_client(r.port, 20.0)
    assert closed is not None and closed < 10.0, closed


def _raw_http(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(data)
    return s


def _answer(s: socket.socket, limit: float) -> bytes:
    """What the router sends back before it closes the connection (or `limit` passes)."""
    s.settimeout(limit)
    out = b""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                break
            out += data
    except (socket.timeout, ConnectionResetError):
        pass
    return out


def _stalled_upload(port: int, sent: int, length: int) -> socket.socket:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()
    return _raw_http(port, head + b" " * sent)


def test_stalled_uploads_are_cut_off_and_give_their_budget_back(serve):
    """Finding 8 as found: 16 stalled uploads make every other HTTP request 503, for as long as they stall."""
    r = serve(http_port=0, served_model_name="tiny", max_request_body_bytes=1024, request_body_budget_bytes=16 * 1024,
              read_timeout_s=4.0)
    port = r.http_port
    stalled = [_stalled_upload(port, 1023, 1024) for _ in range(16)]  # 16,368 of the 16,384 bytes held
    bodies = r.http_app.state.bodies
    wait_for(lambda: bodies.held == 16 * 1023, 10, what="the 16 uploads' bytes held")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    with httpx.Client(timeout=30) as h:
        assert h.post(f"http://127.0.0.1:{port}/v1/completions", json=body).status_code == 503
        answers = [_answer(s, 20.0) for s in stalled]
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[0][:200]
        assert b"request_timeout" in answers[0]
        assert bodies.held == 0
        assert h.post(f"http://127.0.0.1:{port}/v1/completions", json=body).status_code == 200
    for s in stalled:
        s.close()


def test_a_stalled_http_head_is_cut_off(serve):
    r = serve(http_port=0, read_timeout_s=1.0)
    s = _raw_http(r.http_port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
    t0 = time.monotonic()
    assert _answer(s, 20.0) == b""  # closed, nothing to answer
    assert time.monotonic() - t0 < 10.0
    s.close()
    with httpx.Client(timeout=30) as h:  # a request that arrives whole is served, on a kept connection too
        for _ in range(2):
            assert h.get(f"http://127.0.0.1:{r.http_port}/health").status_code == 200


def test_http_connections_past_the_bound_get_503(serve):
    r = serve(http_port=0, max_connections=4, read_timeout_s=30.0)
    held = [_raw_http(r.http_port, b"") for _ in range(4)]
    try:
        wait_for(lambda: _health(r.http_port) == 503, 10, what="a fifth connection refused")
    finally:
        for s in held:
            s.close()
    wait_for(lambda: _health(r.http_port) == 200, 10, what="room again once they left")


def _health(port: int) -> int:
    with httpx.Client(timeout=10) as h:
        return h.get(f"http://127.0.0.1:{port}/health").status_code
