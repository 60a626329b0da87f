"""Every metric pdserve exports, defined once. The router serves them all at one /metrics endpoint.

Request metrics are observed by the router as requests stream. Worker metrics are the workers' own
cumulative counters, reported to the router with decode step outputs and a heartbeat, and exposed at
scrape time by WorkerCollector: counters stay counters (rate() in PromQL gives busy fraction, FLOP/s,
bytes/s), so utilization is computed over whatever window a dashboard asks for. Names follow the
Prometheus conventions: `pdserve_` prefix, base units, `_total` for counters.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from pdserve.planner.autoscale import REASONS
from pdserve.serving.messages import HOPS, WorkerStats
from pdserve.tiers import TIERS, ServiceTier, TiersConfig, TierSLO
from pdserve.transfer.channel import TRANSFER_SECONDS_BUCKETS

REQUEST_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0,
                           30.0, 60.0, 120.0, 300.0)
TOKEN_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                         2.0, 5.0, 10.0)


@dataclass(frozen=True)
class PoolScale:
    """One pool's size as scaling sees it (router.pools, router.autoscaler)."""

    pool: str
    ready: int
    starting: int
    draining: int
    desired: int
    min_workers: int
    max_workers: int
    start_seconds: tuple[float, ...]  # how long each worker started so far took to be ready
    events: dict[tuple[str, str], int]  # (up|down, reason) -> scale events so far
    tensor_parallel_size: int = 1  # ranks (devices) per worker


# pdserve_request_generation_tokens_by_staleness's versions_behind values: 0, 1, 2, then 3 or more.
STALENESS_LABELS = ("0", "1", "2", "3+")


