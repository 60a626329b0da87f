"""Which worker holds which prefix: the router's exact index of every worker's prefix cache.

Each worker sends what its prefix cache stored and evicted (pdserve.engine.block_pool.KVEvents) on its link
after every round of its step thread; the index applies them in order, so it holds what the worker holds
up to the events still in flight. A block hash is chained on its parent's and rooted in the weight version
that computed the KV (pdserve.engine.block_pool.hash_prompt_blocks), so the leading hashes of a prompt that
a worker holds are exactly the prefix it would not compute again. Placement reads `match`; it never
decides exactness: a worker checks its own cache, and a block evicted meanwhile is computed.

Beneath the cache, a worker's KV tiers (host memory, local disk: pdserve.engine.kv_offload) hold blocks it loads
back instead of computing; their events (KVEvents.offloaded, .dropped) are kept apart, and `match_tiers` counts
how far past its resident prefix a prompt's chain goes in them (placement weighs those below resident blocks).

A worker that leaves, or restarts under a new id, is forgotten (its cache went with it; a replacement with the
same disk tier announces that tier's blocks in its first events).
"""
from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.block_pool import KVEvents


class KVIndex:
    def __init__(self) -> None:
        self._held: dict[str, set[bytes]] = {}  # worker id -> the block hashes its prefix cache holds
        self._tiered: dict[str, set[bytes]] = {}  # worker id -> the block hashes its KV tiers hold

    def apply(self, worker_id: str, events: KVEvents) -> None:
        held = self._held.setdefault(worker_id, set())
        if events.cleared:
            held.clear()
        held.update(events.stored)
        held.difference_update(events.removed)
        if events.offloaded or events.dropped:
            tiered = self._tiered.setdefault(worker_id, set())
            tiered.update(events.offloaded)
            tiered.difference_update(events.dropped)

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)
        self._tiered.pop(worker_id, None)

    def match_tiers(self, worker_id: str, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """(leading blocks of the chain the worker's cache holds, blocks after those it holds in the cache or a
        tier): what it would not compute, and what of that it would load from a tier."""
        resident = self.match(worker_id, block_hashes)
        held, tiered = self._held.get(worker_id, set()), self._tiered.get(worker_id)
        if not tiered:
            return resident, 0
        n = resident
        while n < len(block_hashes) and (block_hashes[n] in tiered or block_hashes[n] in held):
            n += 1
        return resident, n - resident

    def match(self, worker_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain the worker holds."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        n = 0
        for h in block_hashes:
            if h not in held:
                break
            n += 1
        return n

    def blocks(self, worker_id: str) -> int:
        """Blocks the worker's prefix cache holds, as far as its events say."""
        return len(self._held.get(worker_id, ()))

    def tiered_blocks(self, worker_id: str) -> int:
        """Blocks the worker's KV tiers hold, as far as its events say."""
        return len(self._tiered.get(worker_id, ()))
