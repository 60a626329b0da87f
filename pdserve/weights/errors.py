"""The weight groups' error, apart: pdserve's own group (pdserve.weights.group) and a client's group
(pdserve.weights.compat) both raise it, and each of those modules uses the other; and the check both make before
each use of their process group."""
from __future__ import annotations

from typing import TypeVar

G = TypeVar("G")


class WeightGroupError(RuntimeError):
    """The group failed: a rank died, the trainer vanished, a timeout."""


def live(pg: G | None, broken: bool, name: str) -> G:
    """A group's process group while the group is open; a WeightGroupError saying it is broken (a failed
    broadcast closed it) or closed otherwise."""
    if pg is None:
        raise WeightGroupError(f"group {name!r} is {'broken' if broken else 'closed'}; join a new group")
    return pg
