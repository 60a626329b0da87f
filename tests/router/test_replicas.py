"""Router replicas (router.registry): two real `pdserve serve` processes on one real Ray cluster (`ray start
--head` on loopback, as a KubeRay head is), simulated workers, real gRPC clients, faults sent as signals
from outside the processes.

- both routers serve, over the same workers (each has its own link to every worker);
- a router SIGKILLed under load: its own streams end with UNAVAILABLE, the other router's streams all
  finish, and the workers cancel what the dead router had placed (no KV block left used);
- the pools' owner SIGKILLed under load: the other router takes the lease over within a bound, its streams
  all finish, no worker is orphaned or doubled; a worker then SIGKILLed is replaced by the new owner.

What the test reads of the cluster (the registry, the named workers, their stats) it reads through a
separate Ray driver (`_OBSERVER`), since this test process's own Ray is the suite's local cluster. One
driver answers every look (a driver's start costs seconds of CPU on 2 cores, beside the routers').
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from pdserve.client import AsyncClient, Client
from router.registry import LEASE_S

from conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# `ray start` turns Ray's token authentication on (the token in ~/.ray); a driver joining it must say it
# uses tokens, or it connects without one and is refused.
ENV = {**os.environ, "RAY_AUTH_MODE": "token"}
pytestmark = pytest.mark.timeout(900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A look at the cluster for each line read from stdin, printed as one line.
_OBSERVER = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="pdserve", log_to_driver=False, logging_level="ERROR")
for asked in sys.stdin:
    out = {"named": sorted(n for n in ray.util.list_named_actors() if n.startswith("pdserve-worker-"))}
    try:
        version, owner, epoch, workers = ray.get(ray.get_actor("pdserve-registry").view.remote(), timeout=30)
        out.update(owner=owner, epoch=epoch, listed=sorted(w.worker_id for w in workers))
    except ValueError:
        out.update(owner=None, epoch=0, listed=[])
    stats = {}
    for name in out["named"]:
        try:
            s = ray.get(ray.get_actor(name).stats.remote(), timeout=30)
            stats[s.worker_id] = dict(pid=s.pid, pool=s.pool, kv_blocks_used=s.kv_blocks_used, running=s.running,
                                      waiting=s.waiting)
        except Exception as e:
            stats[name] = dict(error=repr(e))
    out["stats"] = stats
    print(f"OBSERVED {asked.strip()} " + json.dumps(out), flush=True)
"""


