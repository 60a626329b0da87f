"""pdserve.processes: children forked from a server that has imported torch, each with its parent's environment as
it is when the child starts. Real processes; this module imports no torch, so a child that finds torch imported
before its target runs got it from the server."""
from __future__ import annotations

import os
import sys

from pdserve import processes

WAIT_S = 60.0
VAR = "PDSERVE_TEST_PROCESSES"


def _report(results) -> None:
    results.put((os.getppid(), "torch" in sys.modules, "torch.distributed" in sys.modules, os.environ.get(VAR)))


def _start(ctx, results):
    p = ctx.Process(target=_report, args=(results,), daemon=True)
    p.start()
    got = results.get(timeout=WAIT_S)
    p.join(WAIT_S)
    assert p.exitcode == 0
    return got


def test_children_fork_from_one_server_with_torch_and_the_environment_at_their_start(monkeypatch):
    ctx = processes.context()
    results = ctx.Queue()
    monkeypatch.setenv(VAR, "first")
    server, torch_first, dist_first, env_first = _start(ctx, results)
    monkeypatch.setenv(VAR, "second")  # after the server started: a server's environment would keep "first"
    server_again, torch_second, _, env_second = _start(ctx, results)
    monkeypatch.delenv(VAR)
    _, _, _, env_third = _start(ctx, results)

    assert server == server_again != os.getpid()  # both forked by the one server, not by this process
    assert torch_first and dist_first and torch_second  # imported by the server before the target ran
    assert (env_first, env_second, env_third) == ("first", "second", None)
    assert processes.context() is ctx  # one context, one preload list
