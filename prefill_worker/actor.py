"""The prefill worker as a Ray actor: prompts in, first tokens out, KV sent when a decode worker pulls it."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, InvalidStateError

import torch

from pdserve.config import EngineConfig
from pdserve.kv_transfer import PairChannel, TransferStats, extract_blocks
from pdserve.loader import load
from pdserve.messages import PrefillResult, PrefillTask, WorkerStats, worker_stats
from pdserve.step_loop import StepLoop
from pdserve.utilization import device_peaks
from prefill_worker.worker import PrefillWorker

log = logging.getLogger(__name__)


class PrefillActor:
    """Wrapped with ray.remote by the router's pool (which sets its resources)."""

    def __init__(self, worker_id: str, config: EngineConfig, transfer_timeout_s: float, torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.worker = PrefillWorker(worker_id, config, load(config))
        self.peaks = device_peaks(self.worker.runner.device, config.peak_flops, config.peak_bytes_per_second)
        self.transfer_timeout_s = transfer_timeout_s
        self.transfer_stats = TransferStats()
        self._results: dict[str, Future[PrefillResult]] = {}
        self._channels: dict[str, PairChannel] = {}
        self._send_delays: list[float] = []
        self.busy_seconds = 0.0
        self.started = time.monotonic()
        self.loop = StepLoop(self._step, name=f"prefill-{worker_id}")

    async def ready(self) -> str:
        return self.worker_id

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Ingest the prompt; returns as soon as the first token is sampled (the KV stays held)."""
        fut: Future[PrefillResult] = Future()
        self._results[task.request_id] = fut
        try:
            await asyncio.wrap_future(self.loop.call(lambda: self.worker.add(task)))
            return await asyncio.wrap_future(fut)
        finally:
            self._results.pop(task.request_id, None)

    async def cancel(self, request_id: str) -> bool:
        self._fail(request_id, asyncio.CancelledError(f"request {request_id} cancelled"))
        return await asyncio.wrap_future(self.loop.call(lambda: self.worker.cancel(request_id)))

    async def release(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self.loop.call(lambda: self.worker.release(request_id)))

    async def open_channel(self, decode_id: str, host: str, port: int, generation: int) -> None:
        """The prefill side of a pair rendezvous; the decode worker constructs its side concurrently."""
        old = self._channels.pop(decode_id, None)
        if old is not None:
            old.close()
        self._channels[decode_id] = await asyncio.to_thread(
            PairChannel, host, port, self.worker_id, decode_id, 0, self.transfer_timeout_s,
            self.worker.runner.kv_cache.device, generation=generation, stats=self.transfer_stats,
            before_send=self._before_send)

    async def send_kv(self, request_id: str, decode_id: str, transfer_id: int) -> int:
        """Send a held prompt's KV to the decode worker that asked for it, then release it here.

        If the prompt is no longer held (cancelled), an empty transfer tells the receiver at once
        instead of leaving it to time out. Returns the bytes sent.
        """
        channel = self._channels[decode_id]

        def take() -> torch.Tensor:
            if request_id not in self.worker.held:
                return torch.empty(0, dtype=self.worker.runner.kv_cache.dtype, device=self.worker.runner.kv_cache.device)
            return extract_blocks(self.worker.runner.kv_cache, self.worker.held_blocks(request_id))

        data = await asyncio.wrap_future(self.loop.call(take))
        try:
            await asyncio.to_thread(channel.send, transfer_id, data)
        finally:
            self.loop.call(lambda: self.worker.release(request_id))
        return data.nbytes

    async def inject_send_delay(self, seconds: float, count: int = 1) -> None:
        """Fault injection for tests: the next `count` KV sends stall `seconds` first."""
        self._send_delays = [seconds] * count

    def _before_send(self, transfer_id: int) -> None:
        if self._send_delays:
            time.sleep(self._send_delays.pop())

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.loop.call(self._stats))

    async def shutdown(self) -> None:
        self.loop.stop()
        for ch in self._channels.values():
            ch.close()

    # -- step thread ------------------------------------------------------------------------------
    def _step(self) -> bool:
        if not self.worker.has_work:
            return False
        t0 = time.perf_counter()
        try:
            results = self.worker.step()
        except Exception as e:  # fail what was in flight, free its blocks, keep serving
            log.exception("prefill step failed on %s", self.worker_id)
            for req in [*self.worker.running, *self.worker.waiting]:
                self.worker.cancel(req.request_id)
                self._fail(req.request_id, e)
            return True
        finally:
            self.busy_seconds += time.perf_counter() - t0
        for r in results:
            fut = self._results.get(r.request_id)
            try:
                if fut is None:
                    raise InvalidStateError
                fut.set_result(r)
            except InvalidStateError:  # cancelled meanwhile: nobody will pull this KV
                self.worker.release(r.request_id)
        return True

    def _fail(self, request_id: str, error: BaseException) -> None:
        fut = self._results.get(request_id)
        if fut is not None:
            try:
                fut.set_exception(error)
            except InvalidStateError:
                pass

    def _stats(self) -> WorkerStats:
        w = self.worker
        return worker_stats(self.worker_id, "prefill", waiting=len(w.waiting) + len(w.running),
                            waiting_tokens=w.waiting_tokens, running=len(w.held), pool=w.pool, runner=w.runner,
                            steps=w.steps, tokens_processed=w.tokens_processed, busy_seconds=self.busy_seconds,
                            uptime_seconds=time.monotonic() - self.started, peaks=self.peaks,
                            transfer=self.transfer_stats.snapshot())
