"""The worker pools on Ray: spawning, readiness, the heartbeat, losing a worker and replacing it,
growing a pool and draining a worker out of it.

A worker that dies is noticed at once (its link to the router, pdserve.serving.link, ends, and its
calls raise); one that hangs is noticed when the heartbeat's stats call times out,
and is killed. Either way it leaves its pool, the request flow
(router.cluster) is told so that its requests are tried again elsewhere, and a replacement (a new
incarnation, under a new id) joins the pool once it is ready. Nothing here knows about requests
beyond the worker-side ids routed to each worker.

A worker's life: starting (its actor loads the model, then connects its link; not routable), ready
(placement sees it), draining (placement no longer sees it; the requests it has finish there), then it
leaves: its peers drop their KV channels to it and its actor shuts down. Nothing is retried because of a drain.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from decode_worker.actor import DecodeActor, FastLaneActor
from pdserve.config import ClusterConfig, PoolConfig
from pdserve.model.loader import ModelInfo
from pdserve.parallel.layout import rank_config
from pdserve.serving.colocated import ColocatedActor
from pdserve.serving.messages import StepOutput, WorkerStats
from pdserve.serving.calls import WorkerCalls
from pdserve.serving.link import CallFailed, Link, LinkServer
from pdserve.serving.tp_ranks import TPPlacement
from prefill_worker.actor import PrefillActor
from router.placement import PrefixIndex
from router.registry import LEASE_S, REGISTRY_NAME, Listed, Registry

log = logging.getLogger(__name__)


def _quiet_token_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def init_local_ray(num_cpus: int | None = None, object_store_bytes: int = 128 << 20) -> None:
    """A single-machine Ray cluster on loopback, with a small object store (KV never goes through it).

    Token authentication stays as Ray makes it for a new local cluster (on, with a token of its own in
    ~/.ray, unless RAY_AUTH_MODE says otherwise); Ray's warning that it is on, at every start, is replaced
    by one line that says so."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_quiet_token_notice)
    t0 = time.monotonic()
    log.info("starting a local Ray instance on 127.0.0.1 (token authentication: %s)",
             os.environ.get("RAY_AUTH_MODE", "token, Ray's default"))
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=object_store_bytes, log_to_driver=False)
    log.info("Ray ready (%.1f s)", time.monotonic() - t0)


def demand(c: ClusterConfig) -> dict[str, float]:
    """The Ray resources the pools' workers ask for at their starting sizes (every rank of a TP worker)."""
    total: dict[str, float] = collections.Counter()
    for pc in c.pools.values():
        ranks = pc.num_workers * c.engine_for(pc).tensor_parallel_size
        for name, amount in (("CPU", pc.num_cpus), ("GPU", pc.num_gpus), *pc.resources.items()):
            total[name] += ranks * amount
    return {k: v for k, v in total.items() if v > 0}


def shortfall(asked: dict[str, float], cluster: dict[str, float]) -> str:
    """What of `asked` the cluster's resources cannot hold at once, in words ("" if it all fits)."""
    return ", ".join(f"{k}: {v:g} asked, {cluster.get(k, 0):g} in the cluster" for k, v in sorted(asked.items())
                     if v > cluster.get(k, 0) + 1e-9)


# A start still waiting says which workers it waits for, this often.
START_NOTICE_S = 30.0

# A replacement that fails to start is tried again after 1 s, then twice as long each time, up to 30 s.
REPLACE_BACKOFF_S = (1.0, 30.0)


