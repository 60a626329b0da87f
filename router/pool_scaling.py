"""Growing a pool and draining workers out of it: the scaling half of the pools (router.pools).

PoolScaling is a base of Pools, which owns the state named below (set in Pools.__init__): the pools by
state, the scale events, and the tasks it keeps. A worker drained is taken out of placement at once and
leaves once its requests have finished; nothing is retried because of a drain. Only the pools' owner
scales (a router replica that does not own them leaves it to the one that does).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from typing import TYPE_CHECKING

from router.workers import Worker, kill

if TYPE_CHECKING:
    from pdserve.config import ClusterConfig
    from router.kv_index import KVIndex

log = logging.getLogger(__name__)

# How often a draining worker is checked for its last request.
DRAIN_POLL_S = 0.1


class PoolScaling:
    """grow, drain and drain_worker of Pools."""

    # The pools' state this half reads and writes (Pools.__init__ sets it), and `owner` (Pools.owner).
    config: ClusterConfig
    by_name: dict[str, list[Worker]]
    starting: dict[str, list[Worker]]
    draining: list[Worker]
    scale_events: collections.Counter[tuple[str, str, str]]
    start_seconds: dict[str, list[float]]
    router: str | None
    kv_index: KVIndex

    def grow(self, pool: str, n: int, reason: str) -> list[asyncio.Task]:
        """Start n more workers in the pool; each becomes routable once ready. The tasks that bring them up."""
        if not self.owner:
            return []
        tasks = []
        for _ in range(n):
            used = {w.slot for w in self.by_name[pool] + self.starting[pool] + self.draining if w.pool == pool}
            slot = next(i for i in itertools.count() if i not in used)
            w = self._spawn(pool, slot, self._new_id(pool, slot))
            self.starting[pool].append(w)  # now, so that the next one takes another slot
            self.scale_events[(pool, "up", reason)] += 1
            log.info("scaling %s up (%s): starting %s", pool, reason, w.worker_id)
            tasks.append(self.run_task(self._started(w)))
        return tasks

    async def _started(self, w: Worker) -> None:
        if await self._bring_up(w):
            log.info("worker %s ready in %.1f s", w.worker_id, self.start_seconds[w.pool][-1])

    def drain(self, pool: str, n: int, reason: str) -> None:
        """Take n ready workers out of placement (those with the fewest requests) and let each leave
        once its requests have finished. The pool keeps at least one ready worker."""
        if not self.owner:
            return
        ready = self.by_name[pool]
        for w in sorted(ready, key=lambda x: (len(x.requests), x.queued_tokens, -x.slot))[:min(n, len(ready) - 1)]:
            self.drain_worker(w, reason)

    def drain_worker(self, w: Worker, reason: str) -> None:
        """Take one ready worker out of placement; it leaves once its requests have finished."""
        assert w.state == "ready" and len(self.by_name[w.pool]) > 1, "a pool keeps one ready worker"
        self.by_name[w.pool].remove(w)
        w.state = "draining"
        self.draining.append(w)
        self.scale_events[(w.pool, "down", reason)] += 1
        log.info("scaling %s down (%s): draining %s (%d requests on it)", w.pool, reason, w.worker_id,
                 len(w.requests))
        self.run_task(self._leave(w))
        self.publish()

    async def _leave(self, w: Worker) -> None:
        t0 = time.monotonic()
        while w.requests and w.alive:  # the request flow discards each as it finishes
            await asyncio.sleep(DRAIN_POLL_S)
        if self.router is not None:
            # The other routers' requests too: they stop placing here once they see it unlisted (their next
            # look at the registry), and its heartbeat's stats count every router's requests.
            await asyncio.sleep(2 * self.config.stats_interval_s)
            while w.alive and (w.requests or w.stats is None or w.stats.running + w.stats.waiting > 0):
                await asyncio.sleep(DRAIN_POLL_S)
        if not w.alive:  # lost while draining: its requests were failed over like any loss
            return
        w.alive = False  # leaving: no longer counted among the workers, its outputs' end is not a loss
        self.kv_index.forget(w.worker_id)
        self._tell_peers(w)
        try:
            await asyncio.wait_for(w.handle.shutdown.remote(), self.config.worker_timeout_s)
        except Exception as e:  # noqa: BLE001 - it is leaving either way
            log.warning("worker %s did not shut down cleanly: %s", w.worker_id, e)
        kill(w)
        self.draining.remove(w)  # it has left: its actor is gone
        log.info("worker %s drained in %.1f s and left the %s pool", w.worker_id, time.monotonic() - t0, w.pool)
