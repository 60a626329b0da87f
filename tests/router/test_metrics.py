"""Metrics: utilization arithmetic by hand, the exported series, and a real Prometheus server scraping them."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdserve.config import (
    CacheConfig,
    ClusterConfig,
    EngineConfig,
    ModelConfig,
    PoolConfig,
    SchedulerConfig,
)
from pdserve.engine.utilization import (
    attention_flops,
    linear_flops_per_token,
    lm_head_flops,
    step_bytes,
    step_flops,
    weight_bytes,
)
from pdserve.planner.autoscale import REASONS
from pdserve.serving.messages import WorkerStats
from router.metrics import RouterMetrics
from pdserve.transfer.channel import TRANSFER_SECONDS_BUCKETS

from conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"

TINY = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)


# -- utilization arithmetic -------------------------------------------------------------------------
def test_flops_by_hand():
    # q 64, k/v 32 each, o 64x64, MLP 3 x 64x128; 2 FLOPs per multiply-add; 2 layers.
    per_layer = 2 * 64 * (64 + 32 + 32) + 2 * 64 * 64 + 2 * 3 * 64 * 128
    assert per_layer == 73728
    assert linear_flops_per_token(TINY) == 2 * 73728
    assert attention_flops(TINY, 10) == 2 * 2 * 2 * 64 * 10  # layers x (QK + PV) x 2 x q_size x context
    assert lm_head_flops(TINY) == 2 * 64 * 1000
    # A 3-token prompt from position 0, sampled once: tokens attend to 1, 2 and 3 positions.
    assert step_flops(TINY, [(0, 3)], 1) == 3 * 147456 + 512 * (1 + 2 + 3) + 128000 == 573440
    # A decode at position 10 plus a 2-token chunk at position 5 (attending 6 and 7), both sampled.
    assert step_flops(TINY, [(10, 1), (5, 2)], 2) == 3 * 147456 + 512 * (11 + 6 + 7) + 2 * 128000


def test_bytes_by_hand():
    weights = (147456 // 2 + 64 * 1000) * 4  # fp32 matmul weights incl. the lm_head
    assert weight_bytes(TINY, 4) == weights == 550912
    kv_per_token = 2 * 2 * 32 * 4  # K and V, 2 layers, 2 heads x 16, fp32
    # Two decodes at positions 10 and 20 read 11 and 21 tokens of KV each.
    assert step_bytes(TINY, [(10, 1), (20, 1)], 4) == weights + (11 + 21) * kv_per_token


def test_weight_count_matches_the_model_parameter_count():
    smol = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
    norms = 576 * (2 * 30 + 1)
    assert weight_bytes(smol, 1) == smol.num_params - norms  # tied: the embedding is the lm_head


# -- exported series --------------------------------------------------------------------------------
def stats(pool, worker, **kw) -> WorkerStats:
    base = dict(worker_id=worker, pool=pool, waiting=1, waiting_tokens=7, running=2, kv_blocks_used=3,
                kv_blocks_total=10, steps=5, tokens_processed=40, busy_seconds=1.5, uptime_seconds=10.0, flops=1000,
                bytes_read=2000, peak_flops=1e6, peak_bytes_per_second=1e7, peak_source="measured")
    base.update(kw)
    return WorkerStats(**base)


def test_request_metrics_tpot_and_itl():
    m = RouterMetrics(lambda: [])
    # Arrival at 0; tokens at 1.0, 1.2, 1.5, 2.0: TTFT 1.0, e2e 2.0, TPOT (2.0 - 1.0) / 3, ITL 0.2, 0.3, 0.5.
    m.observe_request(finish_reason="length", code="OK", queue_s=0.1, ttft_s=1.0, e2e_s=2.0,
                      token_times=[1.0, 1.2, 1.5, 2.0], prompt_tokens=9, output_tokens=4)
    def g(name, labels=None):
        return m.registry.get_sample_value(name, {"protocol": "grpc", "service_tier": "default", **(labels or {})})

    assert g("pdserve_request_time_per_output_token_seconds_sum") == pytest.approx(1 / 3)
    assert g("pdserve_request_inter_token_latency_seconds_count") == 3
    assert g("pdserve_request_inter_token_latency_seconds_sum") == pytest.approx(1.0)
    assert g("pdserve_request_inter_token_latency_seconds_bucket", {"le": "0.2"}) == 1
    assert g("pdserve_request_time_to_first_token_seconds_sum") == 1.0
    assert g("pdserve_requests_total", {"finish_reason": "length", "code": "OK"}) == 1
    assert g("pdserve_request_generation_tokens_total") == 4
    # One token: no TPOT, no ITL.
    m.observe_request(finish_reason="stop", code="OK", queue_s=0.0, ttft_s=0.5, e2e_s=0.5, token_times=[0.5],
                      prompt_tokens=3, output_tokens=1)
    assert g("pdserve_request_time_per_output_token_seconds_count") == 1
    # The same request over HTTP is counted under its own protocol.
    m.observe_request(finish_reason="stop", code="OK", queue_s=0.0, ttft_s=0.5, e2e_s=0.5, token_times=[0.5],
                      prompt_tokens=3, output_tokens=1, protocol="http")
    assert m.registry.get_sample_value("pdserve_requests_total", {"protocol": "http", "service_tier": "default",
                                                                  "finish_reason": "stop", "code": "OK"}) == 1
    assert g("pdserve_requests_total", {"finish_reason": "stop", "code": "OK"}) == 1


def test_tier_metrics_judge_each_request_by_its_tiers_slo():
    """SLO attainment and goodput tokens per tier (by the tier asked for), the tier served, queue depth and
    downgrades; the worker-side cost and preemption series by tier."""
    from pdserve.tiers import ServiceTier, TierSLO

    slos = {"priority": TierSLO(1.0, 0.05), "default": TierSLO(4.0, 0.15), "flex": TierSLO(60.0, 1.0)}
    m = RouterMetrics(lambda: [stats("decode", "decode-0", tier_seconds={"default": 2.5, "flex": 0.5},
                                     tier_preemptions={"flex/kept": 3, "flex/recomputed": 1})],
                      slos=slos, downgrades=lambda: 2)
    m.tier_queued(lambda t: {ServiceTier.FLEX: 5}.get(t, 0))

    def one(tier, ttft, e2e, n=5, served=None, code="OK", reason="length"):
        m.observe_request(finish_reason=reason, code=code, queue_s=0.0, ttft_s=ttft, e2e_s=e2e,
                          token_times=[ttft + (e2e - ttft) * i / (n - 1) for i in range(n)], prompt_tokens=3,
                          output_tokens=n, service_tier=tier, served_tier=served)

    one("priority", 0.5, 0.5 + 4 * 0.04)  # TPOT 40 ms: met
    one("priority", 0.5, 0.5 + 4 * 0.10, served="default")  # TPOT 100 ms: missed (priority's 50 ms)
    one("default", 0.5, 0.5 + 4 * 0.10)  # the same timings meet default's 150 ms
    one("flex", 30.0, 34.0, code="CANCELLED", reason="cancelled")  # not finished: not judged

    def v(name, **labels):
        return m.registry.get_sample_value(name, labels)

    assert v("pdserve_tier_slo_requests_total", service_tier="priority", met="true") == 1
    assert v("pdserve_tier_slo_requests_total", service_tier="priority", met="false") == 1
    assert v("pdserve_tier_slo_requests_total", service_tier="default", met="true") == 1
    assert v("pdserve_tier_slo_requests_total", service_tier="flex", met="false") == 0
    assert v("pdserve_tier_slo_output_tokens_total", service_tier="priority", met="true") == 5
    assert v("pdserve_tier_served_requests_total", service_tier="priority", served_tier="default") == 1
    assert v("pdserve_request_time_per_output_token_seconds_count", protocol="grpc", service_tier="priority") == 2
    assert v("pdserve_tier_requests_queued", service_tier="flex") == 5
    assert v("pdserve_tier_requests_queued", service_tier="priority") == 0
    assert v("pdserve_tier_downgrades_total") == 2
    assert v("pdserve_tier_device_seconds_total", pool="decode", worker="decode-0", service_tier="default") == 2.5
    assert v("pdserve_tier_device_seconds_total", pool="decode", worker="decode-0", service_tier="priority") == 0
    assert v("pdserve_tier_preemptions_total", pool="decode", worker="decode-0", service_tier="flex",
             outcome="kept") == 3


def test_worker_series_and_transfer_histogram():
    buckets = [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1)
    buckets[0], buckets[3], buckets[-1] = 2, 1, 1
    workers = [stats("prefill", "prefill-0"),
               stats("decode", "decode-0", preemptions=3, late_steps=2,
                     transfer={"transfers": 4, "bytes": 4096, "seconds": 12.5, "failures": 1,
                               "bucket_counts": buckets})]
    g = RouterMetrics(lambda: workers).registry.get_sample_value
    assert g("pdserve_worker_busy_seconds_total", {"pool": "decode", "worker": "decode-0"}) == 1.5
    assert g("pdserve_worker_peak_flops", {"pool": "prefill", "worker": "prefill-0", "source": "measured"}) == 1e6
    assert g("pdserve_worker_kv_blocks", {"pool": "prefill", "worker": "prefill-0"}) == 10
    assert g("pdserve_worker_preemptions_total", {"pool": "decode", "worker": "decode-0"}) == 3
    assert g("pdserve_worker_late_steps_total", {"pool": "decode", "worker": "decode-0"}) == 2
    assert g("pdserve_worker_late_steps_total", {"pool": "prefill", "worker": "prefill-0"}) == 0
    assert g("pdserve_kv_transfer_failures_total", {"pool": "decode", "worker": "decode-0"}) == 1
    assert g("pdserve_kv_transfers_total", {"pool": "prefill", "worker": "prefill-0"}) is None  # no transfer stats
    lab = {"pool": "decode", "worker": "decode-0"}
    assert g("pdserve_kv_transfer_seconds_bucket", {**lab, "le": str(TRANSFER_SECONDS_BUCKETS[0])}) == 2
    assert g("pdserve_kv_transfer_seconds_bucket", {**lab, "le": str(TRANSFER_SECONDS_BUCKETS[3])}) == 3
    assert g("pdserve_kv_transfer_seconds_bucket", {**lab, "le": "+Inf"}) == 4
    assert g("pdserve_kv_transfer_seconds_sum", lab) == 12.5


def test_session_series_by_pool_and_hop():
    """Prompt tokens by hop, cached or computed, with every hop of each pool at 0 from the start; local prefills and
    the hand-offs' blocks, moved and not, for decode workers only."""
    workers = [stats("prefill", "prefill-0", hop_tokens={"prefill/cached": 32, "prefill/computed": 96}),
               stats("decode", "decode-0", hop_tokens={"local_prefill/cached": 120, "local_prefill/computed": 8},
                     local_prefills=2, handoff_blocks=7, handoff_avoided_blocks=33),
               stats("colocated", "colocated-0")]
    g = RouterMetrics(lambda: workers).registry.get_sample_value
    d, p = {"pool": "decode", "worker": "decode-0"}, {"pool": "prefill", "worker": "prefill-0"}
    hit, computed = "pdserve_worker_prefix_cache_hit_tokens_total", "pdserve_worker_prompt_tokens_computed_by_hop_total"
    assert g(hit, {**p, "hop": "prefill"}) == 32 and g(computed, {**p, "hop": "prefill"}) == 96
    assert g(hit, {**d, "hop": "local_prefill"}) == 120 and g(computed, {**d, "hop": "local_prefill"}) == 8
    assert g(hit, {**d, "hop": "recompute"}) == 0 and g(computed, {**d, "hop": "recompute"}) == 0
    assert g(hit, {**p, "hop": "local_prefill"}) is None  # a prefill worker has no such hop
    assert g(computed, {"pool": "colocated", "worker": "colocated-0", "hop": "colocated"}) == 0
    assert g("pdserve_worker_local_prefills_total", d) == 2
    assert g("pdserve_kv_handoff_blocks_total", d) == 7
    assert g("pdserve_kv_handoff_avoided_blocks_total", d) == 33
    assert g("pdserve_kv_handoff_avoided_blocks_total", p) is None


