"""A worker's step thread: the one thread that owns a worker's state and runs its steps.

Actor methods (on Ray's asyncio loop or transfer threads) never touch the worker directly: they hand
it functions through `call`, which run on the step thread between two steps, in order. So the worker,
its block pool and its scheduler need no locks, and a step is never interleaved with a mutation.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class StepLoopStopped(RuntimeError):
    """A call reached a worker whose step loop has stopped (it is shutting down)."""


class StepLoop:
    def __init__(self, step: Callable[[], bool], name: str, after: Callable[[], None] | None = None):
        """step() runs one unit of work and says whether it did any; when it did none, the loop
        sleeps until a call arrives instead of spinning. after(), if given, runs on the step thread after
        each round of calls and step (a worker sends what they changed of its prefix cache)."""
        self._step = step
        self._after = after
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self.paused = False  # set and cleared by calls (pause / resume): no step runs while it is set
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the step thread before the next step; its result or exception lands in the future."""
        fut: Future[T] = Future()
        if self._stopped.is_set():
            fut.set_exception(StepLoopStopped("step loop is stopped"))
        else:
            self._calls.put((fn, fut))
        return fut

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._calls.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        busy = False
        while not self._stopped.is_set():
            try:
                item = self._calls.get(block=not busy)
                while item is not None:
                    self._apply(item)
                    item = self._calls.get_nowait()
            except queue.Empty:
                pass
            if self._stopped.is_set():
                break
            if self.paused:
                busy = False  # calls only, until one resumes it
            else:
                try:
                    busy = self._step()
                except Exception:  # the step function handles its own failures; this is the last resort
                    log.exception("step failed on %s", self._thread.name)
                    busy = False
            if self._after is not None:
                try:
                    self._after()
                except Exception:  # noqa: BLE001 - the loop goes on; what failed says so
                    log.exception("after-step hook failed on %s", self._thread.name)

    @staticmethod
    def _apply(item: tuple[Callable[[], Any], Future]) -> None:
        fn, fut = item
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who decides
            fut.set_exception(e)
