"""Continuous-batching scheduler of the colocated (offline) engine.

Each step spends a token budget: first one token for every running request that is decoding (and the
next chunk of any running prefill), then prompt chunks of waiting requests in arrival order. When the
pool cannot hold a running request's next token, the most recently admitted request is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed (prompt + output so far),
so nothing is dropped and the tokens already produced are kept.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.config import SchedulerConfig
from pdserve.kv_cache import KVCacheManager
from pdserve.request import FinishReason, Request, RequestStatus, token_stop_reason
from pdserve.runner import Chunk, StepResult


@dataclass
class ScheduledStep:
    requests: list[Request]
    chunks: list[Chunk]
    num_preempted: int = 0


@dataclass
class SampledToken:
    request: Request
    token: int
    finish_reason: FinishReason | None  # set when a token-level rule ended the request


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: tuple[int, ...],
                 max_model_len: int):
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        if self.kv.blocks_needed(req.num_tokens + 1) > self.kv.pool.num_blocks:
            raise ValueError(
                f"request {req.request_id} needs more KV blocks than the cache has "
                f"({req.num_tokens} tokens, {self.kv.pool.num_blocks} blocks of {self.kv.block_size})"
            )
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Join a request whose KV is already in the cache (arrived from a prefill worker)."""
        assert req.block_ids and req.num_computed_tokens == req.num_tokens - 1
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
        # Admitting while preempting would only thrash: the freed room belongs to the running batch.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            req = self.waiting[0]
            if not req.block_ids:
                self.kv.admit_cached_prefix(req)
            n = req.num_tokens - req.num_computed_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n):
                self.kv.free(req)  # drop the prefix references taken above; retry next step
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        self.num_preemptions += preempted
        return ScheduledStep([r for r, _ in scheduled], [chunk_of(r, n) for r, n in scheduled], preempted)

    def update(self, step: ScheduledStep, result: StepResult) -> list[SampledToken]:
        """Account a finished step: computed tokens, newly full blocks, sampled tokens, token-level stops."""
        for req, chunk in zip(step.requests, step.chunks):
            req.num_computed_tokens += len(chunk.token_ids)
            self.kv.cache_computed_blocks(req)
        out = []
        for i, token in zip(result.sampling_chunks, result.sampled.tolist()):
            req = step.requests[i]
            req.token_ids.append(token)
            reason = token_stop_reason(req, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                self.finish(req, reason)
            out.append(SampledToken(req, token, reason))
        return out

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request wherever it is and release its blocks."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)



def chunk_of(req: Request, n: int) -> Chunk:
    """The next n uncomputed tokens of a request; it samples if they reach its last known token."""
    start = req.num_computed_tokens
    return Chunk(
        token_ids=req.token_ids[start:start + n],
        start=start,
        block_ids=req.block_ids,
        sample=req.params if start + n == req.num_tokens else None,
        seed=req.seed,
        output_index=req.num_output_tokens,
    )
