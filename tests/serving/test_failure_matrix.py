"""The failure matrix (docs/faults.md): each row a fault at a moment, on a real local Ray cluster behind
the real gRPC router, with a real client.

Every row must end within its bound either token-exact against the offline engine or with a clean
status, and leave every surviving worker with zero used KV blocks and no KV channel to a lost peer.
Workers are caught at the exact moment by fault points (pdserve.faults: a stall inside a step or a
transfer, a corrupted part) and then killed from outside: ray.kill, or SIGKILL / SIGSTOP of the
worker's process. The clusters live for the module, so each row also starts from whatever state the
rows before it left (replaced workers, rebuilt channels): a leak would show in a later row.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import ray

from pdserve.client import AsyncClient
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig

from conftest import wait_for
from served import Served, Streams, assert_exact, prompts

ROOT = Path(__file__).resolve().parents[2]
STALL_S = 2.0  # how long an armed fault point holds a worker: the kill comes well within it
TRANSFER_TIMEOUT_S = 4.0
WORKER_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Row:
    """One row of docs/faults.md: the fault, the moment, what the client sees, the bound (seconds from
    the fault to the last stream's end)."""

    id: str
    fault: str
    sees: str
    bound_s: float


ROWS = {r.id: r for r in [
    Row("prefill-queued-and-in-step", "prefill worker dies with one prompt batch in its step and more queued",
        "every stream token-exact", 60),
    Row("prefill-after-step", "prefill worker dies after its step: first tokens streamed, KV held, push not started",
        "every stream token-exact", 60),
    Row("prefill-mid-transfer", "prefill worker dies between two parts of a KV transfer", "every stream token-exact", 60),
    Row("decode-holding-reservations", "decode worker dies holding reservations while the prompts compute",
        "every stream token-exact", 60),
    Row("decode-mid-transfer", "decode worker dies between two parts of a KV transfer", "every stream token-exact", 60),
    Row("decode-mid-stream", "one of two decode workers dies while 12 streams of 160 tokens run (1P2D)",
        "every stream token-exact", 60),
    Row("decode-stuck", "decode worker stopped (SIGSTOP) mid-stream: missed heartbeat, killed, replaced",
        "every stream token-exact", 60),
    Row("prefill-stuck", "prefill worker stopped (SIGSTOP) with prompts in its queue", "every stream token-exact", 60),
    Row("transfer-stalled", "a KV transfer stalls past --transfer-timeout (once)", "token-exact (retried once)", 40),
    Row("transfer-stalled-twice", "the same request's KV transfer stalls twice", "UNAVAILABLE naming the transfer", 40),
    Row("transfer-corrupted", "a KV transfer arrives with one bit flipped", "token-exact (checksum fails it; retried)",
        30),
    Row("client-gone-mid-stream", "the client cancels mid-stream", "CANCELLED (its own)", 10),
    Row("client-gone-mid-transfer", "the client cancels while its KV is in flight", "CANCELLED (its own)", 10),
    Row("replacement-fails", "decode worker dies and its replacement cannot start (model files gone)",
        "UNAVAILABLE after --pool-wait-timeout; served again once a replacement starts", 30),
]}

KILLS = ["ray.kill", "SIGKILL"]


# -- clusters -------------------------------------------------------------------------------------------

def cluster_config(model: Path, decode_workers: int = 1, **kw) -> ClusterConfig:
    cache = CacheConfig(block_size=4, num_blocks=1024)
    scheduler = SchedulerConfig(max_num_batched_tokens=64)
    engine = EngineConfig(model=str(model), cache=cache, scheduler=scheduler)
    opts = dict(engine=engine, prefill=PoolConfig(1, num_cpus=0.25, cache=cache, scheduler=scheduler),
                decode=PoolConfig(decode_workers, num_cpus=0.25, cache=cache, scheduler=scheduler),
                stats_interval_s=0.5, worker_timeout_s=WORKER_TIMEOUT_S, transfer_timeout_s=TRANSFER_TIMEOUT_S,
                kv_checksum=True)
    opts.update(kw)
    return ClusterConfig(**opts)


@pytest.fixture(scope="module")
def one_one(ray_local, aloop, tiny_checkpoints):
    s = Served(aloop, cluster_config(tiny_checkpoints["llama"]))
    yield s
    s.close()


@pytest.fixture(scope="module")
def one_two(ray_local, aloop, tiny_checkpoints):
    s = Served(aloop, cluster_config(tiny_checkpoints["llama"], decode_workers=2))
    yield s
    s.close()


# -- running a row ----------------------------------------------------------------------------------

def kill(served: Served, worker, how: str, pid: int) -> float:
    t = time.monotonic()
    if how == "ray.kill":
        ray.kill(worker.handle)
    else:
        os.kill(pid, signal.SIGKILL)
    return t


def reached(worker, point: str) -> None:
    assert ray.get(worker.handle.fault_reached.remote(point, 60)), f"{worker.worker_id} never reached {point}"


# -- worker deaths at each moment ----------------------------------------------------------------

PREFILL_MOMENTS = {"prefill-queued-and-in-step": "step", "prefill-after-step": "send", "prefill-mid-transfer": "mid_send"}


@pytest.mark.parametrize("how", KILLS)
@pytest.mark.parametrize("row", list(PREFILL_MOMENTS))
def test_prefill_worker_dies(one_one, row, how):
    s, point = one_one, PREFILL_MOMENTS[row]
    batch = prompts(6, seed=len(row))
    reference = s.reference(batch, 24)
    victim = s.worker("prefill")
    pid = s.pid(victim)
    ray.get(victim.handle.inject_fault.remote(point, STALL_S))
    streams = Streams(s, batch, 24)
    reached(victim, point)
    if point != "step":  # after its step: the first tokens are out, the KV is still here
        streams.wait_progress(1)
    t = kill(s, victim, how, pid)
    assert_exact(streams.result(ROWS[row].bound_s, t, ROWS[row].id), reference)
    s.settle()
    assert s.worker("prefill").worker_id != victim.worker_id


@pytest.mark.parametrize("how", KILLS)
@pytest.mark.parametrize("row", ["decode-holding-reservations", "decode-mid-transfer"])
def test_decode_worker_dies_during_the_hand_off(one_one, row, how):
    s = one_one
    batch = prompts(6, seed=len(row) + 7)
    reference = s.reference(batch, 24)
    victim, prefill = s.worker("decode"), s.worker("prefill")
    pid = s.pid(victim)
    if row == "decode-holding-reservations":
        ray.get(prefill.handle.inject_fault.remote("step", STALL_S))  # the prompts compute while D holds room
        streams = Streams(s, batch, 24)
        reached(prefill, "step")
        wait_for(lambda: next(x.waiting for x in s.stats() if x.worker_id == victim.worker_id) >= 1, 30,
                 what="the decode worker to hold reservations")
    else:
        ray.get(prefill.handle.inject_fault.remote("mid_send", STALL_S))
        streams = Streams(s, batch, 24)
        reached(prefill, "mid_send")
    t = kill(s, victim, how, pid)
    assert_exact(streams.result(ROWS[row].bound_s, t, ROWS[row].id), reference)
    s.settle()


@pytest.mark.parametrize("how", KILLS)
def test_decode_worker_dies_mid_stream_1p2d(one_two, how):
    """The case found by hand: kill -9 of a decode worker while 12 greedy streams of 160 tokens run."""
    s = one_two
    batch = prompts(12, seed=5)
    reference = s.reference(batch, 160)
    victim = s.worker("decode", 0)
    pid = s.pid(victim)
    ray.get(victim.handle.inject_fault.remote("step", STALL_S, skip=8))  # mid-stream, whatever the timing
    streams = Streams(s, batch, 160)
    reached(victim, "step")
    t = kill(s, victim, how, pid)
    assert_exact(streams.result(ROWS["decode-mid-stream"].bound_s, t, ROWS["decode-mid-stream"].id), reference)
    assert s.cluster.retries["decode_lost"] >= 1
    s.settle()


# -- a stuck worker -------------------------------------------------------------------------------------

@pytest.mark.parametrize("pool", ["decode", "prefill"])
def test_stuck_worker_is_killed_and_replaced(one_one, pool):
    s = one_one
    batch = prompts(6, seed=40 + len(pool))
    reference = s.reference(batch, 40)
    victim = s.worker(pool)
    pid = s.pid(victim)
    restarts = s.cluster.restarts[pool]
    # Caught inside a step: the prefill worker with prompts in it and queued behind it; the decode worker
    # at its fourth step, after every stream began and before any can end.
    ray.get(victim.handle.inject_fault.remote("step", STALL_S, skip=3 if pool == "decode" else 0))
    streams = Streams(s, batch, 40)
    reached(victim, "step")
    t = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        assert_exact(streams.result(ROWS[f"{pool}-stuck"].bound_s, t, ROWS[f"{pool}-stuck"].id), reference)
        assert s.cluster.restarts[pool] == restarts + 1
        s.settle()
        # The stopped process is killed, not left behind to wake up later.
        wait_for(lambda: not _alive(pid), 30, what=f"the stopped {pool} worker's process to be killed")
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie until its parent reaps it: dead all the same
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- the transfer itself --------------------------------------------------------------------------------

def test_stalled_transfer_is_retried_then_unavailable(one_one):
    s = one_one
    batch = prompts(2, seed=60)
    reference = s.reference(batch, 24)
    prefill = s.worker("prefill")
    failures = s.cluster.retries["transfer_failed"]
    ray.get(prefill.handle.inject_fault.remote("send", TRANSFER_TIMEOUT_S + 1.5))
    streams = Streams(s, batch[:1], 24)
    t = time.monotonic()
    assert_exact(streams.result(ROWS["transfer-stalled"].bound_s, t, ROWS["transfer-stalled"].id), reference[:1])
    assert s.cluster.retries["transfer_failed"] == failures + 1
    s.settle()
    ray.get(prefill.handle.inject_fault.remote("send", TRANSFER_TIMEOUT_S + 1.5, 2))
    streams = Streams(s, batch[1:], 24)
    t = time.monotonic()
    (out,) = streams.result(ROWS["transfer-stalled-twice"].bound_s, t, ROWS["transfer-stalled-twice"].id)
    assert out.code == grpc.StatusCode.UNAVAILABLE and "transfer" in out.details
    # Each attempt's first token came from the prefill worker before its KV failed: two, in order.
    assert out.tokens == reference[1][:2]
    s.settle()


def test_corrupted_transfer_is_caught_and_retried(one_one):
    s = one_one
    batch = prompts(3, seed=70)
    reference = s.reference(batch, 24)
    decode = s.worker("decode")
    before = next(x.transfer.get("checksum_failures", 0) for x in s.stats() if x.worker_id == decode.worker_id)
    ray.get(s.worker("prefill").handle.inject_fault.remote("corrupt"))
    streams = Streams(s, batch, 24)
    t = time.monotonic()
    assert_exact(streams.result(ROWS["transfer-corrupted"].bound_s, t, ROWS["transfer-corrupted"].id), reference)
    after = next(x.transfer["checksum_failures"] for x in s.stats() if x.worker_id == decode.worker_id)
    assert after == before + 1
    s.settle()


# -- the client goes away -------------------------------------------------------------------------------

@pytest.mark.parametrize("row", ["client-gone-mid-stream", "client-gone-mid-transfer"])
def test_client_disconnects(one_one, row):
    s = one_one
    prompt = prompts(1, seed=80)[0]
    if row == "client-gone-mid-transfer":
        ray.get(s.worker("prefill").handle.inject_fault.remote("send", STALL_S))

    async def run():
        async with AsyncClient(s.target) as c:
            call = c.stub.Generate(_request(prompt, 200), timeout=60)
            n = 0
            async for r in call:
                n += len(r.token_ids)
                if n >= (1 if row == "client-gone-mid-transfer" else 5):
                    break
            call.cancel()
            return await call.code()

    t = time.monotonic()
    code = s.aloop.run(run(), timeout=ROWS[row].bound_s)
    assert code == grpc.StatusCode.CANCELLED
    s.settle()
    assert time.monotonic() - t < ROWS[row].bound_s + 60


def _request(prompt, max_tokens):
    from pdserve.client import build_request

    return build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# -- a replacement that cannot start ------------------------------------------------------------------

def test_replacement_that_fails_to_start(ray_local, aloop, tiny_checkpoints, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama"], model)
    s = Served(aloop, cluster_config(model, pool_wait_timeout_s=5.0))
    try:
        batch = prompts(4, seed=90)
        reference = s.reference(batch, 40)
        victim = s.worker("decode")
        pid = s.pid(victim)
        ray.get(victim.handle.inject_fault.remote("step", STALL_S, skip=3))  # streams begun, none can end
        streams = Streams(s, batch, 40)
        reached(victim, "step")
        model.rename(tmp_path / "gone")  # the model volume is gone: every replacement fails to load
        t = kill(s, victim, "SIGKILL", pid)
        for out in streams.result(ROWS["replacement-fails"].bound_s, t, ROWS["replacement-fails"].id):
            assert out.code == grpc.StatusCode.UNAVAILABLE and "no decode worker" in out.details, out
        wait_for(lambda: s.cluster._pools.start_failures["decode"] >= 1, 60, what="a replacement to fail")
        assert s.cluster.pools["decode"] == []
        (tmp_path / "gone").rename(model)  # back: the next try starts (after its backoff)
        s.settle()
        streams = Streams(s, batch, 40)
        assert_exact(streams.result(ROWS["replacement-fails"].bound_s, time.monotonic(), ROWS["replacement-fails"].id), reference)
        s.settle()
    finally:
        s.close()


def test_every_row_is_in_docs_faults():
    text = (ROOT / "docs" / "faults.md").read_text()
    missing = [r for r in ROWS if f"`{r}`" not in text]
    assert not missing, f"docs/faults.md lacks rows {missing}"
