"""A worker as the router sees it: its actor, pool and slot, the requests routed to it, its latest stats, its
link; and how a worker's actor is ended for good."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from pdserve.serving.calls import WorkerCalls
from pdserve.serving.link import Link
from pdserve.serving.messages import WorkerStats

log = logging.getLogger(__name__)


@dataclass
class Worker:
    worker_id: str
    handle: Any
    pool: str
    slot: int  # position in its pool; replacements take the same slot under a new id
    requests: set[str] = field(default_factory=set)  # worker-side ids routed here and not finished
    flex: set[str] = field(default_factory=set)  # those of the flex tier (decode workers preempt them for others)
    queued_tokens: int = 0  # prefill: prompt tokens sent and not yet ingested
    stats: WorkerStats | None = None
    alive: bool = True
    state: str = "starting"  # starting | ready | draining
    placement_group: Any = None  # a tensor-parallel worker's: its ranks' bundles, removed when it leaves
    # Decode workers: the prefill workers whose handles it was given (a handle is sent once: pickling
    # one is most of a reservation call's cost).
    prefill_handles: set[str] = field(default_factory=set)
    link: Link | None = None  # its connection to the router: per-request calls out, step outputs in (ready on)

    @property
    def calls(self) -> WorkerCalls:
        """The router's calls on this worker's link (pdserve.serving.calls)."""
        return WorkerCalls(self.link)


# Placement groups of workers that left, being removed (a call to Ray's GCS, off the event loop); the
# pools' shutdown waits this long for them, at most.
REMOVE_GROUPS_TIMEOUT_S = 5.0


def kill(w: Worker) -> threading.Thread | None:
    """End a worker's actor for good, and a TP worker's other ranks with its placement group (removed
    on a thread of its own: it is a blocking call to Ray's GCS); the thread, if any."""
    ray.kill(w.handle, no_restart=True)
    group, w.placement_group = w.placement_group, None
    if group is None:
        return None

    def remove() -> None:
        try:
            remove_placement_group(group)
        except Exception as e:  # noqa: BLE001 - Ray is going away; its groups go with it
            log.warning("placement group of %s not removed: %s", w.worker_id, e)

    t = threading.Thread(target=remove, name=f"remove-group-{w.worker_id}", daemon=True)
    t.start()
    return t
