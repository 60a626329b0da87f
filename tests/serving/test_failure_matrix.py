"""The failure matrix (docs/faults.md): each row a fault at a moment, on a real local Ray cluster behind
the real gRPC router, with a real client.

Every row must end within its bound either token-exact against the offline engine or with a clean
status, and leave every surviving worker with zero used KV blocks and no KV channel to a lost peer.
Workers are caught at the exact moment by fault points (pdserve.faults) armed to hold: the worker waits
at the point (inside a step, before a transfer's header, between two of its parts) until the test kills
it from outside (ray.kill, or SIGKILL / SIGSTOP of the worker's process) or releases it, so the kill lands
inside the moment whatever the machine's speed. Each row asserts that its moment came (the point was
reached, and what the moment is: no first token yet, first tokens out and no transfer done, the stream's
tokens so far, the counter the row is about). A transfer that outlasts its timeout is held until the
router has retried for it; only the last of two such stalls (whose hold could not outlive the first's release)
stalls for fixed seconds. A cancel is read from the workers' own records (CancelWatch): that it
reached the workers of the attempt live at the time, within a few steps. The clusters live for the
module, so each row also starts from whatever state the rows before it left (replaced workers, rebuilt
channels): a leak would show in a later row.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import ray

from pdserve.client import AsyncClient
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig

from conftest import wait_for
from served import CANCEL_WITHIN_STEPS, CancelWatch, Served, Streams, assert_exact, prompts

ROOT = Path(__file__).resolve().parents[2]
TRANSFER_TIMEOUT_S = 4.0
WORKER_TIMEOUT_S = 3.0
# How long a row checks that its worker stays in the moment (held there): a step or a transfer of the tiny
# model takes milliseconds, so one not held would be past it; well within the worker timeout.
STAYS_S = 0.3


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
    Row("prefill-mid-transfer", "prefill worker dies between two parts of a KV transfer", "every stream token-exact",
        60),
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
    Row("client-gone-after-retry", "the client cancels a request resumed after its decode worker died",
        "CANCELLED (its own); the cancel reaches the retry's decode worker", 60),
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
                kv_checksum=True,
                local_prefill_max_tokens=0)  # every prompt handed off (a repeat held by a decode worker included)
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

HELD: dict[tuple[str, str], object] = {}  # (worker id, point) -> handle: armed to hold, not released, not killed


def hold(worker, point: str, skip: int = 0) -> None:
    """Arm the point to hold its hit (after `skip` hits) until the test releases it or kills the worker."""
    ray.get(worker.handle.inject_fault.remote(point, math.inf, skip=skip))
    HELD[(worker.worker_id, point)] = worker.handle


def release(worker, point: str) -> None:
    ray.get(worker.handle.release_fault.remote(point))
    del HELD[(worker.worker_id, point)]


def gone(worker) -> None:
    """The worker's process has ended: nothing of it is held any more."""
    for key in [k for k in HELD if k[0] == worker.worker_id]:
        del HELD[key]


@pytest.fixture(autouse=True)
def nothing_left_held(request):
    """A row that arms a hold ends it: with a kill, or by releasing it. Whatever a failed row left held is
    released, so that the next rows do not wait on it."""
    failed = request.session.testsfailed
    yield
    left = sorted(HELD)
    for (_, point), handle in HELD.items():
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(handle.release_fault.remote(point), timeout=10)
    HELD.clear()
    assert not left or request.session.testsfailed > failed, f"the row left {left} held"


def kill(served: Served, worker, how: str, pid: int) -> float:
    t = time.monotonic()
    if how == "ray.kill":
        ray.kill(worker.handle)
    else:
        os.kill(pid, signal.SIGKILL)
    gone(worker)
    return t


def reached(worker, point: str) -> None:
    assert ray.get(worker.handle.fault_reached.remote(point, 60)), f"{worker.worker_id} never reached {point}"


def held_in_step(worker) -> None:
    """The worker stays inside its step: its step thread, which answers stats between two steps, does not."""
    ready, _ = ray.wait([worker.handle.stats.remote()], timeout=STAYS_S)
    assert not ready, f"{worker.worker_id} is not held inside a step"


def stays(predicate, what: str) -> None:
    """The moment lasts: predicate() holds for STAYS_S (the worker is held in it, not passing through)."""
    deadline = time.monotonic() + STAYS_S
    while time.monotonic() < deadline:
        assert predicate(), f"the moment passed: {what}"
        time.sleep(0.02)


def transfers(served: Served, worker) -> tuple[int, int]:
    """A worker's KV transfers so far: (done, failed)."""
    t = served.stats_of(worker).transfer
    return t.get("transfers", 0), t.get("failures", 0)


# -- worker deaths at each moment ----------------------------------------------------------------