class RouterMetrics:
    """The registry the router serves: request histograms and counters, admission gauges, worker metrics."""

    def __init__(self, worker_stats: Callable[[], Iterable[WorkerStats]],
                 faults: Callable[[], tuple[dict[str, int], dict[str, int]]] = lambda: ({}, {}),
                 scale: Callable[[], Iterable[PoolScale]] = lambda: (),
                 slos: dict[str, TierSLO] | None = None, downgrades: Callable[[], int] = lambda: 0,
                 protocols: Iterable[str] = ("grpc",), weight_version: Callable[[], int] = lambda: 0):
        """worker_stats: the workers' latest stats; faults: (restarts by pool, retries by reason), cumulative;
        scale: each pool's size, target and scale events; slos: each tier's targets (pdserve.tiers);
        downgrades: priority requests served as default so far; protocols: the doors requests come in by
        ("grpc", and "http" where the OpenAI API is served), whose request series exist from the start;
        weight_version: the weight version the cluster serves (router.weights), that tokens' staleness is
        counted against."""
        r = self.registry = CollectorRegistry()
        self.slos = slos if slos is not None else TiersConfig().slo
        # Every request metric is labelled by the protocol it came in on, "grpc" or "http" (OpenAI API),
        # and the service tier it asked for (pdserve.tiers).
        p = ["protocol", "service_tier"]
        self.ttft = Histogram("pdserve_request_time_to_first_token_seconds",
                              "From arrival at the router to the first token streamed", p, registry=r,
                              buckets=REQUEST_SECONDS_BUCKETS)
        self.tpot = Histogram("pdserve_request_time_per_output_token_seconds",
                              "Per request: (end-to-end - time to first token) / (output tokens - 1)", p, registry=r,
                              buckets=TOKEN_SECONDS_BUCKETS)
        self.itl = Histogram("pdserve_request_inter_token_latency_seconds",
                             "Every gap between two consecutive streamed tokens", p, registry=r,
                             buckets=TOKEN_SECONDS_BUCKETS)
        self.e2e = Histogram("pdserve_request_e2e_seconds", "From arrival at the router to the last token", p,
                             registry=r, buckets=REQUEST_SECONDS_BUCKETS)
        self.queue = Histogram("pdserve_request_queue_seconds", "Time waiting for admission", p, registry=r,
                               buckets=REQUEST_SECONDS_BUCKETS)
        self.requests = Counter("pdserve_requests", "Finished requests by protocol, tier, finish reason and status "
                                "code (gRPC's names, for HTTP requests too: OK, INVALID_ARGUMENT, ...)",
                                ["protocol", "service_tier", "finish_reason", "code"], registry=r)
        # Live goodput: requests that finished (stop or length) and whether they met their tier's SLO
        # (TTFT and TPOT targets), and their output tokens.
        slo = ["service_tier", "met"]
        self.slo_requests = Counter("pdserve_tier_slo_requests", "Finished requests by tier, and whether they met "
                                    "the tier's SLO (met=true: goodput)", slo, registry=r)
        self.slo_tokens = Counter("pdserve_tier_slo_output_tokens", "Output tokens of finished requests by tier, and "
                                  "whether their request met the tier's SLO", slo, registry=r)
        self.served = Counter("pdserve_tier_served_requests", "Finished requests by the tier asked for and the tier "
                              "served (lower when a priority request found the fast lane full)",
                              ["service_tier", "served_tier"], registry=r)
        self.prompt_tokens = Counter("pdserve_request_prompt_tokens", "Prompt tokens of finished requests", p,
                                     registry=r)
        self.generation_tokens = Counter("pdserve_request_generation_tokens", "Tokens streamed to clients", p,
                                         registry=r)
        self.weight_version = weight_version
        self.staleness = Counter("pdserve_request_generation_tokens_by_staleness",
                                 "Tokens streamed to clients by how many weight versions the weights that sampled "
                                 "each were behind the version the cluster served when its request ended (RL "
                                 "rollouts: the policy lag of the samples)", ["versions_behind"], registry=r)
        for behind in STALENESS_LABELS:
            self.staleness.labels(behind)
        # Every series a dashboard queries exists from the start, at 0 (a panel reads 0, not "no data", before
        # the first request of a tier), for the label values known up front: doors, tiers, and the finish
        # reasons every door and tier ends requests with (stop or length, OK).
        for t in TIERS:
            for met in ("true", "false"):
                self.slo_requests.labels(t.value, met)
                self.slo_tokens.labels(t.value, met)
            for protocol in protocols:
                for family in (self.ttft, self.tpot, self.itl, self.e2e, self.queue, self.prompt_tokens,
                               self.generation_tokens):
                    family.labels(protocol, t.value)
                for finish_reason in ("stop", "length"):
                    self.requests.labels(protocol, t.value, finish_reason, "OK")
        self.running = Gauge("pdserve_router_requests_running", "Requests admitted to the workers", registry=r)
        self.queued = Gauge("pdserve_router_requests_queued", "Requests waiting for admission", registry=r)
        self._tier_queued: Callable[[ServiceTier], int] = lambda t: 0
        r.register(TierCollector(lambda: {t.value: self._tier_queued(t) for t in TIERS}, downgrades))
        r.register(WorkerCollector(worker_stats))
        r.register(FaultCollector(faults))
        r.register(ScaleCollector(scale))

    def tier_queued(self, queued: Callable[[ServiceTier], int]) -> None:
        """Where the requests waiting by tier are counted (router.frontend)."""
        self._tier_queued = queued

    def observe_request(self, *, finish_reason: str, code: str, queue_s: float | None, ttft_s: float | None,
                        e2e_s: float | None, token_times: list[float], prompt_tokens: int, output_tokens: int,
                        protocol: str = "grpc", service_tier: str = "default", served_tier: str | None = None,
                        token_versions: Sequence[int] = ()) -> None:
        """Record one finished request. token_times: when each output token was streamed (one per token).
        service_tier: the tier it asked for, whose SLO it is judged by; served_tier: the tier it got.
        token_versions: the weight version that sampled each output token."""
        p = (protocol, service_tier)
        self.requests.labels(*p, finish_reason, code).inc()
        if queue_s is not None:
            self.queue.labels(*p).observe(queue_s)
        if ttft_s is not None:
            self.ttft.labels(*p).observe(ttft_s)
        if e2e_s is not None:
            self.e2e.labels(*p).observe(e2e_s)
        tpot = None
        if ttft_s is not None and e2e_s is not None and output_tokens > 1:
            tpot = (e2e_s - ttft_s) / (output_tokens - 1)
            self.tpot.labels(*p).observe(tpot)
        itl = self.itl.labels(*p)
        for a, b in zip(token_times, token_times[1:]):
            itl.observe(b - a)
        self.prompt_tokens.labels(*p).inc(prompt_tokens)
        self.generation_tokens.labels(*p).inc(output_tokens)
        if token_versions:
            served = self.weight_version()
            for version, n in collections.Counter(token_versions).items():
                behind = min(max(served - version, 0), len(STALENESS_LABELS) - 1)  # a newer token: rolling update
                self.staleness.labels(STALENESS_LABELS[behind]).inc(n)
        if code == "OK" and finish_reason in ("stop", "length") and ttft_s is not None:
            met = "true" if self.slos[service_tier].met(ttft_s, tpot) else "false"
            self.slo_requests.labels(service_tier, met).inc()
            self.slo_tokens.labels(service_tier, met).inc(output_tokens)
            self.served.labels(service_tier, served_tier or service_tier).inc()


