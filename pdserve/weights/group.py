"""The trainer's broadcast group: new weights from an RL trainer to every rank of every worker.

A ``WeightGroup`` is a torch.distributed process group of its own: the trainer is rank 0 and hosts the
group's TCPStore, each worker rank is one of ranks 1..N. It never touches the default process group (a
tensor-parallel worker has its own groups for its collectives). Gloo carries CPU tensors; NCCL is not
implemented yet.

An update is a list of named tensors. Both sides plan the same buckets from the tensors' metadata
(``plan_buckets``); the trainer packs each bucket's bytes into one flat uint8 tensor and broadcasts it, the
receivers unpack it and yield the bucket's tensors as soon as it has arrived, so a worker can stage one
bucket while the next is on the wire. A small header before the buckets carries a digest of the names,
shapes, dtypes and bucket size: receivers that expect another update fail instead of reading garbage.

Failure: every collective is bounded by the group's timeout (a trainer that stops sending) and a peer that
dies (its sockets close) fails the others' pending collectives at once. A failed group is closed and
cannot be reused: the owners build a new one, under a new name and port, among the ranks that are left.
"""
from __future__ import annotations

import hashlib
import math
import random
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.transfer.store import bound_store
from pdserve.weights.errors import WeightGroupError, live
from pdserve.weights.update import TensorMeta

TRAINER_RANK = 0
_HEADER = ("tensors", "bytes", "buckets", "digest")  # the int64 fields broadcast before an update's buckets

__all__ = ["GroupAddress", "TensorMeta", "WeightGroup", "WeightGroupError", "free_port", "measure_bandwidth",
           "plan_buckets"]


