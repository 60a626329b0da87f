"""Requests onto blocks: admission with prefix reuse, slot allocation, caching of full blocks, freeing.

Only this module and the block pool touch block ownership; the schedulers ask it for room.
"""
from __future__ import annotations

import math
import mmap

import torch

from pdserve.config import ModelConfig
from pdserve.engine.block_pool import BlockPool, OutOfBlocks, hash_block, version_root
from pdserve.engine.kv_offload import KVTierStore, TierLoad
from pdserve.engine.request import Request


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled KV cache tensor. On a CPU it is an anonymous memory mapping, which the kernel fills with zeros
    a page at a time as each page is first written: a worker's start does not write the whole cache (torch.zeros of
    1 GiB took 0.42 s of CPU), and the process holds the memory of the KV it has written, not of the whole cache."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private, as the heap is: a forked child's writes stay its own. The tensor keeps the mapping alive.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> torch.Tensor:
    """[layers, 2, kv_heads, blocks, block_size, head_dim], zero-filled (see pdserve.model.attention)."""
    return zeroed_cache((model.num_layers, 2, model.num_kv_heads, num_blocks, block_size, model.head_dim), dtype,
                        device)


class KVCacheManager:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.version = 0  # the weight version this worker computes with (EngineCore.update_weights sets it)
        self.tier: KVTierStore | None = None  # host/disk tiers beneath the cache (EngineCore sets them)
        self.recompute_s_per_token = 1e-3  # a prompt token's compute time, the tiers' cost rule weighs it
        self._orphans: list[TierLoad] = []  # loads under way whose requests have ended: their blocks wait for them

    def start(self, req: Request, version: int | None = None) -> None:
        """A request with no KV here is about to get some, computed by weight version `version` (default:
        this worker's): its block hashes are rooted in that version."""
        assert not req.block_ids
        version = self.version if version is None else version
        if req.kv_version != version:
            req.kv_version = version
            req.block_hashes = []

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit_cached_prefix(self, req: Request) -> int:
        """Give a request with no blocks the longest cached prefix of its tokens; returns tokens reused.

        At least one token is always left to compute: its logits are needed to sample. Blocks a tier holds past
        that prefix start loading (req.tier_load): they count once the load is over (`loaded`).
        """
        assert not req.block_ids and req.num_computed_tokens == 0
        full = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, full)
        hits = self.pool.get_cached_prefix(req.block_hashes[:full])
        req.block_ids = list(hits)
        req.num_registered_blocks = len(req.block_ids)
        req.num_computed_tokens = req.num_cached_tokens = len(req.block_ids) * self.block_size
        if self.tier is not None and len(hits) < full:
            self._start_load(req, req.block_hashes[len(hits):full])
        return req.num_computed_tokens

    def _start_load(self, req: Request, block_hashes: list[bytes]) -> None:
        """Start loading the leading blocks of `block_hashes` a tier has into fresh blocks of req (one reference
        each, in no one else's sight until the load is over); nothing when recomputing them is cheaper
        (KVTierStore.load_is_cheaper) or the pool is short of room."""
        tiers = self.tier.lookup(block_hashes)
        if not tiers or not self.tier.load_is_cheaper(len(tiers), self.recompute_s_per_token, self.block_size, tiers):
            return
        job = self.tier.pin(block_hashes[:len(tiers)], tiers)
        try:
            blocks = self.pool.allocate(len(tiers))  # may evict (and save) others, never these: they are fresh
        except OutOfBlocks:
            self.tier.unpin(job)
            return
        req.tier_load = self.tier.start_load(job, blocks)
        req.block_ids += blocks

    def loaded(self, req: Request) -> bool:
        """Whether req has no tier load under way. One just over is taken in: the blocks it filled join req's
        computed prefix and the prefix cache; those it could not fill (dropped from disk meanwhile) are freed."""
        job = req.tier_load
        if job is None:
            return True
        if not job.done.is_set():
            return False
        req.tier_load = None
        n = self.tier.finish_load(job)
        start = len(req.block_ids) - len(job.block_ids)
        for block_id, block_hash in zip(job.block_ids[:n], job.hashes):
            self.pool.cache_block(block_id, block_hash)
        self.pool.free(job.block_ids[n:][::-1])
        del req.block_ids[start + n:]
        req.num_registered_blocks = len(req.block_ids)
        req.num_computed_tokens = req.num_cached_tokens = len(req.block_ids) * self.block_size
        return True

    def reap(self) -> None:
        """Free the blocks of loads whose requests ended while they ran, once those loads have stopped (what they
        did fill is kept in the prefix cache)."""
        going = []
        for job in self._orphans:
            if not job.done.is_set():
                going.append(job)
                continue
            n = self.tier.finish_load(job)
            for block_id, block_hash in zip(job.block_ids[:n], job.hashes):
                self.pool.cache_block(block_id, block_hash)
            self.pool.free(job.block_ids[::-1])
        self._orphans = going

    def fence(self) -> None:
        """Wait until the evicted blocks' copies to a tier are done, before anything writes into blocks just handed
        out (a step's forward, a block copy, an incoming transfer)."""
        if self.tier is not None:
            self.tier.fence()

    def pin_prefix(self, req: Request, num_blocks: int, version: int) -> bool:
        """A partial hand-off's request, with no blocks yet: take the first num_blocks full blocks of its tokens
        from the prefix cache, at weight version `version` (one more reference each, so nothing evicts them
        while its KV is on the way). All or nothing: False, and nothing taken, unless the cache holds them all."""
        assert not req.block_ids and req.num_computed_tokens == 0
        if num_blocks <= 0 or num_blocks * self.block_size >= req.num_tokens:
            return num_blocks == 0  # at least one token is always received (the prefill worker's last)
        self.start(req, version)
        self._extend_hashes(req, num_blocks)
        hits = self.pool.get_cached_prefix(req.block_hashes[:num_blocks])
        if len(hits) < num_blocks:
            self.pool.free(hits[::-1])
            return False
        req.block_ids = hits
        req.num_registered_blocks = req.held_blocks = num_blocks
        return True

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens; False (and nothing changed) if the pool is short."""
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        try:
            req.block_ids.extend(self.pool.allocate(need))
        except OutOfBlocks:
            return False
        return True

    def share(self, block_ids: list[int]) -> list[int]:
        """The same blocks, referenced once more (a forked sample shares its group's prompt blocks)."""
        self.pool.share(block_ids)
        return list(block_ids)

    def allocate_blocks(self, n: int) -> list[int]:
        """n fresh blocks, or none if the pool is short."""
        try:
            return self.pool.allocate(n)
        except OutOfBlocks:
            return []

    def cache_computed_blocks(self, req: Request) -> None:
        """Register every block of the request that is full and computed, for reuse by later requests."""
        full = req.num_computed_tokens // self.block_size
        self._extend_hashes(req, full)
        for i in range(req.num_registered_blocks, full):
            self.pool.cache_block(req.block_ids[i], req.block_hashes[i])
        req.num_registered_blocks = max(req.num_registered_blocks, full)

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first so that shared prefixes are evicted last. Blocks a tier load
        still writes into are released once it has stopped (reap)."""
        if req.tier_load is not None and not self.loaded(req):
            job, req.tier_load = req.tier_load, None
            job.cancelled = True
            self._orphans.append(job)
            del req.block_ids[len(req.block_ids) - len(job.block_ids):]
        self.pool.free(req.block_ids[::-1])
        req.block_ids = []
        req.num_registered_blocks = 0
        req.num_computed_tokens = 0

    def _extend_hashes(self, req: Request, num_full_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(req.block_hashes), num_full_blocks):
            parent = req.block_hashes[i - 1] if i else version_root(req.kv_version)
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs:(i + 1) * bs]))