# The worker families with one value per worker: (kind, name, help, the value from its stats).
_PER_WORKER = (
    (CounterMetricFamily, "pdserve_worker_busy_seconds", "Wall time spent in model steps", lambda s: s.busy_seconds),
    (GaugeMetricFamily, "pdserve_worker_uptime_seconds", "Seconds since the worker started", lambda s: s.uptime_seconds),
    (CounterMetricFamily, "pdserve_worker_steps", "Model steps run", lambda s: s.steps),
    (CounterMetricFamily, "pdserve_worker_tokens", "Tokens computed (prompt chunks and decodes)",
     lambda s: s.tokens_processed),
    (CounterMetricFamily, "pdserve_worker_flops", "Model FLOPs executed (matmuls, attention)", lambda s: s.flops),
    (CounterMetricFamily, "pdserve_worker_read_bytes", "Weight and KV bytes read by model steps",
     lambda s: s.bytes_read),
    (GaugeMetricFamily, "pdserve_worker_waiting_requests",
     "Requests queued (prefill: prompts not yet ingested; decode: KV not yet received)", lambda s: s.waiting),
    (GaugeMetricFamily, "pdserve_worker_waiting_tokens", "Prompt tokens queued", lambda s: s.waiting_tokens),
    (GaugeMetricFamily, "pdserve_worker_running_requests",
     "Running batch (prefill: prompts whose KV is held for transfer)", lambda s: s.running),
    (GaugeMetricFamily, "pdserve_worker_kv_blocks_used", "KV cache blocks in use", lambda s: s.kv_blocks_used),
    (GaugeMetricFamily, "pdserve_worker_kv_blocks", "KV cache blocks in all", lambda s: s.kv_blocks_total),
    (CounterMetricFamily, "pdserve_worker_preemptions",
     "Running requests sent back to the queue for lack of KV blocks (their KV is recomputed)",
     lambda s: s.preemptions),
    (CounterMetricFamily, "pdserve_worker_late_steps",
     "Simulated engine (load format sim): steps whose host work outlasted their simulated time, so the host did "
     "not keep up and the step ran late (0 for a real model)", lambda s: s.late_steps),
    (CounterMetricFamily, "pdserve_worker_prefix_cache_hit_blocks", "Prompt blocks served by the prefix cache",
     lambda s: s.prefix_hit_blocks),
    (CounterMetricFamily, "pdserve_worker_prefix_cache_query_blocks", "Prompt blocks looked up in the prefix cache",
     lambda s: s.prefix_query_blocks),
    (CounterMetricFamily, "pdserve_worker_prompt_tokens_requested",
     "Prompt tokens of the requests this worker took to compute (a resumed request's re-ingested output not "
     "included)", lambda s: s.prompt_tokens_requested),
    (CounterMetricFamily, "pdserve_worker_prompt_tokens_computed",
     "Prompt tokens this worker computed: below requested by what the prefix cache served, above it by prompts "
     "computed again after a preemption", lambda s: s.prompt_tokens_computed),
    (GaugeMetricFamily, "pdserve_worker_weight_version",
     "The weight version the worker serves (0: the weights it started with; router.weights)",
     lambda s: s.weight_version),
    (GaugeMetricFamily, "pdserve_worker_paused",
     "1 while the worker's steps are paused (a pause of generation, or a weight update switching)",
     lambda s: float(s.paused)),
    (CounterMetricFamily, "pdserve_worker_weight_updates", "Weight updates the worker switched to",
     lambda s: s.weight_updates),
    (CounterMetricFamily, "pdserve_worker_weight_update_seconds",
     "Seconds of the weight updates: reading and converting (the worker serving meanwhile) and the switch",
     lambda s: s.weight_update_seconds),
    (CounterMetricFamily, "pdserve_worker_weight_update_bytes", "Bytes of the weight updates staged",
     lambda s: s.weight_update_bytes),
    (CounterMetricFamily, "pdserve_worker_weight_update_failures",
     "Weight updates that failed on the worker before its switch (nothing applied)",
     lambda s: s.weight_update_failures),
)
_WORKER = ["pool", "worker"]


