"""Moving a request's KV blocks from a prefill worker to a decode worker.

The sender gathers the request's used blocks into one contiguous tensor (``extract_blocks``), ships it
over a ``PairChannel`` and the receiver scatters it into the blocks it reserved (``insert_blocks``);
block ids differ on the two sides, the layout (pdserve.model.attention) does not.

A ``PairChannel`` is a two-rank torch.distributed process group of its own (rank 0 = prefill, the
sender; rank 1 = decode, the receiver), built on a ``PrefixStore`` of the decode worker's
``StoreServer``. There is no global world: pairs come and go as pools grow and shrink, and many pairs
live side by side in one process. Gloo carries CPU tensors, NCCL carries CUDA tensors on two GPUs;
two workers on one GPU (NCCL rejects two ranks on one GPU) stage through host memory over gloo: the
channel finds out at its rendezvous (``staged``). (A device-to-device copy over CUDA IPC would be
faster there; it was written once, tested across processes on an H100, never wired into a channel,
and removed: docs/benchmarks.md has the staged path's hand-off times on one GPU.)

Ordering: NCCL matches sends and receives between two ranks by order, not by tag, so one side must
decide the order of transfers and the other follow it: the sender (the prefill worker, which knows when
KV is ready) orders them and announces the order in a small control message (pdserve.transfer.protocol). Every
transfer starts with a small header ``[transfer_id, numel]`` that the receiver checks, so a disagreement
is an error, not corrupted KV. A transfer may be made of several tensors (one per layer, sent while the
next layers compute).

Failure: every wait is bounded by the channel's timeout. A transfer that fails leaves an operation
pending inside the process group, which cannot be reused after that: the channel closes itself and
reports ``broken``; its owner drops it and builds a new one (with a new ``generation``, since the
store still holds the old group's rendezvous keys) when the pair is next needed.
"""
from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.transfer.store import bound_store

SENDER_RANK = 0
RECEIVER_RANK = 1
_TAG = 0  # NCCL ignores tags; gloo needs one. Order alone matches operations (see module docstring).


class TransferError(RuntimeError):
    """A transfer failed; the channel it ran on is broken and must be replaced."""


class TransferTimeout(TransferError):
    """A transfer did not complete within the channel's timeout."""


# --- blocks in and out of a cache ----------------------------------------------------------------

def extract_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """The given blocks as one contiguous [layers, 2, kv_heads, len(block_ids), block_size, head_dim]."""
    index = _block_index(kv_cache, block_ids)
    return kv_cache.index_select(3, index)


