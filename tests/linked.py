"""Worker actors driven by hand the way the router drives them: each linked to a router's end of the links
(pdserve.serving.link) on the test's asyncio loop (conftest's `aloop`), as router.pools links them, the
router's calls made through pdserve.serving.calls.WorkerCalls, the step outputs kept."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.serving.calls import WorkerCalls
from pdserve.serving.link import Link, LinkServer
from pdserve.serving.messages import StepOutput


@dataclass
class Linked:
    """One worker's link to the router's end: its calls, and the outputs it has sent so far."""

    aloop: Any  # conftest.LoopThread
    link: Link
    outputs: list[StepOutput] = field(default_factory=list)

    def call(self, make: Callable[[WorkerCalls], Any], timeout: float = 30.0) -> Any:
        """make(the worker's WorkerCalls) on the test's loop (a link is the loop's), its awaitable awaited: the
        call's result, or what it raised (ValueError: refused; CallFailed; LinkClosed)."""

        async def go():
            made = make(WorkerCalls(self.link))
            return await asyncio.wait_for(made, timeout) if inspect.isawaitable(made) else made

        return self.aloop.run(go())


class RouterEnd:
    """The router's end of the links (a LinkServer on 127.0.0.1), as router `router` ("": the only one)."""

    def __init__(self, aloop, router: str = ""):
        self.aloop = aloop
        self.router = router
        self.server = LinkServer("127.0.0.1")
        aloop.run(self.server.start())

    def link(self, handle, worker_id: str, timeout: float = 30.0) -> Linked:
        """Link the worker actor `handle` here (its `link_to`, as router.pools: Pools._connect does); once open."""
        outputs: list[StepOutput] = []

        async def connect() -> Link:
            link = self.server.expect(worker_id, outputs.append)
            await handle.link_to.remote(self.server.host, self.server.port, self.server.token, self.router)
            await link.wait_open(timeout)
            return link

        return Linked(self.aloop, self.aloop.run(connect()), outputs)

    def close(self) -> None:
        """The router's end goes (as when the router dies): every link to it ends."""
        self.aloop.run(self.server.close())
