"""The requests in flight on this router, each with its inbox: the workers' step outputs fanned out to them.

A request's attempts run under worker-side ids of their own (`<id>#<n>`; a group's samples `<id>#<n>~<i>`
where a worker forks them); each id maps to its request until the attempt ends, so an abandoned attempt's
late events go nowhere. A worker that leaves its pool fails every attempt it holds over to its request's
inbox, where the attempt reads it after the tokens that came before it.
"""
from __future__ import annotations

import asyncio
import collections

from pdserve.engine.request import group_of
from pdserve.serving.messages import Failure, FailureReason, StepOutput, TokenEvent


class Aborted(Exception):
    """The request was aborted (Streams.abort_all): it ends with FinishReason.ABORT and its tokens so far."""


class Inbox:
    """A request's events from its workers' streams, and the one task that streams the request.

    The task sleeps until `min_tokens` tokens have come (the stream interval), or the last one, or a
    failure: one wake-up and one message for all of them, not one per token."""

    __slots__ = ("items", "tokens", "min_tokens", "waiter", "aborted")

    def __init__(self) -> None:
        self.items: collections.deque[TokenEvent | Failure] = collections.deque()
        self.tokens = 0  # token events in items that end nothing
        self.min_tokens = 1
        self.waiter: asyncio.Future[None] | None = None
        self.aborted = False  # the request ends at its next wake-up, with its tokens so far

    def abort(self) -> None:
        self.aborted = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def put(self, item: TokenEvent | Failure) -> None:
        self.items.append(item)
        if isinstance(item, TokenEvent) and item.finish_reason is None:
            self.tokens += 1
            if self.tokens < self.min_tokens:
                return
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def take(self) -> TokenEvent | Failure:
        item = self.items.popleft()
        if isinstance(item, TokenEvent) and item.finish_reason is None:
            self.tokens -= 1
        return item

    async def wait(self, min_tokens: int) -> None:
        """Until min_tokens tokens, a last token or a failure are in (at once if they are); raises Aborted
        once the request is aborted."""
        self.min_tokens = min_tokens
        while not self.items or (self.tokens == len(self.items) and self.tokens < min_tokens):
            if self.aborted:
                raise Aborted()
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def clear(self) -> None:
        self.items.clear()
        self.tokens = 0


class Streams:
    """Inboxes by request id, the request of each live attempt's worker-side id, and `idle`, set while no
    request is in flight (router.weights waits on it)."""

    def __init__(self) -> None:
        self._inboxes: dict[str, Inbox] = {}
        self._owner: dict[str, str] = {}  # worker-side id of a live attempt -> its request
        self.idle = asyncio.Event()
        self.idle.set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._inboxes

    def __len__(self) -> int:
        return len(self._inboxes)

    @property
    def empty(self) -> bool:
        """No request in flight and no attempt's id left mapped (nothing leaked)."""
        return not self._inboxes and not self._owner

    def open(self, request_id: str) -> Inbox:
        inbox = self._inboxes[request_id] = Inbox()
        self.idle.clear()
        return inbox

    def close(self, request_id: str) -> None:
        del self._inboxes[request_id]
        if not self._inboxes:
            self.idle.set()

    def inbox(self, request_id: str) -> Inbox:
        return self._inboxes[request_id]

    def attempt(self, wrid: str, request_id: str) -> None:
        """From now until `ended(wrid)`, events of worker-side id wrid go to the request's inbox."""
        self._owner[wrid] = request_id

    def ended(self, wrid: str) -> None:
        self._owner.pop(wrid, None)

    def deliver(self, out: StepOutput) -> None:
        """A worker's step output, fanned out to its requests' inboxes."""
        for item in (*out.events, *out.failed):
            owner = self._owner.get(item.request_id)
            if owner is None:  # a group's forked sample: "wrid~i"
                owner = self._owner.get(group_of(item.request_id)[0], "")
            inbox = self._inboxes.get(owner)
            if inbox is not None:
                inbox.put(item)

    def fail(self, wrids, reason: FailureReason, detail: str) -> None:
        """Attempts whose worker left its pool: each fails over (in its inbox, after what came before)."""
        for wrid in wrids:
            inbox = self._inboxes.get(self._owner.get(wrid, ""))
            if inbox is not None:
                inbox.put(Failure(wrid, reason, detail))

    def abort_all(self) -> int:
        """End every request in flight at its next wake-up, with FinishReason.ABORT and its tokens so far (its
        KV freed on its workers); how many there were."""
        for inbox in self._inboxes.values():
            inbox.abort()
        return len(self._inboxes)