def insert_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write data (as made by extract_blocks) into the given blocks of kv_cache, in order."""
    index = _block_index(kv_cache, block_ids)
    if len(set(block_ids)) != len(block_ids):
        # index_copy_ with repeated indices keeps an unspecified one of the writes.
        raise ValueError(f"duplicate block ids: {list(block_ids)}")
    expected = (*kv_cache.shape[:3], len(block_ids), *kv_cache.shape[4:])
    if tuple(data.shape) != expected:
        raise ValueError(f"data of shape {tuple(data.shape)} does not fit {len(block_ids)} blocks of a cache "
                         f"of shape {tuple(kv_cache.shape)}: expected {expected}")
    if data.dtype != kv_cache.dtype or data.device != kv_cache.device:
        raise ValueError(f"data is {data.dtype} on {data.device}, the cache is {kv_cache.dtype} on {kv_cache.device}")
    kv_cache.index_copy_(3, index, data)


def _block_index(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    if kv_cache.dim() != 6:
        raise ValueError(f"a KV cache is [layers, 2, kv_heads, blocks, block_size, head_dim]; "
                         f"got shape {tuple(kv_cache.shape)}")
    if not block_ids:
        raise ValueError("a transfer needs at least one block")
    num_blocks = kv_cache.shape[3]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad} out of range for a cache of {num_blocks} blocks")
    return torch.tensor(list(block_ids), dtype=torch.int64, device=kv_cache.device)


# --- statistics ----------------------------------------------------------------------------------

# Upper bounds (seconds) of the transfer-duration histogram buckets; the last bucket is +Inf.
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class TransferStats:
    """Cumulative counts of one side's transfers, with a histogram of their durations."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    checksum_failures: int = 0  # transfers that arrived whole but differed from what was sent
    channels_opened: int = 0  # generations of a pair's channels this side built (a broken one is replaced)
    # Per bucket of TRANSFER_SECONDS_BUCKETS (and +Inf): transfers that took at most that long, not cumulative.
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1))
    # Several channels may share one stats object and run in different threads.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.transfers += 1
            self.bytes += nbytes
            self.seconds += seconds
            self.bucket_counts[bisect.bisect_left(TRANSFER_SECONDS_BUCKETS, seconds)] += 1

    def record_failure(self) -> None:
        with self._lock:
            self.failures += 1

    def record_channel(self) -> None:
        with self._lock:
            self.channels_opened += 1

    def record_checksum_failure(self) -> None:
        with self._lock:
            self.failures += 1
            self.checksum_failures += 1

    def snapshot(self) -> dict[str, int | float | list[int]]:
        with self._lock:
            return {"transfers": self.transfers, "bytes": self.bytes, "seconds": self.seconds,
                    "failures": self.failures,
                    "checksum_failures": self.checksum_failures, "channels_opened": self.channels_opened,
                    "bucket_counts": list(self.bucket_counts)}


# --- rendezvous store and pair channel ------------------------------------------------------------

