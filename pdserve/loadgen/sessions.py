"""Multi-turn sessions (`pdserve bench --sessions N`): chat and agent traffic, each turn the whole conversation.

A session is `turns` requests, one after another, all with the same session key (GenerateRequest.session_id).
Its first turn is the system prompt every session shares (`system_len` tokens) and `turn_len` new tokens; each
later turn, `think_time` seconds after the reply (a tool call), sends the previous turn's prompt, the model's
reply to it (the token ids the router streamed) and `turn_len` new tokens (the user's next message or the
tool's output). Sessions start on the arrival schedule (Poisson at --request-rate, closed, bursty), at most
`concurrency` of them at a time; a turn that fails ends its session.

The report adds to bench's (`sessions`): TTFT by turn (the first turn pays for its whole prompt, a later one
only for what the cluster does not hold), the prompt tokens sent against those new to the cluster (the system
prompt once, every turn's new tokens, and the one token of each reply a worker has not computed the KV of),
and the workers' prompt tokens requested and computed over the run by pool (from the cluster status): a
prefill pool's savings are the shared system prompt's, a decode pool's are its local prefills' (a later turn
whose decode worker holds the conversation computes only the newest tokens, with no hand-off).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from pdserve.client.grpc_client import FINISH_REASONS, AsyncClient, Connection
from pdserve.loadgen.runner import Progress, RunConfig, _judge
from pdserve.loadgen.stats import RequestRecord, summarize
from pdserve.loadgen.workload import TokenSampler


@dataclass(frozen=True)
class SessionSpec:
    """The shape of a multi-turn workload: sessions, turns each, shared system prompt, new tokens and reply a
    turn, and the think time between a reply and the next turn (seconds)."""

    sessions: int
    turns: int = 4
    system_len: int = 256
    turn_len: int = 64
    output_len: int = 32
    think_time: float = 0.0

    def __post_init__(self) -> None:
        for name, low in (("sessions", 1), ("turns", 1), ("system_len", 0), ("turn_len", 1), ("output_len", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if not self.think_time >= 0:
            raise ValueError(f"think time must be >= 0 seconds, got {self.think_time}")

    @property
    def longest(self) -> int:
        """The last turn's prompt and reply: the context a session needs."""
        return self.system_len + self.turns * (self.turn_len + self.output_len)

    def prompt_len(self, turn: int) -> int:
        """Turn `turn`'s prompt (0 first): the system prompt, every turn's new tokens, the replies before it."""
        return self.system_len + (turn + 1) * self.turn_len + turn * self.output_len

    def cached_len(self, turn: int, first_session: bool = False) -> int:
        """What of turn `turn`'s prompt a cluster that keeps every session's KV holds already: the system prompt
        (but for the first session's first turn), then the previous turn's prompt and its reply, all of it but
        the reply's last token (sampled, never computed)."""
        if turn == 0:
            return 0 if first_session else self.system_len
        return self.prompt_len(turn - 1) + self.output_len - 1

    @property
    def cached_fraction(self) -> float:
        """The prompt tokens a cluster holding every session's KV serves from its caches, over those sent."""
        sent = sum(self.prompt_len(t) for t in range(self.turns)) * self.sessions
        cached = sum(self.cached_len(t) for t in range(self.turns)) * self.sessions - self.system_len
        return cached / sent

    def describe(self) -> dict[str, Any]:
        return {"sessions": self.sessions, "turns": self.turns, "system_prompt_len": self.system_len,
                "turn_input_len": self.turn_len, "output_len": self.output_len, "think_time": self.think_time}


@dataclass(frozen=True)
class SessionTokens:
    """A workload's token ids: the shared system prompt, and each session's new tokens turn by turn."""

    system: tuple[int, ...]
    turns: tuple[tuple[tuple[int, ...], ...], ...]  # [session][turn]


def session_tokens(spec: SessionSpec, sampler: TokenSampler, max_model_len: int, seed: int) -> SessionTokens:
    """The seeded token ids of a workload (their own random stream: bench's other workloads' are untouched)."""
    if spec.longest > max_model_len:
        raise ValueError(f"a session's last turn needs {spec.longest} tokens (system prompt + turns x (new tokens + "
                         f"reply)); the model's context is {max_model_len}")
    rng = np.random.default_rng([seed, 5])
    system = sampler(rng, spec.system_len) if spec.system_len else ()
    return SessionTokens(system, tuple(tuple(sampler(rng, spec.turn_len) for _ in range(spec.turns))
                                       for _ in range(spec.sessions)))