PREFILL_MOMENTS = {"prefill-queued-and-in-step": "step", "prefill-after-step": "send",
                   "prefill-mid-transfer": "mid_send"}


@pytest.mark.parametrize("how", KILLS)
@pytest.mark.parametrize("row", list(PREFILL_MOMENTS))
def test_prefill_worker_dies(one_one, row, how):
    s, point = one_one, PREFILL_MOMENTS[row]
    batch = prompts(6, seed=len(row))
    reference = s.reference(batch, 24)
    victim, decode = s.worker("prefill"), s.worker("decode")
    pid = s.pid(victim)
    before = transfers(s, decode)
    hold(victim, point)
    streams = Streams(s, batch, 24)
    reached(victim, point)
    if point == "step":  # prompts inside its held step, more queued behind it: not one first token out yet
        assert sum(map(len, batch)) > s.cluster.config.pools["prefill"].scheduler.max_num_batched_tokens
        held_in_step(victim)
        assert max(streams.progress) == 0 and victim.queued_tokens > 0
    else:  # after its step: the first tokens are out, the KV is still here (no transfer done, none failed)
        streams.wait_progress(1)
        stays(lambda: transfers(s, decode) == before, "a transfer to the decode worker ended")
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
    point = "step" if row == "decode-holding-reservations" else "mid_send"
    before = transfers(s, victim)
    hold(prefill, point)  # the prompts compute (or their KV moves) while D holds room for them
    streams = Streams(s, batch, 24)
    reached(prefill, point)
    if row == "decode-holding-reservations":
        wait_for(lambda: s.stats_of(victim).waiting >= 1, 30, what="the decode worker to hold reservations")
        held_in_step(prefill)
        assert max(streams.progress) == 0  # no prompt computed yet
    # No KV has landed (mid_send: the transfer is under way), none failed.
    stays(lambda: transfers(s, victim) == before, "a transfer to the decode worker ended")
    t = kill(s, victim, how, pid)
    release(prefill, point)
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
    hold(victim, "step", skip=8)  # its ninth step: mid-stream, whatever the timing
    streams = Streams(s, batch, 160)
    reached(victim, "step")
    # Its first request has run its eight steps: nine tokens (the prefill worker's first one, then its own).
    wait_for(lambda: max(streams.progress) >= 9, 30, what="a stream of the decode worker to have 9 tokens")
    held_in_step(victim)
    # The victim's streams are mid-way (the other decode worker's may have ended meanwhile).
    assert victim.requests and not streams.future.done() and min(streams.progress) < 160
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
    # at its fourth step, after every stream began (their first tokens come from the prefill worker) and
    # before any can end.
    hold(victim, "step", skip=3 if pool == "decode" else 0)
    streams = Streams(s, batch, 40)
    reached(victim, "step")
    if pool == "decode":
        streams.wait_progress(1)
    held_in_step(victim)
    assert max(streams.progress) < 40 if pool == "decode" else max(streams.progress) == 0
    t = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        assert_exact(streams.result(ROWS[f"{pool}-stuck"].bound_s, t, ROWS[f"{pool}-stuck"].id), reference)
        assert s.cluster.restarts[pool] == restarts + 1
        s.settle()
        # The stopped process is killed, not left behind to wake up later.
        wait_for(lambda: not _alive(pid), 30, what=f"the stopped {pool} worker's process to be killed")
        gone(victim)
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
    prefill, decode = s.worker("prefill"), s.worker("decode")
    failures = s.cluster.retries["transfer_failed"]
    # About time: the send is held until the decode worker's timeout has failed the transfer (the router retries),
    # then goes on, late.
    hold(prefill, "send")
    before = transfers(s, decode)
    streams = Streams(s, batch[:1], 24)
    reached(prefill, "send")
    t = time.monotonic()
    timed_out(s, prefill, failures + 1)
    assert_exact(streams.result(ROWS["transfer-stalled"].bound_s, t, ROWS["transfer-stalled"].id), reference[:1])
    assert s.cluster.retries["transfer_failed"] == failures + 1
    done, failed = transfers(s, decode)
    assert (done, failed) == (before[0] + 1, before[1] + 1)  # the stalled one failed, its retry's went through
    s.settle()
    hold(prefill, "send")
    streams = Streams(s, batch[1:], 24)
    reached(prefill, "send")
    t = time.monotonic()
    # The retry's send, armed before the first one goes on, stalls for fixed seconds past the timeout: a held one
    # would pass, released with it.
    timed_out(s, prefill, failures + 2, then_stall_s=TRANSFER_TIMEOUT_S + 1.5)
    (out,) = streams.result(ROWS["transfer-stalled-twice"].bound_s, t, ROWS["transfer-stalled-twice"].id)
    assert out.code == grpc.StatusCode.UNAVAILABLE and "transfer" in out.details
    # Each attempt's first token came from the prefill worker before its KV failed: two, in order.
    assert out.tokens == reference[1][:2]
    assert transfers(s, decode) == (done, failed + 2) and s.cluster.retries["transfer_failed"] == failures + 2
    s.settle()


