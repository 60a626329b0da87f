"""KV tiers beneath a worker's paged cache: host memory, then local disk.

A full block the prefix cache evicts (BlockPool.on_evict) is copied, its KV of every layer, into a host pool
preallocated apart from the fast cache (pinned when the cache is on a GPU). When the host pool is full its
least recently used block goes on to a directory on local disk (a file per block, named by its hash), written
by a thread so that no step waits on the disk; beyond the disk budget the least recently used file is deleted.

No copy runs on the step thread. The step thread keeps the books (which hash is in which host slot, on disk,
pinned by a load) and queues the copies: an evicted block's copy to host memory (and a spilled slot's copy
on to disk) on the copy thread, a tier hit's copy back into the cache on the load thread (on a GPU each on
a stream of its own). Copies are done in the order they were queued, so a slot's or a block's old bytes are
read before they are overwritten; a load waits for the writes queued before it (a block it fills may have
just been evicted), and a slot a load reads from is pinned until the load is over. The one wait left to a
step is `fence`: before a step (or an incoming transfer) writes into blocks just handed out, the writes of
their evicted contents must be done; they are host memory copies queued while the step was scheduled.
Blocks are keyed by the prefix cache's hash chains, which are rooted in the weight version that computed the
KV (pdserve.engine.block_pool.version_root): a block of an older version can never match a newer request.

On admission (KVCacheManager.admit_cached_prefix) the blocks of a prompt past its resident prefix that a tier
holds are loaded into fresh blocks instead of being recomputed, when load_is_cheaper says so: the request
stays queued until its load is over while the batch steps on (pdserve.engine.scheduler), and a request
ended meanwhile gives its blocks back once the load has stopped (KVCacheManager.reap).
"""
from __future__ import annotations

import contextlib
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


@dataclass(eq=False)
class TierLoad:
    """One request's blocks on their way back from the tiers (KVTierStore.start_load): `tiers` grows as each is
    copied; `done` is set when the load is over, cancelled or not."""

    hashes: list[bytes]
    block_ids: list[int]
    slots: list[int | None]  # host slot of each block, None: read from disk
    after: int  # the copies queued before it, which it waits for
    tiers: list[str] = field(default_factory=list)
    cancelled: bool = False  # its request ended: the blocks not yet copied are not
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


