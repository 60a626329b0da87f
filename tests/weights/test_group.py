"""The trainer's broadcast group (pdserve.weights.group) between real processes: gloo over loopback, no mocks.

Two child processes (the module's `workers`, from pdserve.processes) play worker ranks 1 and 2 in every test and outlive the groups
that fail, as a worker's ranks do; the pytest process plays the trainer (rank 0), except where the trainer is
killed: there a child process plays it. Workers report digests of what they received, never the tensors.
"""
from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import os
import signal
import socket
import time
from dataclasses import dataclass

import pytest
import torch

from pdserve import processes
from pdserve.weights.group import (
    GroupAddress,
    TensorMeta,
    WeightGroup,
    WeightGroupError,
    free_port,
    measure_bandwidth,
    plan_buckets,
)

TIMEOUT_S = 5.0  # every group's timeout
SLACK_S = 3.0  # how long past a bound a failure may take to be reported (2 busy cores)
WAIT_S = 60.0  # for queue messages and process exits
WORKER_RANKS = (1, 2)
SMALL_BUCKET, LARGE_BUCKET = 64 << 10, 1 << 20


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """20 named tensors of fp32/bf16/fp16, of mixed shapes: a scalar, an empty one, some larger than a
    small bucket (64 KiB) and one larger than a large one (1 MiB)."""
    shapes = [(7,), (16, 33), (300, 257), (3, 5, 11), (), (1024, 129), (600, 600), (64,), (0, 4), (1,),
              (33, 17, 2), (2048,), (128, 128), (5,), (257, 300), (9, 9), (4096,), (1, 1, 1), (70, 70), (3,)]
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    g = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.w{seed}", torch.randn(shape, generator=g).to(dtypes[i % 3]))
            for i, shape in enumerate(shapes)]


def _metas(tensors: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in tensors]


def _digest(name: str, t: torch.Tensor) -> tuple[str, tuple[int, ...], str, str]:
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, tuple(t.shape), str(t.dtype), hashlib.sha256(data).hexdigest()


def _sockets() -> int:
    """Open sockets of this process."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _assert_port_free(port: int) -> None:
    """Nothing listens on the port any more: a new store could serve there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


# --- what the child processes run (module level: a child imports them by name) ---

def _worker(rank: int, commands: mp.Queue, results: mp.Queue) -> None:
    """A worker rank: runs the test's commands in order, reporting each outcome as (rank, kind, ...)."""
    group: WeightGroup | None = None
    arena: list[torch.Tensor] = []
    results.put((rank, "ready"))
    while True:
        cmd, *args = commands.get()
        if cmd == "exit":
            return
        got: list[tuple] = []
        try:
            if cmd == "join":
                address, timeout_s = args
                group = WeightGroup.join(address, rank, timeout_s)
                results.put((rank, "joined"))
            elif cmd == "receive":
                metas, bucket_bytes, progress = args
                for name, t in group.receive(metas, bucket_bytes):
                    got.append(_digest(name, t))  # valid until the next bucket: what a consumer keeps, it copies
                    if progress:
                        results.put((rank, "progress", len(got)))
                results.put((rank, "received", got))
            elif cmd == "receive_arena":  # into the arena kept across commands; tensors kept uncopied
                metas, bucket_bytes = args
                kept = list(group.receive(metas, bucket_bytes, arena))
                results.put((rank, "received", [_digest(name, t) for name, t in kept],
                             [buf.data_ptr() for buf in arena]))
            elif cmd == "bandwidth":
                results.put((rank, "bandwidth", measure_bandwidth(group, args[0])))
            elif cmd == "close":
                group.close()
                group.close()
                results.put((rank, "closed"))
        except WeightGroupError as e:
            results.put((rank, "error", cmd, str(e), got))


def _trainer_paused(address: GroupAddress, bucket_bytes: int, pause_after: int, paused, results: mp.Queue) -> None:
    """Rank 0 that sends _tensors(1) and stops after bucket pause_after (until the test kills it)."""
    results.put((0, "ready"))
    group = WeightGroup.join(address, 0, TIMEOUT_S)

    def after_bucket(k: int, sent: int) -> None:
        if k == pause_after:
            paused.set()
            time.sleep(10 * WAIT_S)  # not synchronisation: the test kills this process here

    group.send(_tensors(1), bucket_bytes, after_bucket=after_bucket)
    results.put((0, "unexpected: the update was sent whole"))


