"""Child processes that compute with torch, forked from a server that has imported torch once.

A spawned child is a fresh interpreter: it imports torch (1.0-1.7 s of CPU on a 2-core machine) before it does
anything. `context()` is a multiprocessing context whose children are forked from multiprocessing's fork server
with torch and torch.distributed already imported: a child starts in ~0.01 s of CPU (docs/benchmarks.md, "torch
imported once for the child processes"). The server imports and nothing more: it never touches a GPU, starts no
thread pool and opens no process group, so a child picks its GPU and joins its groups as a spawned one would.

The server is one per parent process, started at the first child and kept until the parent exits: ~220 MB
resident (torch's import, 147 MB of it private), pages its children share until they write them (a child had
6 MB private where a spawned one had 145 MB). It holds the environment of that moment, so each child takes its
parent's environment as it is when the child starts (what a spawned child gets). Torch reads a few variables
when it is first imported (OMP_NUM_THREADS among them): those are the server's; a child that needs a thread
count sets it (torch.set_num_threads).
"""
from __future__ import annotations

import multiprocessing.context
import os

PRELOAD = ["torch", "torch.distributed"]  # imported once, by the server; a module it cannot import is skipped


class _Process(multiprocessing.context.ForkServerProcess):
    """A fork-server child that runs with its parent's environment at start()."""

    def start(self) -> None:
        self._parent_environ = dict(os.environ)  # pickled with the process object, read in the child
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._parent_environ)
        super().run()


class _Context(multiprocessing.context.ForkServerContext):
    Process = _Process


_CONTEXT = _Context()


def context() -> multiprocessing.context.BaseContext:
    """The context to start torch children from: ctx.Process, ctx.Queue, ctx.Event, ctx.Pipe as with any."""
    _CONTEXT.set_forkserver_preload(PRELOAD)  # effective until the server has started; the same list each call
    return _CONTEXT
