"""The autoscaling policy (pdserve.planner.autoscale), its settings, and the simulator driving it: pure
Python, exact numbers from hand-made cost models (a cost model is the policy's input, as a profile is)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.config import AutoscaleConfig, ClusterConfig, PoolConfig
from pdserve.perf.costs import MeasuredCosts, Transport
from pdserve.planner.autoscale import (
    Autoscaler,
    Demand,
    DemandWindow,
    Need,
    PoolLimits,
    decode_batch,
    decode_need,
    prefill_need,
)
from pdserve.planner.simulator import ClusterShape, PoolShape, simulate

LINK = Transport(latency_s=0.001, bytes_per_s=1e15)


def costs(per_token=0.001, decode=(0.01, 0.073), batches=(1, 64)) -> MeasuredCosts:
    """Prefill 1 ms a token (1000 tokens/s a worker); decode 10 ms at batch 1, +1 ms per request more."""
    return MeasuredCosts({"overhead_s": 0.0, "per_token_s": per_token, "per_pair_s": 0.0, "per_seq_s": 0.0},
                         batches, decode, 0.0, LINK, kv_bytes_per_token=1000, weight_bytes=10**6)


LIMITS = PoolLimits(kv_blocks=10_000, block_size=16, max_num_seqs=64, token_budget=2048)


def demand(rate=0.0, input_len=100, output_len=50, backlog=0, decode_requests=0, kv=0) -> Demand:
    return Demand(rate, input_len, output_len, backlog, decode_requests, kv)


# -- sizing ---------------------------------------------------------------------------------------

def test_prefill_is_sized_by_prompt_tokens_per_second():
    # 20 req/s x 100 tokens = 2000 tokens/s; a worker computes 1000/s and plans for 90 % of it.
    assert prefill_need(costs(), LIMITS, demand(rate=20), ttft_s=1.0, startup_s=5) == Need(3, "rate")
    assert prefill_need(costs(), LIMITS, demand(rate=8), ttft_s=1.0, startup_s=5) == Need(1, "rate")
    assert prefill_need(costs(), LIMITS, demand(), ttft_s=1.0, startup_s=5) == Need(0, "rate")


def test_a_tight_ttft_target_plans_for_less_utilization():
    # A prompt alone takes 0.1 s; within 0.15 s it may wait 0.05 s: M/D/1 allows 50 % utilization.
    assert prefill_need(costs(), LIMITS, demand(rate=20), ttft_s=0.15, startup_s=5) == Need(4, "rate")


def test_a_backlog_counts_only_what_a_new_worker_would_arrive_in_time_for():
    # 10,000 waiting tokens, 1000/s a worker: 2 workers clear it in the 5 s a new one takes to start...
    assert prefill_need(costs(), LIMITS, demand(backlog=10_000), ttft_s=1.0, startup_s=5) == Need(2, "backlog")
    # ... but if it takes 20 s, the one there has finished it long before.
    assert prefill_need(costs(), LIMITS, demand(backlog=10_000), ttft_s=1.0, startup_s=20) == Need(1, "backlog")


def test_decode_batch_is_the_largest_within_tpot_and_kv():
    assert decode_batch(costs(), LIMITS, 100, 50, tpot_s=0.030) == 21  # 10 ms + 1 ms x 20
    assert decode_batch(costs(), LIMITS, 100, 50, tpot_s=1.0) == 64  # max_num_seqs
    small = PoolLimits(kv_blocks=100, block_size=16, max_num_seqs=64, token_budget=2048)
    assert decode_batch(costs(), small, 100, 50, tpot_s=1.0) == 8  # 85 blocks at 10 blocks a request
    assert decode_batch(costs(), LIMITS, 100, 50, tpot_s=0.001) == 1  # never below one


def test_decode_is_sized_by_littles_law_and_by_what_it_holds():
    # b* = 21 at 30 ms; its step is 30 ms. 20 req/s x 49 decode steps x 30 ms = 29.4 requests decoding
    # at once, over 90 % of 21 each: 2 workers.
    assert decode_need(costs(), LIMITS, demand(rate=20), tpot_s=0.030) == Need(2, "rate")
    assert decode_need(costs(), LIMITS, demand(rate=40), tpot_s=0.030) == Need(4, "rate")
    # 50 requests already on decode workers need 3 of 21, whatever the rate says.
    assert decode_need(costs(), LIMITS, demand(decode_requests=50), tpot_s=0.030) == Need(3, "running")
    # KV in use: 17,000 blocks over 85 % of 10,000 a worker.
    assert decode_need(costs(), LIMITS, demand(kv=17_001), tpot_s=0.030) == Need(3, "kv")


# -- decisions and hysteresis ---------------------------------------------------------------------

def scaler(delay=10.0, prefill=(1, 4), decode=(1, 4)) -> Autoscaler:
    return Autoscaler(costs(), {"prefill": LIMITS, "decode": LIMITS}, {"prefill": prefill, "decode": decode},
                      ttft_s=1.0, tpot_s=0.030, scale_down_delay_s=delay, startup_s=5)


def sizes(decisions) -> dict[str, tuple[int, str]]:
    return {d.pool: (d.desired, d.reason) for d in decisions}


def test_up_at_once_down_only_after_the_delay_and_within_the_range():
    a = scaler()
    current = {"prefill": 1, "decode": 1}
    assert sizes(a.decide(0, demand(), current)) == {"prefill": (1, "minimum"), "decode": (1, "minimum")}
    burst = demand(rate=20, decode_requests=50)
    assert sizes(a.decide(2, burst, current)) == {"prefill": (3, "rate"), "decode": (3, "running")}
    current = {"prefill": 3, "decode": 3}
    # The burst is over: for the next 10 s the pools keep what they needed in it.
    for t in (4, 8, 12):
        assert sizes(a.decide(t, demand(), current)) == {"prefill": (3, "rate"), "decode": (3, "running")}
    assert sizes(a.decide(12.5, demand(), current)) == {"prefill": (1, "minimum"), "decode": (1, "minimum")}
    # More than the range allows is the range's maximum.
    assert sizes(a.decide(13, demand(rate=100, decode_requests=500), {"prefill": 1, "decode": 1})) == \
        {"prefill": (4, "maximum"), "decode": (4, "maximum")}


def test_a_lull_shorter_than_the_delay_drains_nothing():
    a = scaler(delay=30)
    burst = demand(rate=20)
    for t in range(0, 100, 2):  # bursts of 4 s every 20 s
        current = {"prefill": 3, "decode": 2}
        d = sizes(a.decide(t, burst if t % 20 < 4 else demand(), current))
        if t >= 2:
            assert d == {"prefill": (3, "rate"), "decode": (2, "rate")}, t


def test_decisions_say_their_direction():
    a = scaler()
    (p, d) = a.decide(0, demand(rate=20), {"prefill": 4, "decode": 1})
    assert (p.pool, p.current, p.desired, p.direction) == ("prefill", 4, 3, "down")
    assert (d.pool, d.desired, d.direction) == ("decode", 2, "up")


def test_bad_ranges_and_targets_are_refused():
    with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
        scaler(prefill=(0, 2))
    with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
        scaler(decode=(3, 2))
    with pytest.raises(ValueError, match="only the prefill, decode and fast pools"):
        Autoscaler(costs(), {}, {"colocated": (1, 2)}, 1.0, 0.03, 10, 5)
    with pytest.raises(ValueError, match="positive"):
        Autoscaler(costs(), {}, {}, 0.0, 0.03, 10, 5)


# -- the demand window ----------------------------------------------------------------------------

def test_demand_window_rate_and_lengths():
    w = DemandWindow(10.0)
    assert w.observe(0.0) == (0.0, 0.0, 0.0)
    for k in range(20):  # 20 requests over 4 s: 5 req/s
        w.arrived(1.0 + k * 0.2, 100 + k, 64)
    rate, n_in, n_out = w.observe(5.0)
    assert rate == pytest.approx(20 / 5.0) and n_in == pytest.approx(109.5)
    assert n_out == 64  # nothing finished yet: the requested max_tokens
    for k in range(DemandWindow.MIN_FINISHED - 1):
        w.finished(5.5, 10 + 20 * (k % 2))
    assert w.observe(6.0)[2] == 64  # too few finished: the first to finish are the short ones
    w.finished(5.6, 20)
    produced = (10 * 10 + 9 * 30 + 20) / 20
    assert w.observe(6.0)[2] == pytest.approx(produced)  # what finished requests produced
    # Nothing in the window: no rate, but the lengths of the requests before (a wave to come is
    # sized by the waves before it).
    assert w.observe(30.0) == (0.0, pytest.approx(109.5), pytest.approx(produced))
    with pytest.raises(ValueError):
        DemandWindow(0)


def test_demand_window_rate_counts_from_its_start():
    w = DemandWindow(30.0, start=0.0)
    for k in range(24):  # a burst at 20 s, watched since 0: 24 requests over 20 s, not over 0.1 s
        w.arrived(20.0 + k * 0.004, 100, 10)
    assert w.observe(20.1)[0] == pytest.approx(24 / 20.1)


# -- settings ----------------------------------------------------------------------------------------

def test_ranges_and_the_cost_model_they_need():
    pool = PoolConfig(1, max_workers=3)
    c = ClusterConfig(prefill=pool, decode=PoolConfig(2), autoscale=AutoscaleConfig(gpu="H100"))
    assert c.ranges == {"prefill": (1, 3)}  # a plain N (or N:N) stays fixed
    with pytest.raises(ValueError, match="cost model"):
        ClusterConfig(prefill=pool)
    with pytest.raises(ValueError, match="colocated pool does not autoscale"):
        ClusterConfig(mode="colocated", colocated=pool, autoscale=AutoscaleConfig(gpu="H100"))
    with pytest.raises(ValueError, match="MIN <= MAX"):
        PoolConfig(3, max_workers=2)
    with pytest.raises(ValueError, match="not both"):
        AutoscaleConfig(profile="p.json", gpu="H100")


@pytest.mark.parametrize("flag, message", [("0:2", "1 <= MIN <= MAX"), ("3:2", "1 <= MIN <= MAX"), ("a:b", "N or MIN:MAX")])
def test_serve_refuses_bad_worker_ranges(flag, message, capsys):
    from router.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--decode-workers", flag])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_serve_config_file_ranges(tmp_path):
    from router.cli import cluster_config_from_args, parse_args

    cfg = tmp_path / "serve.yaml"
    # Unquoted, as a user would write it: YAML 1.1 reads 1:3 as 63 (base 60); the file's reader does not.
    cfg.write_text('prefill-workers: 1:3\ndecode-workers: 2\ngpu: H100\nscale-down-delay: 15\n')
    c = cluster_config_from_args(parse_args(["serve", "--config", str(cfg)]))
    assert c.ranges == {"prefill": (1, 3)} and c.decode.num_workers == 2
    assert c.autoscale.gpu == "H100" and c.autoscale.scale_down_delay_s == 15


# -- the simulator, autoscaled --------------------------------------------------------------------

def pool(workers: int) -> PoolShape:
    return PoolShape(workers, 10_000, 16, 64, 2048)


def bursts(n_per_burst=200, gap=120.0):
    """Two bursts of requests 1 s long, `gap` seconds apart: 100-token prompts, 50-token outputs."""
    arrival = np.concatenate([np.linspace(0, 1, n_per_burst), gap + np.linspace(0, 1, n_per_burst)])
    n = len(arrival)
    return arrival, np.full(n, 100), np.full(n, 50)


def test_simulated_pools_grow_in_each_burst_and_shrink_between():
    arrival, ins, outs = bursts()
    a = scaler(delay=20)
    res = simulate(ClusterShape("disaggregated", pool(1), pool(1)), costs(), arrival, ins, outs, autoscaler=a,
                   interval_s=1.0, startup_s=5.0)
    assert res.ok.all()  # nothing dropped by scaling
    times = np.array([t for t, _, _ in res.sizes])
    decode = np.array([d for _, _, d in res.sizes])
    prefill = np.array([p for _, p, _ in res.sizes])
    for start in (0.0, 120.0):  # each burst grows both pools, and they are back at 1 before the next
        during = (times >= start) & (times < start + 10)
        assert decode[during].max() > 1 and prefill[during].max() > 1
    # Recorded at each change: the sizes in effect 100 s in, long after the first burst was served.
    assert [s[1:] for s in res.sizes if s[0] <= 100][-1] == (1, 1)
    assert times[-1] > 120  # ... and the second burst did grow them again
    fixed = simulate(ClusterShape("disaggregated", pool(4), pool(4)), costs(), arrival, ins, outs)
    last = np.nanmax(fixed.end)
    assert fixed.worker_seconds == pytest.approx(8 * last)  # every worker, the whole run
    assert res.worker_seconds < 0.7 * fixed.worker_seconds  # idle between the bursts at 1P1D, not 4P4D


def test_a_simulated_worker_takes_requests_only_once_started():
    arrival, ins, outs = bursts(n_per_burst=400, gap=1000.0)
    arrival, ins, outs = arrival[:400], ins[:400], outs[:400]
    runs = {}
    for startup in (2.0, 1000.0):  # a worker that never starts within the run serves nobody
        runs[startup] = simulate(ClusterShape("disaggregated", pool(1), pool(1)), costs(), arrival, ins, outs,
                                 autoscaler=scaler(), interval_s=1.0, startup_s=startup)
    never = runs[1000.0]
    assert set(never.busy_s) >= {"prefill-1", "decode-1"}
    assert never.busy_s["prefill-1"] == 0 and never.busy_s["decode-1"] == 0
    assert runs[2.0].busy_s["prefill-1"] > 0
    assert np.nanmax(runs[2.0].end) < np.nanmax(never.end)
    assert math.isclose(never.ok.mean(), 1.0)


# -- the fast lane (service tiers) ----------------------------------------------------------------

LANE = PoolLimits(kv_blocks=10_000, block_size=16, max_num_seqs=6, token_budget=2048)


def test_the_fast_lane_is_sized_by_priority_tpot_and_its_cap():
    a = Autoscaler(costs(), {"decode": LIMITS, "fast": LANE}, {"decode": (1, 8), "fast": (1, 8)}, ttft_s=1.0,
                   tpot_s=0.030, scale_down_delay_s=10, startup_s=5, fast_tpot_s=0.0125)
    # Priority's 12.5 ms allows b = 3 (10 ms + 1 ms x 2), under the lane's cap of 6; its step is 12 ms.
    # 10 req/s of priority x 49 steps x 12 ms = 5.88 decoding at once, over 90 % of 3: 3 workers.
    # The decode pool, from the whole demand at 30 ms (b* = 21): 100 x 49 x 30 ms = 147 over 18.9: 8.
    whole, priority = demand(rate=100), demand(rate=10)
    got = sizes(a.decide(0.0, whole, {"decode": 1, "fast": 1}, {"fast": priority}))
    assert got == {"decode": (8, "rate"), "fast": (3, "rate")}
    # A loose priority target is capped by the lane's max running: b = 6, step 15 ms, 5.88 x 15/12 / 5.4.
    loose = Autoscaler(costs(), {"fast": LANE}, {"fast": (1, 8)}, 1.0, 0.030, 10, 5, fast_tpot_s=1.0)
    assert loose.need("fast", priority) == Need(2, "rate")
    # Without its own demand the lane would be sized by the whole cluster's: the loop always gives it one.
    assert loose.need("fast", demand(decode_requests=13)) == Need(3, "running")


def test_an_autoscaled_fast_lane_needs_priority_tpot():
    with pytest.raises(ValueError, match="priority tier's TPOT"):
        Autoscaler(costs(), {"fast": LANE}, {"fast": (1, 2)}, 1.0, 0.03, 10, 5)
    with pytest.raises(ValueError, match="only the prefill, decode and fast pools"):
        Autoscaler(costs(), {}, {"colocated": (1, 2)}, 1.0, 0.03, 10, 5, fast_tpot_s=0.05)


class _Scaling:
    """The pools' scaling side as router.autoscaler uses it: sizes, workers, and what it was told."""

    def __init__(self, workers):
        self.workers = workers
        self.calls = []
        self.owner = True  # the router that owns the pools (router replicas: only it scales)

    def last_start_seconds(self):
        return None

    def size(self, pool):
        return sum(w.pool == pool for w in self.workers)

    def grow(self, pool, n, reason):
        self.calls.append(("grow", pool, n, reason))

    def drain(self, pool, n, reason):
        self.calls.append(("drain", pool, n, reason))