class StoreServer:
    """The TCPStore a decode worker hosts for the rendezvous of all its pairs (the OS picks the port)."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 60.0):
        self._store: dist.TCPStore | None = bound_store(host, 0, timeout_s)  # listening on host alone
        self.host = host
        self.port: int = self._store.port

    def close(self) -> None:
        """Stop serving (the server lives as long as this object references it); idempotent."""
        self._store = None

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PairChannel:
    """One side of the transfer link between one prefill worker (rank 0) and one decode worker (rank 1).

    Construction is a rendezvous: both sides must construct their channel concurrently (e.g. two Ray
    calls started together), each constructor blocks until the other side has joined or timeout_s has
    passed (TransferTimeout). Both sides must use the same ids and generation; a rebuilt pair takes
    the next generation. A channel runs one transfer at a time.

    stats: where this side records its transfers (several channels may share one); owned if None.
    before_send: a fault-injection hook for tests, called with the transfer id before anything is sent;
    what it raises propagates unchanged and leaves the channel as it was.
    """

    def __init__(self, store_host: str, store_port: int, prefill_id: str, decode_id: str, rank: int,
                 timeout_s: float, device: torch.device | str = "cpu", *, generation: int = 0,
                 stats: TransferStats | None = None, before_send: Callable[[int], None] | None = None):
        if rank not in (SENDER_RANK, RECEIVER_RANK):
            raise ValueError(f"rank must be {SENDER_RANK} (prefill, sends) or {RECEIVER_RANK} (decode, receives)")
        if "/" in prefill_id or "/" in decode_id:
            raise ValueError(f"worker ids must not contain '/': {prefill_id!r}, {decode_id!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.rank = rank
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" != "cuda:0" when comparing devices
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend_for(self.device)
        self.staged = False  # a CUDA pair on one GPU: through host memory over gloo (see _same_gpu)
        self.timeout_s = timeout_s
        self.stats = stats if stats is not None else TransferStats()
        self.prefix = f"pair/{prefill_id}/{decode_id}/{generation}"
        self._before_send = before_send
        self._broken = False
        timeout = timedelta(seconds=timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout)
            pair_store = dist.PrefixStore(self.prefix, store)
            if self.device.type == "cuda" and _same_gpu(pair_store, rank, self.device):
                self.staged, self.backend = True, "gloo"
            self._pg: dist.ProcessGroup | None = new_process_group(pair_store, rank, 2, timeout, self.backend)
        except RuntimeError as e:
            raise self._as_transfer_error(e, deadline, "the rendezvous") from e

    @property
    def broken(self) -> bool:
        return self._broken

    def send(self, transfer_id: int, data: torch.Tensor) -> None:
        """Send data as transfer transfer_id; the receiver must be expecting exactly this transfer next."""
        self.send_parts(transfer_id, [data], data.numel())

    def send_parts(self, transfer_id: int, parts: Iterable[torch.Tensor], numel: int) -> None:
        """Send one transfer made of several tensors (numel elements in all), in order, as they come.

        parts may be a generator that produces each tensor when it is ready (a layer's KV while the next
        layers compute); the whole transfer is bounded by the channel's timeout.
        """
        self._live_pg()
        if self.rank != SENDER_RANK:
            raise RuntimeError(f"rank {self.rank} of pair {self.prefix} cannot send")
        if self._before_send is not None:
            self._before_send(transfer_id)
        header = torch.tensor([transfer_id, numel], dtype=torch.int64, device="cpu" if self.staged else self.device)
        start = time.monotonic()
        deadline = start + self.timeout_s
        nbytes = sent = 0
        with self._failing_closed(transfer_id, deadline):
            self._wait(self._live_pg().send([header], RECEIVER_RANK, _TAG), transfer_id, deadline)
            for part in parts:
                self._require(SENDER_RANK, part)
                wire = part.cpu() if self.staged else part
                self._wait(self._live_pg().send([wire], RECEIVER_RANK, _TAG), transfer_id, deadline)
                nbytes += part.nbytes
                sent += part.numel()
            if sent != numel:
                raise TransferError(f"transfer {transfer_id} on pair {self.prefix} announced {numel} elements "
                                    f"and sent {sent}")
        self.stats.record(nbytes, time.monotonic() - start)

    def recv_into(self, transfer_id: int, out: torch.Tensor) -> None:
        """Receive transfer transfer_id into out, whose shape and dtype the receiver knows beforehand."""
        for _ in self.recv_parts(transfer_id, [out], out.numel()):
            pass

    def recv_parts(self, transfer_id: int, buffers: Iterable[torch.Tensor], numel: int) -> Iterator[torch.Tensor]:
        """Receive one transfer of several tensors into buffers, in order, yielding each once it has arrived.

        The caller consumes each buffer before asking for the next, so one buffer object may be reused.
        """
        self._live_pg()
        if self.rank != RECEIVER_RANK:
            raise RuntimeError(f"rank {self.rank} of pair {self.prefix} cannot receive")
        header = torch.empty(2, dtype=torch.int64, device="cpu" if self.staged else self.device)
        start = time.monotonic()
        deadline = start + self.timeout_s
        nbytes = 0
        with self._failing_closed(transfer_id, deadline):
            self._wait(self._live_pg().recv([header], SENDER_RANK, _TAG), transfer_id, deadline)
            sent_id, sent_numel = header.tolist()
            if sent_id != transfer_id:
                raise TransferError(f"transfer order disagrees on pair {self.prefix}: the receiver expected "
                                    f"transfer {transfer_id}, the sender sent transfer {sent_id} (the receiver "
                                    f"must follow the order the sender announced)")
            if sent_numel != numel:
                raise TransferError(f"transfer {transfer_id} on pair {self.prefix}: the sender sent {sent_numel} "
                                    f"elements, the receiver expected {numel}")
            for out in buffers:
                self._require(RECEIVER_RANK, out)
                wire = torch.empty(out.shape, dtype=out.dtype) if self.staged else out
                self._wait(self._live_pg().recv([wire], SENDER_RANK, _TAG), transfer_id, deadline)
                if self.staged:
                    out.copy_(wire)
                nbytes += out.nbytes
                yield out
        self.stats.record(nbytes, time.monotonic() - start)

    def recv(self, transfer_id: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self.recv_into(transfer_id, out)
        return out

    def break_(self) -> None:
        """Give the pair up from this side (a transfer cannot finish): the peer's waits fail at once."""
        self._broken = True
        self.close()

    def close(self) -> None:
        """Release the process group; idempotent. The peer's pending operations then fail at once."""
        # Dropping the last reference is what closes gloo's sockets (abort() and shutdown() leave them
        # open, and the peer would wait out its timeout).
        self._pg = None

    def __enter__(self) -> PairChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require(self, rank: int, tensor: torch.Tensor) -> None:
        if self.rank != rank:
            raise RuntimeError(f"rank {self.rank} of pair {self.prefix} cannot "
                               f"{'send' if rank == SENDER_RANK else 'receive'}")
        if tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(f"transfers need a contiguous tensor on {self.device}; got one on {tensor.device} "
                             f"(contiguous={tensor.is_contiguous()})")
        self._live_pg()

    def _live_pg(self) -> dist.ProcessGroup:
        if self._pg is None:
            raise TransferError(f"pair {self.prefix} is {'broken' if self._broken else 'closed'}; build a new channel")
        return self._pg

    @contextmanager
    def _failing_closed(self, transfer_id: int, deadline: float) -> Iterator[None]:
        # A failed transfer leaves an operation pending in the group, so the group is done for.
        try:
            yield
        except BaseException as e:
            self._broken = True
            self.stats.record_failure()
            self.close()
            if not isinstance(e, RuntimeError) or isinstance(e, TransferError):
                raise
            # Gloo raises from posting an operation on a closed pair as well as from waiting on one.
            raise self._as_transfer_error(e, deadline, f"transfer {transfer_id}") from e

    def _as_transfer_error(self, e: RuntimeError, deadline: float, what: str) -> TransferError:
        # torch.distributed reports a timeout and a vanished peer alike as RuntimeError; the clock tells
        # them apart.
        if time.monotonic() >= deadline - 0.01:
            return TransferTimeout(f"{what} on pair {self.prefix} did not complete within {self.timeout_s:g} s")
        return TransferError(f"{what} on pair {self.prefix} failed: {e}")

    def _wait(self, work: dist.Work, transfer_id: int, deadline: float) -> None:
        # A zero timeout would mean "the group's default", so never pass less than a millisecond.
        remaining = max(deadline - time.monotonic(), 1e-3)
        if not work.wait(timeout=timedelta(seconds=remaining)):
            raise TransferTimeout(f"transfer {transfer_id} on pair {self.prefix} did not complete within "
                                  f"{self.timeout_s:g} s")