# --- the worker ranks ---

@dataclass
class Workers:
    commands: dict[int, mp.Queue]
    results: mp.Queue
    pids: set[int]

    def tell(self, *command) -> None:
        for q in self.commands.values():
            q.put(command)

    def collect(self, kind: str) -> dict[int, tuple]:
        """One message from each worker, which must be of this kind."""
        out: dict[int, tuple] = {}
        deadline = time.monotonic() + WAIT_S
        while len(out) < len(self.commands):
            msg = self.results.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert msg[1] == kind and msg[0] not in out, msg
            out[msg[0]] = msg[2:]
        return out


@pytest.fixture(scope="module")
def workers():
    ctx = processes.context()
    results = ctx.Queue()
    commands = {rank: ctx.Queue() for rank in WORKER_RANKS}
    procs = [ctx.Process(target=_worker, args=(rank, commands[rank], results), daemon=True) for rank in WORKER_RANKS]
    for p in procs:
        p.start()
    try:
        w = Workers(commands, results, {p.pid for p in procs})
        w.collect("ready")
        yield w
        w.tell("exit")
        for p in procs:
            p.join(WAIT_S)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(WAIT_S)
    assert mp.active_children() == []  # no process of this module outlives it


def _join_all(workers: Workers, name: str) -> WeightGroup:
    """A group of the pytest process (rank 0) and the workers, on a fresh port."""
    address = GroupAddress("127.0.0.1", free_port(), 1 + len(WORKER_RANKS), name)
    workers.tell("join", address, TIMEOUT_S)
    group = WeightGroup.join(address, 0, TIMEOUT_S)
    workers.collect("joined")
    return group


def _close_all(workers: Workers, group: WeightGroup) -> None:
    workers.tell("close")
    group.close()
    workers.collect("closed")


# --- tests ---

def test_plan_buckets_respects_sizes_and_order():
    def meta(n: int, dtype: torch.dtype = torch.float32) -> TensorMeta:
        return TensorMeta(f"t{n}", (n,), dtype)

    # bytes: 40, 40, 40, 200 (larger than a bucket), 10 (fp16), 0, 100, 60, 50 (bf16)
    metas = [meta(10), meta(10), meta(10), meta(50), meta(5, torch.float16), meta(0), meta(25), meta(15),
             meta(25, torch.bfloat16)]
    assert plan_buckets(metas, 100) == [[0, 1], [2], [3], [4, 5], [6], [7], [8]]
    assert plan_buckets(metas, 1000) == [list(range(9))]
    assert plan_buckets(metas, 1) == [[i] for i in range(9)]
    assert plan_buckets([], 100) == []
    with pytest.raises(ValueError):
        plan_buckets(metas, 0)

    metas = _metas(_tensors(0))
    sizes = [math.prod(m.shape) * m.dtype.itemsize for m in metas]
    for bucket_bytes in (1, 100, SMALL_BUCKET, LARGE_BUCKET, 1 << 30):
        plan = plan_buckets(metas, bucket_bytes)
        assert [i for b in plan for i in b] == list(range(len(metas)))  # every index once, in order
        for bucket in plan:
            assert bucket and (len(bucket) == 1 or sum(sizes[i] for i in bucket) <= bucket_bytes)
        # consecutive buckets could not have been merged: the plan is greedy
        for a, b in zip(plan, plan[1:]):
            assert sum(sizes[i] for i in a) + sizes[b[0]] > bucket_bytes