def test_weight_series():
    workers = [stats("prefill", "prefill-0"),
               stats("decode", "decode-0", weight_version=3, paused=True, weight_updates=3, weight_update_seconds=1.25,
                     weight_update_bytes=4096, weight_update_failures=1, version_outcomes={"kept": 2, "aborted": 1})]
    g = RouterMetrics(lambda: workers).registry.get_sample_value
    d, p = {"pool": "decode", "worker": "decode-0"}, {"pool": "prefill", "worker": "prefill-0"}
    assert g("pdserve_worker_weight_version", d) == 3 and g("pdserve_worker_weight_version", p) == 0
    assert g("pdserve_worker_paused", d) == 1 and g("pdserve_worker_paused", p) == 0
    assert g("pdserve_worker_weight_updates_total", d) == 3
    assert g("pdserve_worker_weight_update_seconds_total", d) == 1.25
    assert g("pdserve_worker_weight_update_bytes_total", d) == 4096
    assert g("pdserve_worker_weight_update_failures_total", d) == 1
    assert [g("pdserve_worker_version_outcomes_total", {**d, "outcome": o}) for o in ("recomputed", "kept", "aborted")] \
        == [0, 2, 1]


def test_served_tokens_are_counted_by_their_weight_staleness():
    """Each token by how many versions its weights were behind the cluster's when its request ended: 3 and more
    in one series; a token newer than the cluster's version (a rolling update under way) counts as 0 behind."""
    served = [5]
    m = RouterMetrics(lambda: [], weight_version=lambda: served[0])
    g = lambda behind: m.registry.get_sample_value("pdserve_request_generation_tokens_by_staleness_total",  # noqa: E731
                                                   {"versions_behind": behind})
    assert [g(b) for b in ("0", "1", "2", "3+")] == [0, 0, 0, 0]  # every series from the start
    m.observe_request(finish_reason="length", code="OK", queue_s=0.0, ttft_s=1.0, e2e_s=2.0,
                      token_times=[1.0] * 9, prompt_tokens=3, output_tokens=9,
                      token_versions=[1, 2, 3, 3, 4, 4, 5, 5, 6])
    assert [g(b) for b in ("0", "1", "2", "3+")] == [3, 2, 2, 2]
    served[0] = 6
    m.observe_request(finish_reason="stop", code="OK", queue_s=0.0, ttft_s=1.0, e2e_s=1.0, token_times=[1.0],
                      prompt_tokens=3, output_tokens=1, token_versions=[5])
    assert g("1") == 3


