"""The autoscaler of a running cluster: every interval, the demand the router sees goes to the
planner's policy (pdserve.planner.autoscale), and its decisions grow pools or drain workers
(router.pools).

The fast lane (pool "fast", pdserve.tiers) is sized apart from the decode pool: from the priority tier's
demand (Cluster.tier_demand) and the lane's own workers, with priority's TPOT target.

Its costs come from a measured profile (`pdserve profile`) or a GPU's roofline, as `pdserve plan`'s do; for
simulated workers (`--load-format sim`), unless one is given, from the simulated GPU's roofline slowed by
the time scale, and their KV blocks are the simulated GPU's.
The latest decision of each pool is kept for `pdserve status` and the metrics.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pdserve.perf.costs import StepCosts
from pdserve.planner.autoscale import Autoscaler, Decision, Demand, PoolLimits
from pdserve.tiers import ServiceTier
from router.cluster import Cluster

log = logging.getLogger(__name__)

# Before any worker has been started and timed, a new one is assumed this long from start to ready.
STARTUP_GUESS_S = 30.0


def cluster_costs(cluster: Cluster, tp: int = 1, ep: int = 1) -> StepCosts:
    """The cost model the autoscaler sizes a pool of TP size tp (expert-parallel size ep) with: the configured
    profile, or the configured GPU's roofline for a worker of tp such GPUs."""
    a, info = cluster.config.autoscale, cluster.info
    engine = cluster.config.engine
    if engine.load_format == "sim" and a.profile is None and a.gpu is None:
        return _sim_plan(cluster).costs.slowed(engine.sim_time_scale)  # exactly what its workers' steps take
    if a.profile is not None:
        from pdserve.planner.profile import read_profile

        costs, model, _, _ = read_profile(a.profile)
        if model.get("vocab_size") != info.config.vocab_size or model.get("num_params") not in (None, info.config.num_params):
            raise ValueError(f"{a.profile} profiles {model.get('name')!r}, not the served model {info.path!r}")
        if tp != 1:
            raise ValueError(f"{a.profile} profiles one device; a pool of TP {tp} autoscales from a GPU's roofline (--gpu)")
        return costs
    from pdserve.perf.hardware import gpu, roofline

    return roofline(info.config, gpu(a.gpu), cluster.config.engine.torch_dtype.itemsize, tp, ep)


def _sim_plan(cluster: Cluster, engine=None):
    """What a simulated worker of the cluster stands for (pdserve.engine.sim_runner.sim_plan)."""
    from pdserve.engine.sim_runner import sim_plan

    return sim_plan(engine or cluster.config.engine, cluster.info)


class AutoscaleLoop:
    """Runs the policy over the cluster's pools; `queued` gives the requests waiting for admission."""

    def __init__(self, cluster: Cluster, queued: Callable[[], int] = lambda: 0):
        c = cluster.config
        self.cluster, self.queued = cluster, queued
        limits = {}
        for name in c.ranges:
            engine = c.engine_for(c.pools[name])
            # A simulated worker has the blocks of the GPU it stands for, not what its held bytes would give.
            blocks = _sim_plan(cluster, engine).num_blocks if engine.load_format == "sim" else \
                engine.cache.resolve_num_blocks(cluster.info.config, engine.torch_dtype, engine.tensor_parallel_size)
            limits[name] = PoolLimits(blocks, engine.cache.block_size, engine.scheduler.max_num_seqs,
                                      engine.scheduler.max_num_batched_tokens)
        a = c.autoscale
        engines = {name: c.engine_for(c.pools[name]) for name in c.ranges}
        costs = {name: cluster_costs(cluster, e.tensor_parallel_size, e.expert_parallel_size) for name, e in engines.items()}
        self.policy = Autoscaler(costs, limits, c.ranges, a.ttft_target_s, a.tpot_target_s,
                                 a.scale_down_delay_s, cluster.scaling.last_start_seconds() or STARTUP_GUESS_S,
                                 c.tiers.slo_of(ServiceTier.PRIORITY).tpot_s)
        self.decisions: dict[str, Decision] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cluster.config.autoscale.interval_s)
            try:
                self.step(time.monotonic())
            except Exception:  # noqa: BLE001 - a bad decision must not stop the next one
                log.exception("autoscaler step failed")

    def step(self, now: float) -> list[Decision]:
        """Decide each autoscaled pool's size now and act on it (the pools' owner only, with router replicas:
        it sizes them on its own arrivals and every worker's load)."""
        pools = self.cluster.scaling
        if not pools.owner:
            return []
        startup = pools.last_start_seconds()
        if startup is not None:
            self.policy.startup_s = startup
        demand = self.cluster.load(now, self.queued())
        own = {"fast": self.fast_demand(now)} if "fast" in self.policy.ranges else None
        decisions = self.policy.decide(now, demand, {p: pools.size(p) for p in self.policy.ranges}, own)
        for d in decisions:
            self.decisions[d.pool] = d
            if d.direction == "none":
                continue
            log.info("%s pool: %d -> %d workers (%s; %.2f req/s, prompts %.0f, outputs %.0f tokens, %d prompt "
                     "tokens waiting, %d requests on decode)", d.pool, d.current, d.desired, d.reason,
                     demand.arrival_rate, demand.input_len, demand.output_len, demand.prefill_backlog_tokens,
                     demand.decode_requests)
            if d.direction == "up":
                pools.grow(d.pool, d.desired - d.current, d.reason)
            else:
                pools.drain(d.pool, d.current - d.desired, d.reason)
        return decisions

    def fast_demand(self, now: float) -> Demand:
        """The fast lane's demand, as Cluster.load() is the decode pool's: the priority tier's arrivals and
        lengths, the requests and KV on the lane's workers. A cluster without per-tier windows gives the
        lane only what it holds (no rate), so it keeps the workers its requests need and no more."""
        windows = getattr(self.cluster, "tier_demand", None)
        rate, input_len, output_len = (windows[ServiceTier.PRIORITY].observe(now) if windows
                                       else (0.0, 0.0, 0.0))
        lane = [w for w in self.cluster.scaling.workers if w.pool == "fast"]
        return Demand(rate, input_len, output_len, 0, sum(len(w.requests) for w in lane),
                      sum(w.stats.kv_blocks_used for w in lane if w.stats is not None))

    def desired(self, pool: str) -> int | None:
        d = self.decisions.get(pool)
        return d.desired if d is not None else None