def _same_gpu(store: dist.Store, rank: int, device: torch.device) -> bool:
    """Whether both ranks of a pair hold the same physical GPU. NCCL refuses such a pair ("Duplicate GPU
    detected"), e.g. a prefill and a decode worker sharing one GPU with fractional num_gpus."""
    mine = str(torch.cuda.get_device_properties(device).uuid)
    store.set(f"gpu/{rank}", mine)
    return store.get(f"gpu/{1 - rank}").decode() == mine  # waits for the peer, up to the store's timeout


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors on device: gloo on CPU, NCCL on CUDA."""
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        return "nccl"
    raise ValueError(f"no KV transfer backend for device type {device.type!r} (cpu: gloo, cuda: nccl)")


def new_process_group(store: dist.Store, rank: int, size: int, timeout: timedelta, backend: str) -> dist.ProcessGroup:
    """A process group of its own (no global world) on a store: a KV pair channel's two ranks, or a
    tensor-parallel worker's ranks (pdserve.engine.tp_runner)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    assert backend == "nccl", backend
    # Untested on the CPU development machine. NCCL needs its ranks on different GPUs; its communicator
    # is set up lazily by the first operation, which is a rendezvous as well.
    if not dist.is_nccl_available():
        raise RuntimeError("this torch build has no NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)