def timed_out(s: Served, prefill, failures: int, then_stall_s: float = 0.0) -> None:
    """The prefill worker's send, held, outlasts the transfer's timeout: once the router has retried for it (the
    failures-th transfer failure), it goes on (the next send armed to stall then_stall_s first, if given)."""
    assert (prefill.worker_id, "send") in HELD, "the send is not held"
    wait_for(lambda: s.cluster.retries["transfer_failed"] >= failures, 60, what="the transfer's timeout to fail it")
    assert s.cluster.retries["transfer_failed"] == failures
    if then_stall_s:
        ray.get(prefill.handle.inject_fault.remote("send", then_stall_s))
    release(prefill, "send")


def test_corrupted_transfer_is_caught_and_retried(one_one):
    s = one_one
    batch = prompts(3, seed=70)
    reference = s.reference(batch, 24)
    decode = s.worker("decode")
    before = next(x.transfer.get("checksum_failures", 0) for x in s.stats() if x.worker_id == decode.worker_id)
    prefill = s.worker("prefill")
    ray.get(prefill.handle.inject_fault.remote("corrupt"))
    streams = Streams(s, batch, 24)
    reached(prefill, "corrupt")
    t = time.monotonic()
    assert_exact(streams.result(ROWS["transfer-corrupted"].bound_s, t, ROWS["transfer-corrupted"].id), reference)
    after = next(x.transfer["checksum_failures"] for x in s.stats() if x.worker_id == decode.worker_id)
    assert after == before + 1
    s.settle()


# -- the client goes away -------------------------------------------------------------------------------

class Call:
    """A greedy stream through the router under a request id the test knows, as long as the context allows
    (its end can never explain what a cancel did), that its client cancels: at its `cancel_at`-th token,
    or when the test calls cancel(). Just before, it watches the cancels of the workers of `pools` that
    hold the attempt live then (router-side), reading their step right after (CancelWatch)."""

    def __init__(self, served: Served, prompt: list[int], rid: str, cancel_at: int | None = None,
                 pools: Sequence[str] = ("decode",)):
        self.served, self.rid, self.cancel_at, self.pools = served, rid, cancel_at, pools
        self.max_tokens = served.cluster.info.max_model_len - len(prompt)
        self.tokens = 0
        self.tokens_at_cancel: int | None = None
        self.attempt: str | None = None  # the worker-side id of the attempt live at the cancel
        self.watches: dict[str, CancelWatch] = {}
        self._call = None
        self.future = asyncio.run_coroutine_threadsafe(self._run(prompt), served.aloop.loop)

    async def _run(self, prompt) -> grpc.StatusCode:
        async with AsyncClient(self.served.target) as c:
            self._call = c.stub.Generate(_request(prompt, self.max_tokens, self.rid), timeout=120)
            with contextlib.suppress(asyncio.CancelledError):  # what reading a call cancelled meanwhile raises
                async for r in self._call:
                    self.tokens += len(r.token_ids)
                    if self.cancel_at is not None and self.tokens >= self.cancel_at:
                        await self._cancel()
                        break
            return await self._call.code()

    async def _cancel(self) -> None:
        # Attempts run under worker-side ids of their own (router.cluster: <id>#<attempt>).
        workers = [w for p in self.pools for w in self.served.cluster.pools[p]]
        (self.attempt,) = {a for w in workers for a in w.requests if a.startswith(f"{self.rid}#")}
        live = [w for w in workers if self.attempt in w.requests]
        assert len(live) == len(self.pools), f"{self.attempt} is live on {[w.worker_id for w in live]}"
        watches = await asyncio.gather(*(CancelWatch.of(w) for w in live))
        self.tokens_at_cancel = self.tokens
        self._call.cancel()
        await asyncio.gather(*(w.client_cancelled() for w in watches))
        self.watches = {w.worker.pool: w for w in watches}

    def cancel(self) -> None:
        self.served.aloop.run(self._cancel())

    def cancelled(self, pool: str):
        """The client saw CANCELLED; the record of the cancel on the attempt's worker of `pool`, which it
        reached within CANCEL_WITHIN_STEPS steps, having produced no more than the client had then, plus those."""
        assert self.future.result(30) == grpc.StatusCode.CANCELLED
        record = self.served.aloop.run(self.watches[pool].arrived(self.max_tokens, self.attempt))
        assert record.output_tokens <= self.tokens_at_cancel + CANCEL_WITHIN_STEPS, record
        return record


