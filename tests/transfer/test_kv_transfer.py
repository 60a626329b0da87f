"""KV transfer: block extraction/insertion and PairChannel between real processes (gloo on CPU).

The pytest process plays the decode worker (StoreServer, rank 1); child processes (pdserve.processes) play prefill
workers (rank 0). Both sides build the same seeded cache, so the receiver knows what must arrive.
"""
from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from pdserve import processes
from pdserve.transfer.channel import (
    TRANSFER_SECONDS_BUCKETS,
    PairChannel,
    StoreServer,
    TransferError,
    TransferStats,
    TransferTimeout,
    extract_blocks,
    insert_blocks,
)

LAYERS, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 2, 2, 16, 4, 8
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * BLOCK_SIZE * HEAD_DIM * 4  # fp32
TIMEOUT_S = 20.0  # generous: two busy cores
WAIT_S = 30.0  # for queue messages and joins


@dataclass(frozen=True)
class Transfer:
    transfer_id: int
    src: tuple[int, ...]  # block ids on the prefill side
    dst: tuple[int, ...]  # block ids on the decode side


def _cache(seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, generator=g).to(device)


def _plan(seed: int, count: int = 4) -> list[Transfer]:
    rng = random.Random(seed)
    plan = []
    for transfer_id in range(1, count + 1):
        n = rng.randint(1, 6)
        plan.append(Transfer(transfer_id, tuple(rng.sample(range(NUM_BLOCKS), n)),
                             tuple(rng.sample(range(NUM_BLOCKS), n))))
    return plan


def _shape(n: int) -> tuple[int, ...]:
    return (LAYERS, 2, KV_HEADS, n, BLOCK_SIZE, HEAD_DIM)


# --- what the prefill processes run (module level: a child imports them by name) ---

def _send_plan(port: int, prefill_id: str, seed: int, results: mp.Queue) -> None:
    results.put(("ready",))
    cache = _cache(seed)
    with PairChannel("127.0.0.1", port, prefill_id, "d0", 0, TIMEOUT_S) as channel:
        try:
            for t in _plan(seed):
                channel.send(t.transfer_id, extract_blocks(cache, t.src))
        except TransferError as e:
            results.put(("error", type(e).__name__, str(e), channel.broken, channel.stats.snapshot()))
            return
        results.put(("done", channel.stats.snapshot()))


def _send_late_then_retry(port: int, seed: int, delay_s: float, timeout_s: float, results: mp.Queue) -> None:
    results.put(("ready",))
    cache = _cache(seed)
    first = _plan(seed)[0]
    late = PairChannel("127.0.0.1", port, "p0", "d0", 0, timeout_s, before_send=lambda _: time.sleep(delay_s))
    try:
        late.send(first.transfer_id, extract_blocks(cache, first.src))
        results.put(("unexpected success",))
        return
    except TransferError as e:
        results.put(("failed", type(e).__name__, late.broken))
    with PairChannel("127.0.0.1", port, "p0", "d0", 0, timeout_s, generation=1) as fresh:
        fresh.send(first.transfer_id, extract_blocks(cache, first.src))
        results.put(("done", fresh.stats.snapshot()))


# --- helpers for the decode side ---

@pytest.fixture
def ctx() -> mp.context.BaseContext:
    return processes.context()


@contextmanager
def _started(ctx: mp.context.BaseContext, *targets: tuple[Callable[..., None], tuple]) -> Iterator[None]:
    """Run the targets in their own processes; all must exit cleanly, none may outlive the test."""
    procs = [ctx.Process(target=fn, args=args, daemon=True) for fn, args in targets]
    for p in procs:
        p.start()
    try:
        yield
        for p in procs:
            p.join(WAIT_S)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(WAIT_S)


def _expect(results: mp.Queue, kind: str) -> tuple:
    msg = results.get(timeout=WAIT_S)
    assert msg[0] == kind, msg
    return msg


def _receive_and_check(channel: PairChannel, seed: int, t: Transfer, decode_cache: torch.Tensor) -> None:
    data = channel.recv(t.transfer_id, _shape(len(t.dst)), torch.float32)
    insert_blocks(decode_cache, t.dst, data)
    assert torch.equal(extract_blocks(decode_cache, t.dst), extract_blocks(_cache(seed), t.src))


# --- tests ---