@dataclass
class Worker:
    worker_id: str
    handle: Any
    pool: str
    slot: int  # position in its pool; replacements take the same slot under a new id
    requests: set[str] = field(default_factory=set)  # worker-side ids routed here and not finished
    flex: set[str] = field(default_factory=set)  # those of the flex tier (decode workers preempt them for others)
    queued_tokens: int = 0  # prefill: prompt tokens sent and not yet ingested
    stats: WorkerStats | None = None
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(0))  # prefill workers only
    alive: bool = True
    state: str = "starting"  # starting | ready | draining
    placement_group: Any = None  # a tensor-parallel worker's: its ranks' bundles, removed when it leaves
    # Decode workers: the prefill workers whose handles it was given (a handle is sent once: pickling
    # one is most of a reservation call's cost).
    prefill_handles: set[str] = field(default_factory=set)
    link: Link | None = None  # its connection to the router: per-request calls out, step outputs in (ready on)

    @property
    def calls(self) -> WorkerCalls:
        """The router's calls on this worker's link (pdserve.serving.calls)."""
        return WorkerCalls(self.link)


# Placement groups of workers that left, being removed (a call to Ray's GCS, off the event loop); the
# pools' shutdown waits this long for them, at most.
REMOVE_GROUPS_TIMEOUT_S = 5.0


def _kill(w: Worker) -> threading.Thread | None:
    """End a worker's actor for good, and a TP worker's other ranks with its placement group (removed
    on a thread of its own: it is a blocking call to Ray's GCS); the thread, if any."""
    ray.kill(w.handle, no_restart=True)
    group, w.placement_group = w.placement_group, None
    if group is None:
        return None

    def remove() -> None:
        try:
            remove_placement_group(group)
        except Exception as e:  # noqa: BLE001 - Ray is going away; its groups go with it
            log.warning("placement group of %s not removed: %s", w.worker_id, e)

    t = threading.Thread(target=remove, name=f"remove-group-{w.worker_id}", daemon=True)
    t.start()
    return t


# How often a draining worker is checked for its last request.
DRAIN_POLL_S = 0.1