@pytest.mark.parametrize("row", ["client-gone-mid-stream", "client-gone-mid-transfer"])
def test_client_disconnects(one_one, row):
    s = one_one
    prompt = prompts(1, seed=80)[0][:8]
    prefill, decode = s.worker("prefill"), s.worker("decode")
    t = time.monotonic()
    if row == "client-gone-mid-stream":
        call = Call(s, prompt, row, cancel_at=5)
        record = call.cancelled("decode")
        assert record.status == "running"
    else:
        before = transfers(s, decode)
        hold(prefill, "send")  # the KV is computed, announced to the decode worker, and not sent
        call = Call(s, prompt, row, pools=("prefill", "decode"))
        reached(prefill, "send")
        wait_for(lambda: call.tokens >= 1, 30, what="the first token")
        stays(lambda: transfers(s, decode) == before, "the transfer ended")  # in flight: not landed, not failed
        call.cancel()
        # It reached both workers: the decode worker waiting for the KV, the prefill worker holding it for the push.
        assert (call.cancelled("decode").status, call.cancelled("prefill").status) == ("waiting_for_kv", "held")
        assert call.tokens == 1
        # The blocks being written stay the decode worker's until the write is over.
        stays(lambda: s.stats_of(decode).kv_blocks_used > 0, "the decode worker freed blocks still being written")
        release(prefill, "send")
    s.settle()  # both workers free the KV (the decode worker once the write is over)
    assert time.monotonic() - t < ROWS[row].bound_s + 60


def test_client_cancel_reaches_the_retry(one_one):
    """A request whose decode worker died mid-stream resumes elsewhere (attempt #1); its client's cancel
    then reaches that attempt's decode worker, not only the router."""
    s = one_one
    prompt = prompts(1, seed=86)[0][:8]
    victim = s.worker("decode")
    pid = s.pid(victim)
    hold(victim, "step", skip=8)  # its ninth step: mid-stream
    call = Call(s, prompt, "client-gone-after-retry")
    reached(victim, "step")
    wait_for(lambda: call.tokens >= 9, 30, what="nine tokens from the first attempt")
    held_in_step(victim)
    t = kill(s, victim, "SIGKILL", pid)
    call.cancel_at = call.tokens + 5  # once the retry has streamed a few of its own
    assert call.future.result(ROWS["client-gone-after-retry"].bound_s) == grpc.StatusCode.CANCELLED
    assert call.attempt == "client-gone-after-retry#1" and call.watches["decode"].worker.worker_id != victim.worker_id
    record = call.cancelled("decode")
    assert record.status == "running" and record.output_tokens > 9
    s.settle()
    assert time.monotonic() - t < ROWS["client-gone-after-retry"].bound_s + 60


def _request(prompt, max_tokens, request_id=""):
    from pdserve.client import build_request

    return build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                         request_id=request_id)


# -- a replacement that cannot start ------------------------------------------------------------------

def test_replacement_that_fails_to_start(ray_local, aloop, tiny_checkpoints, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama"], model)
    # A short wait for a worker and a short backoff between replacements: the row's point is the statuses and the
    # replacement that starts once the files are back, not how long either takes.
    s = Served(aloop, cluster_config(model, pool_wait_timeout_s=2.0, replace_backoff_s=(0.5, 1.0)))
    try:
        batch = prompts(4, seed=90)
        reference = s.reference(batch, 40)
        victim = s.worker("decode")
        pid = s.pid(victim)
        hold(victim, "step", skip=3)  # streams begun, none can end
        streams = Streams(s, batch, 40)
        reached(victim, "step")
        streams.wait_progress(1)
        held_in_step(victim)
        assert max(streams.progress) < 40
        model.rename(tmp_path / "gone")  # the model volume is gone: every replacement fails to load
        t = kill(s, victim, "SIGKILL", pid)
        for out in streams.result(ROWS["replacement-fails"].bound_s, t, ROWS["replacement-fails"].id):
            assert out.code == grpc.StatusCode.UNAVAILABLE and "no decode worker" in out.details, out
        wait_for(lambda: s.cluster._pools.start_failures["decode"] >= 1, 60, what="a replacement to fail")
        assert s.cluster.pools["decode"] == []
        (tmp_path / "gone").rename(model)  # back: the next try starts (after its backoff)
        s.settle()
        streams = Streams(s, batch, 40)
        row = ROWS["replacement-fails"]
        assert_exact(streams.result(row.bound_s, time.monotonic(), row.id), reference)
        s.settle()
    finally:
        s.close()


def test_every_row_is_in_docs_faults():
    text = (ROOT / "docs" / "faults.md").read_text()
    missing = [r for r in ROWS if f"`{r}`" not in text]
    assert not missing, f"docs/faults.md lacks rows {missing}"
