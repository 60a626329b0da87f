"""The asyncio driver: sends a workload to a router over gRPC and records what the client sees.

Each request is one task on one shared channel (HTTP/2 streams). Its record gets the send time, the
arrival time and token count of every streamed message, the end, and the gRPC status code on failure.
Open loop (Poisson, bursty, trace): requests go out at their scheduled times whatever the server is
doing. Closed loop: all requests are ready at time 0 and `concurrency` caps how many are in flight, so
each finished request lets the next one go; the cap also bounds the open-loop schedules when given
(vLLM's --max-concurrency). `duration` stops sending new requests after that many seconds; requests
already sent run to completion and count. `n` > 1 asks every request for n samples of its prompt; the
record keeps which sample each message is of.
"""
from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TextIO

import grpc

from pdserve.loadgen.stats import RequestRecord
from pdserve.loadgen.workload import BenchRequest
from pdserve.client.grpc_client import FINISH_REASONS, AsyncClient, Connection

MAX_N = 128  # the most samples of a prompt the API takes (GenerateRequest.n)


@dataclass(frozen=True)
class RunConfig:
    num_prompts: int | None = None  # stop after this many requests
    duration: float | None = None  # stop sending after this many seconds
    concurrency: int | None = None  # requests in flight at most
    timeout: float | None = None  # per-request gRPC deadline, seconds
    temperature: float = 0.0
    n: int = 1  # samples of each prompt; 1 sends no n (what a router from before n takes)

    def __post_init__(self) -> None:
        if self.num_prompts is None and self.duration is None:
            raise ValueError("bound the run with num_prompts, duration or both")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be > 0, got {self.duration}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")


class Progress:
    """One stderr line, redrawn in place on a terminal (every 5 s as new lines otherwise)."""

    def __init__(self, total: int | None, duration: float | None, stream: TextIO = sys.stderr, width: int = 30):
        self.total, self.duration, self.stream, self.width = total, duration, stream, width
        self.sent = self.done = self.failed = 0
        self.start = time.perf_counter()
        self.tty = stream.isatty()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        if self.total is not None:
            frac = self.done / self.total
        else:
            frac = min(1.0, elapsed / self.duration) if self.duration else 0.0
        bar = "#" * int(frac * self.width)
        total = "?" if self.total is None else str(self.total)
        return (f"bench [{bar:<{self.width}}] {self.done}/{total} done, {self.sent - self.done} in flight, "
                f"{self.failed} failed, {elapsed:6.1f}s")

    def draw(self, final: bool = False) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    async def run(self) -> None:
        period = 0.2 if self.tty else 5.0
        while True:
            await asyncio.sleep(period)
            self.draw()


async def warm_up(target: str | Connection, requests: Sequence[BenchRequest], temperature: float = 0.0,
                  timeout: float | None = 120.0) -> None:
    """Send requests at once and wait for them; not recorded (first-call costs: threads, KV channels)."""
    async with AsyncClient(target) as client:
        await asyncio.gather(*(client.complete(timeout=timeout, temperature=temperature, **r.client_kwargs())
                               for r in requests))