def session_key(seed: int, session: int) -> str:
    return f"bench-{seed}-{session}"


async def run_sessions(target: str | Connection, spec: SessionSpec, tokens: SessionTokens, arrivals: Iterable[float],
                       cfg: RunConfig, seed: int = 0,
                       progress: Progress | None = None) -> tuple[list[tuple[int, int, RequestRecord]], float]:
    """Drive the sessions; returns (session, turn, record) for every turn sent, and the run's wall time.
    cfg: its concurrency (sessions at a time), timeout, temperature and duration (no session starts after)."""
    out: list[tuple[int, int, RequestRecord]] = []
    slots = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    ticker = asyncio.create_task(progress.run()) if progress else None
    tasks: list[asyncio.Task] = []
    async with AsyncClient(target) as client:
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        async def session(s: int) -> None:
            conversation = [*tokens.system]
            try:
                for t in range(spec.turns):
                    if t and spec.think_time:
                        await asyncio.sleep(spec.think_time)
                    conversation += tokens.turns[s][t]
                    rec = RequestRecord(send=clock(), input_tokens=len(conversation), max_tokens=spec.output_len)
                    out.append((s, t, rec))
                    if progress:
                        progress.sent += 1
                    reply = await _turn(client, rec, conversation, session_key(seed, s), cfg, clock)
                    if progress:
                        progress.done += 1
                        progress.failed += not rec.ok
                    if not rec.ok:
                        return  # its conversation has no reply to go on from
                    conversation += reply
            finally:
                if slots is not None:
                    slots.release()

        try:
            for s, at in zip(range(spec.sessions), arrivals):
                if cfg.duration is not None and at >= cfg.duration:
                    break
                await asyncio.sleep(max(0.0, at - clock()))
                if slots is not None:
                    await slots.acquire()
                tasks.append(asyncio.create_task(session(s)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if ticker:
                ticker.cancel()
                progress.draw(final=True)
    wall = max((r.end for _, _, r in out if r.end is not None), default=0.0)
    return out, wall


async def _turn(client: AsyncClient, rec: RequestRecord, prompt: list[int], key: str, cfg: RunConfig,
                clock) -> list[int]:
    """One turn's request, recorded in rec; returns the reply's token ids."""
    reply: list[int] = []
    finished: list[str] = []
    try:
        rec.send = clock()
        async for r in client.generate(token_ids=prompt, max_tokens=rec.max_tokens, ignore_eos=True,
                                       temperature=cfg.temperature, timeout=cfg.timeout, session_id=key):
            rec.chunks.append((clock(), len(r.token_ids)))
            reply += r.token_ids
            if r.finish_reason:
                finished.append(FINISH_REASONS.get(r.finish_reason, str(r.finish_reason)))
        rec.end = rec.chunks[-1][0] if rec.chunks else clock()
        _judge(rec, finished, 1)
    except grpc.aio.AioRpcError as e:
        rec.end = clock()
        rec.error_code, rec.error = e.code().name, e.details() or ""
    except Exception as e:  # a client-side failure must still be counted, never dropped
        rec.end = clock()
        rec.error_code, rec.error = type(e).__name__, str(e)
    return reply


async def pool_prompt_tokens(target: str | Connection) -> dict[tuple[str, str], tuple[int, int]] | None:
    """Each worker's prompt tokens (requested, computed) since it started, keyed by (pool, worker), from the
    router's cluster status; None where it reports none."""
    try:
        async with AsyncClient(target) as client:
            status = await client.cluster_status(timeout=30)
    except grpc.RpcError:
        return None
    counts = {(pool.name, w.worker_id): (w.prompt_tokens_requested, w.prompt_tokens_computed)
              for pool in status.pools for w in pool.workers if w.HasField("prompt_tokens_requested")}
    return counts or None


def by_pool(before: dict[tuple[str, str], tuple[int, int]] | None,
            after: dict[tuple[str, str], tuple[int, int]] | None) -> dict[str, dict[str, Any]] | None:
    """The workers' prompt tokens over a run by pool: requested, computed, and the share the prefix cache served
    (1 - computed / requested; None where nothing was requested). A worker that started meanwhile counts from 0."""
    if before is None or after is None:
        return None
    pools: dict[str, list[int]] = {}
    for (pool, worker), (req, comp) in sorted(after.items()):
        r0, c0 = before.get((pool, worker), (0, 0))
        sums = pools.setdefault(pool, [0, 0])
        sums[0] += req - r0
        sums[1] += comp - c0
    return {pool: {"requested": req, "computed": comp, "hit_ratio": 1 - comp / req if req > 0 else None}
            for pool, (req, comp) in pools.items()}


async def run_session_bench(target: str | Connection, spec: SessionSpec, info, arrivals: Iterable[float],
                            cfg: RunConfig, seed: int, progress: Progress | None = None
                            ) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    """`pdserve bench --sessions`: the run on a model (its ModelInfo), with the workers' prompt tokens read before
    and after it; returns every turn's record, the wall time and the report's `sessions`."""
    tokens = session_tokens(spec, TokenSampler(info.vocab_size, info.eos_token_ids), info.max_model_len, seed)
    before = await pool_prompt_tokens(target)
    turns, wall = await run_sessions(target, spec, tokens, arrivals, cfg, seed, progress)
    pools = by_pool(before, await pool_prompt_tokens(target))
    report = sessions_report(spec, turns, pools)
    report["worker_prompt_tokens_requested"] = sum(p["requested"] for p in pools.values()) if pools else None
    return [r for _, _, r in turns], wall, report


def sessions_report(spec: SessionSpec, turns: list[tuple[int, int, RequestRecord]],
                    pools: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """The report's `sessions`: the workload's shape, TTFT by turn (ms), the prompt tokens sent and those new to
    the cluster, and the workers' prompt tokens by pool."""
    by_turn = []
    for t in range(spec.turns):
        mine = [r for _, turn, r in turns if turn == t]
        ttft = summarize([r.ttft for r in mine if r.ok and r.ttft is not None])
        by_turn.append({"turn": t + 1, "sent": len(mine), "completed": sum(r.ok for r in mine),
                        "prompt_len": spec.prompt_len(t),
                        **{f"{k}_ttft_ms": None if ttft[k] is None else ttft[k] * 1e3 for k in ("median", "p99")}})
    ok = [(t, r) for _, t, r in turns if r.ok]
    sent = sum(r.input_tokens for _, r in ok)
    # New to the cluster: the system prompt once, each turn's new tokens, and the last token of the reply before
    # it (sampled, never computed). A failed turn's tokens are not counted: nothing of its session follows.
    new = (spec.system_len if ok else 0) + sum(spec.turn_len + (t > 0) for t, _ in ok)
    computed = sum(p["computed"] for p in pools.values()) if pools else None
    return {**spec.describe(), "by_turn": by_turn, "prompt_tokens_sent": sent, "new_prompt_tokens": new,
            "worker_prompt_tokens_computed": computed, "by_pool": pools}


def format_sessions(s: dict[str, Any]) -> list[str]:
    """The report's lines for a multi-turn run: TTFT by turn, prompt tokens sent, new and computed, by pool."""
    out = ["{s:{c}^50}".format(s=" Sessions (multi-turn) ", c="-")]
    row = lambda name, v: out.append(f"{name:<40}{v:<10}")  # noqa: E731
    row("Sessions x turns:", f"{s['sessions']} x {s['turns']}")
    row("Prompt tokens sent:", s["prompt_tokens_sent"])
    row("Prompt tokens new to the cluster:", s["new_prompt_tokens"])
    if s["worker_prompt_tokens_computed"] is not None:
        row("Prompt tokens computed (workers):", s["worker_prompt_tokens_computed"])
    for p, v in (s["by_pool"] or {}).items():
        hit = "n/a" if v["hit_ratio"] is None else f"{100 * v['hit_ratio']:.1f}% from cache"
        row(f"  {p}:", f"{v['computed']} of {v['requested']} computed, {hit}")
    for t in s["by_turn"]:
        ms = "n/a" if t["median_ttft_ms"] is None else f"{t['median_ttft_ms']:.2f}"
        row(f"Median TTFT turn {t['turn']} (ms):", f"{ms} ({t['prompt_len']} prompt tokens)")
    return out
