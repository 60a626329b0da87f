"""A trainer's weight group as the RL frameworks make it for SGLang: the clients' rendezvous, one tensor per broadcast.

The RL frameworks that drive a remote SGLang server (AReaL, SkyRL-train) make their weight group with torch's
``tcp://master_address:master_port`` rendezvous: the trainer, rank 0, hosts the TCPStore; the store is wrapped
in ``PrefixStore(group_name)`` and the group built on it by torch's own process-group helper, outside the
default process group. An update is announced by its names, dtypes and shapes (an HTTP call), then each tensor
is broadcast from rank 0 on its own, whole and unpacked, in the announced order. pdserve's own group
(pdserve.weights.group) packs buckets behind a digest header instead; this one speaks the clients' wire, so
their own sender code can push weights into every rank of every worker.

``CompatGroup`` has ``WeightGroup``'s interface (``join``, ``receive``, ``close``, ``broken``): a worker's engine
joins and receives through the same calls (``WeightGroup.join`` hands a ``CompatAddress`` to this class), so
every rank of a tensor-parallel worker joins and stages its share as it does for pdserve's own group.

All or nothing across calls: a client may announce a whole model at once or one tensor per call (SkyRL-train).
The tensors received are kept aside, in the group, until the call that completes the update (``Announced.last``,
the router's decision: the model's last tensor has arrived, or the client continued generation); only then does
``receive`` yield them, all at once, to be staged and committed together. An update abandoned part way (a
refused call, a trainer that vanished) drops what was kept: the old weights serve on.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.weights.errors import WeightGroupError, live
from pdserve.weights.update import TensorMeta

TRAINER_RANK = 0
BACKENDS = ("gloo", "nccl")  # gloo carries CPU tensors; NCCL (GPUs) takes the same path by its name

# The dtypes an announced tensor may have, by the names the clients send ("bfloat16" or "torch.bfloat16"). The
# integer ones are read only to be received and refused (a model's weights are floating): the group stays in step.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float": torch.float32, "half": torch.float16, "float64": torch.float64, "int64": torch.int64,
          "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8}

__all__ = ["Announced", "BACKENDS", "CompatAddress", "CompatGroup", "parse_dtype"]


def parse_dtype(name: str) -> torch.dtype:
    """A client's dtype name ("bfloat16", "torch.bfloat16") as a torch dtype; ValueError naming the ones known."""
    dtype = DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(sorted(DTYPES))}")
    return dtype


@dataclass(frozen=True)
class CompatAddress:
    """Where and how to join a client's group: its rendezvous address, its size and name, its backend."""
    host: str  # master_address: where the trainer's TCPStore listens
    port: int  # master_port
    world_size: int  # the trainer's ranks + every rank of every worker (of every server the trainer drives)
    name: str  # group_name: the store's prefix and the process group's name
    backend: str = "gloo"
    timeout_s: float = 600.0  # bounds the rendezvous and each broadcast

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"a weight group has the trainer and at least one worker rank; world_size "
                             f"{self.world_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if not self.name:
            raise ValueError("a group needs a name")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


class Announced(list):
    """The TensorMetas of one client call, in broadcast order, with what the receivers do with them.

    last: once they have arrived, every tensor of the update kept so far is yielded, to be staged and committed
    (an empty list with last set: commit what was kept). discard: receive them (the trainer broadcasts them
    whatever the server answers, and the group must stay in step) and drop them and everything kept: the
    update was refused."""

    def __init__(self, metas: Sequence[TensorMeta] = (), last: bool = False, discard: bool = False):
        super().__init__(metas)
        self.last = last
        self.discard = discard

    def __reduce__(self):
        return (Announced, (list(self), self.last, self.discard))