def test_update_arrives_bit_exact_on_every_rank(workers):
    tensors = _tensors(0)
    metas = _metas(tensors)
    expected = [_digest(name, t) for name, t in tensors]
    assert any(t.nbytes > SMALL_BUCKET for _, t in tensors) and any(t.nbytes > LARGE_BUCKET for _, t in tensors)
    group = _join_all(workers, "exact")
    assert (group.rank, group.world_size) == (0, 3)
    for bucket_bytes in (SMALL_BUCKET, LARGE_BUCKET):
        workers.tell("receive", metas, bucket_bytes, False)
        assert group.send(tensors, bucket_bytes) == sum(t.nbytes for _, t in tensors)
        for rank, (got,) in workers.collect("received").items():
            assert [g[:4] for g in got] == expected, f"rank {rank}, buckets of {bucket_bytes} bytes"
    with pytest.raises(RuntimeError, match="ranks 1.. receive"):
        group.receive(metas, SMALL_BUCKET)
    _close_all(workers, group)


def test_an_arena_keeps_every_bucket_and_is_reused_by_the_next_update(workers):
    """Received into an arena, every tensor is still whole once the update has arrived (a worker stages them
    where they landed), and the next update of the same tensors lands in the same buffers (no new memory)."""
    first = _tensors(0)
    second = [(name, t + 1) for name, t in first]
    metas = _metas(first)
    group = _join_all(workers, "arena")
    pointers = None
    for tensors in (first, second):
        workers.tell("receive_arena", metas, SMALL_BUCKET)
        group.send(tensors, SMALL_BUCKET)
        received = workers.collect("received")
        for rank, (got, ptrs) in received.items():
            assert [g[:4] for g in got] == [_digest(name, t) for name, t in tensors], f"rank {rank}"
            assert len(ptrs) == len(plan_buckets(metas, SMALL_BUCKET))
            if pointers is not None:
                assert ptrs == pointers[rank], f"rank {rank}: the arena was not reused"
        pointers = {rank: ptrs for rank, (_, ptrs) in received.items()}
    _close_all(workers, group)


def test_receivers_that_expect_another_update_fail_and_so_does_the_trainer(workers):
    tensors = _tensors(0)
    metas = _metas(tensors)
    assert metas[1].dtype == torch.bfloat16
    metas[1] = TensorMeta(metas[1].name, metas[1].shape, torch.float32)  # a bf16 tensor, expected as fp32
    group = _join_all(workers, "mismatch")
    workers.tell("receive", metas, SMALL_BUCKET, False)
    start = time.monotonic()
    with pytest.raises(WeightGroupError):  # the receivers closed their groups: the trainer's broadcasts fail
        group.send(tensors, SMALL_BUCKET)
    for cmd, message, got in workers.collect("error").values():
        assert cmd == "receive" and "expects another update" in message and got == []
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert group.broken
    group.close()


def test_a_trainer_that_stops_sending_fails_every_receiver_within_the_timeout(workers):
    group = _join_all(workers, "stalled")
    start = time.monotonic()
    workers.tell("receive", _metas(_tensors(0)), SMALL_BUCKET, False)  # the trainer sends nothing
    errors = workers.collect("error")
    elapsed = time.monotonic() - start
    print(f"receivers of a stalled trainer failed after {elapsed:.2f} s (timeout {TIMEOUT_S:g} s)")
    assert TIMEOUT_S - 0.1 <= elapsed < TIMEOUT_S + SLACK_S
    for cmd, message, got in errors.values():
        assert cmd == "receive" and "receiving an update failed" in message and got == []
    start = time.monotonic()
    with pytest.raises(WeightGroupError):  # the receivers are gone from the group
        group.barrier()
    group.close()
    assert time.monotonic() - start < SLACK_S


