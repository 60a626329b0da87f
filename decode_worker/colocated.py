"""A colocated worker: one engine does both phases (prefill chunks share steps with decodes).

It runs the same requests as a prefill/decode pair and streams the same StepOutputs, so the router
can compare the two architectures on the same hardware.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import time

import torch

from pdserve.config import EngineConfig
from pdserve.engine import EngineCore
from pdserve.messages import Failure, FailureReason, PrefillTask, StepOutput, TokenEvent, WorkerStats, worker_stats
from pdserve.step_loop import StepLoop
from pdserve.utilization import device_peaks

log = logging.getLogger(__name__)


class ColocatedActor:
    def __init__(self, worker_id: str, config: EngineConfig, torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.core = EngineCore(config)
        self.peaks = device_peaks(self.core.runner.device, config.peak_flops, config.peak_bytes_per_second)
        self._outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()
        self.busy_seconds = 0.0
        self.started = time.monotonic()
        self.loop = StepLoop(self._step, name=f"colocated-{worker_id}")

    async def ready(self) -> str:
        return self.worker_id

    async def generate(self, task: PrefillTask) -> None:
        """Queue a whole request; its tokens (the first one included) arrive on stream()."""
        req = task.new_request()
        await asyncio.wrap_future(self.loop.call(lambda: self.core.scheduler.add(req)))

    async def cancel(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self.loop.call(lambda: self.core.cancel(request_id)))

    async def stream(self):
        while True:
            yield await asyncio.to_thread(self._outputs.get)

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.loop.call(self._stats))

    async def shutdown(self) -> None:
        self.loop.stop()

    def _step(self) -> bool:
        if not self.core.scheduler.has_work:
            return False
        t0 = time.perf_counter()
        failed: tuple[Failure, ...] = ()
        try:
            events = tuple(TokenEvent(t.request.request_id, t.token, t.finish_reason) for t in self.core.step())
        except Exception as e:  # fail the batch, free its blocks, keep serving
            log.exception("step failed on %s", self.worker_id)
            failed = tuple(Failure(rid, FailureReason.STEP_FAILED, f"step failed: {e}") for rid in self.core.cancel_all())
            events = ()
        self.busy_seconds += time.perf_counter() - t0
        if events or failed:
            self._outputs.put(StepOutput(self.worker_id, events, failed, self._stats()))
        return True

    def _stats(self) -> WorkerStats:
        c = self.core
        waiting = c.scheduler.waiting
        return worker_stats(self.worker_id, "colocated", waiting=len(waiting),
                            waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting),
                            running=len(c.scheduler.running), pool=c.pool, runner=c.runner, steps=c.steps,
                            tokens_processed=c.tokens_processed, busy_seconds=self.busy_seconds,
                            uptime_seconds=time.monotonic() - self.started, peaks=self.peaks,
                            preemptions=c.scheduler.num_preemptions)