class WorkerCollector(Collector):
    """Worker metrics from the latest stats each worker reported, labelled by pool and worker."""

    def __init__(self, worker_stats: Callable[[], Iterable[WorkerStats]]):
        self.worker_stats = worker_stats

    def collect(self) -> Iterator[Metric]:
        stats = list(self.worker_stats())
        for kind, name, doc, value in _PER_WORKER:
            f = kind(name, doc, labels=_WORKER)
            for s in stats:
                f.add_metric([s.pool, s.worker_id], value(s))
            yield f
        yield from self._peaks(stats)
        yield from self._tiers(stats)
        yield from self._by_key(stats)
        yield from self._speculation(stats)
        yield from self._sessions(stats)
        yield from self._transfers(stats)
        yield from self._kv_offload(stats)

    @staticmethod
    def _kv_offload(stats: list[WorkerStats]) -> Iterator[Metric]:
        """The KV tiers beneath each worker's cache (host memory, disk); 0 for a worker without tiers."""
        tiered = stats
        for unit, doc in (("blocks", "KV blocks"), ("bytes", "KV bytes")):
            f = CounterMetricFamily(f"pdserve_worker_kv_offload_{unit}", f"{doc} the KV tiers took in (written: "
                                    "evicted from the cache, or from host on to disk) and gave back (loaded into the "
                                    "cache instead of recomputing), by tier", labels=_WORKER + ["op", "tier"])
            for s in tiered:
                for op in ("written", "loaded"):
                    for tier in ("host", "disk"):
                        f.add_metric([s.pool, s.worker_id, op, tier], s.kv_offload.get(f"{op}_{tier}_{unit}", 0))
            yield f
        f = CounterMetricFamily("pdserve_worker_kv_offload_hit_blocks", "Prompt blocks found in a KV tier past the "
                                "resident prefix when a prompt was admitted, by tier", labels=_WORKER + ["tier"])
        for s in tiered:
            for tier in ("host", "disk"):
                f.add_metric([s.pool, s.worker_id, tier], s.kv_offload.get(f"hits_{tier}_blocks", 0))
        yield f
        f = CounterMetricFamily("pdserve_worker_kv_offload_load_seconds", "Seconds spent loading blocks from the "
                                "KV tiers into the cache", labels=_WORKER)
        for s in tiered:
            f.add_metric([s.pool, s.worker_id], s.kv_offload.get("load_seconds", 0.0))
        yield f

    @staticmethod
    def _peaks(stats: list[WorkerStats]) -> Iterator[Metric]:
        for name, doc, value in (
                ("pdserve_worker_peak_flops", "The device's peak FLOP/s; source says table, configured or measured",
                 lambda s: s.peak_flops),
                ("pdserve_worker_peak_read_bytes_per_second",
                 "The device's peak memory bandwidth; source says table, configured or measured",
                 lambda s: s.peak_bytes_per_second)):
            f = GaugeMetricFamily(name, doc, labels=_WORKER + ["source"])
            for s in stats:
                f.add_metric([s.pool, s.worker_id, s.peak_source], value(s))
            yield f

    @staticmethod
    def _tiers(stats: list[WorkerStats]) -> Iterator[Metric]:
        tiers = [t.value for t in TIERS]
        f = CounterMetricFamily("pdserve_tier_device_seconds", "Step seconds attributed to each service tier (a "
                                "step's time shared by its requests by the tokens each computed): the device cost of "
                                "a tier", labels=_WORKER + ["service_tier"])
        for s in stats:
            for t in tiers:
                f.add_metric([s.pool, s.worker_id, t], (s.tier_seconds or {}).get(t, 0))
        yield f
        f = CounterMetricFamily("pdserve_tier_preemptions", "Requests preempted, by tier and by outcome: kept "
                                "(resumed with its KV) or recomputed (its KV freed)",
                                labels=_WORKER + ["service_tier", "outcome"])
        for s in stats:
            for t in tiers:
                for o in ("kept", "recomputed"):
                    f.add_metric([s.pool, s.worker_id, t, o], (s.tier_preemptions or {}).get(f"{t}/{o}", 0))
        yield f

    @staticmethod
    def _by_key(stats: list[WorkerStats]) -> Iterator[Metric]:
        """The version policies' outcomes, and a mixture of experts' tokens by expert."""
        f = CounterMetricFamily("pdserve_worker_version_outcomes", "Requests holding KV of another weight version "
                                "than the worker's (at an update, or as their KV landed), by what their version "
                                "policy did: recomputed, kept or aborted", labels=_WORKER + ["outcome"])
        for s in stats:
            for outcome in ("recomputed", "kept", "aborted"):
                f.add_metric([s.pool, s.worker_id, outcome], (s.version_outcomes or {}).get(outcome, 0))
        yield f
        f = CounterMetricFamily("pdserve_worker_expert_tokens", "A mixture of experts: tokens routed to each expert, "
                                "summed over the model's expert layers (each token counts once per expert it chose; "
                                "max over mean across experts is a lower bound on a layer's load imbalance: hot experts "
                                "of different layers even out in the sum)", labels=_WORKER + ["expert"])
        for s in stats:
            for e, n in enumerate(s.expert_tokens):
                f.add_metric([s.pool, s.worker_id, str(e)], n)
        yield f

    @staticmethod
    def _speculation(stats: list[WorkerStats]) -> Iterator[Metric]:
        """Speculative decoding (pdserve.engine.scheduler_spec), on the workers where it is on: drafted and
        accepted tokens, each verification's accepted length (0 to num_speculative_tokens), and whether a draft model
        went stale with a weight update."""
        on = [s for s in stats if s.speculation]
        for key, name, doc in (("drafted", "pdserve_worker_spec_drafted_tokens",
                                "Tokens drafted (by prompt lookup or a draft model) and verified"),
                               ("accepted", "pdserve_worker_spec_accepted_tokens",
                                "Drafted tokens the target model accepted")):
            f = CounterMetricFamily(name, doc, labels=_WORKER)
            for s in on:
                f.add_metric([s.pool, s.worker_id], s.speculation[key])
            yield f
        f = HistogramMetricFamily("pdserve_worker_spec_acceptance_length",
                                  "Drafted tokens accepted per verification step of a request", labels=_WORKER)
        for s in on:
            lengths = {int(k): v for k, v in s.speculation["acceptance_lengths"].items()}
            top = max(lengths, default=0)
            buckets, total = [], 0
            for le in range(top + 1):
                total += lengths.get(le, 0)
                buckets.append((str(float(le)), total))
            buckets.append(("+Inf", total))
            f.add_metric([s.pool, s.worker_id], buckets, sum_value=sum(k * v for k, v in lengths.items()))
        yield f
        f = GaugeMetricFamily("pdserve_worker_spec_draft_stale",
                              "1 where a weight update left the worker's draft model unpaired with the served weights "
                              "(its requests decode without speculation), 0 where it drafts", labels=_WORKER)
        for s in on:
            if "draft_stale" in s.speculation:
                f.add_metric([s.pool, s.worker_id], float(s.speculation["draft_stale"]))
        yield f

    @staticmethod
    def _sessions(stats: list[WorkerStats]) -> Iterator[Metric]:
        """Sessions and the prefix cache: prompt tokens by hop, cached or computed; decode workers' local
        prefills and the hand-offs' KV blocks, moved and not moved. Every hop of a worker's pool from the start."""
        for how, name, doc in (
                ("cached", "pdserve_worker_prefix_cache_hit_tokens",
                 "Prompt tokens the prefix cache served when the prompt was admitted, by hop: prefill (a prefill "
                 "worker's), local_prefill (a decode worker computing a prompt it holds most of), recompute (a "
                 "decode worker's KV computed again), colocated"),
                ("computed", "pdserve_worker_prompt_tokens_computed_by_hop",
                 "Prompt tokens computed, by hop (prefill, local_prefill, recompute, colocated)")):
            f = CounterMetricFamily(name, doc, labels=_WORKER + ["hop"])
            for s in stats:
                for hop in HOPS.get(s.pool, (s.pool,)):
                    f.add_metric([s.pool, s.worker_id, hop], (s.hop_tokens or {}).get(f"{hop}/{how}", 0))
            yield f
        decode = [s for s in stats if "local_prefill" in HOPS.get(s.pool, ())]
        for name, doc, value in (
                ("pdserve_worker_local_prefills", "Requests whose prompt this decode worker computed itself (it "
                 "held most of it): no prefill worker, no hand-off", lambda s: s.local_prefills),
                ("pdserve_kv_handoff_blocks", "KV blocks hand-offs brought to this decode worker (a request's "
                 "prompt and earlier output, whole)", lambda s: s.handoff_blocks),
                ("pdserve_kv_handoff_avoided_blocks", "KV blocks a hand-off did not move: the prompts of the local "
                 "prefills, which a hand-off would have brought whole", lambda s: s.handoff_avoided_blocks)):
            f = CounterMetricFamily(name, doc, labels=_WORKER)
            for s in decode:
                f.add_metric([s.pool, s.worker_id], value(s))
            yield f

    @staticmethod
    def _transfers(stats: list[WorkerStats]) -> Iterator[Metric]:
        moving = [s for s in stats if s.transfer]
        for name, doc, key in (
                ("pdserve_kv_transfers",
                 "KV transfers completed (one per channel: one between TP workers counts each pair of ranks)",
                 "transfers"),
                ("pdserve_kv_transfer_bytes", "KV bytes transferred", "bytes"),
                ("pdserve_kv_transfer_failures", "KV transfers that failed or timed out", "failures"),
                ("pdserve_kv_transfer_checksum_failures",
                 "KV transfers that arrived but differed from what was sent (checksum)", "checksum_failures")):
            f = CounterMetricFamily(name, doc, labels=_WORKER)
            for s in moving:
                f.add_metric([s.pool, s.worker_id], s.transfer.get(key, 0))
            yield f
        yield _histogram("pdserve_kv_transfer_seconds", "Duration of KV transfers", _WORKER, moving,
                         lambda s: {"buckets": TRANSFER_SECONDS_BUCKETS, "counts": s.transfer["bucket_counts"],
                                    "sum": s.transfer["seconds"]})
        for key, name, doc in (
                ("handoff", "pdserve_kv_handoff_seconds",
                 "Per request: first token sampled on the prefill worker -> its KV usable on this decode worker"),
                ("reservation_wait", "pdserve_kv_reservation_wait_seconds",
                 "Per request: placed on this decode worker -> KV blocks reserved (waits while the cache is full)")):
            yield _histogram(name, doc, _WORKER, [s for s in stats if getattr(s, key)], lambda s, k=key: getattr(s, k))


