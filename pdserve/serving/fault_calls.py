"""A worker's fault calls: what a test calls to put a worker in a fault (its fault points, its ranks' processes).

Every part of a worker hits its fault points (pdserve.faults: the step, a weight commit, a KV push), inert
unless a test arms one; the router never calls these. Tests call them on the worker's Ray actor, and Ray
finds an actor's methods on its class, so `FaultCalls` is a mixin of `WorkerActor` (pdserve.serving.worker).
It owns `faults`, set in its `__init__`, which `WorkerActor.__init__` runs first; what it uses of the actor
is declared below the class line.
"""
from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from pdserve.faults import FaultPoints

if TYPE_CHECKING:
    from pdserve.serving.tp_ranks import RayRanks


class FaultCalls:
    """The tests' fault calls on a worker actor (a mixin of pdserve.serving.worker.WorkerActor)."""

    ranks: RayRanks | None  # the actor's: a TP worker's other ranks

    def __init__(self) -> None:
        super().__init__()
        self.faults = FaultPoints()

    async def inject_fault(self, point: str, seconds: float = 0.0, count: int = 1, skip: int = 0,
                           key: str | None = None) -> None:
        """Arm a fault point (pdserve.faults) for `count` hits after the next `skip` (whose key begins with
        `key`, if given)."""
        self.faults.arm(point, seconds, count, skip, key)

    async def disarm_fault(self, point: str) -> None:
        """The fault point's coming hits pass."""
        self.faults.disarm(point)

    async def release_fault(self, point: str) -> None:
        """Let a fault point armed with seconds=math.inf go on."""
        self.faults.release(point)

    async def fault_reached(self, point: str, timeout: float = 60.0) -> bool:
        """Wait until an armed fault point has been hit (False after the timeout)."""
        return await asyncio.to_thread(self.faults.wait_reached, point, timeout)

    async def rank_pids(self) -> list[int]:
        """The processes of this worker's ranks, rank 0 (this one) first: a test kills one to lose a rank."""
        others = await asyncio.to_thread(self.ranks.pids) if self.ranks is not None else []
        return [os.getpid(), *others]
