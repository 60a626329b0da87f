"""The decode worker as a Ray actor: pulls prompt KV from prefill workers and streams one output per step.

Threads: the step thread owns the worker (pdserve.step_loop); one transfer thread per prefill peer
pulls KV in the order this worker chose (it reserves blocks, then asks the peer to send, then
receives), so transfers never block the decode steps and NCCL's order-matching holds by construction.
The router consumes `stream()`, a Ray streaming generator with one StepOutput per step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import Any

import ray
import torch

from pdserve.config import EngineConfig
from pdserve.kv_transfer import PairChannel, StoreServer, TransferError, TransferStats
from pdserve.messages import DecodeTask, StepOutput, TokenEvent, WorkerStats, worker_stats
from pdserve.step_loop import StepLoop
from pdserve.utilization import device_peaks
from decode_worker.worker import DecodeWorker

log = logging.getLogger(__name__)


class DecodeActor:
    """Wrapped with ray.remote by the router's pool (which sets its resources)."""

    def __init__(self, worker_id: str, config: EngineConfig, transfer_timeout_s: float,
                 torch_threads: int | None = None, bind_host: str | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.worker = DecodeWorker(worker_id, config)
        self.peaks = device_peaks(self.worker.core.runner.device, config.peak_flops, config.peak_bytes_per_second)
        self.transfer_timeout_s = transfer_timeout_s
        self.transfer_stats = TransferStats()
        # Prefill workers on other nodes connect here: the node's address, unless told otherwise.
        self.store = StoreServer(bind_host or ray.util.get_node_ip_address())
        self._outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()
        self._peers: dict[str, _Peer] = {}
        self._transfer_ids = itertools.count()
        self.busy_seconds = 0.0
        self.started = time.monotonic()
        self.loop = StepLoop(self._step, name=f"decode-{worker_id}")

    async def ready(self) -> str:
        return self.worker_id

    async def decode(self, task: DecodeTask, prefill: Any) -> None:
        """Queue a request whose prompt KV sits on `prefill` (an actor handle); returns once queued."""
        if task.prefill_worker not in self._peers:
            self._peers[task.prefill_worker] = _Peer(self, task.prefill_worker, prefill)
        await asyncio.wrap_future(self.loop.call(lambda: self.worker.add(task)))

    async def cancel(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self.loop.call(lambda: self.worker.cancel(request_id)))

    async def stream(self):
        """One StepOutput per decode step, forever (the router holds one such stream per worker)."""
        while True:
            out = await asyncio.to_thread(self._outputs.get)
            yield out

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.loop.call(self._stats))

    async def shutdown(self) -> None:
        self.loop.stop()
        for p in self._peers.values():
            p.stop()
        self.store.close()

    # -- step thread ------------------------------------------------------------------------------
    def _step(self) -> bool:
        while (reserved := self.worker.reserve_next()) is not None:
            task, blocks = reserved
            self._peers[task.prefill_worker].pull(task, len(blocks), next(self._transfer_ids))
        events: list[TokenEvent] = []
        failed: tuple[tuple[str, str], ...] = ()
        did_work = self.worker.has_work
        if did_work:
            t0 = time.perf_counter()
            try:
                events = self.worker.step()
            except Exception as e:  # fail the running batch, free its blocks, keep serving
                log.exception("decode step failed on %s", self.worker_id)
                failed = tuple((rid, f"decode step failed: {e}") for rid in self.worker.core.cancel_all())
            self.busy_seconds += time.perf_counter() - t0
        if events or failed:
            self._outputs.put(StepOutput(self.worker_id, tuple(events), failed, self._stats()))
        return did_work

    def _transfer_done(self, request_id: str, data: torch.Tensor) -> None:
        self.worker.complete_transfer(request_id, data)

    def _transfer_failed(self, request_id: str, error: BaseException) -> None:
        if self.worker.abort_transfer(request_id):
            self._outputs.put(StepOutput(self.worker_id, (), ((request_id, f"KV transfer failed: {error}"),),
                                         self._stats()))

    def _stats(self) -> WorkerStats:
        w = self.worker
        return worker_stats(self.worker_id, "decode", waiting=len(w.pending) + len(w.reserved),
                            waiting_tokens=sum(len(t.prompt_token_ids) for t in w.pending), running=w.num_running,
                            pool=w.pool, runner=w.core.runner, steps=w.core.steps,
                            tokens_processed=w.core.tokens_processed, busy_seconds=self.busy_seconds,
                            uptime_seconds=time.monotonic() - self.started, peaks=self.peaks,
                            transfer=self.transfer_stats.snapshot())


class _Peer:
    """The transfer thread for one prefill worker: one pull at a time, in the order they were queued."""

    def __init__(self, actor: DecodeActor, prefill_id: str, handle: Any):
        self.actor, self.prefill_id, self.handle = actor, prefill_id, handle
        self._jobs: queue.SimpleQueue[tuple[DecodeTask, int, int] | None] = queue.SimpleQueue()
        self._channel: PairChannel | None = None
        self._generation = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-{prefill_id}->{actor.worker_id}", daemon=True)
        self._thread.start()

    def pull(self, task: DecodeTask, num_blocks: int, transfer_id: int) -> None:
        self._jobs.put((task, num_blocks, transfer_id))

    def stop(self) -> None:
        self._jobs.put(None)
        if self._channel is not None:
            self._channel.close()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            task, num_blocks, transfer_id = job
            try:
                data = self._transfer(task.request_id, num_blocks, transfer_id)
            except Exception as e:  # noqa: BLE001 - reported to the step thread, which frees the blocks
                log.warning("KV transfer %s of %s from %s failed: %s", transfer_id, task.request_id, self.prefill_id, e)
                if not isinstance(e, TransferError):  # the channel counts its own failures
                    self.actor.transfer_stats.record_failure()
                self.actor.loop.call(lambda rid=task.request_id, err=e: self.actor._transfer_failed(rid, err))
            else:
                self.actor.loop.call(lambda rid=task.request_id, d=data: self.actor._transfer_done(rid, d))

    def _transfer(self, request_id: str, num_blocks: int, transfer_id: int) -> torch.Tensor:
        a = self.actor
        timeout = a.transfer_timeout_s
        if self._channel is None or self._channel.broken:
            self._generation += 1
            ref = self.handle.open_channel.remote(a.worker_id, a.store.host, a.store.port, self._generation)
            self._channel = PairChannel(a.store.host, a.store.port, self.prefill_id, a.worker_id, 1, timeout,
                                        a.worker.core.runner.kv_cache.device, generation=self._generation,
                                        stats=a.transfer_stats)
            ray.get(ref, timeout=timeout)
        cache = a.worker.core.runner.kv_cache
        shape = (*cache.shape[:3], num_blocks, *cache.shape[4:])  # [layers, 2, kv_heads, n, block_size, head_dim]
        sent = self.handle.send_kv.remote(request_id, a.worker_id, transfer_id)
        data = self._channel.recv(transfer_id, shape, cache.dtype)
        ray.get(sent, timeout=timeout)
        return data