def test_extract_insert_round_trip_moves_blocks_between_ids():
    src, dst = _cache(0), _cache(1)
    before = dst.clone()
    rng = random.Random(0)
    src_ids, dst_ids = rng.sample(range(NUM_BLOCKS), 5), rng.sample(range(NUM_BLOCKS), 5)

    data = extract_blocks(src, src_ids)
    assert data.shape == _shape(5) and data.is_contiguous()
    insert_blocks(dst, dst_ids, data)

    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[:, :, :, d], src[:, :, :, s])
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert torch.equal(dst[:, :, :, untouched], before[:, :, :, untouched])


def test_extract_insert_reject_what_does_not_fit():
    cache = _cache(0)
    data = extract_blocks(cache, [1, 2])
    with pytest.raises(ValueError, match=r"expected \(2, 2, 2, 3, 4, 8\)"):
        insert_blocks(cache, [1, 2, 3], data)
    with pytest.raises(ValueError, match="out of range"):
        extract_blocks(cache, [3, NUM_BLOCKS])
    with pytest.raises(ValueError, match="duplicate"):
        insert_blocks(cache, [4, 4], data)
    with pytest.raises(ValueError, match="float64"):
        insert_blocks(cache, [1, 2], data.double())
    with pytest.raises(ValueError, match="at least one block"):
        extract_blocks(cache, [])
    with pytest.raises(ValueError, match=r"\[layers, 2, kv_heads, blocks, block_size, head_dim\]"):
        extract_blocks(cache[0], [0])


def test_stats_count_and_snapshot():
    stats = TransferStats()
    stats.record(100, 0.5)
    stats.record(28, 0.25)
    stats.record(1, 0.0025)  # on a bucket's upper bound: counted in that bucket
    stats.record(1, 99.0)  # past the last bound: the +Inf bucket
    stats.record_failure()
    stats.record_checksum_failure()
    stats.record_channel()
    buckets = [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1)
    buckets[TRANSFER_SECONDS_BUCKETS.index(0.5)] = 1
    buckets[TRANSFER_SECONDS_BUCKETS.index(0.25)] = 1
    buckets[TRANSFER_SECONDS_BUCKETS.index(0.0025)] = 1
    buckets[-1] = 1
    assert stats.snapshot() == {"transfers": 4, "bytes": 130, "seconds": 99.7525, "failures": 2,
                                "checksum_failures": 1, "channels_opened": 1, "bucket_counts": buckets}


def test_channel_arguments_are_checked_before_any_rendezvous():
    with pytest.raises(ValueError, match="rank"):
        PairChannel("127.0.0.1", 1, "p0", "d0", 2, 1.0)
    with pytest.raises(ValueError, match="'/'"):
        PairChannel("127.0.0.1", 1, "p/0", "d0", 0, 1.0)
    with pytest.raises(ValueError, match="no KV transfer backend"):
        PairChannel("127.0.0.1", 1, "p0", "d0", 1, 1.0, device="meta")


@pytest.mark.timeout(60)
def test_rendezvous_without_a_peer_times_out():
    """The rendezvous waits out its own timeout (not the store's 60 s, not one timeout per step), then
    says so. A TransferTimeout is only raised once the clock has passed the deadline, so the lower bound
    is exact; the upper bound leaves a whole timeout for the machine's load, and still fails a second wait."""
    timeout_s = 2.0
    with StoreServer() as server:
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match="rendezvous on pair pair/p0/d0/0 did not complete within 2 s"):
            PairChannel(server.host, server.port, "p0", "d0", 1, timeout_s)
        elapsed = time.monotonic() - start
        assert timeout_s - 0.05 <= elapsed < 2 * timeout_s


@pytest.mark.timeout(60)
def test_blocks_arrive_bit_identical_across_processes(ctx):
    results = ctx.Queue()
    plan = _plan(seed=3)
    with StoreServer() as server, _started(ctx, (_send_plan, (server.port, "p0", 3, results))):
        _expect(results, "ready")
        decode_cache = torch.zeros(_shape(NUM_BLOCKS))
        with PairChannel(server.host, server.port, "p0", "d0", 1, TIMEOUT_S) as channel:
            for t in plan:
                _receive_and_check(channel, 3, t, decode_cache)
            sent = _expect(results, "done")[1]
            with pytest.raises(RuntimeError, match="cannot send"):
                channel.send(9, decode_cache)
        with pytest.raises(TransferError, match="closed"):
            channel.recv(9, _shape(1), torch.float32)
        channel.close()  # idempotent

    total = sum(len(t.src) for t in plan) * BLOCK_BYTES
    for stats in (sent, channel.stats.snapshot()):
        assert (stats["transfers"], stats["bytes"], stats["failures"]) == (len(plan), total, 0)
        assert sum(stats["bucket_counts"]) == len(plan)