def test_handoff_and_reservation_wait_histograms():
    from pdserve.transfer.protocol import SecondsHistogram

    handoff, wait = SecondsHistogram(), SecondsHistogram(buckets=(0.1, 1.0))
    for v in (0.004, 0.02, 0.02, 3.0):
        handoff.observe(v)
    wait.observe(0.5)
    workers = [stats("prefill", "prefill-0"),
               stats("decode", "decode-0", handoff=handoff.snapshot(), reservation_wait=wait.snapshot())]
    g = RouterMetrics(lambda: workers).registry.get_sample_value
    lab = {"pool": "decode", "worker": "decode-0"}
    assert g("pdserve_kv_handoff_seconds_bucket", {**lab, "le": "0.005"}) == 1
    assert g("pdserve_kv_handoff_seconds_bucket", {**lab, "le": "0.025"}) == 3
    assert g("pdserve_kv_handoff_seconds_bucket", {**lab, "le": "+Inf"}) == 4
    assert g("pdserve_kv_handoff_seconds_sum", lab) == pytest.approx(3.044)
    assert g("pdserve_kv_reservation_wait_seconds_bucket", {**lab, "le": "0.1"}) == 0
    assert g("pdserve_kv_reservation_wait_seconds_bucket", {**lab, "le": "1.0"}) == 1
    assert g("pdserve_kv_handoff_seconds_count", {"pool": "prefill", "worker": "prefill-0"}) is None


