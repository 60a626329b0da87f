"""The worker pools on Ray: spawning, readiness, the heartbeat, losing a worker and replacing it.

A worker that dies is noticed at once (its calls and its stream raise); one that hangs is noticed when
the heartbeat's stats call times out, and is killed. Either way it leaves its pool, the request flow
(router.cluster) is told so that its requests are tried again elsewhere, and a replacement (a new
incarnation, under a new id) joins the pool once it is ready. Nothing here knows about requests
beyond the worker-side ids routed to each worker.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from decode_worker.actor import DecodeActor
from pdserve.colocated import ColocatedActor
from pdserve.config import ClusterConfig, PoolConfig
from pdserve.loader import ModelInfo
from pdserve.messages import StepOutput, WorkerStats
from prefill_worker.actor import PrefillActor
from router.placement import PrefixIndex

log = logging.getLogger(__name__)


def init_local_ray(num_cpus: int | None = None, object_store_bytes: int = 128 << 20) -> None:
    """A single-machine Ray cluster on loopback, with a small object store (KV never goes through it)."""
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=object_store_bytes, log_to_driver=False)


# A replacement that fails to start is tried again after 1 s, then twice as long each time, up to 30 s.
REPLACE_BACKOFF_S = (1.0, 30.0)


@dataclass
class Worker:
    worker_id: str
    handle: Any
    pool: str
    slot: int  # position in its pool; replacements take the same slot under a new id
    requests: set[str] = field(default_factory=set)  # worker-side ids routed here and not finished
    queued_tokens: int = 0  # prefill: prompt tokens sent and not yet ingested
    stats: WorkerStats | None = None
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(0))  # prefill workers only
    alive: bool = True


class Pools:
    """The pools of a cluster; on_output(worker, StepOutput) gets every streamed step output and
    on_lost(worker, why) every worker taken out of its pool (before its replacement is started)."""

    def __init__(self, config: ClusterConfig, on_output: Callable[[Worker, StepOutput], None],
                 on_lost: Callable[[Worker, str], None]):
        self.config = config
        self.info: ModelInfo | None = None
        self.by_name: dict[str, list[Worker]] = {"prefill": [], "decode": [], "colocated": []}
        self._on_output, self._on_lost = on_output, on_lost
        self._tasks: list[asyncio.Task] = []
        self._incarnations = itertools.count(1)
        self._pool_changed = asyncio.Event()
        self.restarts: collections.Counter[str] = collections.Counter()  # by pool, exported as a metric
        self.start_failures: collections.Counter[str] = collections.Counter()  # replacements that did not start
        self._closing = False

    @property
    def workers(self) -> list[Worker]:
        return [w for pool in self.by_name.values() for w in pool]

    async def start(self, info: ModelInfo) -> None:
        c = self.config
        self.info = info
        sizes = {name: pool.num_workers for name, pool in c.pools.items()}
        starting = [self._spawn(pool, slot, f"{pool}-{slot}") for pool, n in sizes.items() for slot in range(n)]
        await asyncio.gather(*(w.handle.ready.remote() for w in starting))
        for w in starting:
            self.by_name[w.pool].append(w)
        await self._poll_stats()
        for w in starting:
            self._watch(w)
        self._tasks.append(asyncio.create_task(self._heartbeat()))

    def _spawn(self, pool: str, slot: int, worker_id: str) -> Worker:
        c = self.config
        pc: PoolConfig = getattr(c, pool)
        cls, extra = {"prefill": (PrefillActor, dict(transfer_timeout_s=c.transfer_timeout_s, kv_checksum=c.kv_checksum)),
                      "decode": (DecodeActor, dict(transfer_timeout_s=c.transfer_timeout_s, bind_host=c.bind_host)),
                      "colocated": (ColocatedActor, {})}[pool]
        actor = ray.remote(cls).options(num_cpus=pc.num_cpus, num_gpus=pc.num_gpus, resources=pc.resources,
                                        max_restarts=0)
        engine = c.engine_for(pc)
        handle = actor.remote(worker_id, engine, torch_threads=pc.torch_threads, **extra)
        w = Worker(worker_id, handle, pool, slot)
        if pool == "prefill":
            w.prefix = PrefixIndex(engine.cache.resolve_num_blocks(self.info.config, engine.torch_dtype))
        return w

    def _watch(self, w: Worker) -> None:
        if w.pool in ("decode", "colocated"):
            self._tasks.append(asyncio.create_task(self._consume(w)))

    async def shutdown(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.handle.shutdown.remote() for w in self.workers), return_exceptions=True)
        for w in self.workers:
            ray.kill(w.handle)
        self.by_name = {p: [] for p in self.by_name}

    async def stats(self) -> list[WorkerStats]:
        """Fresh stats from every worker (one call each)."""
        return list(await asyncio.gather(*(w.handle.stats.remote() for w in self.workers)))

    def latest_stats(self) -> list[WorkerStats]:
        """The latest stats each worker reported (step outputs and the heartbeat); no call is made."""
        return [w.stats for w in self.workers if w.stats is not None]

    async def _poll_stats(self) -> None:
        """The heartbeat: every worker must answer within worker_timeout_s, or it is declared stuck."""
        workers = self.workers
        results = await asyncio.gather(
            *(asyncio.wait_for(w.handle.stats.remote(), self.config.worker_timeout_s) for w in workers),
            return_exceptions=True)
        for w, r in zip(workers, results):
            if isinstance(r, WorkerStats):
                w.stats = r
            elif isinstance(r, (asyncio.TimeoutError, ray.exceptions.RayError)):
                self.lose(w, "stuck: no heartbeat" if isinstance(r, asyncio.TimeoutError) else f"dead: {r}")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await self._poll_stats()

    def lose(self, w: Worker, why: str) -> None:
        """Take a dead or stuck worker out of its pool, fail its requests over, start its replacement."""
        if not w.alive or self._closing:
            return
        w.alive = False
        log.warning("worker %s lost (%s); replacing it", w.worker_id, why)
        self.by_name[w.pool].remove(w)
        ray.kill(w.handle, no_restart=True)  # a stuck actor must not come back and act on stale requests
        for other in self.workers:  # its peers drop their KV channels to it (and what waited on them)
            if other.pool != w.pool:
                other.handle.peer_lost.remote(w.worker_id)
        self._on_lost(w, why)
        self.restarts[w.pool] += 1
        self._tasks.append(asyncio.create_task(self._replace(w)))

    async def _replace(self, lost: Worker) -> None:
        backoff = REPLACE_BACKOFF_S[0]
        while not self._closing:
            w = self._spawn(lost.pool, lost.slot, f"{lost.pool}-{lost.slot}.{next(self._incarnations)}")
            try:
                await asyncio.wait_for(w.handle.ready.remote(), self.config.worker_start_timeout_s)
            except Exception as e:  # noqa: BLE001 - try again with a fresh actor, after a while
                log.error("replacement %s failed to start (next try in %.0f s): %s", w.worker_id, backoff, e)
                ray.kill(w.handle)
                self.start_failures[lost.pool] += 1
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, REPLACE_BACKOFF_S[1])
                continue
            self.by_name[w.pool].append(w)  # routable only now that it is ready
            self._watch(w)
            self._pool_changed.set()
            self._pool_changed = asyncio.Event()
            log.info("worker %s replaces %s", w.worker_id, lost.worker_id)
            return

    async def alive(self, pool: str) -> list[Worker]:
        """The pool's live workers, waiting (bounded) for a replacement if none is left ([] after that)."""
        deadline = asyncio.get_running_loop().time() + self.config.pool_wait_timeout_s
        while not self.by_name[pool]:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return []
            try:
                await asyncio.wait_for(self._pool_changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return self.by_name[pool]

    async def _consume(self, w: Worker) -> None:
        """Hand one worker's step outputs to the request flow, in order."""
        try:
            async for ref in w.handle.stream.remote():
                out: StepOutput = await ref
                if out.stats is not None:
                    w.stats = out.stats
                self._on_output(w, out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the worker is gone: no request of its may hang
            self.lose(w, f"stream ended: {type(e).__name__}")