async def run_workload(target: str | Connection, requests: Iterable[BenchRequest], arrivals: Iterable[float],
                       cfg: RunConfig, progress: Progress | None = None) -> tuple[list[RequestRecord], float]:
    """Drive the workload; returns every request's record and the run's wall time (first send to last end)."""
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    slots = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    schedule: Iterator[tuple[BenchRequest, float]] = zip(requests, arrivals)
    if cfg.num_prompts is not None:
        schedule = itertools.islice(schedule, cfg.num_prompts)
    ticker = asyncio.create_task(progress.run()) if progress else None
    async with AsyncClient(target) as client:
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        n = {"n": cfg.n} if cfg.n > 1 else {}

        async def one(req: BenchRequest, rec: RequestRecord) -> None:
            try:
                rec.send = clock()
                finished = []  # each sample's finish reason, as they come
                async for r in client.generate(timeout=cfg.timeout, temperature=cfg.temperature, **n,
                                               **req.client_kwargs()):
                    rec.chunks.append((clock(), len(r.token_ids)))
                    if cfg.n > 1:
                        rec.chunk_index.append(r.index)
                    if r.service_tier:  # the tier served: on the last message
                        rec.served_tier = r.service_tier
                    if r.finish_reason:
                        finished.append(FINISH_REASONS.get(r.finish_reason, str(r.finish_reason)))
                    if r.HasField("usage"):  # the last message
                        rec.input_tokens = r.usage.prompt_tokens or rec.input_tokens
                rec.end = rec.chunks[-1][0] if rec.chunks else clock()
                _judge(rec, finished, cfg.n)
            except grpc.aio.AioRpcError as e:
                rec.end = clock()
                rec.error_code, rec.error = e.code().name, e.details() or ""
            except Exception as e:  # a client-side failure must still be counted, never dropped
                rec.end = clock()
                rec.error_code, rec.error = type(e).__name__, str(e)
            finally:
                if slots is not None:
                    slots.release()
                if progress:
                    progress.done += 1
                    progress.failed += rec.error_code is not None

        try:
            for req, at in schedule:
                if cfg.duration is not None and at >= cfg.duration:
                    break
                # Always yield: started tasks send at once, and an all-at-once schedule cannot starve the loop.
                await asyncio.sleep(max(0.0, at - clock()))
                if slots is not None:
                    await slots.acquire()
                if cfg.duration is not None and clock() >= cfg.duration:
                    if slots is not None:
                        slots.release()
                    break
                rec = RequestRecord(send=clock(), input_tokens=req.input_len or 0, max_tokens=req.max_tokens,
                                    service_tier=req.service_tier, samples=cfg.n)
                records.append(rec)
                tasks.append(asyncio.create_task(one(req, rec)))
                if progress:
                    progress.sent += 1
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            if ticker:
                ticker.cancel()
                progress.draw(final=True)
    wall = max((r.end for r in records if r.end is not None), default=0.0)
    return records, wall


def _judge(rec: RequestRecord, finished: list[str], n: int) -> None:
    """A stream that ended: its finish reason, and an error if it did not end well (no finish reason, the server
    cancelled or failed it, or fewer of its n samples finished than it asked for)."""
    rec.finish_reason = finished[-1] if finished else ""
    failed = next((f for f in finished if f in ("cancelled", "error")), None)
    if not finished:
        rec.error_code, rec.error = "INCOMPLETE", "the stream ended without a finish reason"
    elif failed is not None:
        rec.error_code, rec.error = f"FINISH_{failed.upper()}", "finished by the server"
    elif len(finished) < n:
        rec.error_code = "INCOMPLETE"
        rec.error = f"the stream ended with {len(finished)} of {n} samples finished"


async def worker_prompt_tokens(target: str | Connection) -> dict[str, tuple[int, int]] | None:
    """Each worker's prompt tokens (requested, computed) since it started, from the router's cluster status
    (WorkerStatus.prompt_tokens_requested / _computed); None where the router reports none (one from before
    they were added, or every worker still starting) or the status cannot be had."""
    try:
        async with AsyncClient(target) as client:
            status = await client.cluster_status(timeout=30)
    except grpc.RpcError:
        return None
    counts = {w.worker_id: (w.prompt_tokens_requested, w.prompt_tokens_computed)
              for pool in status.pools for w in pool.workers if w.HasField("prompt_tokens_requested")}
    return counts or None


def prompt_tokens_between(before: dict[str, tuple[int, int]] | None,
                          after: dict[str, tuple[int, int]] | None) -> tuple[int | None, int | None]:
    """The workers' prompt tokens (requested, computed) from one worker_prompt_tokens snapshot to the next: a
    worker that started in between counts from zero; one that left took its counts along (not in `after`)."""
    if before is None or after is None:
        return None, None
    return (sum(r - before.get(w, (0, 0))[0] for w, (r, _) in after.items()),
            sum(c - before.get(w, (0, 0))[1] for w, (_, c) in after.items()))
