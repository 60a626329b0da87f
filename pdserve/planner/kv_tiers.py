"""How much host memory a pool's KV tiers need for a multi-turn workload: hit rates by capacity.

Between two turns of a session (its tool call, `--think-time`) the other sessions' turns pass through the
workers, and a cache too small for every conversation evicts the waiting ones: the next turn computes its whole
conversation again. A KV tier (`--kv-offload-mib`, pdserve.engine.kv_offload) keeps what the cache evicts; this
module says which tier size keeps what.

The model: the pool that holds the sessions (the decode pool of a disaggregated cluster, whose workers compute a
returning turn's new tokens themselves; the colocated pool) is one least-recently-used store of `workers` x
(cache + host tier) tokens, sessions spread over its workers. The shared system prompt is always held (every
turn uses it). A session's conversation (its last prompt and reply) is touched at each of its turns; when its
next turn comes, what more recently touched conversations take of the store is gone from it, the conversation's
tail first (a worker frees a request's blocks tail first, pdserve.engine.kv_cache), so the turn is served the
prefix that is left and computes the rest. The turns come in the order `pdserve plan` simulates them: a session
starts at its arrival (or, under --concurrency, when a session before it ends) and its turn t follows its
turn t - 1 by the think time. Whether a hit is loaded or computed (the tiers' cost rule) is not modelled: on
every device the planner knows, a host copy is far cheaper than the prompt's compute.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.loadgen.sessions import SessionSpec

# Host tier sizes tried, MiB per worker, up to the first that keeps every conversation its next turn needs (the
# size that holds every conversation at its longest is tried last).
HOST_MIB = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
# The recommendation: the smallest tier whose prompt tokens computed are within this of the workload's floor.
WITHIN = 0.05


@dataclass(frozen=True)
class TierRow:
    host_mib: int  # host tier per worker
    hit_fraction: float  # of the tokens a pool keeping every conversation serves from its caches, those served
    prompt_tokens_computed: int  # over the workload


def session_turns(spec: SessionSpec, arrivals: Sequence[float], concurrency: int | None) -> list[tuple[float, int, int]]:
    """(time, session, turn) of every turn, in time order: session s starts at its arrival, or under concurrency
    K when session s - K has ended (its turns one think time apart; a reply's own time is not known up front)."""
    span = (spec.turns - 1) * spec.think_time
    starts: list[float] = []
    for s, at in zip(range(spec.sessions), arrivals):
        starts.append(max(at, starts[s - concurrency] + span) if concurrency and s >= concurrency else at)
    return sorted((start + t * spec.think_time, s, t) for s, start in enumerate(starts) for t in range(spec.turns))


def replay(spec: SessionSpec, turns: Sequence[tuple[float, int, int]], capacity_tokens: int) -> tuple[int, int]:
    """(tokens served from the store, prompt tokens computed) over the turns, with a store of capacity_tokens."""
    room = capacity_tokens - spec.system_len  # the system prompt is always held
    held: OrderedDict[int, int] = OrderedDict()  # session -> its conversation's tokens past the system prompt, LRU first
    served = computed = 0
    for _, s, t in turns:
        cached = spec.cached_len(t, first_session=not served and not computed)
        kept = spec.system_len if t else cached  # a first turn: only the system prompt (or nothing) is held
        if t and s in held:
            newer = 0
            for other in reversed(held):  # the conversations touched since, most recent first
                if other == s or newer >= room:
                    break
                newer += held[other]
            kept += min(max(room - newer, 0), cached - spec.system_len)
        served += kept
        computed += spec.prompt_len(t) - kept
        held[s] = spec.prompt_len(t) + spec.output_len - spec.system_len
        held.move_to_end(s)
    return served, computed


def tier_table(spec: SessionSpec, arrivals: Sequence[float], concurrency: int | None, workers: int,
               cache_bytes: int, kv_bytes_per_token: int, sizes_mib: Sequence[int] = HOST_MIB) -> dict[str, Any]:
    """Hit rates and prompt tokens computed by host tier size per worker, for a pool of `workers` workers of
    cache_bytes each, and the recommended size (the smallest within WITHIN of the floor, which keeping every
    conversation reaches)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    turns = session_turns(spec, arrivals, concurrency)
    everything = len({s for _, s, _ in turns}) * spec.longest + spec.system_len  # every conversation at its longest
    floor_served, floor = replay(spec, turns, everything)
    mib = 1 << 20
    whole = -(-max(everything * kv_bytes_per_token // workers - cache_bytes, 0) // mib)
    rows = []
    for size in sorted({*(m for m in sizes_mib if m < whole), whole}):
        capacity = workers * (cache_bytes + size * mib) // kv_bytes_per_token
        served, computed = replay(spec, turns, capacity)
        rows.append(TierRow(size, served / floor_served if floor_served else 1.0, computed))
        if computed <= floor:
            break  # every conversation is kept: a larger tier holds only what no turn comes back for
    best = next(r for r in rows if r.prompt_tokens_computed <= floor * (1 + WITHIN))
    return {"workers": workers, "kv_cache_mib": cache_bytes / mib, "floor_prompt_tokens": floor,
            "rows": [asdict(r) for r in rows], "recommended_host_mib": best.host_mib,
            "without_tier_prompt_tokens": rows[0].prompt_tokens_computed if rows[0].host_mib == 0 else None}


def format_tiers(table: dict[str, Any]) -> str:
    lines = [f"KV tiers for these sessions: {table['workers']} worker(s) holding them, {table['kv_cache_mib']:.0f} MiB "
             f"of cache each; prompt tokens computed at best (every conversation kept): "
             f"{table['floor_prompt_tokens']:,}",
             f"{'host MiB/worker':>16}  {'hits':>6}  {'prompt tokens computed':>22}"]
    for r in table["rows"]:
        mark = "  <- recommended" if r["host_mib"] == table["recommended_host_mib"] else ""
        lines.append(f"{r['host_mib']:>16}  {r['hit_fraction']:>6.1%}  {r['prompt_tokens_computed']:>22,}{mark}")
    lines.append(f"recommended: --kv-offload-mib {table['recommended_host_mib']} (the smallest within "
                 f"{WITHIN:.0%} of the best)")
    return "\n".join(lines)
