"""A worker's cancels: a request ended wherever it stands (its KV freed), one cancelled before it came refused
when it comes, a gone router's requests ended, and the record of what cancels did.

A cancel reaches a worker on its link to the router (Call.CANCEL: `_cancel_soon`) or as a Ray call
(`cancel`, `recent_cancels`), so `Cancels` is a mixin of `WorkerActor` (pdserve.serving.worker): Ray finds
an actor's methods on its class. Its state (the tombstones and the record) is set in its `__init__`, which
`WorkerActor.__init__` runs first; what it uses of the actor is declared below the class line. A worker
kind says how a request ends in its role by overriding `_cancel`.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING

from pdserve.engine.step_loop import StepLoopStopped
from pdserve.serving.messages import CancelRecord

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import EngineCore
    from pdserve.engine.step_loop import StepLoop

log = logging.getLogger(__name__)

TOMBSTONE_TTL_S = 60.0  # the race it covers lasts milliseconds
CANCELS_KEPT = 64  # the recent cancels a worker can tell (recent_cancels)


class Cancels:
    """The cancels of a worker actor (a mixin of pdserve.serving.worker.WorkerActor)."""

    # The actor's, used here: its id, its engine, its step thread.
    worker_id: str
    core: EngineCore
    loop: StepLoop | None

    def __init__(self) -> None:
        super().__init__()
        # Ids cancelled before their request arrived here (Ray may run a cancel ahead of the call that
        # adds the request): the add then refuses them. Step thread; expire after TOMBSTONE_TTL_S.
        self._tombstones: collections.OrderedDict[str, float] = collections.OrderedDict()
        # What cancels did here (step thread): how many ended a request, and the latest ones' records.
        self.cancelled = 0
        self._cancels: collections.deque[CancelRecord] = collections.deque(maxlen=CANCELS_KEPT)

    async def cancel(self, request_id: str) -> bool:
        """End a request here wherever it stands and free its KV (False: this worker does not have it)."""
        try:
            return await asyncio.wrap_future(self.loop.call(lambda: self._cancel_or_remember(request_id)))
        except StepLoopStopped:  # shutting down: nothing left to free
            return False

    async def recent_cancels(self) -> list[CancelRecord]:
        """The last CANCELS_KEPT cancels that ended a request here, oldest first: a cancel's arrival, checkable."""
        return await asyncio.wrap_future(self.loop.call(lambda: list(self._cancels)))

    def _cancel_soon(self, request_id: str) -> None:
        """cancel() without waiting for the step thread to have done it."""
        self.loop.call(lambda: self._cancel_or_remember(request_id))

    def _router_gone(self, router: str) -> None:
        """A router's link ended (it died): cancel what it placed here; its clients retry elsewhere."""
        prefix = f"{router}/"

        def cancel_its_requests() -> None:
            mine = [rid for rid in self.core.scheduler.requests if rid.startswith(prefix)]
            for rid in mine:
                self._cancel_soon(rid)
            log.warning("%s: router %s is gone; %d of its requests cancelled here", self.worker_id, router, len(mine))

        self.loop.call(cancel_its_requests)

    # -- step thread ------------------------------------------------------------------------------
    def _cancel(self, request_id: str) -> bool:
        return self.core.cancel(request_id)

    def _cancel_or_remember(self, request_id: str) -> bool:
        req = self.core.scheduler.requests.get(request_id)
        # As it stands before the cancel ends it (a request whose push is under way may have left already).
        record = CancelRecord(request_id, self.core.steps, req.num_output_tokens if req else 0,
                              req.status.value if req else "pushing")
        if self._cancel(request_id):
            self.cancelled += 1
            self._cancels.append(record)
            return True
        now = time.monotonic()
        while self._tombstones and now - next(iter(self._tombstones.values())) > TOMBSTONE_TTL_S:
            self._tombstones.popitem(last=False)
        self._tombstones[request_id] = now
        return False

    def _cancelled_already(self, request_id: str) -> bool:
        """On the step thread, as a request is added: whether its cancel came first (it must not run)."""
        return self._tombstones.pop(request_id, None) is not None
