"""Fault points: named places in a worker's code where a test can make it stall or tamper with data.

The failure matrix (tests/test_failure_matrix.py, docs/faults.md) needs a worker to be caught at an
exact moment (inside a step, between two parts of a KV transfer) while the test kills it from outside,
or a transfer to arrive corrupted. A point does nothing unless a test armed it through the worker's
`inject_fault` actor method; `fault_reached` lets the test wait, without sleeping, until the worker
is there.

Points: "step" (a step with work, before it runs), "send" (a KV transfer, before its header),
"mid_send" (a KV transfer, after its first part), "corrupt" (a KV transfer: one of its parts is
altered after its checksum was taken).
"""
from __future__ import annotations

import threading
import time

POINTS = ("step", "send", "mid_send", "corrupt")


class FaultPoints:
    """Thread-safe: armed from the actor's event loop, hit from the step or pusher threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, list[float]] = {}  # point -> the stall of each coming hit
        self._reached: dict[str, threading.Event] = {p: threading.Event() for p in POINTS}

    def arm(self, point: str, seconds: float = 0.0, count: int = 1) -> None:
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}; the points are {', '.join(POINTS)}")
        with self._lock:
            self._armed[point] = [seconds] * count
            self._reached[point].clear()

    def hit(self, point: str) -> bool:
        """At the point: whether it was armed (and stall as armed, after saying it was reached)."""
        if not self._armed:  # the common case: nothing armed, no lock taken
            return False
        with self._lock:
            stalls = self._armed.get(point)
            if not stalls:
                return False
            seconds = stalls.pop()
            if not stalls:
                del self._armed[point]
            self._reached[point].set()
        if seconds > 0:
            time.sleep(seconds)
        return True

    def wait_reached(self, point: str, timeout: float) -> bool:
        return self._reached[point].wait(timeout)