def _reachable(host: str, port: int, deadline: float) -> None:
    """Return once a TCP connection to host:port succeeds; TimeoutError at the deadline."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"nothing listens on {host}:{port}")
        try:
            socket.create_connection((host, port), timeout=min(left, 0.5)).close()
            return
        except OSError:
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))


@dataclass(frozen=True)
class GroupAddress:
    host: str  # where rank 0's TCPStore listens (127.0.0.1 in tests)
    port: int
    world_size: int  # trainer + every worker rank
    name: str  # a unique name (a prefix in the store) so a new group after a failed one never mixes keys

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"a group has at least one rank (the trainer); world_size {self.world_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if not self.name:
            raise ValueError("a group needs a name")


# Where free_port looks: above Ray's worker ports (10002-19999 by default), below the kernel's ephemeral range.
PORTS_FROM = 20000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, from below the kernel's ephemeral range where there
    is room: the kernel hands ports of that range to every outgoing connection (Ray's, gRPC's), and one of them
    took a port picked there before the group's store bound it (EADDRINUSE). Another process may still take
    this one first; none does by accident."""
    low = _ephemeral_low()
    for port in random.sample(range(PORTS_FROM, low), min(64, max(0, low - PORTS_FROM))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def meta_nbytes(meta: TensorMeta) -> int:
    return math.prod(meta.shape) * meta.dtype.itemsize


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Indices of metas grouped into consecutive buckets of at most bucket_bytes (a tensor larger than a bucket
    is a bucket by itself). Both sides compute the same plan from the same metas."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, meta in enumerate(metas):
        n = meta_nbytes(meta)
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


class WeightGroup:
    """One rank of a weight-update group; built by ``join``. Rank 0 (the trainer) sends, the others receive.

    Every rank must take part in every collective in the same order: an update is one ``send`` on rank 0 and
    one fully consumed ``receive`` on each other rank, started within the timeout of each other. The timeout
    bounds each collective (the header, each bucket, a barrier), not a whole update.
    """

    def __init__(self, address: GroupAddress, rank: int, timeout_s: float, store: dist.Store,
                 pg: dist.ProcessGroup):
        """Use ``join``."""
        self.address = address
        self.rank = rank
        self.world_size = address.world_size
        self.timeout_s = timeout_s
        self._store: dist.Store | None = store  # rank 0: the server; dropping the last reference stops it
        self._pg: dist.ProcessGroup | None = pg
        self._broken = False
        # The two buffers buckets are packed into or received into, in turns (_buffer).
        self._wire: list[torch.Tensor | None] = [None, None]

    @classmethod
    def join(cls, address: GroupAddress, rank: int, timeout_s: float = 60.0, backend: str = "gloo") -> WeightGroup:
        """Rank 0 hosts the store; every rank blocks here until all world_size ranks have joined (or raises
        WeightGroupError after timeout_s, naming how many joined if that can be known). A client's address
        (pdserve.weights.compat.CompatAddress) joins that group instead, by the clients' rendezvous: a worker's
        engine joins either through this one call."""
        from pdserve.weights.compat import CompatAddress, CompatGroup

        if isinstance(address, CompatAddress):
            return CompatGroup.join(address, rank, timeout_s)
        if backend != "gloo":
            raise NotImplementedError(f"weight-group backend {backend!r} is not implemented; only 'gloo' (CPU "
                                      f"tensors) is")
        if not 0 <= rank < address.world_size:
            raise ValueError(f"rank {rank} of a group of {address.world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        where = f"group {address.name!r} ({address.host}:{address.port})"
        timeout = timedelta(seconds=timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            # The ranks may start in any order: a client retries until rank 0's store answers. Probed here with
            # a bounded connect, since the store's own retries back off past their timeout under load.
            if rank != TRAINER_RANK:
                _reachable(address.host, address.port, deadline)
            remaining = max(deadline - time.monotonic(), 0.5)
            # The trainer's store listens on the address the workers are given only (pdserve.transfer.store).
            store = bound_store(address.host, address.port, remaining, address.world_size) if rank == TRAINER_RANK \
                else dist.TCPStore(address.host, address.port, address.world_size, False, timedelta(seconds=remaining),
                                   wait_for_workers=False)
        except (RuntimeError, TimeoutError) as e:
            if rank == TRAINER_RANK:
                raise WeightGroupError(f"rank 0 of {where} cannot host the group's store: {e}") from e
            raise WeightGroupError(f"rank {rank} of {where} could not reach rank 0's store within "
                                   f"{timeout_s:g} s: {e}") from e
        keys = [f"rank/{r}" for r in range(address.world_size)]
        group_store = dist.PrefixStore(f"weights/{address.name}/", store)
        pg = None
        try:
            if group_store.add(keys[rank], 1) != 1:
                raise WeightGroupError(f"rank {rank} joined {where} twice")
            group_store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            pg = dist.ProcessGroupGloo(group_store, rank, address.world_size, timeout)
            pg.barrier().wait()  # every rank is past its rendezvous: rank 0 may close the store from now on
        except RuntimeError as e:
            error = e if isinstance(e, WeightGroupError) else WeightGroupError(
                f"rank {rank} of {where}: {_joined(group_store, keys)} within {timeout_s:g} s: {e}")
            # The traceback keeps this frame: drop the store (rank 0: stop serving it) before raising.
            store = group_store = pg = None
            raise error from (None if error is e else e)
        return cls(address, rank, timeout_s, store, pg)

    @property
    def broken(self) -> bool:
        """Whether a collective failed (the group is then closed)."""
        return self._broken

    def send(self, tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, *,
             after_bucket: Callable[[int, int], None] | None = None) -> int:
        """Rank 0: broadcast the tensors bucket by bucket (each bucket = the tensors' bytes packed into one
        flat uint8 CPU tensor, one broadcast per bucket, tensors of any dtype incl. bfloat16); returns bytes
        sent (the tensors' bytes, not counting the header) once every rank has received them all.

        after_bucket(k, bytes so far) is called once bucket k is on the wire and every bucket before it has been
        sent (progress, tests)."""
        if self.rank != TRAINER_RANK:
            raise RuntimeError(f"rank {self.rank} of group {self.address.name!r} receives; only rank 0 sends")
        self._live()
        items = [(name, t) for name, t in tensors]
        metas = [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in items]
        plan = plan_buckets(metas, bucket_bytes)
        sent = 0
        with self._failing("sending an update"):
            self._broadcast(_header(metas, plan, bucket_bytes))
            # Bucket k + 1 is packed while bucket k is on the wire: two buffers take turns.
            in_flight = None
            for k, bucket in enumerate(plan):
                flat = _pack([items[i][1] for i in bucket], lambda n: self._buffer(n, k % 2))
                work = self._live().broadcast(flat, TRAINER_RANK) if flat.numel() else None
                if in_flight is not None:
                    in_flight.wait()
                in_flight = work
                sent += sum(items[i][1].nbytes for i in bucket)
                if after_bucket is not None:
                    after_bucket(k, sent)
            if in_flight is not None:
                in_flight.wait()
            # A broadcast returns on rank 0 once its bytes are written, so only this says every rank has them
            # (and fails at once if a receiver gave up, e.g. on a header that was not what it expected).
            self._live().barrier().wait()
        return sent

    def receive(self, metas: Sequence[TensorMeta], bucket_bytes: int,
                arena: list[torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Other ranks: yield (name, tensor) with the metas' shapes/dtypes, bucket by bucket (a bucket's tensors
        are yielded as soon as it has arrived, as views of the group's receive buffer: each is valid until the
        generator moves past its bucket, so a consumer copies what it keeps). arena: the caller's list of one
        buffer per bucket (grown here as needed, kept for the next update): bucket k arrives in arena[k], and its
        tensors stay valid until the arena is given to another receive, so a consumer may keep them uncopied.
        The generator must be exhausted: the last step tells the trainer the update arrived. An update
        abandoned part way leaves the group out of step with the trainer: it is closed."""
        if self.rank == TRAINER_RANK:
            raise RuntimeError(f"rank 0 of group {self.address.name!r} sends; ranks 1.. receive")
        self._live()
        metas = list(metas)
        plan = plan_buckets(metas, bucket_bytes)
        return self._receive(metas, plan, bucket_bytes, arena)

    def _receive(self, metas: list[TensorMeta], plan: list[list[int]], bucket_bytes: int,
                 arena: list[torch.Tensor] | None) -> Iterator[tuple[str, torch.Tensor]]:
        finished = False
        try:
            with self._failing("receiving an update"):
                header = torch.empty(len(_HEADER), dtype=torch.int64)
                self._broadcast(header)
                expected = _header(metas, plan, bucket_bytes)
                if not torch.equal(header, expected):
                    theirs, mine = (dict(zip(_HEADER, h.tolist())) for h in (header, expected))
                    raise WeightGroupError(f"rank {self.rank} of group {self.address.name!r} expects another "
                                           f"update than the trainer sends: trainer {theirs}, this rank {mine} "
                                           f"(names, shapes, dtypes and bucket_bytes must agree)")
            # Bucket k + 1 is received while the consumer takes bucket k: two buffers take turns (or the arena's).
            pending = self._post(metas, plan, 0, arena)
            for k in range(len(plan)):
                flat, work = pending
                if work is not None:
                    with self._failing("receiving an update"):
                        work.wait()
                pending = self._post(metas, plan, k + 1, arena)
                yield from _unpack(flat, [metas[i] for i in plan[k]])
            with self._failing("receiving an update"):
                self._live().barrier().wait()  # tell the trainer the update arrived whole
            finished = True
        finally:
            if not finished:
                self._broken = True
                self.close()

    def _post(self, metas: list[TensorMeta], plan: list[list[int]], k: int,
              arena: list[torch.Tensor] | None) -> tuple[torch.Tensor, dist.Work | None]:
        """Start receiving bucket k (if there is one) into arena[k], or buffer k % 2 without an arena: the buffer
        and the broadcast's work."""
        if k >= len(plan):
            return torch.empty(0, dtype=torch.uint8), None
        nbytes = _packed_nbytes([metas[i] for i in plan[k]])
        if arena is None:
            flat = self._buffer(nbytes, k % 2)
        else:
            arena.extend([torch.empty(0, dtype=torch.uint8)] * (k + 1 - len(arena)))
            if arena[k].numel() < nbytes:
                arena[k] = torch.empty(nbytes, dtype=torch.uint8)
            flat = arena[k][:nbytes]
        if not flat.numel():
            return flat, None
        with self._failing("receiving an update"):
            return flat, self._live().broadcast(flat, TRAINER_RANK)

    def _buffer(self, nbytes: int, which: int = 0) -> torch.Tensor:
        """The first nbytes of the group's wire buffer `which` (0 or 1; each grown to the largest bucket, then
        reused): memory written for the first time costs page faults, several times the broadcast itself on a
        CPU host."""
        wire = self._wire[which]
        if wire is None or wire.numel() < nbytes:
            wire = self._wire[which] = torch.empty(nbytes, dtype=torch.uint8)
        return wire[:nbytes]

    def barrier(self) -> None:
        with self._failing("a barrier"):
            self._live().barrier().wait()

    def close(self) -> None:
        """Release the process group and the store (rank 0: stop serving it); idempotent, and quick after a
        failure. Peers' pending collectives then fail at once."""
        # Dropping the last references closes gloo's sockets and stops rank 0's store server.
        self._pg = None
        self._store = None
        self._wire = [None, None]

    def __enter__(self) -> WeightGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> dist.ProcessGroup:
        return live(self._pg, self._broken, self.address.name)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        # Bounded by the group's timeout. No local holds the process group: a traceback must not keep it alive.
        self._live().broadcast(tensor, TRAINER_RANK).wait()

    @contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        # A failed collective leaves the ranks out of step, so the group is done for.
        start = time.monotonic()
        try:
            yield
        except BaseException as e:
            self._broken = True
            self.close()
            if not isinstance(e, RuntimeError) or isinstance(e, WeightGroupError):
                raise
            raise WeightGroupError(f"rank {self.rank} of group {self.address.name!r}: {what} failed after "
                                   f"{time.monotonic() - start:.1f} s (timeout {self.timeout_s:g} s): {e}") from e


def measure_bandwidth(group: WeightGroup, nbytes: int, repeats: int = 3) -> float:
    """Every rank calls it: bytes/s of a broadcast of nbytes from rank 0 (best of repeats), the raw gloo
    figure the weight-update benchmark compares itself to. A repeat is timed on rank 0 from a barrier to
    every rank having the bytes; every rank returns rank 0's figure."""
    if nbytes <= 0 or repeats <= 0:
        raise ValueError(f"nbytes and repeats must be positive, got {nbytes} and {repeats}")
    if group.rank == TRAINER_RANK:
        buf = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8)
    seconds = torch.zeros(repeats, dtype=torch.float64)
    for i in range(repeats):
        group.barrier()
        start = time.perf_counter()
        with group._failing("a bandwidth measurement"):
            group._broadcast(buf)
        group.barrier()  # rank 0 leaves it once every rank has received
        seconds[i] = time.perf_counter() - start
    with group._failing("a bandwidth measurement"):
        group._broadcast(seconds)
    return nbytes / float(seconds.min())


def _joined(store: dist.Store, keys: list[str]) -> str:
    """How many ranks reached the store, for an error message (bounded: the store may be gone)."""
    try:
        store.set_timeout(timedelta(seconds=1))
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
    except RuntimeError:
        return "not every rank joined (rank 0's store no longer answers)"
    return f"{len(keys) - len(missing)} of {len(keys)} ranks joined (missing ranks {missing})"


def _header(metas: Sequence[TensorMeta], plan: list[list[int]], bucket_bytes: int) -> torch.Tensor:
    text = "\n".join(f"{m.name}|{tuple(m.shape)}|{m.dtype}" for m in metas) + f"\n{bucket_bytes}"
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")  # fits an int64
    return torch.tensor([len(metas), sum(meta_nbytes(m) for m in metas), len(plan), digest], dtype=torch.int64)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


ALIGN = 64  # each tensor of a bucket starts at a multiple of this many bytes: a view of it is aligned for any dtype


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _packed_nbytes(metas: list[TensorMeta]) -> int:
    """A bucket's bytes on the wire: its tensors', each padded to ALIGN but the last (a lone tensor is as is)."""
    sizes = [meta_nbytes(m) for m in metas]
    return sum(_padded(n) for n in sizes[:-1]) + (sizes[-1] if sizes else 0)


def _pack(tensors: list[torch.Tensor], buffer: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, in order, as one flat uint8 CPU tensor (from buffer(n)), each at a multiple of ALIGN (a
    lone tensor is not copied)."""
    if len(tensors) == 1:
        return _flat_bytes(tensors[0])
    flat = buffer(_packed_nbytes([TensorMeta("", tuple(t.shape), t.dtype) for t in tensors]))
    offset = 0
    for t in tensors:
        flat[offset:offset + t.nbytes].copy_(_flat_bytes(t))
        offset += _padded(t.nbytes)
    return flat


def _unpack(flat: torch.Tensor, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The bucket's tensors: views of its buffer, each aligned for its dtype."""
    offset = 0
    for meta in metas:
        n = meta_nbytes(meta)
        if n == 0:
            yield meta.name, torch.empty(meta.shape, dtype=meta.dtype)
            continue
        yield meta.name, flat[offset:offset + n].view(meta.dtype).reshape(meta.shape)
        offset += _padded(n)