def _histogram(name: str, doc: str, labels: list[str], stats: list[WorkerStats],
               snapshot: Callable[[WorkerStats], dict]) -> HistogramMetricFamily:
    """A histogram family from per-worker snapshots: {"buckets": upper bounds, "counts": per bucket and
    +Inf, not cumulative, "sum": seconds} (pdserve.transfer.protocol.SecondsHistogram's shape)."""
    h = HistogramMetricFamily(name, doc, labels=labels)
    for s in stats:
        snap = snapshot(s)
        cumulative, buckets = 0, []
        for bound, n in zip((*map(str, snap["buckets"]), "+Inf"), snap["counts"]):
            cumulative += n
            buckets.append((bound, cumulative))
        h.add_metric([s.pool, s.worker_id], buckets, sum_value=snap["sum"])
    return h


class TierCollector(Collector):
    """Requests waiting by service tier (for admission or in the router's line), and downgrades."""

    def __init__(self, queued: Callable[[], dict[str, int]], downgrades: Callable[[], int]):
        self.queued, self.downgrades = queued, downgrades

    def collect(self) -> Iterator[Metric]:
        f = GaugeMetricFamily("pdserve_tier_requests_queued", "Requests waiting, by the tier they are served at: for "
                              "admission or for workers with room", labels=["service_tier"])
        for tier, n in self.queued().items():
            f.add_metric([tier], n)
        yield f
        yield CounterMetricFamily("pdserve_tier_downgrades", "Priority requests served as default: the fast lane was "
                                  "full", value=self.downgrades())


