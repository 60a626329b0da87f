"""Placement: which prefill worker and which decode worker take a request. Pure functions of pool state."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillLoad:
    queued_tokens: int  # prompt tokens placed on the worker and not yet ingested
    cached_tokens: int = 0  # leading tokens of this prompt the worker probably still holds in its prefix cache


@dataclass(frozen=True)
class DecodeLoad:
    active: int  # requests placed on the worker and not finished
    free_blocks: int  # as last reported by the worker
    total_blocks: int


def pick_prefill(pool: Sequence[PrefillLoad]) -> int:
    """Least work to wait for plus work that is not cached: queued tokens minus the prompt tokens the
    worker's prefix cache would save. Prefill is compute-bound, so tokens are time. Ties: the first."""
    return min(range(len(pool)), key=lambda i: pool[i].queued_tokens - pool[i].cached_tokens)


def pick_decode(pool: Sequence[DecodeLoad]) -> int:
    """Fewest active requests (decode cost grows with the batch), then the most free KV blocks; ties: the first."""
    return min(range(len(pool)), key=lambda i: (pool[i].active, -pool[i].free_blocks))


class PrefixIndex:
    """The router's estimate of one prefill worker's prefix cache: block hashes it ingested, LRU, bounded.

    It can only be an estimate (the worker evicts on its own), so it steers placement and nothing else.
    """

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def match(self, block_hashes: Sequence[bytes]) -> int:
        """Number of leading blocks present."""
        n = 0
        for h in block_hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def add(self, block_hashes: Sequence[bytes]) -> None:
        for h in block_hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        """Forget every block (the worker's weights changed: its cached blocks are another version's)."""
        self._hashes.clear()

    def __len__(self) -> int:
        return len(self._hashes)