def _on(stream):
    """Copies on `stream` (a GPU's copy stream), or where they are on a CPU."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _sync(stream) -> None:
    if stream is not None:
        stream.synchronize()


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
        self._pinned: Counter = Counter()  # host slot -> loads queued that read it (it is not reused meanwhile)
        self.copy_bytes_per_s = self._calibrate()
        cuda = kv_cache.device.type == "cuda"
        self._streams = [torch.cuda.Stream(kv_cache.device) if cuda else None for _ in range(2)]  # copy, load
        self._saves = queue.SimpleQueue()  # the copy thread's (block id, slot) and (hash, slot) spills, in order
        self._saved = threading.Condition()
        self._save_seq = self._save_done = 0  # copies queued and done (the copy thread counts the latter)
        self._loads: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._copy_loop, name="kv-offload-copy", daemon=True),
                         threading.Thread(target=self._load_loop, name="kv-offload-load", daemon=True)]
        self.before_load = None  # called by the load thread as each load starts (a worker's fault point)
        self.on_load_done = None  # called by the load thread as each load ends (a worker wakes its step thread)
        self.load_done = threading.Event()  # set as each load ends (an engine with nothing else to do waits on it)
        for t in self._threads:
            t.start()
        if self.disk_blocks:
            self._open_disk(meta or {})

    # -- writes -------------------------------------------------------------------------------------------------

    def save(self, block_id: int, block_hash: bytes) -> None:
        """Keep a copy of cache block `block_id` (about to be reused) under `block_hash`, in host memory: a host slot
        is taken now and the copy queued to the copy thread (`fence` waits for it)."""
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
            return
        if not self._free_slots and not self._spill():
            return  # every slot is read by a load under way: this block is not kept
        slot = self._free_slots.pop()
        written = None  # on a GPU: where the compute stream is, so the copy reads the block as its steps left it
        if self._streams[0] is not None:
            written = torch.cuda.Event()
            written.record()
        self._queue_copy(("save", block_id, slot, written))
        self._host[block_hash] = slot
        self.stats.written["host"] += 1
        with self._lock:
            self._events[block_hash] = True

    def _spill(self) -> bool:
        """Free the least recently used host slot no load reads, its block going on to disk (if there is a disk
        tier); False if every slot is read by a load."""
        old = next((h for h, slot in self._host.items() if not self._pinned[slot]), None)
        if old is None:
            return False
        slot = self._host.pop(old)
        self._free_slots.append(slot)
        if not self.disk_blocks:
            with self._lock:
                self._events[old] = False
            return True
        if old in self._disk:
            return True
        with self._lock:
            self._disk[old] = None
            while len(self._disk) > self.disk_blocks:
                gone, _ = self._disk.popitem(last=False)
                self._pending.pop(gone, None)
                self._queue.put((gone, None))
                if gone not in self._host:
                    self._events[gone] = False
        self._queue_copy(("spill", old, slot, None))  # its bytes are read before the slot's next save overwrites them
        return True

    def _queue_copy(self, op: tuple) -> None:
        self._save_seq += 1
        self._saves.put(op)

    def _copy_loop(self) -> None:
        """The copy thread: ("save", block id, slot, event) copies a cache block into a host slot once the compute
        stream has passed the event (a GPU's), ("spill", hash, slot, None) a host slot's block on to the disk
        writer; None ends the thread."""
        while (op := self._saves.get()) is not None:
            kind, key, slot, written = op
            try:
                with _on(self._streams[0]):
                    if written is not None:
                        self._streams[0].wait_event(written)
                    if kind == "save":
                        self.host[:, :, :, slot].copy_(self.kv_cache[:, :, :, key])
                    else:
                        data = self.host[:, :, :, slot].clone()
                    _sync(self._streams[0])
                if kind == "spill":
                    with self._lock:  # the budget may have dropped it since it was queued: then it is not written
                        if key in self._disk:
                            self._pending[key] = data
                            self._queue.put((key, data))
            except Exception:  # noqa: BLE001 - a copy that failed loses one block of a tier, never the worker
                log.exception("kv offload: %s of %s failed", kind, key if kind == "save" else key.hex()[:12])
            finally:
                with self._saved:
                    self._save_done += 1
                    self._saved.notify_all()

    def fence(self, upto: int | None = None) -> None:
        """Wait until the copies queued so far (or the first `upto`) are done: before anything writes into blocks
        just handed out, their evicted contents must be in host memory."""
        upto = self._save_seq if upto is None else upto
        with self._saved:
            self._saved.wait_for(lambda: self._save_done >= upto)

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

    def pin(self, block_hashes: Sequence[bytes], tiers: Sequence[str]) -> TierLoad:
        """A load of the blocks stored under `block_hashes` (as `lookup` found them, in `tiers`), not yet started:
        the host slots it reads are pinned now, so that the allocation of its blocks (which may evict and save
        others) does not spill them. Then `start_load`, or `unpin` if it does not go ahead."""
        slots = [self._host.get(h) if t == "host" else None for h, t in zip(block_hashes, tiers)]
        for slot in slots:
            if slot is not None:
                self._pinned[slot] += 1
        return TierLoad(list(block_hashes), [], slots, 0)

    def start_load(self, job: TierLoad, block_ids: Sequence[int]) -> TierLoad:
        """Queue a pinned load's copies into cache blocks `block_ids`, which the caller holds and shows no one
        until the load is over (`finish_load`)."""
        job.block_ids, job.after = list(block_ids), self._save_seq
        self._loads.put(job)
        return job

    def _load_loop(self) -> None:
        """The load thread: each queued TierLoad in turn, after the copies queued before it; None ends the thread."""
        while (job := self._loads.get()) is not None:
            self.fence(job.after)
            t0 = time.perf_counter()
            try:
                if self.before_load is not None:
                    self.before_load()
                with _on(self._streams[1]):
                    for block_hash, block_id, slot in zip(job.hashes, job.block_ids, job.slots):
                        if job.cancelled:
                            break
                        data = self.host[:, :, :, slot] if slot is not None else self._read_disk(block_hash)
                        if data is None:  # gone from disk meanwhile: the rest is recomputed
                            break
                        self.kv_cache[:, :, :, block_id].copy_(data)
                        job.tiers.append("host" if slot is not None else "disk")
                    _sync(self._streams[1])
            except Exception:  # noqa: BLE001 - the blocks not loaded are recomputed
                log.exception("kv offload: a load of %d blocks failed", len(job.hashes))
                job.tiers.clear()
            finally:
                job.seconds = time.perf_counter() - t0
                job.done.set()
                self.load_done.set()
                if self.on_load_done is not None:
                    self.on_load_done()

    def finish_load(self, job: TierLoad) -> int:
        """A load that is over (job.done): its host slots unpinned, its counts taken; the number of its leading
        blocks that were loaded (the rest, dropped from disk meanwhile or cancelled, hold nothing)."""
        assert job.done.is_set()
        self.unpin(job)
        for tier in job.tiers:
            self.stats.loaded[tier] += 1
        self.stats.load_seconds += job.seconds
        return len(job.tiers)

    def unpin(self, job: TierLoad) -> None:
        """The host slots a load read (or would have) may be reused again."""
        for slot in job.slots:
            if slot is not None:
                self._pinned[slot] -= 1
                if not self._pinned[slot]:
                    del self._pinned[slot]

    def wait_load(self, timeout: float) -> None:
        """Wait until a load ends (or timeout seconds): for an engine whose only work is requests loading."""
        self.load_done.wait(timeout)
        self.load_done.clear()

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
            raw = b""
        if len(raw) != self.block_bytes:  # deleted (another worker's budget) or cut short: no longer held
            with self._lock:
                if self._disk.pop(block_hash, 0) is None and block_hash not in self._host:
                    self._events[block_hash] = False
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
        """Wait until every queued copy and disk write is done (tests; a worker's orderly stop)."""
        self.fence()
        deadline = time.monotonic() + timeout
        while self._writer is not None and (self._pending or not self._queue.empty()):
            if time.monotonic() > deadline:
                raise TimeoutError("kv offload: disk writes still pending")
            time.sleep(0.01)

    def close(self) -> None:
        """Finish the queued copies, loads and disk writes and stop their threads."""
        self._saves.put(None)
        self._loads.put(None)
        for t in self._threads:
            t.join()
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