def _loop_cluster(with_tier_demand: bool):
    from types import SimpleNamespace

    from pdserve.perf.hardware import resolve_model
    from pdserve.tiers import ServiceTier, TiersConfig, TierSLO

    config = ClusterConfig(prefill=PoolConfig(1), decode=PoolConfig(1, max_workers=8), fast=PoolConfig(1, max_workers=8),
                           autoscale=AutoscaleConfig(gpu="H100", tpot_target_s=0.030),
                           tiers=TiersConfig(fast_lane_max_running=6, slo={"priority": TierSLO(1.0, 0.0125)}))
    lane_worker = SimpleNamespace(pool="fast", requests={"a", "b", "c", "d"}, stats=SimpleNamespace(kv_blocks_used=40))
    workers = [SimpleNamespace(pool="prefill", requests=set(), stats=None),
               SimpleNamespace(pool="decode", requests={"x"}, stats=SimpleNamespace(kv_blocks_used=10)), lane_worker]
    cluster = SimpleNamespace(config=config, info=SimpleNamespace(config=resolve_model("llama-3-8b")[1], path="m"),
                              scaling=_Scaling(workers), load=lambda now, queued: demand(rate=100))
    if with_tier_demand:
        window = DemandWindow(10.0, start=0.0)
        for k in range(100):  # 10 req/s of priority over the last 10 s, 100-token prompts, 50-token outputs
            window.arrived(k / 10, 100, 50)
        cluster.tier_demand = {t: DemandWindow(10.0, start=0.0) for t in ServiceTier}
        cluster.tier_demand[ServiceTier.PRIORITY] = window
    return cluster


