"""The planner on multi-turn traffic: the simulator computes only a prompt's uncached tokens, and `pdserve plan` on an
agentic workload (pdserve bench --sessions' shape) sizes the prefill pool for the new tokens alone."""
from __future__ import annotations

import numpy as np
import pytest

from pdserve.loadgen.stats import Slo
from pdserve.planner.plan import PoolSettings, Workload, make_plan, workload_from_args
from pdserve.planner.simulator import ClusterShape, simulate

from test_planner import _bench_args, costs, disagg, pool


def one(shape, cached):
    return simulate(shape, costs(per_pair=1e-6), np.array([0.0]), np.array([100]), np.array([5]),
                    cached_len=None if cached is None else np.array([cached]))


def test_a_cached_prefix_is_not_computed_but_is_attended_to():
    # 20 new tokens at 1 ms, each attending to the 80 cached ones and the new ones before it (1 us a pair).
    pairs = sum(80 + i + 1 for i in range(20))
    for shape in (disagg(), ClusterShape("colocated", colocated=pool())):
        assert one(shape, None).first_token[0] == pytest.approx(0.1 + sum(range(1, 101)) * 1e-6)
        assert one(shape, 80).first_token[0] == pytest.approx(0.02 + pairs * 1e-6)
        assert one(shape, 0).first_token[0] == one(shape, None).first_token[0]
    assert one(disagg(), 100).first_token[0] == pytest.approx(0.001 + 100e-6)  # one token is always computed


def test_session_workload_has_each_turns_cached_prefix():
    args = _bench_args(sessions=3, turns=3, system_prompt_len=100, turn_input_len=20, output_len=10, think_time=5,
                       request_rate=0.1, seed=1)
    w = workload_from_args(args, 1000, [0], 4096)
    assert len(w.arrival) == 9 and list(w.arrival) == sorted(w.arrival)
    assert sorted(w.input_len.tolist()) == sorted([120, 150, 180] * 3)
    # The first session's first turn holds nothing; every other first turn the system prompt; a later turn the
    # conversation so far but the newest 20 tokens and the reply's last token.
    assert sorted(w.cached_len.tolist()) == sorted([0, 100, 100] + [129, 159] * 3)
    assert w.description["cached_fraction"] == pytest.approx(w.cached_len.sum() / w.input_len.sum())
    assert w.scaled(2.0).cached_len is w.cached_len


def test_an_agentic_workload_needs_fewer_prefill_workers_than_its_prompts_uncached():
    """The same prompts (a 512-token system prompt, six turns of 64 new tokens and 16-token replies, 2 s of think
    time), once with the prefix each turn shares with what the cluster holds and once without: the disaggregated
    configurations that keep 90 % within the SLOs need 1 prefill worker against 5."""
    c = costs(per_token=0.0004, decode=(0.01, 0.03), batches=(1, 32))
    args = _bench_args(sessions=24, turns=6, system_prompt_len=512, turn_input_len=64, output_len=16, think_time=2,
                       request_rate=1.0, seed=3)
    agentic = workload_from_args(args, 1000, [0], 4096)
    uncached = Workload(agentic.arrival, agentic.input_len, agentic.output_len, agentic.concurrency,
                        agentic.description)
    assert agentic.description["cached_fraction"] > 0.9
    plans = {name: make_plan(c, w, Slo(ttft_ms=500, tpot_ms=100), 6, [64], PoolSettings(kv_cache_bytes=1 << 30))
             for name, w in (("agentic", agentic), ("uncached", uncached))}
    fewest = {name: min((x["prefill_workers"] for x in p["candidates"]
                         if x["mode"] == "disaggregated" and x["slo_attainment"] >= 0.9), default=None)
              for name, p in plans.items()}
    assert fewest == {"agentic": 1, "uncached": 5}
    assert plans["agentic"]["recommended"]["workers"] < plans["uncached"]["recommended"]["workers"]
