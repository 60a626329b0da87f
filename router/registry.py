"""Router replicas: which router owns the pools, and the workers it has made ready.

Several router processes (`pdserve serve --router-name NAME --ray-address ...`, one per pod behind the
Service) can serve one cluster. Each runs the front doors and the request flow, and each has its own
link to every worker (pdserve.serving.link). Exactly one, the pool owner, spawns, replaces, scales and
drains workers; the others follow what it publishes here. Requests are placed by each router on the
workers' published load (their stats) plus its own requests.

The registry is one small detached Ray actor, named in the cluster's namespace, holding:
- the owner's lease: a router claims it and renews it every LEASE_S / 3; when the owner stops renewing
  (it died, or hangs) the lease expires and the next router that claims it becomes owner, with a new
  epoch. An owner whose renewal is refused (another has the lease) stops acting as owner at once.
- the workers the owner has made ready (id, pool, slot, actor name), published with the epoch of the
  owner that made them: a publication from an older epoch is refused, so a deposed owner that wakes up
  cannot undo what the new one did.
Workers in this mode are detached named actors, so that they outlive the router that started them and
the next owner adopts them by name.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

REGISTRY_NAME = "pdserve-registry"
LEASE_S = 6.0  # an owner that has not renewed for this long has lost its lease


@dataclass(frozen=True)
class Listed:
    """A ready worker as the owner publishes it."""

    worker_id: str
    pool: str
    slot: int
    actor_name: str  # its detached actor's name in the cluster's namespace


class Registry:
    """Wrapped with ray.remote (detached, named REGISTRY_NAME) by router.pools."""

    def __init__(self) -> None:
        self.owner: str | None = None
        self.epoch = 0
        self.expires = 0.0
        self.version = 0  # bumped by every accepted publication
        self.workers: tuple[Listed, ...] = ()

    def claim(self, router: str, lease_s: float = LEASE_S) -> int | None:
        """Take or renew the owner's lease; the owner's epoch if `router` holds it now, else None."""
        now = time.monotonic()
        if self.owner != router and self.owner is not None and now < self.expires:
            return None
        if self.owner != router:
            self.owner = router
            self.epoch += 1
        self.expires = now + lease_s
        return self.epoch

    def release(self, router: str) -> None:
        """The owner leaves (shutdown): the next claim takes the lease at once."""
        if self.owner == router:
            self.owner = None

    def publish(self, epoch: int, workers: tuple[Listed, ...]) -> bool:
        """The owner's ready workers; refused (False) from an owner whose epoch has passed."""
        if epoch != self.epoch:
            return False
        self.workers = tuple(workers)
        self.version += 1
        return True

    def view(self) -> tuple[int, str | None, int, tuple[Listed, ...]]:
        """(version, owner, epoch, workers)."""
        return self.version, self.owner if time.monotonic() < self.expires else None, self.epoch, self.workers
