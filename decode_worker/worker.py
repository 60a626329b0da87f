"""Decode worker: continuous batching of requests whose prompt KV arrives from prefill workers.

A request first waits in `pending` until blocks for its prompt KV and its next token can be reserved
(backpressure when the cache is full: it waits, it is never dropped); the transfer then fills those
blocks and the request joins the running batch at the next step. Each step decodes one token for every
running request and yields them together. If the batch outgrows the cache, the scheduler preempts the
newest request and recomputes its KV here later, so tokens already streamed are never lost.
"""
from __future__ import annotations

from collections import deque

import torch

from pdserve.config import EngineConfig
from pdserve.engine import EngineCore
from pdserve.kv_transfer import insert_blocks
from pdserve.loader import LoadedModel
from pdserve.messages import DecodeTask, TokenEvent
from pdserve.request import Request


class DecodeWorker:
    def __init__(self, worker_id: str, config: EngineConfig, loaded: LoadedModel | None = None):
        self.worker_id = worker_id
        self.core = EngineCore(config, loaded)
        self.pool, self.kv, self.scheduler = self.core.pool, self.core.kv, self.core.scheduler
        self.pending: deque[DecodeTask] = deque()  # waiting for room
        self.reserved: dict[str, Request] = {}  # room reserved, KV in flight

    def add(self, task: DecodeTask) -> None:
        if self.kv.blocks_needed(len(task.prompt_token_ids) + len(task.output_token_ids)) > self.pool.num_blocks:
            raise ValueError(f"request {task.request_id} needs more KV blocks than this decode worker has")
        self.pending.append(task)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def reserve_next(self) -> tuple[DecodeTask, list[int]] | None:
        """Reserve blocks for the oldest pending request if there is room; returns it and its prompt blocks.

        Room means the reservation still leaves one free block per running request, so admitting it does
        not force a preemption at the very next step.
        """
        if not self.pending or self.num_running + len(self.reserved) >= self.scheduler.config.max_num_seqs:
            return None
        task = self.pending[0]
        req = task.new_request()
        need = self.kv.blocks_needed(req.num_tokens)
        if self.pool.num_free_blocks - need < self.num_running:
            return None
        if not self.kv.allocate_slots(req, req.num_tokens):
            return None
        self.pending.popleft()
        self.reserved[task.request_id] = req
        return task, req.block_ids[: self.kv.blocks_needed(req.num_tokens - 1)]

    def complete_transfer(self, request_id: str, kv: torch.Tensor) -> bool:
        """Write the received prompt KV into the reserved blocks and join the running batch."""
        req = self.reserved.pop(request_id, None)
        if req is None:
            return False  # cancelled while in flight: its blocks were already freed
        insert_blocks(self.core.runner.kv_cache, req.block_ids[: kv.shape[3]], kv)
        req.num_computed_tokens = req.num_tokens - 1  # all but the last sampled token, computed next step
        self.kv.cache_computed_blocks(req)
        self.scheduler.add_running(req)
        return True

    def abort_transfer(self, request_id: str) -> bool:
        """The transfer failed: free the reservation (the caller decides whether to retry elsewhere)."""
        req = self.reserved.pop(request_id, None)
        if req is not None:
            self.kv.free(req)
        return req is not None

    def cancel(self, request_id: str) -> bool:
        for task in self.pending:
            if task.request_id == request_id:
                self.pending.remove(task)
                return True
        return self.abort_transfer(request_id) or self.core.cancel(request_id)

    def step(self) -> list[TokenEvent]:
        return [TokenEvent(t.request.request_id, t.token, t.finish_reason) for t in self.core.step()]
