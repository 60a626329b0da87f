"""The router's calls on a worker's link, defined once: their names, arguments and results.

A request reaches its workers as calls on their links (pdserve.serving.link): the router makes them through
WorkerCalls (each a typed method), a worker answers them with the handlers its actor gives for the same
`Call` names (WorkerActor.handlers and its subclasses'), and the link carries `Call` values. A reader
following a request goes from `WorkerCalls.prefill` to the handler named in `Call.PREFILL`'s line below.

    call       args                                  result (the router's future)     answered by
    CANCEL     request_id                            none: sent, not awaited           every worker: Cancels._cancel_soon
    STATS      -                                     WorkerStats (the heartbeat)       every worker, from its step thread
    PREFILL    PrefillTask                           PrefillResult (the first tokens)  PrefillActor._submit
    ADMITTED   request_id                            True once the prompt has all of   PrefillActor._admitted
                                                     its KV blocks there; False if it
                                                     ended first
    RESERVE    DecodeTask, prefill worker's handle   None, once queued                 DecodeActor._reserve
               (None when this decode worker has it already)
    GENERATE   PrefillTask                           None, once queued                 ColocatedActor._generate

A handler returns its value or a concurrent.futures.Future of it; a ValueError it raises reaches the
router as a ValueError (the request was refused), anything else as CallFailed. A call's name travels as the
plain string (`Call.X.value`: a pickled enum member would carry its class's path in every frame).
"""
from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING, Any

from pdserve.serving.messages import DecodeTask, PrefillResult, PrefillTask, WorkerStats

if TYPE_CHECKING:
    from pdserve.serving.link import Link


class Call(str, enum.Enum):
    """A call's name on the wire (the table above says what each takes and returns)."""

    CANCEL = "cancel"
    STATS = "stats"
    PREFILL = "prefill"
    ADMITTED = "admitted"
    RESERVE = "reserve"
    GENERATE = "generate"


class WorkerCalls:
    """The router's side: each call on one worker's link as a typed method."""

    def __init__(self, link: Link):
        self.link = link

    def cancel(self, request_id: str) -> None:
        """End the request on this worker wherever it stands and free its KV (nothing if the link has ended)."""
        self.link.send(Call.CANCEL.value, request_id)

    def stats(self) -> asyncio.Future[WorkerStats]:
        return self.link.call(Call.STATS.value)

    def prefill(self, task: PrefillTask) -> asyncio.Future[PrefillResult]:
        """A prefill worker computes the prompt; the result carries the first token (or the n first tokens)."""
        return self.link.call(Call.PREFILL.value, task)

    def admitted(self, request_id: str) -> asyncio.Future[bool]:
        """Resolves once a prefill worker has taken the prompt into its batch with blocks for all of it (its KV is
        then computed without waiting for anything): True; False if the prompt ended before that. The router
        reserves decode room only then (router.attempt)."""
        return self.link.call(Call.ADMITTED.value, request_id)

    def reserve(self, task: DecodeTask, prefill_handle: Any = None) -> asyncio.Future[None]:
        """A decode worker reserves room for the KV that task.prefill_worker computes, then decodes; the
        handle (the prefill worker's Ray actor) the first time this decode worker hears of that worker."""
        return self.link.call(Call.RESERVE.value, task, prefill_handle)

    def generate(self, task: PrefillTask) -> asyncio.Future[None]:
        """A colocated worker serves the whole request (its tokens come with the step outputs); the future
        resolves once it is queued."""
        return self.link.call(Call.GENERATE.value, task)