@pytest.mark.parametrize("with_tier_demand", [True, False])
def test_the_loop_scales_the_fast_lane_by_priority_demand(with_tier_demand):
    from router.autoscaler import AutoscaleLoop

    cluster = _loop_cluster(with_tier_demand)
    loop = AutoscaleLoop(cluster)
    assert loop.policy.fast_tpot_s == 0.0125 and loop.policy.limits["fast"].max_num_seqs == 6
    loop.policy.costs = dict.fromkeys(loop.policy.ranges, costs())  # the hand-made model, for exact numbers
    for name in ("decode", "fast"):
        loop.policy.limits[name] = LIMITS if name == "decode" else LANE
    lane = loop.fast_demand(10.0)
    assert (lane.decode_requests, lane.decode_kv_blocks) == (4, 40)  # the lane's workers only
    decisions = {d.pool: d for d in loop.step(10.0)}
    assert decisions["decode"].desired == 8  # the whole demand, as before
    if with_tier_demand:
        assert lane.arrival_rate == pytest.approx(10.0) and (lane.input_len, lane.output_len) == (100, 50)
        assert (decisions["fast"].desired, decisions["fast"].reason) == (3, "rate")  # as computed above
        assert cluster.scaling.calls == [("grow", "decode", 7, "rate"), ("grow", "fast", 2, "rate")]
    else:  # no per-tier windows (older clusters): the lane keeps what its requests need, 4 over b = 3
        assert lane.arrival_rate == 0.0
        assert (decisions["fast"].desired, decisions["fast"].reason) == (2, "running")


