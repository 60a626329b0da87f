"""A worker's links to its routers, and which one each output goes on.

Outputs go out on the links to the routers (pdserve.serving.link), one queue each, by the router whose tag
begins a request's id ("tag/..."); with one router, everything goes on its link. `RouterLinks` is an object
the worker actor holds, not a mixin: nothing here is a Ray call (the actor's `link_to` hands it the
worker's handlers and what to do when a router is gone), and its state is its own.
"""
from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable
from typing import Any

from pdserve.serving.link import WorkerLink
from pdserve.serving.messages import Failure, StepOutput, TokenEvent, WorkerStats


class RouterLinks:
    """One worker's links, by router tag ("" when one router serves the cluster)."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._first: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()  # the first router's
        self._queues: dict[str, queue.SimpleQueue[StepOutput]] = {}  # router tag -> its link's queue
        self._links: dict[str, WorkerLink] = {}  # router tag -> its link

    async def connect(self, router: str, host: str, port: int, token: bytes, handlers: dict[str, Callable[..., Any]],
                      on_end: Callable[[], None] | None) -> None:
        """Link to router `router` at host:port; returns once connected (WorkerLink: on_end when it ends)."""
        old = self._links.get(router)
        if old is not None and old.alive:
            raise RuntimeError(f"{self.worker_id} is already linked to router {router!r}")
        # A queue of its own (a router that comes back under its name gets a new one: the old one ended
        # with its link); the first link takes what was published before it.
        q = queue.SimpleQueue() if self._queues else self._first
        self._queues[router] = q
        self._links[router] = await asyncio.to_thread(WorkerLink, q, host, port, token, self.worker_id, handlers,
                                                      on_end)

    def queue_of(self, request_id: str) -> queue.SimpleQueue[StepOutput]:
        """The queue of the link to the router that placed the request."""
        if len(self._queues) <= 1:
            return next(iter(self._queues.values()), self._first)
        return self._queues.get(request_id.split("/", 1)[0], self._first)

    def put(self, events: tuple[TokenEvent, ...], failed: tuple[Failure, ...], stats: WorkerStats) -> None:
        """One StepOutput per router whose requests have events or failures, each with the stats."""
        if len(self._queues) <= 1:
            self.queue_of("").put(StepOutput(self.worker_id, events, failed, stats))
            return
        by_queue: dict[int, tuple[queue.SimpleQueue, list, list]] = {}
        for items, i in ((events, 1), (failed, 2)):
            for item in items:
                q = self.queue_of(item.request_id)
                by_queue.setdefault(id(q), (q, [], []))[i].append(item)
        for q, ev, fa in by_queue.values():
            q.put(StepOutput(self.worker_id, tuple(ev), tuple(fa), stats))

    def broadcast(self, out: StepOutput) -> None:
        """An output every router needs (the prefix cache's changes: each places by them)."""
        for q in self._queues.values() or (self._first,):
            q.put(out)

    async def close(self) -> None:
        """Each link sends what waits for its router, then ends."""
        for link in list(self._links.values()):
            await asyncio.to_thread(link.close)
