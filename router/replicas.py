"""This router among several serving one cluster (router replicas, router.registry): who owns the pools.

Several router processes (`pdserve serve --router-name NAME --ray-address ...`) serve one Ray cluster. One
owns the pools (spawns, replaces, scales and drains workers) under a lease it renews in the registry; the
others link to the workers it lists and place on them, and claim the lease when it lapses. Pools asks this
one thing, `owner`, before it acts on a worker, and calls `publish` when its ready workers change; an only
router has no Replicas (it always owns its pools).
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Any

import ray

from router.registry import LEASE_S, REGISTRY_NAME, Listed, Registry

if TYPE_CHECKING:
    from router.workers import Worker

log = logging.getLogger(__name__)

# How often a takeover checks for the adoptions an earlier look began.
ADOPT_POLL_S = 0.1


class Replicas:
    """This router (`name`) among the cluster's routers: whether it owns the pools, the owner's epoch (worker
    ids carry it), the workers it lost (never adopted again)."""

    def __init__(self, pools: Any, name: str):
        """pools: the router.pools.Pools this router holds (not imported here: it imports this module)."""
        self.pools = pools
        self.name = name
        self.owner = False
        self.epoch = 0
        self.gone: set[str] = set()  # workers this router lost (ids are never reused): not adopted again
        self._registry: Any = None
        self._adopting: set[str] = set()  # listed workers this router is linking to

    async def release(self) -> None:
        """This router leaves (shutdown): if it owns the pools, the next claim takes the lease at once."""
        if self.owner:
            await asyncio.gather(self._registry.release.remote(self.name), return_exceptions=True)

    async def join(self) -> None:
        """Start as one of several routers: own the pools if the lease is free, else follow its owner."""
        if any(self.pools.config.engine_for(pc).tensor_parallel_size > 1 for pc in self.pools.config.pools.values()):
            raise ValueError("router replicas (router_name) do not serve tensor-parallel workers yet")
        self._registry = ray.remote(Registry).options(
            name=REGISTRY_NAME, lifetime="detached", get_if_exists=True, num_cpus=0, max_restarts=-1,
            max_task_retries=-1).remote()
        epoch = await self._registry.claim.remote(self.name)
        _, owner, _, listed = await self._registry.view.remote()
        if epoch is not None:
            await self._take_over(epoch, listed, first=True)
        else:
            log.info("router %s follows the pools' owner %s (%d workers listed)", self.name, owner, len(listed))
            await asyncio.gather(*(self._adopt(x) for x in listed))
        self.pools.run_task(self._lease())
        self.pools.run_task(self.pools.heartbeat())

    async def _lease(self) -> None:
        """The owner renews its lease; the others follow the registry and claim the lease when it lapses."""
        while True:
            await asyncio.sleep(LEASE_S / 3 if self.owner else self.pools.config.stats_interval_s)
            try:
                if self.owner:
                    epoch = await self._registry.claim.remote(self.name)
                    if epoch is not None:
                        if epoch != self.epoch:  # the registry was restarted (its state lost): list again
                            self.epoch = epoch
                            self.publish()
                        continue
                    log.error("router %s lost the pools' lease: another router owns them now", self.name)
                    self.owner = False
                version, owner, _, listed = await self._registry.view.remote()
                if owner is None or owner == self.name:
                    epoch = await self._registry.claim.remote(self.name)
                    if epoch is not None:
                        await self._take_over(epoch, listed)
                        continue
                if version:  # 0: a registry restarted, nothing published again yet
                    self._follow(listed)
            except ray.exceptions.RayError as e:  # the registry restarts (max_restarts): try again
                log.warning("router %s: the registry did not answer: %s", self.name, e)

    def _follow(self, listed: tuple[Listed, ...]) -> None:
        """Link to the workers the owner lists; stop placing on those it no longer lists (drained or lost)."""
        names = {x.worker_id for x in listed}
        known = {w.worker_id for w in self.pools.workers}
        for x in listed:
            if x.worker_id not in known | self.gone | self._adopting:
                self.pools.run_task(self._adopt(x))
        for w in [w for w in self.pools.draining if w.worker_id in names and w.alive]:  # listed again
            self.pools.draining.remove(w)
            w.state = "ready"
            self.pools.by_name[w.pool].append(w)
            self.pools.notify()
        for pool in self.pools.by_name.values():
            for w in [w for w in pool if w.worker_id not in names]:
                pool.remove(w)  # it leaves once the owner shuts it down (its link ends)
                w.state = "draining"
                self.pools.draining.append(w)
                self.pools.notify()

    async def _adopt(self, x: Listed) -> Worker | None:
        """Link to a worker another router started, and place on it."""
        self._adopting.add(x.worker_id)
        try:
            handle = await asyncio.to_thread(ray.get_actor, x.actor_name)
            w = self.pools.make_worker(x.worker_id, handle, x.pool, x.slot)
            w.stats = await asyncio.wait_for(handle.stats.remote(), self.pools.config.worker_timeout_s)
            await self.pools.connect(w)
        except Exception as e:  # noqa: BLE001 - dead or not reachable: tried again while it is listed
            log.warning("router %s could not link to worker %s: %s", self.name, x.worker_id, e)
            return None
        finally:
            self._adopting.discard(x.worker_id)
        w.state = "ready"
        self.pools.by_name[w.pool].append(w)
        self.pools.watch(w)
        self.pools.notify()
        return w  # not published: a follower never does, and an owner taking over does once it has adopted all

    async def _take_over(self, epoch: int, listed: tuple[Listed, ...], first: bool = False) -> None:
        """Become the pools' owner: adopt the listed workers, end the workers nobody lists (an owner died
        while starting them), and bring each pool back to the size its last owner published (the
        configured sizes when nothing was ever published)."""
        self.epoch, self.owner = epoch, True
        log.warning("router %s owns the pools (epoch %d; %d workers listed)", self.name, epoch, len(listed))
        known = {w.worker_id for w in self.pools.workers}
        await asyncio.gather(*(self._adopt(x) for x in listed
                               if x.worker_id not in known | self.gone | self._adopting))
        while self._adopting:  # adoptions an earlier look began (each bounded): their workers count below
            await asyncio.sleep(ADOPT_POLL_S)
        mine = {actor_name(w.worker_id) for w in self.pools.workers + [w for ws in self.pools.starting.values() for w in ws]}
        for name in await asyncio.to_thread(_named_workers):
            if name not in mine:
                log.warning("router %s ends worker %s: started by an owner that died, never listed", self.name, name)
                await asyncio.to_thread(_kill_named, name)
        targets = collections.Counter(x.pool for x in listed) if listed else \
            {pool: pc.num_workers for pool, pc in self.pools.config.pools.items()}
        started = [t for pool, n in targets.items()
                   for t in self.pools.grow(pool, max(n - self.pools.size(pool), 0), "start" if first else "takeover")]
        self.publish()
        if first and started:
            await asyncio.gather(*started)
            if any(not self.pools.by_name[pool] for pool in targets):
                raise RuntimeError("a pool has no worker ready: see the workers' errors above")

    def publish(self) -> None:
        """The owner lists its ready workers in the registry (the other routers place on them)."""
        if self._registry is None or not self.owner:
            return
        listed = tuple(Listed(w.worker_id, w.pool, w.slot, actor_name(w.worker_id))
                       for ws in self.pools.by_name.values() for w in ws)
        self.pools.run_task(self._published(self._registry.publish.remote(self.epoch, listed)))

    async def _published(self, ref: Any) -> None:
        try:
            if not await ref and self.owner:
                log.error("router %s: its list of workers was refused (another router owns the pools)", self.name)
                self.owner = False
        except ray.exceptions.RayError as e:
            log.warning("router %s: the registry did not take its list of workers: %s", self.name, e)


WORKER_NAME_PREFIX = "pdserve-worker-"


def actor_name(worker_id: str) -> str:
    return WORKER_NAME_PREFIX + worker_id


def _named_workers() -> list[str]:
    """The live named worker actors of the cluster's namespace (router replicas)."""
    return [n for n in ray.util.list_named_actors() if isinstance(n, str) and n.startswith(WORKER_NAME_PREFIX)]


def _kill_named(name: str) -> None:
    try:
        ray.kill(ray.get_actor(name), no_restart=True)
    except ValueError:  # gone meanwhile
        pass
