"""Placement: which prefill worker and which decode worker take a request. Pure functions of pool state and of
what each worker's prefix cache holds of the prompt (router.kv_index)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A prompt token a worker holds in a KV tier (host memory or disk beneath its cache) counts for this much of a
# token held in its cache: loading it back costs a copy, so it beats recomputing (0) and loses to residence (1).
TIER_WEIGHT = 0.5


def cached_score(resident_tokens: int, tiered_tokens: int) -> int:
    """The cached tokens placement weighs for a worker: its resident prefix, then TIER_WEIGHT of each token after
    that prefix that it holds in a tier (router.kv_index.KVIndex.match_tiers)."""
    return resident_tokens + int(TIER_WEIGHT * tiered_tokens)


@dataclass(frozen=True)
class PrefillLoad:
    queued_tokens: int  # prompt tokens placed on the worker and not yet ingested
    cached_tokens: int = 0  # leading tokens of this prompt the worker's prefix cache holds (router.kv_index)


@dataclass(frozen=True)
class DecodeLoad:
    active: int  # requests placed on the worker and not finished
    free_blocks: int  # as last reported by the worker
    total_blocks: int
    cached_tokens: int = 0  # leading tokens of this prompt the worker's prefix cache holds (router.kv_index)


def pick_prefill(pool: Sequence[PrefillLoad]) -> int:
    """Least work to wait for plus work that is not cached: queued tokens minus the prompt tokens the
    worker's prefix cache would save. Prefill is compute-bound, so tokens are time. Ties: the first."""
    return min(range(len(pool)), key=lambda i: pool[i].queued_tokens - pool[i].cached_tokens)


def pick_decode(pool: Sequence[DecodeLoad], load_tokens: int = 0) -> int:
    """The most prompt tokens cached against the load: cached tokens minus `load_tokens` for each active request
    (a request in the batch weighs as much as that many tokens it need not receive or compute: decode cost
    grows with the batch); then the most free KV blocks; ties: the first. With nothing cached anywhere: the
    fewest active requests."""
    return min(range(len(pool)), key=lambda i: (pool[i].active * load_tokens - pool[i].cached_tokens
                                                if load_tokens else pool[i].active,
                                                -pool[i].cached_tokens, -pool[i].free_blocks))