class FaultCollector(Collector):
    """Worker replacements and request retries, as counted by the router."""

    def __init__(self, faults: Callable[[], tuple[dict[str, int], dict[str, int]]]):
        self.faults = faults

    def collect(self) -> Iterator[Metric]:
        restarts, retries = self.faults()
        f = CounterMetricFamily("pdserve_worker_restarts", "Workers lost (dead or stuck) and replaced", labels=["pool"])
        for pool in ("prefill", "decode", "fast", "colocated"):
            f.add_metric([pool], restarts.get(pool, 0))
        yield f
        f = CounterMetricFamily("pdserve_request_retries",
                                "Requests placed again after a lost worker or failed transfer", labels=["reason"])
        for reason, n in sorted(retries.items()):
            f.add_metric([reason], n)
        yield f


class ScaleCollector(Collector):
    """The pools' sizes against their targets and ranges, scale events, and workers' start-up times."""

    def __init__(self, scale: Callable[[], Iterable[PoolScale]]):
        self.scale = scale

    def collect(self) -> Iterator[Metric]:
        pools = list(self.scale())
        workers = GaugeMetricFamily("pdserve_pool_workers", "Workers in the pool by state (starting, ready, draining)",
                                    labels=["pool", "state"])
        desired = GaugeMetricFamily("pdserve_pool_desired_workers",
                                    "Workers the autoscaler wants in the pool (its configured size if fixed)",
                                    labels=["pool"])
        lo = GaugeMetricFamily("pdserve_pool_min_workers", "The pool's smallest size", labels=["pool"])
        hi = GaugeMetricFamily("pdserve_pool_max_workers", "The pool's largest size", labels=["pool"])
        tp = GaugeMetricFamily("pdserve_pool_tensor_parallel_size",
                               "Ranks (devices) per worker of the pool: its devices are workers x this",
                               labels=["pool"])
        events = CounterMetricFamily("pdserve_scale_events", "Workers started (up) or drained (down) by the "
                                     "autoscaler, by the reason of the decision",
                                     labels=["pool", "direction", "reason"])
        start = SummaryMetricFamily("pdserve_worker_start_seconds",
                                    "From a worker's start to ready (model load included)", labels=["pool"])
        for p in pools:
            for state in ("starting", "ready", "draining"):
                workers.add_metric([p.pool, state], getattr(p, state))
            desired.add_metric([p.pool], p.desired)
            lo.add_metric([p.pool], p.min_workers)
            hi.add_metric([p.pool], p.max_workers)
            tp.add_metric([p.pool], p.tensor_parallel_size)
            # Every series exists from the start, in a fixed pool too (its panel reads 0 events, not "no data").
            counts = {**{(d, r): 0 for d in ("up", "down") for r in REASONS}, **p.events}
            for (direction, reason), n in sorted(counts.items()):
                events.add_metric([p.pool, direction, reason], n)
            start.add_metric([p.pool], len(p.start_seconds), sum(p.start_seconds))
        yield from (workers, desired, lo, hi, tp, events, start)
