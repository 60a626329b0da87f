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
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from decode_worker.actor import DecodeActor, FastLaneActor
from pdserve.config import ClusterConfig, PoolConfig
from pdserve.model.loader import ModelInfo
from pdserve.parallel.layout import rank_config
from pdserve.serving.colocated import ColocatedActor
from pdserve.serving.link import CallFailed, LinkServer
from pdserve.serving.messages import StepOutput, WorkerStats
from pdserve.serving.tp_ranks import TPPlacement
from prefill_worker.actor import PrefillActor
from router.kv_index import KVIndex
from router.pool_scaling import PoolScaling
from router.replicas import Replicas, actor_name
from router.workers import REMOVE_GROUPS_TIMEOUT_S, Worker, kill

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


class Pools(PoolScaling):
    """The pools of a cluster; on_output(worker, StepOutput) gets every streamed step output and
    on_lost(worker, why) every worker taken out of its pool (before its replacement is started)."""

    def __init__(self, config: ClusterConfig, on_output: Callable[[Worker, StepOutput], None],
                 on_lost: Callable[[Worker, str], None]):
        self.config = config
        self.info: ModelInfo | None = None
        self.by_name: dict[str, list[Worker]] = {"prefill": [], "decode": [], "fast": [], "colocated": []}  # ready
        self.kv_index = KVIndex()  # what each worker's prefix cache holds, from its events (placement reads it)
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
        # Router replicas (router.replicas): which router owns the pools; None: this is the only router.
        self.replicas = Replicas(self, self.router) if self.router is not None else None
        # Called with a worker that has started, before it is routable (router.weights: it brings the worker's
        # weights to the version the cluster serves); a failure fails the start.
        self.catch_up: Callable[[Worker], Awaitable[None]] | None = None

    @property
    def owner(self) -> bool:
        """Whether this router spawns, replaces, scales and drains the workers (the only router always does)."""
        return self.replicas is None or self.replicas.owner

    def publish(self) -> None:
        """Tell the other routers, if any, the ready workers (the owner lists them in the registry)."""
        if self.replicas is not None:
            self.replicas.publish()

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
        await asyncio.to_thread(_build_cpu_kernels, c.engine.device)
        sizes = {name: pool.num_workers for name, pool in c.pools.items()}
        t0 = time.monotonic()
        log.info("starting %s (each loads the model)", ", ".join(
            f"{n} {name} worker{'s' * (n != 1)} of TP {c.engine_for(c.pools[name]).tensor_parallel_size}"
            for name, n in sizes.items()))
        # Where the workers connect their links: --kv-bind-host if given, else this node's address as Ray
        # knows it (loopback on a local cluster, the pod's IP on Kubernetes).
        self._links = LinkServer(self.config.bind_host or ray.util.get_node_ip_address())
        await self._links.start()
        if self.replicas is not None:
            await self.replicas.join()
            return
        short = shortfall(demand(c), ray.cluster_resources())
        if short:
            log.warning("the pools ask Ray for more than this cluster has (%s): some workers wait until it grows "
                        "(--worker-cpus, --worker-gpus: a worker's share)", short)
        starting = [self._spawn(pool, slot, f"{pool}-{slot}") for pool, n in sizes.items() for slot in range(n)]
        waiting = {w.worker_id for w in starting}

        async def ready(w: Worker) -> None:
            await w.handle.ready.remote()
            await self.connect(w)
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
            self.watch(w)
        self.run_task(self.heartbeat())

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
            options.update(name=actor_name(worker_id), lifetime="detached")
        group = None
        if engine.tensor_parallel_size > 1:  # its ranks packed on one node; this actor is rank 0, in bundle 0
            placement = TPPlacement.create(f"tp-{worker_id}", engine.tensor_parallel_size, pc.num_cpus, pc.num_gpus,
                                           pc.resources)
            extra, options, group = dict(extra, placement=placement), placement.options(0), placement.group
        handle = ray.remote(cls).options(**options).remote(worker_id, engine, torch_threads=pc.torch_threads, **extra)
        return self.make_worker(worker_id, handle, pool, slot, group)

    def make_worker(self, worker_id: str, handle: Any, pool: str, slot: int, group: Any = None) -> Worker:
        return Worker(worker_id, handle, pool, slot, placement_group=group)

    def _new_id(self, pool: str, slot: int) -> str:
        """A worker id never used before in this cluster (an owner's epoch keeps replicas' ids apart)."""
        n = next(self._incarnations)
        return f"{pool}-{slot}.{n}" if self.replicas is None else f"{pool}-{slot}.e{self.replicas.epoch}.{n}"

    def run_task(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def watch(self, w: Worker) -> None:
        self.run_task(self._until_link_ends(w))

    async def shutdown(self) -> None:
        self._closing = True
        everyone = self.workers + [w for ws in self.starting.values() for w in ws]  # before their tasks end
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.replicas is not None:  # the workers serve the other routers: only this router's links end
            await self.replicas.release()
            if self._links is not None:
                await self._links.close()
            return
        await asyncio.gather(*(w.handle.shutdown.remote() for w in self.workers), return_exceptions=True)
        if self._links is not None:
            await self._links.close()
        removals = [t for t in map(kill, everyone) if t is not None]
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

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await self._poll_stats()

    def lose(self, w: Worker, why: str) -> None:
        """Take a dead or stuck worker out of its pool, fail its requests over, start its replacement
        (unless it was draining: it was leaving anyway)."""
        if not w.alive or self._closing:
            return
        w.alive = False
        self.kv_index.forget(w.worker_id)  # its cache went with it
        if not self.owner:  # a replica that does not own the pools: the owner replaces it; this one lets go
            if w.state == "draining":
                log.info("worker %s left (%s)", w.worker_id, why)
            else:
                log.warning("worker %s lost (%s); the pools' owner replaces it", w.worker_id, why)
            self.replicas.gone.add(w.worker_id)
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
        kill(w)  # a stuck actor must not come back and act on stale requests
        if w.link is not None:
            w.link.close(why)  # the calls waiting on it fail over now
        self._tell_peers(w)
        self._on_lost(w, why)
        self.notify()
        if replace:
            self.restarts[w.pool] += 1
            self.run_task(self._replace(w))
        self.publish()

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
        backoff, most = self.config.replace_backoff_s
        while not self._closing and self.owner:
            w = self._spawn(lost.pool, lost.slot, self._new_id(lost.pool, lost.slot))
            self.starting[w.pool].append(w)
            if await self._bring_up(w):
                log.info("worker %s replaces %s", w.worker_id, lost.worker_id)
                return
            log.error("replacement %s failed to start (next try in %.0f s)", w.worker_id, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, most)

    async def _bring_up(self, w: Worker) -> bool:
        """Wait (bounded) for a spawned worker, already counted as starting, to be ready, then make it
        routable; False if it did not start."""
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(w.handle.ready.remote(), self.config.worker_start_timeout_s)
            await self.connect(w)
            if self.catch_up is not None:
                await self.catch_up(w)
        except Exception as e:  # noqa: BLE001 - a worker that cannot start is killed, never half-joined
            log.error("worker %s did not start: %s", w.worker_id, e)
            kill(w)
            self.start_failures[w.pool] += 1
            return False
        finally:
            self.starting[w.pool].remove(w)
        if self._closing:
            kill(w)
            return False
        self.start_seconds[w.pool].append(time.monotonic() - t0)
        w.state = "ready"
        self.by_name[w.pool].append(w)  # routable only now that it is ready
        self.watch(w)
        self.notify()
        self.publish()
        return True

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

    async def connect(self, w: Worker) -> None:
        """Open the worker's link (pdserve.serving.link): its step outputs and replies in, in order; the
        router's per-request calls out."""

        def take(out: StepOutput) -> None:
            if out.kv is not None:
                self.kv_index.apply(w.worker_id, out.kv)
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

def _build_cpu_kernels(device: str) -> None:
    """Build the CPU kernels here, once, before the workers start: they then load the built extension
    instead of racing to build it, and the one slow first build is a stage the user sees."""
    from pdserve.kernels import cpu_kernels

    if not device.startswith("cpu") or not cpu_kernels.enabled():
        return
    t0 = time.monotonic()
    log.info("CPU kernels: loading (built once per machine into %s)", cpu_kernels.build_directory())
    ok = cpu_kernels.available()
    log.info("CPU kernels: %s (%.1f s)", "ready" if ok else "unavailable, the workers use the torch paths",
             time.monotonic() - t0)