class CompatGroup:
    """One rank of a client's weight group (rank 0 is the trainer's: this side only receives)."""

    def __init__(self, address: CompatAddress, rank: int, pg: dist.ProcessGroup):
        """Use ``join``."""
        self.address = address
        self.rank = rank
        self.world_size = address.world_size
        self.timeout_s = address.timeout_s
        self._pg: dist.ProcessGroup | None = pg
        self._broken = False
        self._kept: dict[str, torch.Tensor] = {}  # the update's tensors received so far, by name, in order

    @classmethod
    def join(cls, address: CompatAddress, rank: int, timeout_s: float | None = None) -> CompatGroup:
        """Join as `rank` (1..world_size-1) the way the clients' servers do: the tcp:// rendezvous (the trainer
        hosts the store), a PrefixStore of the group's name, torch's process-group helper with no global ranks
        (a group of its own, not a subgroup of a default one). Blocks until every rank has joined; a
        WeightGroupError after the timeout (timeout_s, or the address's)."""
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world, rendezvous

        if not 0 < rank < address.world_size:
            raise ValueError(f"rank {rank} of a group of {address.world_size} (rank 0 is the trainer's)")
        joining = timedelta(seconds=timeout_s or address.timeout_s)
        timeout = timedelta(seconds=address.timeout_s)
        where = f"group {address.name!r} ({address.host}:{address.port})"
        try:
            store, _, _ = next(rendezvous(f"tcp://{address.host}:{address.port}", rank, address.world_size,
                                          timeout=joining))
            store.set_timeout(timeout)
            pg, _ = _new_process_group_helper(address.world_size, rank, [], Backend(address.backend),
                                              dist.PrefixStore(address.name, store), group_name=address.name,
                                              timeout=timeout, group_desc=address.name)
            # The clients' servers register the ranks so that torch.distributed's functions accept the group.
            _world.pg_group_ranks[pg] = {i: i for i in range(address.world_size)}
        except (RuntimeError, ValueError, TimeoutError) as e:
            raise WeightGroupError(f"rank {rank} of {where} could not join within {joining.total_seconds():g} s: "
                                   f"{e}") from e
        return cls(address, rank, pg)

    @property
    def broken(self) -> bool:
        """Whether a broadcast failed (the group is then closed)."""
        return self._broken

    @property
    def kept(self) -> list[str]:
        """The names of the update's tensors received and kept so far."""
        return list(self._kept)

    def receive(self, metas: Sequence[TensorMeta], bucket_bytes: int = 0,
                arena: list[torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive the announced tensors, one broadcast each in their order, and keep them; yield every tensor
        kept (name, full tensor) when `metas` is an Announced with `last` set, nothing otherwise; drop them all
        when it has `discard` set. bucket_bytes and arena: WeightGroup.receive's, unused (each tensor arrives
        whole, in memory of its own, kept until the commit). The generator must be exhausted; one abandoned
        part way, or a failed broadcast, closes the group."""
        self._live()
        last = bool(getattr(metas, "last", False))
        discard = bool(getattr(metas, "discard", False))
        return self._receive(list(metas), last, discard)

    def _receive(self, metas: list[TensorMeta], last: bool, discard: bool) -> Iterator[tuple[str, torch.Tensor]]:
        finished = False
        start = time.monotonic()
        try:
            arrived = [torch.empty(m.shape, dtype=m.dtype) for m in metas]
            try:
                # Posted together, waited in order: the trainer's broadcasts follow one another on the wire.
                works = [self._live().broadcast(t, TRAINER_RANK) for t in arrived if t.numel()]
                for work in works:
                    work.wait()
            except RuntimeError as e:
                raise WeightGroupError(f"rank {self.rank} of group {self.address.name!r}: receiving {len(metas)} "
                                       f"tensors failed after {time.monotonic() - start:.1f} s (timeout "
                                       f"{self.timeout_s:g} s): {e}") from e
            if discard:
                self._kept.clear()
            else:
                for m, t in zip(metas, arrived):
                    self._kept.pop(m.name, None)  # a tensor sent again: its last value, at its new place
                    self._kept[m.name] = t
            if last and not discard:
                kept, self._kept = self._kept, {}
                yield from kept.items()
            finished = True
        finally:
            if not finished:
                self._broken = True
                self.close()

    def drop(self) -> None:
        """Forget the tensors kept (an update abandoned between two calls)."""
        self._kept.clear()

    def close(self) -> None:
        """Leave the group: its process group destroyed (its sockets closed: the trainer's pending broadcasts
        fail), the tensors kept dropped; idempotent."""
        pg, self._pg = self._pg, None
        self._kept.clear()
        if pg is not None:
            try:
                dist.destroy_process_group(pg)
            except (RuntimeError, ValueError, KeyError, AssertionError):
                pass  # a group already failed may be half torn down; dropping the reference closes it

    def __enter__(self) -> CompatGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> dist.ProcessGroup:
        return live(self._pg, self._broken, self.address.name)


def announced_bytes(metas: Sequence[TensorMeta]) -> int:
    """The bytes a call's tensors take on the wire."""
    return sum(math.prod(m.shape) * m.dtype.itemsize for m in metas)
