"""KV tiers beneath a worker's paged cache: host memory, then local disk.

A full block the prefix cache evicts (BlockPool.on_evict) is copied, its KV of every layer, into a host pool
preallocated apart from the fast cache (pinned when the cache is on a GPU). When the host pool is full its
least recently used block goes on to a directory on local disk (a file per block, named by its hash), written
by a thread so that no step waits on the disk; beyond the disk budget the least recently used file is deleted.
Blocks are keyed by the prefix cache's hash chains, which are rooted in the weight version that computed the
KV (pdserve.engine.block_pool.version_root): a block of an older version can never match a newer request.

On admission (KVCacheManager.admit_cached_prefix) the blocks of a prompt past its resident prefix that a tier
holds are copied back into fresh blocks instead of being recomputed, when load_is_cheaper says so.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_META = "pdserve-kv-tier.json"
log = logging.getLogger(__name__)


@dataclass
class TierStats:
    """What the tiers did since the worker started (the worker's metrics)."""

    written: Counter = field(default_factory=Counter)  # blocks written, by tier ("host", "disk")
    loaded: Counter = field(default_factory=Counter)  # blocks loaded into the cache, by tier
    hits: Counter = field(default_factory=Counter)  # prompt blocks found in a tier at admission, by tier
    load_seconds: float = 0.0
    block_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {"load_seconds": self.load_seconds}
        for name, counts in (("written", self.written), ("loaded", self.loaded), ("hits", self.hits)):
            for tier in ("host", "disk"):
                out[f"{name}_{tier}_blocks"] = counts[tier]
                if name != "hits":
                    out[f"{name}_{tier}_bytes"] = counts[tier] * self.block_bytes
        return out


class KVTierStore:
    """Host and disk tiers for the blocks of one KV cache tensor [layers, 2, kv_heads, blocks, block_size, head_dim].

    host_bytes: the host pool's budget (a whole number of blocks; at least one). disk_dir / disk_bytes: the
    disk tier (None: none). meta: what a block's bytes depend on (model, dtype, block size, layout): a disk
    directory written under other meta is refused rather than read.
    """

    def __init__(self, kv_cache: torch.Tensor, host_bytes: int, disk_dir: str | None = None,
                 disk_bytes: int = 0, meta: dict | None = None):
        self.kv_cache = kv_cache
        shape = list(kv_cache.shape)
        shape[3] = 1
        self.block_shape = tuple(shape)
        self.block_bytes = kv_cache[:, :, :, 0].numel() * kv_cache.element_size()
        n = host_bytes // self.block_bytes
        if n < 1:
            raise ValueError(f"--kv-offload-mib: {host_bytes} B holds no block of {self.block_bytes} B")
        pin = kv_cache.device.type == "cuda"
        shape[3] = n
        self.host = torch.empty(shape, dtype=kv_cache.dtype, pin_memory=pin)
        self._host: OrderedDict[bytes, int] = OrderedDict()  # hash -> host slot, least recently used first
        self._free_slots = list(range(n - 1, -1, -1))
        self.stats = TierStats(block_bytes=self.block_bytes)
        self.disk_dir = disk_dir
        self.disk_blocks = disk_bytes // self.block_bytes if disk_dir else 0
        self._disk: OrderedDict[bytes, None] = OrderedDict()  # hashes on disk (or queued to be), LRU first
        self._pending: dict[bytes, torch.Tensor] = {}  # queued to the writer, not yet on disk
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._events: dict[bytes, bool] = {}  # the tiers' changes since take_events (True: gained), last wins
        self.copy_bytes_per_s = self._calibrate()
        if self.disk_blocks:
            self._open_disk(meta or {})

    # -- writes -------------------------------------------------------------------------------------------------

    def save(self, block_id: int, block_hash: bytes) -> None:
        """Keep a copy of cache block `block_id` (about to be reused) under `block_hash`, in host memory."""
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
            return
        if not self._free_slots:
            self._spill()
        slot = self._free_slots.pop()
        self.host[:, :, :, slot].copy_(self.kv_cache[:, :, :, block_id])
        self._host[block_hash] = slot
        self.stats.written["host"] += 1
        with self._lock:
            self._events[block_hash] = True

    def _spill(self) -> None:
        """Free the least recently used host slot, its block going on to disk (if there is a disk tier)."""
        old, slot = self._host.popitem(last=False)
        self._free_slots.append(slot)
        if not self.disk_blocks:
            with self._lock:
                self._events[old] = False
            return
        if old in self._disk:
            return
        data = self.host[:, :, :, slot].clone()
        with self._lock:
            self._pending[old] = data
            self._disk[old] = None
            while len(self._disk) > self.disk_blocks:
                gone, _ = self._disk.popitem(last=False)
                self._pending.pop(gone, None)
                self._queue.put((gone, None))
                if gone not in self._host:
                    self._events[gone] = False
        self._queue.put((old, data))

    def _write_loop(self) -> None:
        """The disk writer: (hash, KV) writes a block's file, (hash, None) deletes it; None ends the thread."""
        tmp = os.path.join(self.disk_dir, f".{os.getpid()}-{threading.get_ident()}.tmp")  # this writer's own
        while (item := self._queue.get()) is not None:
            block_hash, data = item
            path = self._path(block_hash)
            try:
                if data is None:
                    os.unlink(path)
                    continue
                with open(tmp, "wb") as f:
                    f.write(data.contiguous().view(torch.uint8).numpy().tobytes())
                os.replace(tmp, path)  # a reader (or a successor worker) never sees half a block
                self.stats.written["disk"] += 1
            except OSError as e:  # gone already (another worker's budget), or the disk is full: no copy kept
                if data is not None:
                    log.warning("kv offload: block %s not written to %s: %s", block_hash.hex()[:12], self.disk_dir, e)
                    with self._lock:
                        self._disk.pop(block_hash, None)
                        self._events[block_hash] = block_hash in self._host
            finally:
                if data is not None:
                    with self._lock:
                        if self._pending.get(block_hash) is data:
                            del self._pending[block_hash]

    # -- loads --------------------------------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes]) -> list[str]:
        """The tier ("host" or "disk") of each leading hash a tier holds, stopping at the first it does not;
        found blocks become the most recently used."""
        found = []
        for h in block_hashes:
            if h in self._host:
                self._host.move_to_end(h)
                found.append("host")
            elif h in self._disk:
                with self._lock:
                    if h in self._disk:
                        self._disk.move_to_end(h)
                found.append("disk")
            else:
                break
        for tier in found:
            self.stats.hits[tier] += 1
        return found

    def load(self, block_hash: bytes, block_id: int) -> str | None:
        """Copy the block stored under `block_hash` into cache block `block_id`; its tier, or None if it is gone."""
        t0 = time.perf_counter()
        dst = self.kv_cache[:, :, :, block_id]
        slot = self._host.get(block_hash)
        if slot is not None:
            dst.copy_(self.host[:, :, :, slot], non_blocking=True)
            tier = "host"
        else:
            data = self._read_disk(block_hash)
            if data is None:
                return None
            dst.copy_(data)
            tier = "disk"
        self.stats.loaded[tier] += 1
        self.stats.load_seconds += time.perf_counter() - t0
        return tier

    def _read_disk(self, block_hash: bytes) -> torch.Tensor | None:
        with self._lock:
            if block_hash not in self._disk:
                return None
            data = self._pending.get(block_hash)
        if data is not None:
            return data
        try:
            with open(self._path(block_hash), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        if len(raw) != self.block_bytes:
            return None
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.kv_cache.dtype)
        return flat.view(self.block_shape).squeeze(3)

    def load_is_cheaper(self, num_blocks: int, recompute_s_per_token: float, block_size: int,
                        tiers: Sequence[str] = ()) -> bool:
        """The rule: load when the bytes over the measured copy bandwidth (disk blocks at a tenth of it) take
        less time than recomputing their tokens at recompute_s_per_token."""
        disk = sum(t == "disk" for t in tiers)
        load_s = (num_blocks - disk + 10 * disk) * self.block_bytes / self.copy_bytes_per_s
        return load_s < num_blocks * block_size * recompute_s_per_token

    def _calibrate(self) -> float:
        """Bytes per second of a block copy from the host pool into the cache (measured on block 0, then
        restored); a floor of 1 GB/s keeps a noisy first measurement from refusing every load."""
        saved = self.kv_cache[:, :, :, 0].clone()
        t0 = time.perf_counter()
        for _ in range(4):
            self.kv_cache[:, :, :, 0].copy_(self.host[:, :, :, 0])
        if self.kv_cache.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.device)
        dt = (time.perf_counter() - t0) / 4
        self.kv_cache[:, :, :, 0].copy_(saved)
        return max(self.block_bytes / max(dt, 1e-9), 1e9)

    # -- disk directory -----------------------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.disk_dir, block_hash.hex() + ".kv")

    def _open_disk(self, meta: dict) -> None:
        """Take the directory's blocks when they were written under the same meta; refuse it otherwise."""
        os.makedirs(self.disk_dir, exist_ok=True)
        meta = {**meta, "block_shape": list(self.block_shape), "dtype": str(self.kv_cache.dtype),
                "block_bytes": self.block_bytes}
        meta_path = os.path.join(self.disk_dir, _META)
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                found = json.load(f)
            if found != meta:
                raise ValueError(f"--kv-offload-dir {self.disk_dir} holds KV of {found}, not of {meta}")
        else:
            tmp = f"{meta_path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(meta, f)
            os.replace(tmp, meta_path)
        files = []
        for name in os.listdir(self.disk_dir):
            if name.endswith(".kv") and len(name) == 67:
                try:  # another worker of this node sharing the directory may delete it meanwhile
                    files.append((os.path.getmtime(os.path.join(self.disk_dir, name)), bytes.fromhex(name[:-3])))
                except (OSError, ValueError):
                    continue
            elif name.endswith(".tmp") and time.time() - os.path.getmtime(os.path.join(self.disk_dir, name)) > 600:
                os.unlink(os.path.join(self.disk_dir, name))  # a write its worker did not finish, long ago
        for _, h in sorted(files):
            self._disk[h] = None
        while len(self._disk) > self.disk_blocks:
            gone, _ = self._disk.popitem(last=False)
            try:
                os.unlink(self._path(gone))
            except FileNotFoundError:
                pass
        self._events.update(dict.fromkeys(self._disk, True))  # a successor announces its predecessor's blocks
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-disk", daemon=True)
        self._writer.start()

    def take_events(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """Hashes the tiers gained and lost since the last call (KVEvents.offloaded, KVEvents.dropped)."""
        with self._lock:
            ev, self._events = self._events, {}
        return tuple(h for h, v in ev.items() if v), tuple(h for h, v in ev.items() if not v)

    def disk_hashes(self) -> list[bytes]:
        """Hashes the disk tier holds (a replacement worker announces them)."""
        with self._lock:
            return list(self._disk)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued disk write is done (tests; a worker's orderly stop)."""
        deadline = time.monotonic() + timeout
        while self._writer is not None and (self._pending or not self._queue.empty()):
            if time.monotonic() > deadline:
                raise TimeoutError("kv offload: disk writes still pending")
            time.sleep(0.01)

    def close(self) -> None:
        """Finish the queued disk writes and stop the writer."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None


def attach_tiers(kv, kv_cache: torch.Tensor, config, num_params: int) -> KVTierStore:
    """Put the tiers config.cache asks for beneath a KVCacheManager and its block pool: evictions are saved, the
    tiers' events go out with the cache's, admission loads from them. A prompt token's recompute time, which the
    cost rule weighs, is 2 FLOPs per parameter at the configured peak (10^11 FLOP/s, a CPU's order, if none)."""
    cache = config.cache
    meta = {"model": config.model, "weight_format": config.load_format, "block_size": cache.block_size}
    tier = KVTierStore(kv_cache, cache.offload_bytes, cache.offload_dir, cache.offload_disk_bytes, meta)
    kv.tier = tier
    kv.pool.on_evict = tier.save
    kv.pool.tier_events = tier.take_events
    kv.recompute_s_per_token = 2 * num_params / (config.peak_flops or 1e11)
    return tier
