"""The planner knows the KV tiers (pdserve.planner.kv_tiers): which host tier keeps a multi-turn workload's
conversations between turns, by replaying its turns through a least-recently-used store, and `pdserve plan
--sessions` saying how much host memory the pool holding the sessions should have."""
from __future__ import annotations

import json

import pytest

from pdserve.loadgen.sessions import SessionSpec
from pdserve.planner.kv_tiers import replay, session_turns, tier_table

# A 100-token system prompt, turns of 20 new tokens and 10-token replies: turn t's prompt is 120 + 30 t tokens.
SPEC = SessionSpec(sessions=3, turns=3, system_len=100, turn_len=20, output_len=10, think_time=5.0)


def test_turns_follow_each_other_by_the_think_time_and_sessions_wait_for_a_slot():
    assert session_turns(SPEC, [0.0, 1.0, 2.0], None) == [
        (0.0, 0, 0), (1.0, 1, 0), (2.0, 2, 0), (5.0, 0, 1), (6.0, 1, 1), (7.0, 2, 1),
        (10.0, 0, 2), (11.0, 1, 2), (12.0, 2, 2)]
    # Two at a time: the third session starts when the first ends (its last turn at 10 s).
    assert [(at, s) for at, s, t in session_turns(SPEC, [0.0, 1.0, 2.0], 2) if s == 2] == [(10.0, 2), (15.0, 2),
                                                                                         (20.0, 2)]


def test_a_store_holding_every_conversation_serves_the_floor_and_one_holding_none_only_the_system_prompt():
    turns = session_turns(SPEC, [0.0, 1.0, 2.0], None)
    sent = 3 * (120 + 150 + 180)
    served, computed = replay(SPEC, turns, 10_000)
    # Served: the system prompt to every turn but the very first; a later turn its conversation but the newest 20
    # tokens and the reply's last one (SessionSpec.cached_len).
    assert served == 100 * 2 + 3 * (129 + 159) and computed == sent - served
    served, computed = replay(SPEC, turns, 100)  # room for the system prompt alone
    assert served == 100 * 8 and computed == sent - 800


def test_the_conversations_touched_since_take_the_store_tail_first():
    """Session 0's second turn comes after sessions 1 and 2 took 30 tokens each (their first message and reply, past
    the system prompt): of a 100 + 30 + 30 + 15 store, 15 of its own 30 are left, so it is served 115 and computes
    35 of its 150."""
    spec = SessionSpec(sessions=3, turns=2, system_len=100, turn_len=20, output_len=10, think_time=5.0)
    turns = [(0.0, 0, 0), (1.0, 1, 0), (2.0, 2, 0), (5.0, 0, 1)]
    served, computed = replay(spec, turns, 100 + 30 + 30 + 15)
    first_turns = 0 + 100 + 100  # the very first turn holds nothing; the others the system prompt
    assert served == first_turns + 115
    assert computed == 3 * 120 - first_turns + 150 - 115
    assert replay(spec, turns, 100 + 30 + 30 + 30)[0] == first_turns + 100 + 29  # all of it kept (but the reply's last)


def test_the_table_falls_to_the_floor_and_recommends_the_smallest_tier_within_5_percent():
    spec = SessionSpec(sessions=40, turns=6, system_len=512, turn_len=128, output_len=64, think_time=3.0)
    arrivals = [i * 0.5 for i in range(40)]
    kv_per_token = 1 << 17  # 128 KiB, Llama-3-8B's in bf16
    table = tier_table(spec, arrivals, None, 2, 256 << 20, kv_per_token)
    rows = table["rows"]
    computed = [r["prompt_tokens_computed"] for r in rows]
    assert rows[0]["host_mib"] == 0 and computed == sorted(computed, reverse=True)
    assert computed[-1] == table["floor_prompt_tokens"] < computed[0] / 2  # the cache alone keeps little
    best = next(r for r in rows if r["host_mib"] == table["recommended_host_mib"])
    assert best["prompt_tokens_computed"] <= 1.05 * table["floor_prompt_tokens"]
    assert all(r["prompt_tokens_computed"] > 1.05 * table["floor_prompt_tokens"]
               for r in rows if r["host_mib"] < best["host_mib"])
    with pytest.raises(ValueError, match="workers"):
        tier_table(spec, arrivals, None, 0, 256 << 20, kv_per_token)


def test_plan_command_sizes_the_host_tier_for_sessions(tmp_path, capsys):
    from pdserve.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--gpu", "H100", "--model", "llama-3-8b", "--sessions", "60", "--turns", "6",
                 "--system-prompt-len", "1024", "--turn-input-len", "256", "--output-len", "128", "--think-time", "3",
                 "--request-rate", "2", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50", "--max-workers", "2",
                 "--kv-cache-mib", "2048", "--output", str(out)]) == 0
    plan = json.loads(out.read_text())
    tiers = plan["kv_tiers"]
    assert tiers["workers"] == plan["recommended"]["decode_workers"]
    assert tiers["recommended_host_mib"] > 0 and tiers["rows"][0]["host_mib"] == 0
    assert f"--kv-offload-mib {tiers['recommended_host_mib']}" in capsys.readouterr().out