# -- PromQL expressions ------------------------------------------------------------------------------
def dashboard_queries() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def rule_queries() -> list[str]:
    out = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for r in group["rules"]:
            if "record" in r:
                out += [r["expr"], r["record"]]  # the expression, and the series Prometheus recorded from it
            else:
                # An alert's expression is empty unless it fires: `A > N` as `A > bool N` still returns A's series.
                out.append(re.sub(r"\s(>|<|>=|<=|==|!=)\s", r" \1 bool ", r["expr"], count=1))
    return out


_SELECTOR = re.compile(r"\b(pdserve_[a-z0-9_]+)(?:\{([^}]*)\})?")
_OR_ZERO = re.compile(r"(\[\w+\])?\)*\s*or vector\(0\)")  # what follows a selector the expression lets be absent
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def _matches(labels: dict[str, str], matchers: str) -> bool:
    for name, op, value in _MATCHER.findall(matchers or ""):
        have = labels.get(name, "")
        ok = {"=": have == value, "!=": have != value, "=~": re.fullmatch(value, have) is not None,
              "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


# Series a mixture of experts' workers alone export. A dense model's panels for them read the value their
# expression falls back to when no such series exists (`or on() vector(N)`), not "no data".
MOE_ONLY = {"pdserve_worker_expert_tokens_total"}
# Series only a speculating worker exports (--speculative-config): their panels fall back to a number elsewhere.
SPEC_ONLY = {f"pdserve_worker_spec_{n}" for n in ("drafted_tokens_total", "accepted_tokens_total", "draft_stale",
                                                  "acceptance_length_sum", "acceptance_length_count",
                                                  "acceptance_length_bucket")}
_FALLBACK = re.compile(r"\bor on\(\) vector\([\d.]+\)$")


@pytest.mark.parametrize("experts", [0, 8])
def test_every_queried_series_exists_at_zero_from_the_start(experts):
    """A router just started with default flags (fixed pools, nothing served, no transfer yet): every series
    a dashboard panel or a rule selects is there, so a panel reads 0 rather than "no data"; the counters of
    what has not happened (requests, scale events, failures) read 0. The expert panels' series exist where the
    model is a mixture of experts (8 experts), one per expert; on a dense model those panels fall back to a
    number."""
    from router.metrics import PoolScale
    from pdserve.transfer.channel import TransferStats
    from pdserve.transfer.protocol import SecondsHistogram

    zeros = dict(steps=0, tokens_processed=0, busy_seconds=0.0, flops=0, bytes_read=0, waiting=0, waiting_tokens=0,
                 running=0, kv_blocks_used=0, transfer=TransferStats().snapshot(), expert_tokens=(0,) * experts)
    workers = [stats("prefill", "prefill-0", **zeros),
               stats("decode", "decode-0", **zeros, handoff=SecondsHistogram().snapshot(),
                     reservation_wait=SecondsHistogram().snapshot())]
    pools = [PoolScale(p, 1, 0, 0, 1, 1, 1, (4.0,), {}) for p in ("prefill", "decode")]  # fixed: 1:1
    m = RouterMetrics(lambda: workers, scale=lambda: pools)
    exposed = [(s.name, s.labels, s.value) for f in m.registry.collect() for s in f.samples]
    missing = []
    for expr in dashboard_queries() + rule_queries():
        for sel in _SELECTOR.finditer(expr):
            name, matchers = sel.groups()
            if _OR_ZERO.match(expr, sel.end()):  # `(... failed requests ...) or vector(0)`: none failed yet
                continue
            if name in MOE_ONLY and not experts:
                if not _FALLBACK.search(expr):
                    missing.append(f"{name} (a dense model has none) without a fallback in {expr}")
                continue
            if name in SPEC_ONLY:  # no worker here speculates
                if not _FALLBACK.search(expr):
                    missing.append(f"{name} (a worker that does not speculate has none) without a fallback in {expr}")
                continue
            if not any(n == name and _matches(labels, matchers) for n, labels, _ in exposed):
                missing.append(f"{name}{{{matchers or ''}}} in {expr}")
    assert not missing, missing
    assert len([n for n, labels, _ in exposed if n in MOE_ONLY and labels["pool"] == "decode"]) == experts
    for name in ("pdserve_requests_total", "pdserve_scale_events_total", "pdserve_kv_transfer_failures_total",
                 "pdserve_request_time_to_first_token_seconds_count", "pdserve_tier_slo_requests_total"):
        values = [v for n, _, v in exposed if n == name]
        assert values and not any(values), name
    # Only label values that can happen: the gRPC door (HTTP is off), every tier, requests that ended OK.
    requests = {tuple(sorted(labels.items())) for n, labels, _ in exposed if n == "pdserve_requests_total"}
    assert requests == {(("code", "OK"), ("finish_reason", r), ("protocol", "grpc"), ("service_tier", t))
                        for r in ("stop", "length") for t in ("priority", "default", "flex")}
    with_http = RouterMetrics(lambda: [], protocols=("grpc", "http")).registry.get_sample_value
    assert with_http("pdserve_request_e2e_seconds_count", {"protocol": "http", "service_tier": "flex"}) == 0
    # A fixed pool's scale events: each direction and reason at 0, as an autoscaled pool's.
    events = [labels for n, labels, _ in exposed if n == "pdserve_scale_events_total" and labels["pool"] == "decode"]
    assert len(events) == 2 * len(REASONS)


def test_the_speculation_panels_read_a_speculating_workers_series():
    """Every series the speculative-decoding panels select is exported for a worker that speculates (elsewhere
    the panels read their fallback: test_every_queried_series_exists_at_zero_from_the_start)."""
    spec = {"method": "ngram", "drafted": 10, "accepted": 7, "verifications": 4,
            "acceptance_lengths": {"0": 1, "2": 1, "4": 2}, "draft_stale": False}
    m = RouterMetrics(lambda: [stats("fast", "fast-0", speculation=spec), stats("decode", "decode-0")])
    exposed = [(s.name, s.labels) for f in m.registry.collect() for s in f.samples]
    selected = [sel.groups() for e in dashboard_queries() for sel in _SELECTOR.finditer(e) if sel.group(1) in SPEC_ONLY]
    assert {name for name, _ in selected} == SPEC_ONLY
    for name, matchers in selected:
        assert any(n == name and labels["pool"] == "fast" and _matches(labels, matchers) for n, labels in exposed), \
            (name, matchers)
    assert not [n for n, labels in exposed if n in SPEC_ONLY and labels["pool"] == "decode"]


def test_dashboard_is_grafana_shaped():
    d = json.loads(DASHBOARD.read_text())
    assert d["templating"]["list"][0]["type"] == "datasource"
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Prefill pool", "Decode pool", "Latency", "KV transfer", "Sessions and prefix cache",
                    "Pool sizes (autoscaling)",
                    "Service tiers", "Weights (RL updates)", "Mixture of experts", "KV tiers (offload)",
                    "Speculative decoding"]
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
    assert len(dashboard_queries()) > 30


