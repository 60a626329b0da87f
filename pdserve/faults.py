"""Fault points: named places in a worker's code where a test can make it stall or tamper with data.

The failure matrix (tests/serving/test_failure_matrix.py, docs/faults.md) needs a worker to be caught at an
exact moment (inside a step, between two parts of a KV transfer) while the test kills it from outside,
or a transfer to arrive corrupted. A point does nothing unless a test armed it through the worker's
`inject_fault` actor method; `fault_reached` lets the test wait, without sleeping, until the worker
is there. A point can let its first hits pass (`skip`), so a test catches a worker at, say, its fourth
step with work: a moment that comes after the streams began and before any of them can end. Armed with
seconds=math.inf, a hit is held there until the test releases it (`release_fault`) or kills the worker:
the moment is the test's to end, whatever the machine's speed. A stall of fixed seconds is for what is
about time (a transfer that outlasts its timeout).

Points: "step" (a step with work, before it runs), "send" (a KV transfer, before its header),
"mid_send" (a KV transfer, after its first part), "corrupt" (a KV transfer: one of its parts is
altered after its checksum was taken), "stage_weights" (a weight update, before it is read; the worker
serves on), "commit_weights" (a weight update, staged, before its switch: the step thread waits),
"request_data" (a request whose data fails every step it is in, and the worker's check of it: a bad value
the validation missed; armed with a key, the worker-side request id's beginning, it hits that request only),
"evict_prefix" (a decode worker taking a partial hand-off: every unused block of its prefix cache is evicted
just before it pins the prefix the router counted on), "tier_load" (a load of a prompt's blocks from a KV tier,
on the tier's load thread, before it copies: the step thread steps on meanwhile).
"""
from __future__ import annotations

import logging
import math
import threading
import time

POINTS = ("step", "send", "mid_send", "corrupt", "stage_weights", "commit_weights", "request_data", "evict_prefix",
          "tier_load")
# A hit armed with seconds=math.inf is held until the test releases it (or the process dies); a test
# that never does (it failed first) lets it go after this long, so no worker is kept forever.
HOLD_LIMIT_S = 600.0
log = logging.getLogger(__name__)


class FaultPoints:
    """Thread-safe: armed from the actor's event loop, hit from the step or pusher threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # point -> [hits still to let pass, hits still to act on, each one's stall]: counts, never a list of
        # hits, so a test may let a point pass any number of times.
        self._armed: dict[str, list] = {}
        self._keys: dict[str, str] = {}  # point -> the key a hit must begin with to count (none: every hit)
        self._reached: dict[str, threading.Event] = {p: threading.Event() for p in POINTS}
        self._released: dict[str, threading.Event] = {p: threading.Event() for p in POINTS}

    def arm(self, point: str, seconds: float = 0.0, count: int = 1, skip: int = 0, key: str | None = None) -> None:
        """The `count` hits after the next `skip` ones stall `seconds` each (and act, for "corrupt" and
        "request_data"); math.inf holds each until `release`. key: only hits whose key begins with it count."""
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}; the points are {', '.join(POINTS)}")
        if count < 1 or skip < 0:
            raise ValueError(f"count must be at least 1 and skip at least 0, not {count} and {skip}")
        with self._lock:
            self._armed[point] = [skip, count, seconds]
            if key is None:
                self._keys.pop(point, None)
            else:
                self._keys[point] = key
            self._reached[point].clear()
            self._released[point].clear()

    def hit(self, point: str, key: str = "") -> bool:
        """At the point: whether it was armed (and stall as armed, after saying it was reached). key: what
        this hit is about (a request's id), for a point armed for one."""
        if not self._armed:  # the common case: nothing armed, no lock taken
            return False
        with self._lock:
            armed = self._armed.get(point)
            if armed is None or not key.startswith(self._keys.get(point, "")):
                return False
            if armed[0] > 0:  # a hit let through
                armed[0] -= 1
                return False
            armed[1] -= 1
            seconds = armed[2]
            if armed[1] == 0:
                del self._armed[point]
            self._reached[point].set()
        if seconds == math.inf:
            if not self._released[point].wait(HOLD_LIMIT_S):
                log.warning("fault point %r held %.0f s and never released: going on", point, HOLD_LIMIT_S)
        elif seconds > 0:
            time.sleep(seconds)
        return True

    def disarm(self, point: str) -> None:
        """The point's coming hits pass (one held now stays held until `release`)."""
        with self._lock:
            self._armed.pop(point, None)
            self._keys.pop(point, None)

    def release(self, point: str) -> None:
        """Let a held hit of the point go on (and any later one armed with the same hold)."""
        self._released[point].set()

    def wait_reached(self, point: str, timeout: float) -> bool:
        return self._reached[point].wait(timeout)