def test_a_killed_trainer_fails_every_receiver_and_a_new_group_works(workers):
    ctx = processes.context()
    results, paused = ctx.Queue(), ctx.Event()
    tensors = _tensors(1)
    metas = _metas(tensors)
    plan = plan_buckets(metas, SMALL_BUCKET)
    pause_after = 3
    arrived = sum(len(b) for b in plan[:pause_after + 1])  # tensors of the buckets sent before the kill
    assert arrived < len(tensors)
    address = GroupAddress("127.0.0.1", free_port(), 3, "killed")
    trainer = ctx.Process(target=_trainer_paused, args=(address, SMALL_BUCKET, pause_after, paused, results),
                          daemon=True)
    trainer.start()
    try:
        assert results.get(timeout=WAIT_S) == (0, "ready")
        workers.tell("join", address, TIMEOUT_S)
        workers.tell("receive", metas, SMALL_BUCKET, True)
        workers.collect("joined")
        assert paused.wait(WAIT_S)
        # Kill once every receiver has yielded the buckets sent: they are waiting for the next one.
        progress = dict.fromkeys(WORKER_RANKS, 0)
        while min(progress.values()) < arrived:
            rank, kind, count = workers.results.get(timeout=WAIT_S)
            assert kind == "progress", (rank, kind, count)
            progress[rank] = count
        killed_at = time.monotonic()
        os.kill(trainer.pid, signal.SIGKILL)
        errors = workers.collect("error")
        elapsed = time.monotonic() - killed_at
        print(f"receivers of a killed trainer failed after {elapsed:.2f} s (timeout {TIMEOUT_S:g} s)")
        assert elapsed < TIMEOUT_S + SLACK_S
        expected = [_digest(name, t) for name, t in tensors[:arrived]]
        for cmd, message, got in errors.values():
            assert cmd == "receive" and "receiving an update failed" in message
            assert [g[:4] for g in got] == expected  # what arrived before the kill was whole and exact
        trainer.join(WAIT_S)
        assert trainer.exitcode == -signal.SIGKILL
    finally:
        if trainer.is_alive():
            trainer.kill()
        trainer.join(WAIT_S)

    # The survivors and a new trainer (this process) form a new group under a new name and port.
    tensors = _tensors(2)
    group = _join_all(workers, "after-kill")
    workers.tell("receive", _metas(tensors), SMALL_BUCKET, False)
    group.send(tensors, SMALL_BUCKET)
    for got, in workers.collect("received").values():
        assert [g[:4] for g in got] == [_digest(name, t) for name, t in tensors]
    _close_all(workers, group)


def test_join_with_a_missing_rank_fails_within_the_timeout():
    timeout_s = 2.0
    port = free_port()
    start = time.monotonic()
    with pytest.raises(WeightGroupError, match=r"1 of 3 ranks joined \(missing ranks \[1, 2\]\)"):
        WeightGroup.join(GroupAddress("127.0.0.1", port, 3, "lonely"), 0, timeout_s)
    assert timeout_s - 0.1 <= time.monotonic() - start < timeout_s + SLACK_S
    _assert_port_free(port)  # the failed trainer's store is gone

    start = time.monotonic()  # a worker rank whose trainer never comes
    with pytest.raises(WeightGroupError, match="could not reach rank 0's store"):
        WeightGroup.join(GroupAddress("127.0.0.1", free_port(), 3, "orphan"), 1, timeout_s)
    assert time.monotonic() - start < timeout_s + SLACK_S


def test_arguments_are_checked():
    address = GroupAddress("127.0.0.1", free_port(), 2, "args")
    with pytest.raises(NotImplementedError, match="only 'gloo'"):
        WeightGroup.join(address, 0, backend="nccl")
    with pytest.raises(ValueError):
        WeightGroup.join(address, 2)
    with pytest.raises(ValueError):
        GroupAddress("127.0.0.1", 0, 2, "no port")
    with pytest.raises(ValueError):
        GroupAddress("127.0.0.1", 1234, 2, "")


def test_measure_bandwidth_gives_every_rank_the_same_figure(workers):
    nbytes = 32 << 20
    group = _join_all(workers, "bandwidth")
    workers.tell("bandwidth", nbytes)
    mine = measure_bandwidth(group, nbytes)
    theirs = [bw for bw, in workers.collect("bandwidth").values()]
    _close_all(workers, group)
    print(f"gloo broadcast of {nbytes >> 20} MiB from rank 0 to 2 ranks over loopback: {mine / 1e9:.2f} GB/s")
    assert math.isfinite(mine) and mine > 0
    assert theirs == [mine, mine]


def test_close_releases_the_port_and_sockets(workers):
    before = _sockets()
    group = _join_all(workers, "leak")
    port = group.address.port
    assert _sockets() > before
    _close_all(workers, group)
    group.close()  # idempotent
    assert _sockets() == before
    _assert_port_free(port)
    with pytest.raises(WeightGroupError, match="closed"):
        group.barrier()
    assert {p.pid for p in mp.active_children()} == workers.pids  # no process of an earlier test lingers
