"""Which worker holds which prefix: the router's exact index of every worker's prefix cache.

Each worker sends what its prefix cache stored and evicted (pdserve.engine.block_pool.KVEvents) on its link
after every round of its step thread; the index applies them in order, so it holds what the worker holds
up to the events still in flight. A block hash is chained on its parent's and rooted in the weight version
that computed the KV (pdserve.engine.block_pool.hash_prompt_blocks), so the leading hashes of a prompt that
a worker holds are exactly the prefix it would not compute again. Placement reads `match`; it never
decides exactness: a worker checks its own cache, and a block evicted meanwhile is computed.

A worker that leaves, or restarts under a new id, is forgotten (its cache went with it).
"""
from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.block_pool import KVEvents


class KVIndex:
    def __init__(self) -> None:
        self._held: dict[str, set[bytes]] = {}  # worker id -> the block hashes its prefix cache holds

    def apply(self, worker_id: str, events: KVEvents) -> None:
        held = self._held.setdefault(worker_id, set())
        if events.cleared:
            held.clear()
        held.update(events.stored)
        held.difference_update(events.removed)

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)

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
