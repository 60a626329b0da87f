"""Block pool of the paged KV cache: ref counts, free queue and prefix cache over block ids.

The KV tensors live elsewhere; a block here is only an id. A block is either free (ref 0, in the
free queue, possibly still holding reusable cached content) or in use (ref > 0, out of the queue).
Full blocks can be registered under a content hash chained on their parent's hash, so a later
request with the same prefix takes references on the same blocks instead of recomputing them. The chain
is rooted in the weight version that computed the KV (version_root): a block computed by one version is
never a hit for a request computed by another, with nothing to flush when the weights change.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HASH_BYTES = 32
# Stands in for the parent of a prompt's first block so every hashed message has the same layout.
_ROOT_PARENT = bytes(HASH_BYTES)


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Content hash of one full block, chained on its parent block's hash (None for the first).

    sha256 over the parent digest and the tokens as little-endian int64s, so a router in another
    process (or on another machine) computes the same value; Python's hash() is salted per process.
    """
    if parent is not None and len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    if len(token_ids) == 0:
        raise ValueError("cannot hash an empty block")
    h = hashlib.sha256(_ROOT_PARENT if parent is None else parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def version_root(version: int) -> bytes | None:
    """The parent of a prompt's first block for KV computed by weight version `version` (None for version 0,
    the weights a cluster starts with, so its hashes are those of a chain with no root)."""
    if version == 0:
        return None
    return hashlib.sha256(b"pdserve weight version " + struct.pack("<q", version)).digest()


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, version: int = 0) -> list[bytes]:
    """Hash chain of every full block of `token_ids` (KV of weight version `version`); a trailing partial
    block is not hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[bytes] = []
    parent: bytes | None = version_root(version)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class OutOfBlocks(Exception):
    """Fewer free blocks than requested; the pool was left unchanged."""


@dataclass(frozen=True)
class KVEvents:
    """What a worker's prefix cache gained and lost since it last said (router.kv_index keeps the cluster's
    view): block hashes stored, block hashes removed (evicted), and `cleared` when the whole cache was
    forgotten first (the hashes after it are since then). `offloaded` and `dropped`: the same for the KV tiers
    beneath the cache (pdserve.engine.kv_offload): blocks it can load back instead of recomputing."""

    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    cleared: bool = False
    offloaded: tuple[bytes, ...] = ()
    dropped: tuple[bytes, ...] = ()

    def merged(self, later: KVEvents) -> KVEvents:
        """These events followed by `later` (a hash's last event wins)."""
        tier = _last_wins((self.offloaded, self.dropped), (later.offloaded, later.dropped))
        if later.cleared:
            return KVEvents(later.stored, later.removed, True, *tier)
        cache = _last_wins((self.stored, self.removed), (later.stored, later.removed))
        return KVEvents(cache[0], cache[1], self.cleared, *tier)


def _last_wins(*events: tuple[Sequence[bytes], Sequence[bytes]]) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """(gained, lost) pairs in order folded into one: a hash's last event wins."""
    state: dict[bytes, bool] = {}
    for gained, lost in events:
        for h in gained:
            state[h] = True
        for h in lost:
            state[h] = False
    return tuple(h for h, v in state.items() if v), tuple(h for h, v in state.items() if not v)


class BlockPool:
    """Ref-counted block ids with an LRU free queue and an optional prefix cache.

    Freed blocks keep their cached hash until they are handed out again, so eviction order is the
    free queue's order: least recently freed first.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # An ordered set: O(1) pop at the head (allocation) and O(1) removal from the middle (a
        # cached free block revived by a prefix hit). OrderedDict rather than dict because popping
        # a plain dict's first key repeatedly rescans the deleted slots at its front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_hits = 0
        self.prefix_queries = 0
        # The cache's changes since take_events(), a hash's last change winning (True: stored), when recorded.
        self._events: dict[bytes, bool] | None = None
        self._cleared = False
        # Called with (block id, hash) as a cached block is evicted, before its slots are reused: a KV tier
        # beneath the cache (pdserve.engine.kv_offload) keeps a copy of its KV.
        self.on_evict: Callable[[int, bytes], None] | None = None
        # The tiers' own events (KVEvents.offloaded, .dropped), folded into take_events() when set.
        self.tier_events: Callable[[], tuple[tuple[bytes, ...], tuple[bytes, ...]]] | None = None

    def record_events(self) -> None:
        """From now on, keep what the prefix cache stores and evicts for take_events()."""
        self._events = {}

    def take_events(self) -> KVEvents | None:
        """The cache's changes since the last call (None if there were none, or if they are not recorded)."""
        if self._events is None:
            return None
        offloaded, dropped = self.tier_events() if self.tier_events is not None else ((), ())
        if not self._events and not self._cleared and not offloaded and not dropped:
            return None
        ev = self._events
        out = KVEvents(tuple(h for h, v in ev.items() if v), tuple(h for h, v in ev.items() if not v), self._cleared,
                       offloaded, dropped)
        self._events, self._cleared = {}, False
        return out

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self._caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take, counting cached-but-unreferenced ones (evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self._num_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (ref 1) from the head of the free queue, evicting their cached content.

        All or nothing: raises OutOfBlocks without changing anything if fewer than `n` are free.
        Call get_cached_prefix first, so the prefix hits are not evicted by this allocation.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocks(f"requested {n} blocks, {len(self._free)} free of {self._num_blocks}")
        blocks = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            assert self._ref[block_id] == 0, f"free block {block_id} has ref {self._ref[block_id]}"
            self._evict(block_id)
            self._ref[block_id] = 1
            blocks.append(block_id)
        return blocks

    def share(self, block_ids: Sequence[int]) -> None:
        """One more reference to each of these blocks, which must be in use."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref[block_id] == 0:
                raise ValueError(f"block {block_id} is free: only a block in use can be shared")
        for block_id in block_ids:
            self._ref[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block; those reaching 0 join the free queue's tail, in order.

        Pass a request's block table reversed: its tail blocks then sit nearer the queue's head and
        are evicted before its prefix blocks, which are the ones other requests are likely to share.
        Freeing a block more times than it is referenced raises ValueError and changes nothing.
        """
        drops: dict[int, int] = {}
        for block_id in block_ids:
            self._check_id(block_id)
            drops[block_id] = drops.get(block_id, 0) + 1
        for block_id, count in drops.items():
            if count > self._ref[block_id]:
                raise ValueError(
                    f"block {block_id} freed {count} time(s) but has ref {self._ref[block_id]}"
                )
        for block_id in block_ids:
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, already-written, in-use block under its content hash.

        If another block already holds this hash, that mapping stays and this block stays uncached:
        duplicate content is allowed, it is just not shared. No-op without prefix caching.
        """
        if not self._caching:
            return
        self._check_id(block_id)
        if self._ref[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only a written, allocated block is cached")
        current = self._hash[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} is already cached under a different hash")
            return
        if block_hash in self._cached:
            return
        self._cached[block_hash] = block_id
        self._hash[block_id] = block_hash
        if self._events is not None:
            self._events[block_hash] = True

    def get_cached_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of the hash chain, each with one more reference.

        prefix_queries grows by len(block_hashes) and prefix_hits by the number returned, so their
        ratio is the share of prompt blocks served from cache. Returns [] without prefix caching.
        """
        if not self._caching:
            return []
        self.prefix_queries += len(block_hashes)
        blocks = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1
            blocks.append(block_id)
        self.prefix_hits += len(blocks)
        return blocks

    def peek_cached_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """Count of leading hashes that are cached; takes no references (for placement policies)."""
        if not self._caching:
            return 0
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self._cached:
            n += 1
        return n

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; only possible (returns True) while no block is in use."""
        if self.num_used_blocks > 0:
            return False
        self._cached.clear()
        self._hash = [None] * self._num_blocks
        if self._events is not None:
            self._events, self._cleared = {}, True
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant, if any."""
        assert len(self._ref) == len(self._hash) == self._num_blocks, "per-block arrays mis-sized"
        for block_id in self._free:
            assert 0 <= block_id < self._num_blocks, f"free queue holds unknown block {block_id}"
        for block_id, ref in enumerate(self._ref):
            in_free = block_id in self._free
            assert ref >= 0, f"block {block_id} has negative ref {ref}"
            assert in_free == (ref == 0), f"block {block_id}: ref {ref}, in free queue: {in_free}"
        for block_hash, block_id in self._cached.items():
            assert self._hash[block_id] == block_hash, f"map entry for block {block_id} is stale"
        for block_id, block_hash in enumerate(self._hash):
            if block_hash is not None:
                assert self._cached.get(block_hash) == block_id, f"block {block_id} hash not in map"
        assert self._caching or not self._cached, "prefix cache populated while disabled"
        assert 0 <= self.prefix_hits <= self.prefix_queries, (
            f"prefix_hits={self.prefix_hits} prefix_queries={self.prefix_queries}"
        )

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        if block_hash is not None:
            assert self._cached.get(block_hash) == block_id, f"block {block_id} hash not in map"
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash)
            del self._cached[block_hash]
            self._hash[block_id] = None
            if self._events is not None:
                self._events[block_hash] = False

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self._num_blocks})")
