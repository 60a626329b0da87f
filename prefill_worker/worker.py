"""Prefill worker: prompt ingestion in token-budget batches, then the prompt's KV is held for pickup.

Prefill is compute-bound, so a step packs as many prompt tokens as the budget allows; prompts longer
than the budget are split into chunks over several steps. A prompt is admitted only when blocks for
all of it can be allocated (reusing cached prefix blocks), so a partially ingested prompt never waits
for room. When its last chunk runs, the first output token is sampled and returned at once; the KV
stays held (blocks referenced) until a decode worker has pulled it, then it is released. Held KV
fills the pool, which stops admission: backpressure, not failure.
"""
from __future__ import annotations

from collections import deque

from pdserve.block_pool import BlockPool
from pdserve.config import EngineConfig
from pdserve.kv_cache import KVCacheManager
from pdserve.loader import LoadedModel
from pdserve.messages import PrefillResult, PrefillTask
from pdserve.request import Request
from pdserve.runner import ModelRunner
from pdserve.scheduler import chunk_of


class PrefillWorker:
    def __init__(self, worker_id: str, config: EngineConfig, loaded: LoadedModel):
        self.worker_id = worker_id
        num_blocks = config.cache.resolve_num_blocks(loaded.info.config, config.torch_dtype)
        self.pool = BlockPool(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool)
        self.runner = ModelRunner(loaded.model, num_blocks, config.cache.block_size)
        self.token_budget = config.scheduler.max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, prompt partly ingested
        self.held: dict[str, Request] = {}  # prompt ingested, KV waiting for a decode worker
        self.steps = 0
        self.tokens_processed = 0

    def add(self, task: PrefillTask) -> None:
        req = task.new_request()
        if self.kv.blocks_needed(req.num_tokens) > self.pool.num_blocks:
            raise ValueError(f"prompt of {req.num_tokens} tokens does not fit this worker's KV cache "
                             f"({self.pool.num_blocks} blocks of {self.pool.block_size})")
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def waiting_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting) + \
            sum(r.num_tokens - r.num_computed_tokens for r in self.running)

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks that hold an ingested prompt's KV (of a resumed request: prompt and earlier output)."""
        req = self.held[request_id]
        return req.block_ids[: self.kv.blocks_needed(req.num_computed_tokens)]

    def release(self, request_id: str) -> bool:
        """Free a held prompt's KV (after its transfer, or when its request ended)."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def cancel(self, request_id: str) -> bool:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self.kv.free(req)
                    return True
        return self.release(request_id)

    def step(self) -> list[PrefillResult]:
        budget = self.token_budget
        scheduled: list[tuple[Request, int]] = []
        for req in self.running:
            if budget == 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            scheduled.append((req, n))
            budget -= n
        while self.waiting and budget > 0:
            req = self.waiting[0]
            self.kv.admit_cached_prefix(req)
            if not self.kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens):
                self.kv.free(req)  # room comes back as held KV is pulled
                break
            self.waiting.popleft()
            self.running.append(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            scheduled.append((req, n))
            budget -= n
        if not scheduled:
            return []
        chunks = [chunk_of(req, n) for req, n in scheduled]
        result = self.runner.execute(chunks)
        self.steps += 1
        for req, n in scheduled:
            req.num_computed_tokens += n
            self.kv.cache_computed_blocks(req)
            self.tokens_processed += n
        out = []
        for i, token in zip(result.sampling_chunks, result.sampled.tolist()):
            req = scheduled[i][0]
            self.running.remove(req)
            self.held[req.request_id] = req
            out.append(PrefillResult(req.request_id, token, req.num_cached_tokens, len(self.held_blocks(req.request_id))))
        return out
