"""The weight groups' error, apart: pdserve's own group (pdserve.weights.group) and a client's group
(pdserve.weights.compat) both raise it, and each of those modules uses the other."""
from __future__ import annotations


class WeightGroupError(RuntimeError):
    """The group failed: a rank died, the trainer vanished, a timeout."""