@pytest.mark.timeout(60)
def test_two_pairs_share_one_store_and_interleave(ctx):
    results = {"pa": ctx.Queue(), "pb": ctx.Queue()}
    seeds = {"pa": 5, "pb": 6}
    with StoreServer() as server, _started(ctx, *[(_send_plan, (server.port, p, seeds[p], results[p]))
                                                  for p in results]):
        for q in results.values():
            _expect(q, "ready")
        channels = {p: PairChannel(server.host, server.port, p, "d0", 1, TIMEOUT_S) for p in results}
        try:
            decode_cache = torch.zeros(_shape(NUM_BLOCKS))
            for ta, tb in zip(_plan(seeds["pa"]), _plan(seeds["pb"])):
                _receive_and_check(channels["pa"], seeds["pa"], ta, decode_cache)
                _receive_and_check(channels["pb"], seeds["pb"], tb, decode_cache)
            for p, q in results.items():
                sent = _expect(q, "done")[1]
                assert sent["transfers"] == channels[p].stats.transfers == 4
                assert sent["bytes"] == channels[p].stats.bytes
        finally:
            for channel in channels.values():
                channel.close()


@pytest.mark.timeout(60)
def test_transfer_order_mismatch_is_an_error_on_both_sides(ctx):
    results = ctx.Queue()
    first = _plan(seed=7)[0]
    assert first.transfer_id == 1
    with StoreServer() as server, _started(ctx, (_send_plan, (server.port, "p0", 7, results))):
        _expect(results, "ready")
        channel = PairChannel(server.host, server.port, "p0", "d0", 1, TIMEOUT_S)
        with pytest.raises(TransferError, match="expected transfer 2, the sender sent transfer 1"):
            channel.recv(2, _shape(len(first.dst)), torch.float32)
        assert channel.broken and channel.stats.failures == 1
        # Closing the receiver's group makes the sender's pending data send fail at once.
        _, error_type, _, sender_broken, sender_stats = _expect(results, "error")
        assert error_type == "TransferError" and sender_broken
        assert sender_stats["failures"] == 1 and sender_stats["transfers"] == 0


@pytest.mark.timeout(60)
def test_timeout_breaks_the_channel_and_a_fresh_one_works(ctx):
    timeout_s = 2.0
    results = ctx.Queue()
    first = _plan(seed=8)[0]
    with StoreServer() as server, _started(ctx, (_send_late_then_retry,
                                                 (server.port, 8, timeout_s + 1.5, timeout_s, results))):
        _expect(results, "ready")
        channel = PairChannel(server.host, server.port, "p0", "d0", 1, timeout_s)
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match=f"transfer {first.transfer_id} .* within 2 s"):
            channel.recv(first.transfer_id, _shape(len(first.dst)), torch.float32)
        elapsed = time.monotonic() - start
        # Given up at its timeout: not before (the clock decides TransferTimeout), and not after a second
        # one (a whole timeout of margin for a loaded machine); a recv still waiting when the late sender
        # sends (timeout + 1.5 s) would have received the transfer instead of raising.
        assert timeout_s - 0.05 <= elapsed < 2 * timeout_s
        assert channel.broken and channel.stats.failures == 1
        with pytest.raises(TransferError, match="broken"):
            channel.recv(first.transfer_id, _shape(len(first.dst)), torch.float32)

        # The late sender finds the pair gone; then both sides build generation 1 of the same pair.
        assert _expect(results, "failed")[1:] == ("TransferError", True)
        decode_cache = torch.zeros(_shape(NUM_BLOCKS))
        with PairChannel(server.host, server.port, "p0", "d0", 1, timeout_s, generation=1) as fresh:
            _receive_and_check(fresh, 8, first, decode_cache)
        assert _expect(results, "done")[1]["transfers"] == 1


