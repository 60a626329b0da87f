"""pdserve bench --sessions: the multi-turn workload's shape, its runner against a scripted gRPC server (each turn
the conversation so far with the model's replies, the session's key, the think time), and a real run on a tiny
1P1D cluster whose decode worker computes the later turns itself."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pdserve.cli import build_parser
from pdserve.loadgen.runner import RunConfig
from pdserve.loadgen.sessions import (
    SessionSpec,
    by_pool,
    format_sessions,
    run_sessions,
    session_key,
    session_tokens,
    sessions_report,
)
from pdserve.loadgen.workload import TokenSampler, closed_arrivals, poisson_arrivals
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc


def test_spec_shape_and_seeded_tokens():
    spec = SessionSpec(sessions=3, turns=3, system_len=10, turn_len=4, output_len=2)
    assert [spec.prompt_len(t) for t in range(3)] == [14, 20, 26] and spec.longest == 28
    # Held already: the system prompt (not by the first session's first turn), then all of the previous turn's
    # prompt and reply but the reply's last token.
    assert [spec.cached_len(t) for t in range(3)] == [10, 15, 21] and spec.cached_len(0, first_session=True) == 0
    assert spec.cached_fraction == pytest.approx((3 * (10 + 15 + 21) - 10) / (3 * (14 + 20 + 26)))
    sampler = TokenSampler(50, exclude=[0])
    a, b = session_tokens(spec, sampler, 64, seed=1), session_tokens(spec, sampler, 64, seed=1)
    assert a == b and len(a.system) == 10 and all(len(t) == 4 for s in a.turns for t in s)
    assert a.turns[0] != a.turns[1] and 0 not in a.system
    with pytest.raises(ValueError, match="context is 27"):
        session_tokens(spec, sampler, 27, seed=1)
    for bad in (dict(sessions=0), dict(turns=0), dict(turn_len=0), dict(think_time=-1.0)):
        with pytest.raises(ValueError):
            SessionSpec(**{"sessions": 1, **bad})


class ScriptedSessions(pb_grpc.GenerationServicer):
    """Replies max_tokens tokens 10 ms apart (the reply to the k-th request: 1000 + k, 1001 + k, ...) and keeps
    every request as it came, with its arrival time; a prompt whose last token is 7 is refused."""

    def __init__(self):
        self.seen: list[tuple[float, str, list[int]]] = []

    async def Generate(self, request, context):
        loop = asyncio.get_running_loop()
        k = len(self.seen)
        self.seen.append((loop.time(), request.session_id, list(request.token_ids.ids)))
        if request.token_ids.ids[-1] == 7:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        for i in range(request.max_tokens):
            await asyncio.sleep(0.01)
            r = pb.GenerateResponse(request_id="x", token_ids=[1000 + k + i])
            if i == request.max_tokens - 1:
                r.finish_reason = pb.FINISH_REASON_LENGTH
            yield r


def test_each_turn_sends_the_conversation_with_the_replies_and_the_key():
    spec = SessionSpec(sessions=3, turns=3, system_len=5, turn_len=3, output_len=2, think_time=0.05)
    tokens = session_tokens(spec, TokenSampler(7), 64, seed=2)  # ids 0..6: no prompt ends in 7
    script = ScriptedSessions()

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(script, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await run_sessions(f"127.0.0.1:{port}", spec, tokens, closed_arrivals(),
                                      RunConfig(num_prompts=9, concurrency=2), seed=2)
        finally:
            await server.stop(0)

    turns, wall = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(turns) == len(script.seen) == 9 and all(r.ok for _, _, r in turns)
    replies = {}  # the reply each prompt got, by the prompt
    for (_, key, prompt), k in zip(script.seen, range(9)):
        replies[tuple(prompt)] = [1000 + k, 1001 + k]
    for s in range(3):
        mine = [(at, key, prompt) for at, key, prompt in script.seen if key == session_key(2, s)]
        assert len(mine) == 3  # every turn with its session's own key
        conversation = list(tokens.system)
        for t, (_, _, prompt) in enumerate(mine):
            conversation += tokens.turns[s][t]
            assert prompt == conversation, (s, t)
            conversation += replies[tuple(prompt)]  # the model's own reply, as streamed
    # A turn goes out a think time after the reply to the one before (the server's clock on both).
    for s in range(3):
        got = [i for i, (_, key, _) in enumerate(script.seen) if key == session_key(2, s)]
        for a, b in zip(got, got[1:]):
            assert script.seen[b][0] >= script.seen[a][0] + 0.02 + 0.05 - 1e-3
    # Two sessions at a time: the third starts once one has ended.
    third = min(i for i, (_, key, _) in enumerate(script.seen) if key == session_key(2, 2))
    assert third >= 3
    pools = by_pool({("prefill", "p0"): (0, 0), ("decode", "d0"): (10, 10)},
                    {("prefill", "p0"): (27, 24), ("decode", "d0"): (160, 30), ("decode", "d1"): (10, 2)})
    assert pools == {"decode": {"requested": 160, "computed": 22, "hit_ratio": pytest.approx(1 - 22 / 160)},
                     "prefill": {"requested": 27, "computed": 24, "hit_ratio": pytest.approx(1 - 24 / 27)}}
    rep = sessions_report(spec, turns, pools)
    assert [t["sent"] for t in rep["by_turn"]] == [3, 3, 3]
    assert [t["prompt_len"] for t in rep["by_turn"]] == [8, 13, 18]
    assert all(t["median_ttft_ms"] >= 10 for t in rep["by_turn"])  # the first token comes 10 ms after the send
    assert rep["prompt_tokens_sent"] == 3 * (8 + 13 + 18)
    assert rep["new_prompt_tokens"] == 5 + 3 * (3 + 4 + 4)
    assert rep["worker_prompt_tokens_computed"] == 46
    text = "\n".join(format_sessions(rep))
    assert "Median TTFT turn 3 (ms):" in text and "decode:" in text


def test_a_failed_turn_ends_its_session():
    spec = SessionSpec(sessions=2, turns=3, system_len=0, turn_len=2, output_len=1)
    tokens = session_tokens(spec, TokenSampler(7), 64, seed=0)
    # Session 0's second turn ends in 7: refused, and its third turn is never sent.
    rows = [list(t) for t in tokens.turns[0]]
    rows[1][-1] = 7
    tokens = type(tokens)(tokens.system, (tuple(tuple(r) for r in rows), tokens.turns[1]))
    script = ScriptedSessions()

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(script, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await run_sessions(f"127.0.0.1:{port}", spec, tokens, poisson_arrivals(100, 0),
                                      RunConfig(num_prompts=6), seed=0)
        finally:
            await server.stop(0)

    turns, _ = asyncio.run(asyncio.wait_for(main(), 60))
    assert sorted((s, t, r.ok) for s, t, r in turns) == [(0, 0, True), (0, 1, False), (1, 0, True), (1, 1, True),
                                                        (1, 2, True)]
    assert [r.error_code for s, t, r in turns if not r.ok] == ["RESOURCE_EXHAUSTED"]
    rep = sessions_report(spec, turns, None)
    assert [t["completed"] for t in rep["by_turn"]] == [2, 1, 1] and rep["by_pool"] is None


@pytest.mark.parametrize("argv, message", [
    (["--sessions", "2", "--trace", "x.jsonl"], "--sessions takes fixed lengths"),
    (["--sessions", "2", "--n", "2"], "--sessions takes fixed lengths"),
    (["--sessions", "2", "--num-prompts", "5"], "--num-prompts has no meaning"),
    (["--sessions", "2", "--turns", "0"], "turns must be >= 1"),
])
def test_cli_rejects_bad_session_flags(argv, message, capsys):
    from pdserve.cli import main

    assert main(["bench", "--target", "127.0.0.1:1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_session_flags():
    from pdserve.loadgen.cli import session_spec_from_args

    args = build_parser().parse_args(["bench", "--sessions", "5", "--turns", "6", "--system-prompt-len", "100",
                                      "--turn-input-len", "20", "--output-len", "9", "--think-time", "0.5"])
    assert session_spec_from_args(args) == SessionSpec(5, 6, 100, 20, 9, 0.5)
    assert session_spec_from_args(build_parser().parse_args(["bench"])) is None


@pytest.mark.slow
def test_real_session_run(ray_local, aloop, tiny_checkpoints, tmp_path):
    """Sessions on a tiny 1P1D cluster through `pdserve bench --sessions`: every prompt sent is requested of
    exactly one worker; the decode worker, holding each conversation, computes the later turns itself from its
    cache; the workers compute far fewer prompt tokens than were sent, and no fewer than were new."""
    from pdserve.cli import main
    from router.cluster import Cluster
    from router.compose import build_router
    from router.config import RouterConfig

    from served import tiny_1p1d

    cluster = Cluster(tiny_1p1d(tiny_checkpoints["llama"], batched_tokens=64, local_prefill_max_tokens=32))
    aloop.run(cluster.start(), timeout=600)
    router = build_router(cluster, RouterConfig(port=0))
    try:
        port = aloop.run(router.start())
        out = tmp_path / "sessions.json"
        rc = main(["bench", "--target", f"127.0.0.1:{port}", "--sessions", "4", "--turns", "4", "--concurrency", "2",
                   "--system-prompt-len", "48", "--turn-input-len", "16", "--output-len", "8", "--think-time", "0.05",
                   "--timeout", "120", "--warmup", "0", "--output", str(out), "--no-progress"])
    finally:
        aloop.run(router.stop(grace=5))
        aloop.run(cluster.shutdown())
    assert rc == 0
    rep = json.loads(out.read_text())
    s = rep["sessions"]
    assert rep["completed"] == 16 and rep["failed"] == 0
    assert [t["completed"] for t in s["by_turn"]] == [4, 4, 4, 4]
    assert all(t["median_ttft_ms"] > 0 for t in s["by_turn"])
    assert s["prompt_tokens_sent"] == rep["total_input_tokens"] == 4 * sum(48 + 16 * (t + 1) + 8 * t for t in range(4))
    assert rep["worker_prompt_tokens_requested"] == s["prompt_tokens_sent"]  # each prompt at one worker, once
    assert s["by_pool"]["decode"]["requested"] > 0  # local prefills
    assert s["by_pool"]["decode"]["hit_ratio"] > 0.5
    assert s["new_prompt_tokens"] <= rep["worker_prompt_tokens_computed"] < s["prompt_tokens_sent"] / 2