def test_promtool_accepts_rules_and_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; `make setup` installs it where it can)")
    subprocess.run([promtool, "check", "rules", str(RULES)], check=True, capture_output=True)
    subprocess.run([promtool, "check", "config", str(ROOT / "deploy" / "prometheus" / "prometheus.yaml")], check=True,
                   capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prom_query(port: int, expr: str, at: float | None = None) -> list:
    """An instant query, evaluated now or at `at` (Unix seconds: the query API's `time`)."""
    params = {"query": expr} if at is None else {"query": expr, "time": repr(at)}
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(params)
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).status == 200
    except OSError:
        return False


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus server is not installed (Debian package prometheus; `make setup` installs it "
                    "where it can)")
    procs = []

    def start(target_port: int) -> int:
        port = free_port()
        cfg = tmp_path / "prometheus.yaml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "pdserve", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
        }))
        procs.append(subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                       f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_for(lambda: _ready(port), timeout=60, what="Prometheus to be ready")
        return port

    yield start
    for p in procs:
        p.terminate()
        p.wait(30)


RATE_WINDOW_S = 60  # the rules' rate windows ([1m]), and $__rate_interval here
PREFILL_MFU = 'pdserve:worker_mfu:ratio_rate1m{pool="prefill"}'


def _rises(port: int, counter: str, since: float) -> list[tuple[float, float]] | None:
    """For each series of `counter`: (the time of the last scrape before its first rise at or after `since`,
    the time of the scrape after the one that saw the rise); None until every series has both."""
    found = []
    for series in prom_query(port, f"{counter}[5m]"):
        values = [(float(t), float(v)) for t, v in series["values"]]
        rise = next(((t0, t2) for (t0, v0), (t1, v1), (t2, _) in zip(values, values[1:], values[2:])
                     if t1 >= since and v1 > v0), None)
        if rise is None:
            return None
        found.append(rise)
    return found or None


def evaluation_over_load(port: int, since: float) -> tuple[float, float] | None:
    """The first evaluation of the prefill's MFU rule over a window that holds, for every worker, the scrape
    before its FLOPs rose under load and the scrape that saw the rise: (its time, its value); None until
    Prometheus has one. A scrape's samples are stored once it ends and a target's next scrape starts only
    then, so an evaluation timed at or after the next scrape sees the rise."""
    rises = _rises(port, "pdserve_worker_flops_total", since)
    if rises is None:
        return None
    first, last = min(before for before, _ in rises), max(after for _, after in rises)
    for series in prom_query(port, f"{PREFILL_MFU}[5m]"):
        for t, v in series["values"]:
            if last <= float(t) < first + RATE_WINDOW_S:
                return float(t), float(v)
    return None


def scrape_every_expression(aloop, cluster, prometheus, first_token: int, experts: bool) -> None:
    """A router with default flags on `cluster` (fixed pools, no autoscaling, no fast lane, no HTTP door),
    scraped by a real Prometheus with the rules: every dashboard and rule expression reads a number (a zero
    included), never "no data", idle and then under load (the series of features that are off exist at
    0). The load's prompts are runs of one token from first_token on (300 of them)."""
    from pdserve.client import AsyncClient
    from router.compose import build_router
    from router.config import RouterConfig

    router = build_router(cluster, RouterConfig(port=0, metrics_port=0))
    aloop.run(router.start())
    try:
        prom_port = prometheus(router.metrics_port)
        exprs = [e.replace("$__rate_interval", f"{RATE_WINDOW_S}s") for e in dashboard_queries()] + rule_queries()
        expert_exprs = [e for e in exprs if "pdserve_worker_expert_tokens_total" in e]
        assert len(expert_exprs) == 2

        def empty(at: float | None = None) -> list[str]:
            return [e for e in exprs if not prom_query(prom_port, e, at)]

        def samples(expr: str) -> float:
            result = prom_query(prom_port, f"min(count_over_time({expr}[1m]))")
            return float(result[0]["value"][1]) if result else 0.0

        def dense_fallbacks(at: float | None = None) -> None:
            # A dense model's expert panels: one series, no labels, 0 tokens routed and an imbalance of 1.
            read = [[(r["metric"], r["value"][1]) for r in prom_query(prom_port, e, at)] for e in expert_exprs]
            assert read == [[({}, "0")], [({}, "1")]]

        # From the start, before any request: every panel and rule has its series (zeros, or NaN for a
        # quantile or ratio of zero rates), once rate() has two scrapes and the rules an evaluation.
        wait_for(lambda: samples("pdserve_worker_busy_seconds_total") >= 3, timeout=60, interval=0.5,
                 what="Prometheus to have scraped the idle router")
        missing = empty()
        for _ in range(10):  # a rule evaluated before the second scrape has its series a second later
            if not missing:
                break
            time.sleep(1)
            missing = empty()
        assert not missing, f"idle, {len(missing)} of {len(exprs)} expressions returned no data: {missing}"
        assert prom_query(prom_port, "sum(pdserve_requests_total)")[0]["value"][1] == "0"  # nothing served yet
        if not experts:
            dense_fallbacks()

        stop = threading.Event()

        async def load():
            async with AsyncClient(f"127.0.0.1:{router.port}") as c:
                n = 0
                while not stop.is_set():
                    prompts = [[first_token + (n + i) % 300] * (5 + 7 * i) for i in range(6)]
                    await asyncio.gather(*(c.complete(token_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True)
                                           for p in prompts))
                    n += 1
                try:  # one failing request, so the error series exist too
                    await c.complete(token_ids=[10**6], max_tokens=2)
                except Exception:  # noqa: BLE001 - INVALID_ARGUMENT is the point
                    pass

        load_started = time.time()  # Prometheus stamps its samples with this clock
        loader = threading.Thread(target=lambda: asyncio.run(load()))
        loader.start()

        # Under load until rate() over 1m windows has several scrapes of finished requests (two rounds at
        # least: the zero series exist from the start) and of workers.
        def served() -> float:
            result = prom_query(prom_port, 'sum(pdserve_requests_total{code="OK"})')
            return float(result[0]["value"][1]) if result else 0.0

        wait_for(lambda: served() >= 12 and samples('pdserve_requests_total{code="OK"}') >= 4
                 and samples("pdserve_worker_busy_seconds_total") >= 4,
                 timeout=180, interval=0.5, what="Prometheus to have scraped the router under load")
        stop.set()
        loader.join(60)
        wait_for(lambda: prom_query(prom_port, "pdserve_requests_total{code='INVALID_ARGUMENT'}"), timeout=30,
                 interval=0.5, what="the failed request to be scraped")
        missing = empty()
        assert not missing, f"under load, {len(missing)} of {len(exprs)} expressions returned no data: {missing}"
        # The utilization series are real numbers, not just present: read where the rules' windows held the
        # load's work. Read now, a 1m rate is 0 once the load is over a minute old (as it can be on a slow
        # host: the last round, the failed request's scrape and the queries above come between).
        at, mfu = wait_for(lambda: evaluation_over_load(prom_port, load_started), timeout=60, interval=0.5,
                           what="a rule evaluation of the prefill's MFU over the scrapes of every worker's "
                                "FLOPs rising under load")
        assert 0 < mfu < 1
        assert not empty(at), "an expression returned no data where the load's work was in its window"
        if experts:
            # Every expert of both pools' workers has its series; the busiest expert's load is the mean's or more.
            routed = prom_query(prom_port, "pdserve_worker_expert_tokens_total")
            assert sorted(int(r["metric"]["expert"]) for r in routed if r["metric"]["pool"] == "decode") \
                == list(range(8))
            assert sum(float(r["value"][1]) for r in routed) > 0
            assert all(float(r["value"][1]) >= 1 for r in prom_query(prom_port, expert_exprs[1], at))
        else:
            dense_fallbacks(at)
        source = prom_query(prom_port, "pdserve_worker_peak_flops")[0]["metric"]["source"]
        assert source == "measured"
    finally:
        aloop.run(router.stop(grace=5))


def test_prometheus_scrapes_every_dashboard_and_rule_expression(ray_local, aloop, tmp_path, prometheus):
    """scrape_every_expression on a mixture of experts: the dense layers' series and the experts'."""
    from router.cluster import Cluster

    from moe_models import build

    # A tiny mixture of experts (a dense first layer, then experts).
    model = build(tmp_path / "moe", "qwen3_moe-mixed", packed=True)
    cache = CacheConfig(block_size=4, num_blocks=256)
    engine = EngineConfig(model=str(model), cache=cache)
    pool = PoolConfig(1, num_cpus=0.25, cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    cluster = Cluster(ClusterConfig(engine=engine, prefill=pool, decode=pool, stats_interval_s=0.5))
    aloop.run(cluster.start(), timeout=600)
    try:
        scrape_every_expression(aloop, cluster, prometheus, first_token=1, experts=True)
    finally:
        aloop.run(cluster.shutdown())


@pytest.mark.slow
def test_prometheus_reads_every_panel_on_a_dense_model(aloop, smol_1p1d, prometheus):
    """scrape_every_expression on a dense model (SmolLM2, on the suite's shared cluster: no start-up of its
    own): no expert series exists and the expert panels read their fallbacks. Its prompts (runs of a token
    from 30000 on) are none another module sends to the shared cluster."""
    scrape_every_expression(aloop, smol_1p1d, prometheus, first_token=30000, experts=False)


def test_kv_offload_series_by_tier():
    """The KV tiers' blocks and bytes written and loaded, hits and load time, by tier; 0 for a worker without tiers."""
    tier = {"written_host_blocks": 9, "written_host_bytes": 9 * 64, "written_disk_blocks": 4,
            "written_disk_bytes": 4 * 64, "loaded_host_blocks": 5, "loaded_host_bytes": 5 * 64,
            "loaded_disk_blocks": 2, "loaded_disk_bytes": 2 * 64, "hits_host_blocks": 6, "hits_disk_blocks": 2,
            "load_seconds": 0.25}
    workers = [stats("decode", "decode-0", kv_offload=tier), stats("prefill", "prefill-0")]
    g = RouterMetrics(lambda: workers).registry.get_sample_value
    d, p = {"pool": "decode", "worker": "decode-0"}, {"pool": "prefill", "worker": "prefill-0"}
    assert g("pdserve_worker_kv_offload_blocks_total", {**d, "op": "written", "tier": "disk"}) == 4
    assert g("pdserve_worker_kv_offload_bytes_total", {**d, "op": "loaded", "tier": "host"}) == 5 * 64
    assert g("pdserve_worker_kv_offload_hit_blocks_total", {**d, "tier": "host"}) == 6
    assert g("pdserve_worker_kv_offload_load_seconds_total", d) == 0.25
    assert g("pdserve_worker_kv_offload_blocks_total", {**p, "op": "loaded", "tier": "host"}) == 0