class Pools:
    """The pools of a cluster; on_output(worker, StepOutput) gets every streamed step output and
    on_lost(worker, why) every worker taken out of its pool (before its replacement is started)."""

    def __init__(self, config: ClusterConfig, on_output: Callable[[Worker, StepOutput], None],
                 on_lost: Callable[[Worker, str], None]):
        self.config = config
        self.info: ModelInfo | None = None
        self.by_name: dict[str, list[Worker]] = {"prefill": [], "decode": [], "fast": [], "colocated": []}  # ready
        self.starting: dict[str, list[Worker]] = {p: [] for p in self.by_name}
        self.draining: list[Worker] = []
        self._on_output, self._on_lost = on_output, on_lost
        self._tasks: set[asyncio.Task] = set()  # running: each leaves the set when it ends
        self._incarnations = itertools.count(1)
        # Set (and replaced) whenever a worker joins or leaves a pool, or has room again for prompts
        # (router.cluster waits on it for both).
        self.changed = asyncio.Event()
        self.listeners: list[Callable[[], None]] = []  # called on every notify()
        self.restarts: collections.Counter[str] = collections.Counter()  # by pool, exported as a metric
        self.start_failures: collections.Counter[str] = collections.Counter()  # workers that did not start
        # Scaling: events by (pool, up|down, reason); seconds each started worker took to be ready, by pool.
        self.scale_events: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.start_seconds: dict[str, list[float]] = {p: [] for p in self.by_name}
        self._closing = False
        self._links: LinkServer | None = None  # every worker's link to the router (pdserve.serving.link)
        # Router replicas (router.registry): this router's name; whether it owns the pools (spawns, replaces,
        # scales and drains workers; the only router always does); the registry and the owner's epoch.
        self.router = config.router_name
        self.owner = self.router is None
        self._registry: Any = None
        self._epoch = 0
        self._adopting: set[str] = set()  # listed workers this router is linking to
        # Called with a worker that has started, before it is routable (router.weights: it brings the worker's
        # weights to the version the cluster serves); a failure fails the start.
        self.catch_up: Callable[[Worker], Awaitable[None]] | None = None
        self._gone: set[str] = set()  # workers this router lost (ids are never reused): not adopted again

    @property
    def workers(self) -> list[Worker]:
        """Every worker with a live actor: ready and draining (starting ones are not answering yet)."""
        return [w for pool in self.by_name.values() for w in pool] + [w for w in self.draining if w.alive]

    def size(self, pool: str) -> int:
        """The pool's size as scaling counts it: ready and starting workers."""
        return len(self.by_name[pool]) + len(self.starting[pool])

    def last_start_seconds(self) -> float | None:
        """How long the latest worker took to be ready (the cluster's first ones included)."""
        times = [t for ts in self.start_seconds.values() for t in ts[-1:]]
        return max(times) if times else None

    async def start(self, info: ModelInfo) -> None:
        c = self.config
        self.info = info
        for name, pool in c.pools.items():  # a TP size the model cannot take is an error now, not a failed start
            engine = c.engine_for(pool)
            try:
                rank_config(info.config, engine.tensor_parallel_size, engine.expert_parallel_size)
            except ValueError as e:
                raise ValueError(f"the {name} pool: {e}") from None
        sizes = {name: pool.num_workers for name, pool in c.pools.items()}
        t0 = time.monotonic()
        log.info("starting %s (each loads the model)", ", ".join(
            f"{n} {name} worker{'s' * (n != 1)} of TP {c.engine_for(c.pools[name]).tensor_parallel_size}"
            for name, n in sizes.items()))
        # Where the workers connect their links: --kv-bind-host if given, else this node's address as Ray
        # knows it (loopback on a local cluster, the pod's IP on Kubernetes).
        self._links = LinkServer(self.config.bind_host or ray.util.get_node_ip_address())
        await self._links.start()
        if self.router is not None:
            await self._join()
            return
        short = shortfall(demand(c), ray.cluster_resources())
        if short:
            log.warning("the pools ask Ray for more than this cluster has (%s): some workers wait until it grows "
                        "(--worker-cpus, --worker-gpus: a worker's share)", short)
        starting = [self._spawn(pool, slot, f"{pool}-{slot}") for pool, n in sizes.items() for slot in range(n)]
        waiting = {w.worker_id for w in starting}

        async def ready(w: Worker) -> None:
            await w.handle.ready.remote()
            await self._connect(w)
            waiting.discard(w.worker_id)
            self.start_seconds[w.pool].append(time.monotonic() - t0)
            log.info("worker %s ready (%.1f s)", w.worker_id, self.start_seconds[w.pool][-1])

        async def say_who_is_late() -> None:  # a start that waits says so, not silence
            while True:
                await asyncio.sleep(START_NOTICE_S)
                log.info("still starting after %.0f s: %s", time.monotonic() - t0, ", ".join(sorted(waiting)))

        notice = asyncio.create_task(say_who_is_late())
        try:
            await asyncio.gather(*(ready(w) for w in starting))
        finally:
            notice.cancel()
        for w in starting:
            w.state = "ready"
            self.by_name[w.pool].append(w)
        log.info("%d workers ready (%.1f s)", len(starting), time.monotonic() - t0)
        await self._poll_stats()
        for w in starting:
            self._watch(w)
        self._task(self._heartbeat())

    def _spawn(self, pool: str, slot: int, worker_id: str) -> Worker:
        c = self.config
        pc: PoolConfig = getattr(c, pool)
        cls, extra = {"prefill": (PrefillActor, dict(transfer_timeout_s=c.transfer_timeout_s, kv_checksum=c.kv_checksum)),
                      "decode": (DecodeActor, dict(transfer_timeout_s=c.transfer_timeout_s, bind_host=c.bind_host)),
                      "fast": (FastLaneActor, dict(transfer_timeout_s=c.transfer_timeout_s, bind_host=c.bind_host)),
                      "colocated": (ColocatedActor, {})}[pool]
        engine = c.engine_for(pc)
        options = dict(num_cpus=pc.num_cpus, num_gpus=pc.num_gpus, resources=pc.resources, max_restarts=0)
        if self.router is not None:  # it outlives this router: the next owner adopts it by name
            options.update(name=_actor_name(worker_id), lifetime="detached")
        group = None
        if engine.tensor_parallel_size > 1:  # its ranks packed on one node; this actor is rank 0, in bundle 0
            placement = TPPlacement.create(f"tp-{worker_id}", engine.tensor_parallel_size, pc.num_cpus, pc.num_gpus,
                                           pc.resources)
            extra, options, group = dict(extra, placement=placement), placement.options(0), placement.group
        handle = ray.remote(cls).options(**options).remote(worker_id, engine, torch_threads=pc.torch_threads, **extra)
        return self._worker(worker_id, handle, pool, slot, group)

    def _worker(self, worker_id: str, handle: Any, pool: str, slot: int, group: Any = None) -> Worker:
        w = Worker(worker_id, handle, pool, slot, placement_group=group)
        if pool == "prefill":
            engine = self.config.engine_for(getattr(self.config, pool))
            w.prefix = PrefixIndex(engine.cache.resolve_num_blocks(self.info.config, engine.torch_dtype,
                                                                   engine.tensor_parallel_size))
        return w

    def _new_id(self, pool: str, slot: int) -> str:
        """A worker id never used before in this cluster (an owner's epoch keeps replicas' ids apart)."""
        n = next(self._incarnations)
        return f"{pool}-{slot}.{n}" if self.router is None else f"{pool}-{slot}.e{self._epoch}.{n}"

    def _task(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _watch(self, w: Worker) -> None:
        self._task(self._until_link_ends(w))

    async def shutdown(self) -> None:
        self._closing = True
        everyone = self.workers + [w for ws in self.starting.values() for w in ws]  # before their tasks end
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.router is not None:  # the workers serve the other routers: only this router's links end
            if self.owner:
                await asyncio.gather(self._registry.release.remote(self.router), return_exceptions=True)
            if self._links is not None:
                await self._links.close()
            return
        await asyncio.gather(*(w.handle.shutdown.remote() for w in self.workers), return_exceptions=True)
        if self._links is not None:
            await self._links.close()
        removals = [t for t in map(_kill, everyone) if t is not None]
        deadline = time.monotonic() + REMOVE_GROUPS_TIMEOUT_S
        for t in removals:
            await asyncio.to_thread(t.join, max(deadline - time.monotonic(), 0))
        self.by_name = {p: [] for p in self.by_name}
        self.starting = {p: [] for p in self.by_name}
        self.draining = []

    async def stats(self) -> list[WorkerStats]:
        """Fresh stats from every worker (one call each)."""
        return list(await asyncio.gather(*(w.handle.stats.remote() for w in self.workers)))

    def latest_stats(self) -> list[WorkerStats]:
        """The latest stats each worker reported (step outputs and the heartbeat); no call is made."""
        return [w.stats for w in self.workers if w.stats is not None]

    async def _poll_stats(self) -> None:
        """The heartbeat: every worker must answer within worker_timeout_s, or it is declared stuck. Asked on
        the worker's link where it has one: a Ray actor call and its result cost the router about 1 ms of
        CPU, a worker each second (docs/benchmarks.md); a link whose worker died ends by itself
        (_until_link_ends)."""
        workers = self.workers
        results = await asyncio.gather(
            *(asyncio.wait_for(w.calls.stats() if w.link is not None else w.handle.stats.remote(),
                               self.config.worker_timeout_s) for w in workers),
            return_exceptions=True)
        for w, r in zip(workers, results):
            if isinstance(r, WorkerStats):
                w.stats = r
                self.notify()
            elif isinstance(r, (asyncio.TimeoutError, ray.exceptions.RayError, CallFailed)):
                self.lose(w, "stuck: no heartbeat" if isinstance(r, asyncio.TimeoutError) else f"dead: {r}")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await self._poll_stats()

    def lose(self, w: Worker, why: str) -> None:
        """Take a dead or stuck worker out of its pool, fail its requests over, start its replacement
        (unless it was draining: it was leaving anyway)."""
        if not w.alive or self._closing:
            return
        w.alive = False
        if not self.owner:  # a replica that does not own the pools: the owner replaces it; this one lets go
            if w.state == "draining":
                log.info("worker %s left (%s)", w.worker_id, why)
            else:
                log.warning("worker %s lost (%s); the pools' owner replaces it", w.worker_id, why)
            self._gone.add(w.worker_id)
            for ws in (*self.by_name.values(), self.draining):
                if w in ws:
                    ws.remove(w)
            if w.link is not None:
                w.link.close(why)
            self._on_lost(w, why)
            self.notify()
            return
        replace = w.state != "draining"
        log.warning("worker %s lost (%s)%s", w.worker_id, why, "; replacing it" if replace else " while draining")
        (self.by_name[w.pool] if replace else self.draining).remove(w)
        _kill(w)  # a stuck actor must not come back and act on stale requests
        if w.link is not None:
            w.link.close(why)  # the calls waiting on it fail over now
        self._tell_peers(w)
        self._on_lost(w, why)
        self.notify()
        if replace:
            self.restarts[w.pool] += 1
            self._task(self._replace(w))
        self._publish()

    def notify(self) -> None:
        """Wake whatever waits for a pool to change, and tell the listeners (router.cluster's line)."""
        self.changed.set()
        self.changed = asyncio.Event()
        for listener in self.listeners:
            listener()

    def _tell_peers(self, w: Worker) -> None:
        """Its peers drop their KV channels to a worker that left (and whatever waited on them)."""
        for other in self.workers:
            if other.pool != w.pool:
                other.handle.peer_lost.remote(w.worker_id)

    async def _replace(self, lost: Worker) -> None:
        backoff = REPLACE_BACKOFF_S[0]
        while not self._closing and self.owner:
            w = self._spawn(lost.pool, lost.slot, self._new_id(lost.pool, lost.slot))
            self.starting[w.pool].append(w)
            if await self._bring_up(w):
                log.info("worker %s replaces %s", w.worker_id, lost.worker_id)
                return
            log.error("replacement %s failed to start (next try in %.0f s)", w.worker_id, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, REPLACE_BACKOFF_S[1])

    async def _bring_up(self, w: Worker) -> bool:
        """Wait (bounded) for a spawned worker, already counted as starting, to be ready, then make it
        routable; False if it did not start."""
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(w.handle.ready.remote(), self.config.worker_start_timeout_s)
            await self._connect(w)
            if self.catch_up is not None:
                await self.catch_up(w)
        except Exception as e:  # noqa: BLE001 - a worker that cannot start is killed, never half-joined
            log.error("worker %s did not start: %s", w.worker_id, e)
            _kill(w)
            self.start_failures[w.pool] += 1
            return False
        finally:
            self.starting[w.pool].remove(w)
        if self._closing:
            _kill(w)
            return False
        self.start_seconds[w.pool].append(time.monotonic() - t0)
        w.state = "ready"
        self.by_name[w.pool].append(w)  # routable only now that it is ready
        self._watch(w)
        self.notify()
        self._publish()
        return True

    # -- scaling ----------------------------------------------------------------------------------
    def grow(self, pool: str, n: int, reason: str) -> None:
        """Start n more workers in the pool; each becomes routable once ready."""
        self._grow(pool, n, reason)

    def _grow(self, pool: str, n: int, reason: str) -> list[asyncio.Task]:
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
            tasks.append(self._task(self._started(w)))
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
        self._task(self._leave(w))
        self._publish()

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
        self._tell_peers(w)
        try:
            await asyncio.wait_for(w.handle.shutdown.remote(), self.config.worker_timeout_s)
        except Exception as e:  # noqa: BLE001 - it is leaving either way
            log.warning("worker %s did not shut down cleanly: %s", w.worker_id, e)
        _kill(w)
        self.draining.remove(w)  # it has left: its actor is gone
        log.info("worker %s drained in %.1f s and left the %s pool", w.worker_id, time.monotonic() - t0, w.pool)

    async def alive(self, pool: str) -> list[Worker]:
        """The pool's live workers, waiting (bounded) for a replacement if none is left ([] after that)."""
        deadline = asyncio.get_running_loop().time() + self.config.pool_wait_timeout_s
        while not self.by_name[pool]:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return []
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return self.by_name[pool]

    async def _connect(self, w: Worker) -> None:
        """Open the worker's link (pdserve.serving.link): its step outputs and replies in, in order; the
        router's per-request calls out."""

        def take(out: StepOutput) -> None:
            if out.stats is not None:
                w.stats = out.stats
            self._on_output(w, out)
            if out.stats is not None:
                self.notify()  # its room changed (router.cluster waits on it)

        w.link = self._links.expect(w.worker_id, take)
        try:
            await asyncio.wait_for(w.handle.link_to.remote(self._links.host, self._links.port, self._links.token,
                                                           self.router or ""), self.config.worker_timeout_s)
            await w.link.wait_open(self.config.worker_timeout_s)
        except BaseException:
            self._links.forget(w.worker_id)
            w.link.close("did not connect")
            raise

    async def _until_link_ends(self, w: Worker) -> None:
        """A worker whose link ends (it died, or left) is lost: no request of its may hang."""
        try:
            why = await asyncio.shield(w.link.ended)
        finally:
            self._links.forget(w.worker_id)
        self.lose(w, why)

    # -- router replicas (router.registry) ----------------------------------------------------------
    async def _join(self) -> None:
        """Start as one of several routers: own the pools if the lease is free, else follow its owner."""
        if any(self.config.engine_for(pc).tensor_parallel_size > 1 for pc in self.config.pools.values()):
            raise ValueError("router replicas (router_name) do not serve tensor-parallel workers yet")
        self._registry = ray.remote(Registry).options(
            name=REGISTRY_NAME, lifetime="detached", get_if_exists=True, num_cpus=0, max_restarts=-1,
            max_task_retries=-1).remote()
        epoch = await self._registry.claim.remote(self.router)
        _, owner, _, listed = await self._registry.view.remote()
        if epoch is not None:
            await self._take_over(epoch, listed, first=True)
        else:
            log.info("router %s follows the pools' owner %s (%d workers listed)", self.router, owner, len(listed))
            await asyncio.gather(*(self._adopt(x) for x in listed))
        self._task(self._lease())
        self._task(self._heartbeat())

    async def _lease(self) -> None:
        """The owner renews its lease; the others follow the registry and claim the lease when it lapses."""
        while True:
            await asyncio.sleep(LEASE_S / 3 if self.owner else self.config.stats_interval_s)
            try:
                if self.owner:
                    epoch = await self._registry.claim.remote(self.router)
                    if epoch is not None:
                        if epoch != self._epoch:  # the registry was restarted (its state lost): list again
                            self._epoch = epoch
                            self._publish()
                        continue
                    log.error("router %s lost the pools' lease: another router owns them now", self.router)
                    self.owner = False
                version, owner, _, listed = await self._registry.view.remote()
                if owner is None or owner == self.router:
                    epoch = await self._registry.claim.remote(self.router)
                    if epoch is not None:
                        await self._take_over(epoch, listed)
                        continue
                if version:  # 0: a registry restarted, nothing published again yet
                    self._follow(listed)
            except ray.exceptions.RayError as e:  # the registry restarts (max_restarts): try again
                log.warning("router %s: the registry did not answer: %s", self.router, e)

    def _follow(self, listed: tuple[Listed, ...]) -> None:
        """Link to the workers the owner lists; stop placing on those it no longer lists (drained or lost)."""
        names = {x.worker_id for x in listed}
        known = {w.worker_id for w in self.workers}
        for x in listed:
            if x.worker_id not in known | self._gone | self._adopting:
                self._task(self._adopt(x))
        for w in [w for w in self.draining if w.worker_id in names and w.alive]:  # listed again
            self.draining.remove(w)
            w.state = "ready"
            self.by_name[w.pool].append(w)
            self.notify()
        for pool in self.by_name.values():
            for w in [w for w in pool if w.worker_id not in names]:
                pool.remove(w)  # it leaves once the owner shuts it down (its link ends)
                w.state = "draining"
                self.draining.append(w)
                self.notify()

    async def _adopt(self, x: Listed) -> Worker | None:
        """Link to a worker another router started, and place on it."""
        self._adopting.add(x.worker_id)
        try:
            handle = await asyncio.to_thread(ray.get_actor, x.actor_name)
            w = self._worker(x.worker_id, handle, x.pool, x.slot)
            w.stats = await asyncio.wait_for(handle.stats.remote(), self.config.worker_timeout_s)
            await self._connect(w)
        except Exception as e:  # noqa: BLE001 - dead or not reachable: tried again while it is listed
            log.warning("router %s could not link to worker %s: %s", self.router, x.worker_id, e)
            return None
        finally:
            self._adopting.discard(x.worker_id)
        w.state = "ready"
        self.by_name[w.pool].append(w)
        self._watch(w)
        self.notify()
        return w  # not published: a follower never does, and an owner taking over does once it has adopted all

    async def _take_over(self, epoch: int, listed: tuple[Listed, ...], first: bool = False) -> None:
        """Become the pools' owner: adopt the listed workers, end the workers nobody lists (an owner died
        while starting them), and bring each pool back to the size its last owner published (the
        configured sizes when nothing was ever published)."""
        self._epoch, self.owner = epoch, True
        log.warning("router %s owns the pools (epoch %d; %d workers listed)", self.router, epoch, len(listed))
        known = {w.worker_id for w in self.workers}
        await asyncio.gather(*(self._adopt(x) for x in listed
                               if x.worker_id not in known | self._gone | self._adopting))
        while self._adopting:  # adoptions an earlier look began (each bounded): their workers count below
            await asyncio.sleep(DRAIN_POLL_S)
        mine = {_actor_name(w.worker_id) for w in self.workers + [w for ws in self.starting.values() for w in ws]}
        for name in await asyncio.to_thread(_named_workers):
            if name not in mine:
                log.warning("router %s ends worker %s: started by an owner that died, never listed", self.router, name)
                await asyncio.to_thread(_kill_named, name)
        targets = collections.Counter(x.pool for x in listed) if listed else \
            {pool: pc.num_workers for pool, pc in self.config.pools.items()}
        started = [t for pool, n in targets.items()
                   for t in self._grow(pool, max(n - self.size(pool), 0), "start" if first else "takeover")]
        self._publish()
        if first and started:
            await asyncio.gather(*started)
            if any(not self.by_name[pool] for pool in targets):
                raise RuntimeError("a pool has no worker ready: see the workers' errors above")

    def _publish(self) -> None:
        """The owner lists its ready workers in the registry (the other routers place on them)."""
        if self._registry is None or not self.owner:
            return
        listed = tuple(Listed(w.worker_id, w.pool, w.slot, _actor_name(w.worker_id))
                       for ws in self.by_name.values() for w in ws)
        self._task(self._published(self._registry.publish.remote(self._epoch, listed)))

    async def _published(self, ref: Any) -> None:
        try:
            if not await ref and self.owner:
                log.error("router %s: its list of workers was refused (another router owns the pools)", self.router)
                self.owner = False
        except ray.exceptions.RayError as e:
            log.warning("router %s: the registry did not take its list of workers: %s", self.router, e)


WORKER_NAME_PREFIX = "pdserve-worker-"


def _actor_name(worker_id: str) -> str:
    return WORKER_NAME_PREFIX + worker_id


def _named_workers() -> list[str]:
    """The live named worker actors of the cluster's namespace (router replicas)."""
    return [n for n in ray.util.list_named_actors() if isinstance(n, str) and n.startswith(WORKER_NAME_PREFIX)]


def _kill_named(name: str) -> None:
    try:
        ray.kill(ray.get_actor(name), no_restart=True)
    except ValueError:  # gone meanwhile
        pass
