"""Placement: which prefill worker and which decode worker take a request. Pure functions of pool state."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillLoad:
    queued_tokens: int  # prompt tokens placed on the worker and not yet ingested


@dataclass(frozen=True)
class DecodeLoad:
    active: int  # requests placed on the worker and not finished
    free_blocks: int  # as last reported by the worker
    total_blocks: int


def pick_prefill(pool: list[PrefillLoad]) -> int:
    """Least queued prompt tokens (prefill is compute-bound: queued tokens are queued time); ties to the first."""
    return min(range(len(pool)), key=lambda i: pool[i].queued_tokens)


def pick_decode(pool: list[DecodeLoad]) -> int:
    """Fewest active requests, then the most free KV blocks; ties to the first."""
    return min(range(len(pool)), key=lambda i: (pool[i].active, -pool[i].free_blocks))