class Replicas:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        # Ray's sockets live under its temp dir, and a Unix socket's path may not pass 107 bytes: pytest's tmp path
        # is too deep for that under pytest-xdist (popen-gwN/), so Ray gets a short directory of its own.
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="pdserve-ray-"))
        self.ray_port = _free_port()
        self.address = f"127.0.0.1:{self.ray_port}"
        self.head = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", f"--port={self.ray_port}", "--node-ip-address=127.0.0.1",
             "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.ray_tmp}"],
            stdout=open(tmp / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
            # No drain at SIGTERM: it waits (30 s by default) for the node to be idle, which its workers, named
            # actors that live until the head goes, never are; it is for Serve's proxies, which this has none of.
            env={**ENV, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
        self.routers: dict[str, tuple[subprocess.Popen, int]] = {}
        self.observer: subprocess.Popen | None = None
        self.looks: queue.SimpleQueue = queue.SimpleQueue()
        self.asked = 0

    def start_router(self, name: str) -> int:
        port = _free_port()
        log = open(self.tmp / f"router-{name}.log", "w")
        proc = subprocess.Popen(
            [str(BIN / "pdserve"), "serve", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
             "--http-port", "0", "--ray-address", self.address, "--router-name", name, "--load-format", "sim",
             "--model", "llama3-8b", "--dtype", "bfloat16", "--prefill-workers", "1", "--decode-workers", "2",
             "--worker-cpus", "0.25", "--stream-interval", "4", "--worker-timeout", "10",
             "--kv-bind-host", "127.0.0.1"],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=ENV)
        self.routers[name] = (proc, port)
        wait_for(lambda: self._serving(port) or proc.poll() is not None or self.head.poll() is not None,
                 timeout=300, interval=0.5, what=f"router {name} to serve")
        assert self.head.poll() is None, "Ray's head ended: " + (self.tmp / "head.log").read_text()[-3000:]
        assert proc.poll() is None, (self.tmp / f"router-{name}.log").read_text()[-3000:]
        return port

    @staticmethod
    def _serving(port: int) -> bool:
        # What `pdserve status` asks, from this process: a status command's own start (~3 s of CPU on 2 cores)
        # every half second would slow the router it waits for.
        try:
            with Client(f"127.0.0.1:{port}") as c:
                c.cluster_status(timeout=10)
            return True
        except grpc.RpcError:
            return False

    def log(self, name: str) -> str:
        return (self.tmp / f"router-{name}.log").read_text()

    def observe(self) -> dict:
        """A look at the cluster now, from the observer driver (started at the first look)."""
        if self.observer is None:
            self.observer = subprocess.Popen([sys.executable, "-c", _OBSERVER, self.address], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=open(self.tmp / "observer.log", "w"),
                                             text=True, cwd=ROOT, env=ENV)
            threading.Thread(target=self._read_looks, daemon=True).start()
        self.asked += 1
        self.observer.stdin.write(f"{self.asked}\n")
        self.observer.stdin.flush()
        deadline = time.monotonic() + 120
        while True:  # a look asked for before (by a test that failed waiting for it) is not this one
            try:
                n, look = self.looks.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise AssertionError("no look in 120 s: " + self._observer_log()) from None
            assert look is not None, "the observer ended: " + self._observer_log()
            if n == self.asked:
                return look

    def _read_looks(self) -> None:
        for line in self.observer.stdout:
            if line.startswith("OBSERVED "):
                n, look = line[len("OBSERVED "):].split(" ", 1)
                self.looks.put((int(n), json.loads(look)))
        self.looks.put((0, None))

    def _observer_log(self) -> str:
        return (self.tmp / "observer.log").read_text()[-2000:]

    def kill_router(self, name: str) -> None:
        proc, _ = self.routers.pop(name)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def close(self) -> None:
        if self.observer is not None:
            self.observer.stdin.close()  # its loop ends, and with it its driver
            try:
                self.observer.wait(30)
            except subprocess.TimeoutExpired:
                self.observer.kill()
        for proc, _ in self.routers.values():
            proc.send_signal(signal.SIGINT)
        for proc, _ in self.routers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.head.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            self.head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.head.pid, signal.SIGKILL)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    r = Replicas(tmp_path_factory.mktemp("replicas"))
    try:
        yield r
    finally:
        r.close()


async def _stream(port: int, seed: int, tokens: int, started: asyncio.Event | None = None) -> tuple[int, str]:
    """One greedy stream; (tokens received, the gRPC status name at its end)."""
    n = 0
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            async for out in client.generate(token_ids=list(range(1, 60 + seed % 40)), max_tokens=tokens,
                                             ignore_eos=True, seed=seed):
                n += len(out.token_ids)
                if started is not None and n >= 8:
                    started.set()
        return n, "OK"
    except grpc.aio.AioRpcError as e:
        return n, e.code().name


def _idle(r: Replicas) -> dict:
    """The cluster once nothing is left on any worker (every block freed, no request)."""
    def quiet():
        o = r.observe()
        s = o["stats"].values()
        return o if s and all(x.get("kv_blocks_used") == 0 and x.get("running") == 0 and x.get("waiting") == 0
                              for x in s) else None
    return wait_for(quiet, timeout=60, interval=1.0, what="every worker idle, no KV block used")


def test_two_routers_serve_the_same_workers(replicas, aloop):
    a = replicas.start_router("a")
    b = replicas.start_router("b")
    seen = replicas.observe()
    assert seen["owner"] == "a"
    assert len(seen["named"]) == 3 and len(seen["listed"]) == 3  # one set of workers, not one per router

    async def run():
        return await asyncio.gather(*(_stream(port, i, 32) for i in range(8) for port in (a, b)))

    results = aloop.run(run(), timeout=300)
    assert results == [(32, "OK")] * 16
    assert "router b follows the pools' owner a" in replicas.log("b")
    assert "scaling" not in replicas.log("b")  # b started no worker
    assert replicas.observe()["named"] == seen["named"]


def test_a_router_killed_under_load_fails_only_its_own_streams(replicas, aloop):
    a, b = replicas.routers["a"][1], replicas.routers["b"][1]

    async def run():
        started = asyncio.Event()
        on_a = [asyncio.create_task(_stream(a, i, 300)) for i in range(6)]
        on_b = [asyncio.create_task(_stream(b, 100 + i, 300, started)) for i in range(6)]
        await asyncio.wait_for(started.wait(), 120)
        await asyncio.to_thread(replicas.kill_router, "b")
        return await asyncio.gather(*on_a), await asyncio.gather(*on_b)

    from_a, from_b = aloop.run(run(), timeout=300)
    assert from_a == [(300, "OK")] * 6  # the other router's streams are untouched
    assert all(code == "UNAVAILABLE" and n < 300 for n, code in from_b), from_b
    _idle(replicas)  # what b had placed was cancelled on the workers when its links ended


def test_the_owner_killed_under_load_another_takes_over(replicas, aloop):
    c = replicas.start_router("c")
    a = replicas.routers["a"][1]
    before = replicas.observe()
    assert before["owner"] == "a"

    async def run():
        started = asyncio.Event()
        on_a = [asyncio.create_task(_stream(a, i, 300, started)) for i in range(4)]
        on_c = [asyncio.create_task(_stream(c, 50 + i, 300)) for i in range(6)]
        await asyncio.wait_for(started.wait(), 120)
        t0 = time.monotonic()
        await asyncio.to_thread(replicas.kill_router, "a")
        return await asyncio.gather(*on_a), await asyncio.gather(*on_c), t0

    from_a, from_c, killed_at = aloop.run(run(), timeout=300)
    assert from_c == [(300, "OK")] * 6
    assert all(code == "UNAVAILABLE" for _, code in from_a), from_a
    # The lease lapses LEASE_S after a's last renewal; c looks every second.
    wait_for(lambda: replicas.observe()["owner"] == "c", timeout=LEASE_S + 20, interval=1.0, what="c to own the pools")
    assert time.monotonic() - killed_at < LEASE_S + 20
    after = _idle(replicas)
    assert after["named"] == before["named"] and after["listed"] == before["listed"]  # none orphaned, none doubled
    assert after["epoch"] == before["epoch"] + 1

    # The new owner replaces a worker killed from outside.
    victim = next(w for w, s in after["stats"].items() if s["pool"] == "decode")
    os.kill(after["stats"][victim]["pid"], signal.SIGKILL)

    def replaced():
        o = replicas.observe()
        return o if victim not in o["listed"] and len(o["listed"]) == 3 and len(o["named"]) == 3 else None

    final = wait_for(replaced, timeout=180, interval=1.0, what="the killed worker's replacement")
    assert "decode-" in next(w for w in final["listed"] if w not in after["listed"])

    async def again():
        return await asyncio.gather(*(_stream(c, i, 16) for i in range(4)))

    assert aloop.run(again(), timeout=120) == [(16, "OK")] * 4