def test_a_router_that_does_not_own_the_pools_does_not_scale_them():
    """Router replicas: the same demand that grows two pools on the owner does nothing on a follower."""
    from router.autoscaler import AutoscaleLoop

    cluster = _loop_cluster(True)
    cluster.scaling.owner = False
    loop = AutoscaleLoop(cluster)
    loop.policy.costs = dict.fromkeys(loop.policy.ranges, costs())
    assert loop.step(10.0) == [] and cluster.scaling.calls == []


def test_each_pool_is_sized_with_its_own_costs():
    """Pools of different tensor-parallel sizes have different step costs: the autoscaler takes one cost
    model per pool, and a decode pool whose steps cost half sizes with half the workers."""
    slow, fast = costs(decode=(0.02, 0.146)), costs()
    shared = Autoscaler(slow, {"prefill": LIMITS, "decode": LIMITS}, {"prefill": (1, 8), "decode": (1, 8)}, 1.0, 0.030,
                        10, 5)
    per_pool = Autoscaler({"prefill": slow, "decode": fast}, {"prefill": LIMITS, "decode": LIMITS},
                          {"prefill": (1, 8), "decode": (1, 8)}, 1.0, 0.030, 10, 5)
    d = demand(rate=40)
    assert shared.need("prefill", d) == per_pool.need("prefill", d)
    assert per_pool.need("decode", d) == decode_need(fast, LIMITS, d, tpot_s=0.030) == Need(4, "rate")
    assert shared.need("decode", d).workers > per_pool.need("decode", d).workers


