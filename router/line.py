"""The router's line: prompts waiting for a prefill worker with room (and a decode worker with room for
their KV), in the order they go, by service tier (pdserve.tiers) then arrival.

router.dispatch walks the line whenever the pools change and places every prompt whose workers have room,
in order: a prompt that finds no prefill room holds back every prompt behind it that needs one too; one
that finds its decode pool full only holds back the prompts behind it bound for the same pool, so a
priority prompt waiting for the fast lane never blocks a default one bound for the decode pool. A
priority prompt needs prefill room only: when its decode pool is full it goes to a prefill worker at
once and comes back into line, already computed, for its KV's destination (Entry.prefill).

flex's floor: while fewer flex requests are in flight than flex's floor, the first flex prompts in line
go as if they were default (by arrival among the defaults), so flex never starves behind a steady
default load.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.tiers import TIERS, ServiceTier


@dataclass(eq=False)
class Entry:
    """One prompt in line: what it needs, where it goes, and the future its placement is set on."""

    wrid: str  # the attempt's worker-side id
    tokens: int  # prompt tokens (those already streamed included)
    target: str | None  # its decode pool ("decode" or "fast"), or None if no token follows the first
    avoid: tuple[str, ...]  # workers it prefers not to use (a retry's previous ones)
    token_ids: Sequence[int]  # its prompt (the tokens already streamed included): its blocks' hashes steer placement
    tier: ServiceTier  # its place in line: the tier it asked for
    served: ServiceTier | None = None  # the tier it is served at (downgraded: default); None: its tier
    prefill: Any = None  # a prompt already on this prefill worker, its KV held there: it needs decode room only
    local_ok: bool = False  # its decode worker may compute the prompt itself, if it holds most of it
    session: str | None = None  # its conversation's key: the decode worker of the session's last turn first
    seq: int = 0
    placed: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    _hashes: dict[tuple[int, int], list[bytes]] = field(default_factory=dict)

    def hashes(self, block_size: int, version: int = 0) -> list[bytes]:
        """Its prompt's block hashes, rooted in weight version `version` (a worker's cache holds its version's)."""
        key = (block_size, version)
        if key not in self._hashes:
            self._hashes[key] = hash_prompt_blocks(self.token_ids, block_size, version)
        return self._hashes[key]


class Line:
    def __init__(self) -> None:
        self._by_tier: dict[ServiceTier, list[Entry]] = {t: [] for t in TIERS}  # each in arrival order
        self._seq = itertools.count()

    def add(self, e: Entry) -> None:
        e.seq = next(self._seq)
        self._by_tier[e.tier].append(e)

    def remove(self, e: Entry) -> None:
        entries = self._by_tier[e.tier]
        if e in entries:
            entries.remove(e)

    def __contains__(self, e: Entry) -> bool:
        return e in self._by_tier[e.tier]

    def count(self, tier: ServiceTier) -> int:
        return len(self._by_tier[tier])

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_tier.values())

    def order(self, flex_slack: int) -> Iterator[Entry]:
        """The entries in the order they go; the first `flex_slack` flex entries rank as default."""
        flex = self._by_tier[ServiceTier.FLEX]
        lifted, rest = flex[:max(flex_slack, 0)], flex[max(flex_slack, 0):]
        yield from list(self._by_tier[ServiceTier.PRIORITY])
        yield from heapq.merge(list(self._by_tier[ServiceTier.DEFAULT]), lifted, key=lambda x: x.seq)
        yield from list(rest)
