"""pdserve.faults.FaultPoints, alone: which hits act, which pass, and disarming."""
import time

import pytest

from pdserve.faults import FaultPoints


def test_skip_then_count_hits_act_then_the_point_is_spent():
    f = FaultPoints()
    f.arm("corrupt", 0.0, count=2, skip=3)
    assert [f.hit("corrupt") for _ in range(7)] == [False] * 3 + [True] * 2 + [False] * 2
    assert f.wait_reached("corrupt", 0)


def test_a_key_counts_only_its_own_hits():
    f = FaultPoints()
    f.arm("request_data", 0.0, count=1, skip=1, key="req-1#")
    assert not f.hit("request_data", "req-2#0")  # not its key: neither let through nor acted on
    assert not f.hit("request_data", "req-1#0")  # the one let through
    assert f.hit("request_data", "req-1#0")
    assert not f.hit("request_data", "req-1#0")


def test_disarm_lets_every_coming_hit_pass_and_a_large_skip_costs_nothing():
    f = FaultPoints()
    t0 = time.monotonic()
    f.arm("request_data", 0.0, count=10**12, skip=10**12)  # counts, not a list of hits
    assert time.monotonic() - t0 < 1.0
    f.disarm("request_data")
    f.arm("step", 0.0, count=1000, key="x")
    f.disarm("step")
    assert not f.hit("step", "x") and not f.hit("request_data")
    assert not f.wait_reached("step", 0)


def test_arming_checks_its_arguments():
    f = FaultPoints()
    with pytest.raises(ValueError, match="unknown fault point"):
        f.arm("nowhere")
    with pytest.raises(ValueError, match="count must be at least 1"):
        f.arm("step", count=0)