def test_a_tp_pool_is_priced_as_a_worker_of_tp_gpus():
    """The autoscaler prices a pool of TP 4 with the roofline of a worker of 4 GPUs; a profile (measured
    on one device) cannot price it."""
    from types import SimpleNamespace

    from pdserve.config import AutoscaleConfig, EngineConfig
    from pdserve.perf.hardware import resolve_model
    from router.autoscaler import cluster_costs

    _, cfg = resolve_model("llama-3-70b")
    cluster = SimpleNamespace(config=SimpleNamespace(autoscale=AutoscaleConfig(gpu="H100"),
                                                     engine=EngineConfig(dtype="bfloat16")),
                              info=SimpleNamespace(config=cfg))
    one, four = cluster_costs(cluster, 1), cluster_costs(cluster, 4)
    assert (one.tp, four.tp) == (1, 4)
    assert four.step_time(0, 0, 0, 32, 32 * 1024) < one.step_time(0, 0, 0, 32, 32 * 1024)


def test_simulated_pools_autoscale_by_the_simulated_gpu():
    """Simulated workers (load_format sim) need no profile or --gpu to autoscale: the autoscaler takes the
    simulated GPU's roofline slowed by the time scale (what their steps take) and the GPU's KV blocks (not
    what the held, scaled-down bytes would give)."""
    from types import SimpleNamespace

    from pdserve.config import CacheConfig, EngineConfig
    from pdserve.model.loader import load_info
    from pdserve.perf.hardware import gpu, kv_budget_bytes, resolve_model, roofline
    from router.autoscaler import AutoscaleLoop

    engine = EngineConfig(load_format="sim", model="llama3-8b", dtype="bfloat16", sim_time_scale=16.0,
                          cache=CacheConfig(block_size=16))
    config = ClusterConfig(engine=engine, prefill=PoolConfig(1, max_workers=8), decode=PoolConfig(1, max_workers=24))
    with pytest.raises(ValueError, match="sized by a cost model"):  # a real model still needs one
        ClusterConfig(prefill=PoolConfig(1, max_workers=8), decode=PoolConfig(1))
    cluster = SimpleNamespace(config=config, info=load_info(engine), scaling=_Scaling([]))
    loop = AutoscaleLoop(cluster)
    h100 = roofline(resolve_model("llama3-8b")[1], gpu("H100"), 2)
    blocks = kv_budget_bytes(gpu("H100"), h100.resident_weight_bytes) // (h100.kv_bytes_per_token * 16)
    assert {n: lim.kv_blocks for n, lim in loop.policy.limits.items()} == {"prefill": blocks, "decode": blocks}
    assert blocks == 26674 and engine.cache.resolve_num_blocks(cluster.info.config, engine.torch_dtype) < blocks
    for work in [(512, 512 * 513 // 2, 1, 0, 0), (0, 0, 0, 64, 64 * 700)]:  # a prefill step, a decode step
        for pool in ("prefill", "decode"):
            assert loop.policy.costs[pool].step_time(*work) == pytest.approx(16 * h100.step_time(*work), rel=1e-12)


def test_a_slowed_roofline_takes_every_part_of_a_step_longer():
    from pdserve.perf.hardware import gpu, resolve_model, roofline

    for tp in (1, 4):
        base = roofline(resolve_model("llama-3-70b")[1], gpu("H100"), 2, tp)
        slow = base.slowed(3.0)
        for work in [(2048, 2048 * 2049 // 2, 1, 0, 0), (0, 0, 0, 128, 128 * 4096), (0, 0, 0, 1, 10)]:
            assert slow.step_time(*work) == pytest.approx(3 * base.step_time(*work), rel=1e-12)
        assert slow.transport == base.transport
    with pytest.raises(ValueError, match="positive"):
        base.slowed(0)
