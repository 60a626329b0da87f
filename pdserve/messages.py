"""The small dataclasses the router and the workers exchange through Ray actor calls.

Only plain values cross process boundaries: token ids, parameters, ids and counters, never requests
or tensors (KV moves over the transfer channels, not through Ray).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.request import FinishReason
from pdserve.sampling import SamplingParams


@dataclass(frozen=True)
class PrefillTask:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_kv_blocks: int  # blocks held on the prefill worker until the decode worker pulls them


@dataclass(frozen=True)
class DecodeTask:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token: int
    params: SamplingParams
    seed: int
    prefill_worker: str  # id of the prefill worker that holds the prompt's KV


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token: int
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    pool: str  # "prefill", "decode" or "colocated"
    waiting: int  # requests queued (prefill: prompts; decode: KV not yet received)
    waiting_tokens: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int = 0
    tokens_processed: int = 0
    busy_seconds: float = 0.0  # wall time spent in model steps
    uptime_seconds: float = 0.0
    transfer: dict = field(default_factory=dict)  # TransferStats snapshot

    @property
    def busy_fraction(self) -> float:
        return self.busy_seconds / self.uptime_seconds if self.uptime_seconds > 0 else 0.0


@dataclass(frozen=True)
class StepOutput:
    """Everything one decode step produced, for all of the worker's running requests at once."""

    worker_id: str
    events: tuple[TokenEvent, ...]
    failed: tuple[tuple[str, str], ...] = ()  # (request_id, reason) of requests the worker had to drop
    stats: WorkerStats | None = None
