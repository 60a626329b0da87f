"""A discrete-event simulator of a pdserve cluster, fast enough to try many configurations.

It replays a workload (arrival time, prompt and output length of each request) through the parts of
the request path that decide latency, with each step's duration from a cost model
(pdserve.planner.costs):

- the router: admission (max_running on the workers, max_queued waiting, the rest refused) and
  placement (pdserve router.placement's rules: the prefill worker with the fewest queued prompt tokens,
  the decode or colocated worker with the fewest active requests, then the most free KV blocks); a
  prompt is sent only when a prefill worker has less than PREFILL_QUEUE_STEPS token budgets queued and,
  if a token will follow the first, a decode worker has room for its KV (fewer than max_num_seqs
  requests, and the free blocks its waiting requests leave); the others wait in arrival order at the
  router (router.cluster's rules);
- a prefill worker: token-budget steps, running chunks first, then waiting prompts in arrival order,
  each admitted only when blocks for its whole prompt are free; a finished prompt's first token goes
  to the client at once and its KV stays HELD until it has reached the decode worker;
- the hand-off: the decode worker reserves blocks for the prompt's KV at its next step boundary (FIFO,
  bounded by max_num_seqs and the free blocks it must keep per running request); KV whose destination
  was ready when its prefill step began is pushed during the step (what is left after the first token
  is Transport.exposed_time); KV held for a late reservation is sent whole once it is made;
- a decode worker: continuous batching, one token per running request a step; a landed request
  joins at the next step, whose end is its 2nd token;
- a colocated worker: one scheduler for both phases, decodes first, then prompt chunks in the rest of
  the token budget, as pdserve.engine.scheduler does.

What it leaves out, and why that is safe for sizing: prefix caching (synthetic prompts share none),
stop strings and EOS (benchmarks set ignore_eos), preemption (a step whose KV would overflow the
worker's cache is counted in `kv_overflows` and the plan marks the configuration; nothing is
recomputed), and per-block rounding of a running request's growth (its blocks are its tokens / block
size plus half a block). Ray and gRPC hops are the constant latencies of ClusterShape.

Autoscaling: given an Autoscaler (pdserve.planner.autoscale), the simulator asks it every interval
with the demand the router would see (the same DemandWindow, queues, requests on decode workers and
their KV) and acts as router.pools does: a new worker is placeable startup_s after it was asked for;
a drained one takes no new requests and leaves once its last request is done. Worker-seconds count
each worker from the moment it was asked for to the moment it left.

Service tiers (pdserve.tiers), given a tier per request: the router's line and its admission queue
serve by (tier rank, arrival), flex at default's rank while the flex requests in flight are fewer than
its floor (flex_floor of the decode pool's slots); flex is refused once flex_max_queued of it wait; a
fast lane (ClusterShape.fast) decodes priority requests only, with its own running cap, and a priority
request that finds it full waits for it up to fast_lane_max_wait_s and is then served as default
("wait"), or is served as default at once ("downgrade"); a decode worker reserves by (tier, arrival),
and a priority or default request that finds it full preempts its latest running flex request above
flex's floor (flex_floor of the worker's slots): the flex request keeps its KV and resumes where it
was when only a slot was short, and loses its KV and recomputes its context (prompt and tokens so far,
as a prefill on top of the step it rejoins) when KV was short. Without tiers every request is default
and none of this changes anything. Left out: the prefill worker's own queue stays first come, first
served (the router's line, in front of it, is ordered; it holds at most PREFILL_QUEUE_STEPS budgets).

Per step the work is O(requests joining or finishing), never O(batch): a running request's context
grows by one token a step, so the decode context of a step is a running sum plus the batch times
the step index, and finishing steps sit in a heap.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.planner.autoscale import Autoscaler, Demand, DemandWindow
from pdserve.planner.costs import StepCosts, attention_pairs
from pdserve.tiers import TIERS, ServiceTier, TiersConfig, flex_floor, parse_tier

PREFILL_QUEUE_STEPS = 2  # router.cluster.PREFILL_QUEUE_STEPS (pdserve/ cannot import router/)


@dataclass(frozen=True)
class PoolShape:
    """One pool: how many workers and how each batches (pdserve.config.SchedulerConfig's knobs)."""

    workers: int
    kv_blocks: int  # KV cache per worker, in blocks
    block_size: int = 16
    max_num_seqs: int = 64
    token_budget: int = 2048  # tokens a step computes (max_num_batched_tokens)
    headroom_blocks: int = 1  # decode: free blocks a reservation leaves per running request

    def __post_init__(self) -> None:
        if min(self.workers, self.kv_blocks, self.block_size, self.max_num_seqs, self.token_budget) < 1:
            raise ValueError(f"every pool setting must be >= 1: {self}")


@dataclass(frozen=True)
class ClusterShape:
    """A deployment to simulate: disaggregated (prefill + decode pools, and the fast lane's decode workers
    when `fast` is given) or colocated (one pool)."""

    mode: str
    prefill: PoolShape | None = None
    decode: PoolShape | None = None
    colocated: PoolShape | None = None
    max_running: int = 256  # router admission (pdserve serve --max-running)
    max_queued: int = 1024  # router queue (--max-queued)
    first_token_latency_s: float = 0.0  # worker -> router -> client, for the first token
    token_latency_s: float = 0.0  # the same for a decode step's tokens
    fast: PoolShape | None = None  # the fast lane: priority only, max_num_seqs its running cap

    def __post_init__(self) -> None:
        pools = (self.prefill, self.decode) if self.mode == "disaggregated" else (self.colocated,)
        if self.mode not in ("disaggregated", "colocated") or any(p is None for p in pools):
            raise ValueError(f"a {self.mode} cluster needs its pools: {self}")
        if self.fast is not None and self.mode != "disaggregated":
            raise ValueError("the fast lane is a set of decode workers: it needs a disaggregated cluster")

    @property
    def workers(self) -> int:
        if self.mode == "colocated":
            return self.colocated.workers
        return self.prefill.workers + self.decode.workers + (self.fast.workers if self.fast else 0)

    @property
    def label(self) -> str:
        if self.mode == "colocated":
            return f"colocated x{self.colocated.workers}"
        return f"{self.prefill.workers}P{self.decode.workers}D" + (f"+{self.fast.workers}F" if self.fast else "")


@dataclass
class SimResult:
    """Per request: seconds after the start (NaN where it does not apply); per worker: peaks and busy time."""

    arrival: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    first_token: np.ndarray  # when the client sees the first token
    second_token: np.ndarray
    end: np.ndarray  # when the client sees the last token
    rejected: np.ndarray  # bool: refused by admission (RESOURCE_EXHAUSTED)
    peak_kv_blocks: dict[str, int]  # worker -> most blocks in use at once
    busy_s: dict[str, float]  # worker -> seconds spent in steps
    kv_overflows: int  # decode steps that needed more blocks than the worker has (preemption in reality)
    steps: int
    worker_seconds: float = 0.0  # summed over workers, from asked for to gone (or the last request's end)
    sizes: list[tuple[float, int, int]] = field(default_factory=list)  # autoscaled: (time, prefill, decode) after each change
    tier: np.ndarray | None = None  # the rank of the tier each request asked for (pdserve.tiers)
    served_tier: np.ndarray | None = None  # ... and of the tier it was served as (priority -> default)
    preemptions: np.ndarray | None = None  # times each request was preempted (flex only)
    recomputes: np.ndarray | None = None  # ... of which its KV was dropped and its context recomputed

    @property
    def ok(self) -> np.ndarray:
        return ~self.rejected & ~np.isnan(self.end)

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def e2el(self) -> np.ndarray:
        return self.end - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.output_len > 1, (self.end - self.first_token) / (self.output_len - 1), np.nan)

    def tier_stats(self, tiers: TiersConfig | None = None) -> dict[str, dict]:
        """Per tier asked for: counts, TTFT and TPOT (median, p99), and the share of its requests within
        its own SLO (tiers.slo; a refused or downgraded request is judged by the tier it asked for)."""
        tiers = tiers or TiersConfig()
        out = {}
        for t in TIERS:
            sel = self.tier == t.rank
            if not sel.any():
                continue
            ok = sel & self.ok
            slo = tiers.slo_of(t)
            ttft, tpot = self.ttft[ok], self.tpot[ok]
            tpot = tpot[~np.isnan(tpot)]
            with np.errstate(invalid="ignore"):
                met = ok & (self.ttft <= slo.ttft_s) & (np.nan_to_num(self.tpot, nan=0.0) <= slo.tpot_s)

            def pct(v: np.ndarray, q: float, scale: float = 1.0) -> float | None:
                return float(np.percentile(v, q)) * scale if v.size else None

            out[t.value] = {
                "requests": int(sel.sum()), "completed": int(ok.sum()), "rejected": int((sel & self.rejected).sum()),
                "served_lower": int((sel & (self.served_tier != t.rank)).sum()),
                "median_ttft_s": pct(ttft, 50), "p99_ttft_s": pct(ttft, 99),
                "median_tpot_ms": pct(tpot, 50, 1e3), "p99_tpot_ms": pct(tpot, 99, 1e3),
                "slo_attainment": float(met.sum() / sel.sum()),
                "preemptions": int(self.preemptions[sel].sum()), "recomputes": int(self.recomputes[sel].sum())}
        return out


class _Line:
    """Requests waiting, in the order every queue serves them: (tier rank, arrival), flex at default's
    rank while it is under its floor (flex_as_default). Without tiers all are default: first come, first served."""

    __slots__ = ("queues", "arr", "rank")

    def __init__(self, arr: list[float], rank: list[int]):
        self.queues: tuple[deque[int], ...] = (deque(), deque(), deque())
        self.arr, self.rank = arr, rank

    def __len__(self) -> int:
        return len(self.queues[0]) + len(self.queues[1]) + len(self.queues[2])

    def __iter__(self):
        return itertools.chain(*self.queues)

    def flex(self) -> int:
        return len(self.queues[2])

    def append(self, r: int) -> None:
        """In arrival order within r's tier (a preempted or downgraded request goes back to its place)."""
        q, arr = self.queues[self.rank[r]], self.arr
        i = len(q)
        while i and arr[q[i - 1]] > arr[r]:
            i -= 1
        q.insert(i, r)

    def head(self, flex_as_default: bool = False) -> int | None:
        p, d, f = self.queues
        if p:
            return p[0]
        if f and (not d or flex_as_default and (self.arr[f[0]], f[0]) < (self.arr[d[0]], d[0])):
            return f[0]
        return d[0] if d else None

    def remove(self, r: int) -> None:
        """Take r, a head, out of the line."""
        q = self.queues[self.rank[r]]
        assert q[0] == r
        q.popleft()


class _StepWork:
    """The prompt chunks one step computes, within its token budget."""

    __slots__ = ("chunks", "tokens", "pairs", "seqs", "budget")

    def __init__(self, budget: int):
        self.chunks: list[tuple[int, int]] = []  # (request, tokens)
        self.tokens = self.pairs = self.seqs = 0
        self.budget = budget

    def add(self, r: int, done: int, prompt: int, k: int) -> None:
        """k more tokens of request r's prompt of `prompt` tokens, `done` of them already computed."""
        self.chunks.append((r, k))
        self.tokens += k
        self.pairs += attention_pairs(done, k)
        self.seqs += done + k == prompt
        self.budget -= k


# Event kinds; the heap holds (time, seq, kind, worker).
_PREFILL_END, _DECODE_END, _COLOCATED_END, _LANDED, _WAKE, _SCALE, _PREFILL_READY, _DECODE_READY, _ROUTER = range(9)


def _completed(step: list[tuple[int, int]], in_progress: list[list[int]], n_in: list[int]) -> list[int]:
    """Account a step's chunks to the prompts in progress ([request, tokens computed]); the requests
    whose prompt it completed, taken out of in_progress."""
    done = []
    for r, k in step:
        entry = next(e for e in in_progress if e[0] == r)
        entry[1] += k
        if entry[1] == n_in[r]:
            in_progress.remove(entry)
            done.append(r)
    return done


class _Lifecycle:
    """When a worker was asked for, when it left, and whether placement sees it."""

    born = 0.0
    left = math.inf
    state = "ready"  # starting | ready | draining | gone


class _Prefill(_Lifecycle):
    def __init__(self, index: int, shape: PoolShape):
        self.index, self.name, self.shape = index, f"prefill-{index}", shape
        self.waiting: deque[int] = deque()
        self.running: list[list[int]] = []  # [request, tokens computed]
        self.free = shape.kv_blocks
        self.queued_tokens = 0  # the router's view: prompt tokens placed and not yet answered
        self.busy = False
        self.step: list[tuple[int, int]] = []  # (request, tokens) of the step under way
        self.step_start = 0.0
        self.busy_s = 0.0
        self.peak = 0


class _Decode(_Lifecycle):
    def __init__(self, index: int, name: str, shape: PoolShape, gid: int, line: _Line, floor: int):
        self.index, self.name, self.shape = index, name, shape
        self.gid = gid  # index among every decode-side worker (the events' key)
        self.to_reserve = line
        self.floor = floor  # flex's floor of this worker's slots
        self.flex_active = 0  # flex requests placed here and not finished
        self.flex_held = 0  # ... holding a slot (reserved or running)
        self.flex_running: set[int] = set()
        self.paused_blocks = 0  # KV kept by preempted flex requests
        self.recompute = [0, 0, 0]  # prompt tokens, pairs, seqs: preempted contexts the next step recomputes
        self.reserved = 0  # blocks reserved for KV in flight
        self.num_reserved = 0  # requests whose KV is in flight (they count towards max_num_seqs)
        self.landed: list[int] = []  # join at the next step
        self.active = 0  # the router's view: placed and not finished
        self.batch = 0
        self.ctx_base = 0  # sum over running requests of (context at join - join step)
        self.finish: list[tuple[int, int]] = []  # (step index of the last token, request)
        self.joined: list[int] = []  # requests whose first decode step is the next one to end
        self.k = 0  # index of the next step
        self.busy = False
        self.busy_s = 0.0
        self.peak = 0
        # colocated only: prompts placed here, and the chunks in progress
        self.waiting: deque[int] = deque()
        self.prefilling: list[list[int]] = []
        self.prefill_blocks = 0
        self.step: list[tuple[int, int]] = []

    @property
    def context(self) -> int:
        """Tokens of KV the running requests hold at step k, the token each computes in it included."""
        return self.ctx_base + self.batch * self.k

    def used_blocks(self) -> int:
        """Blocks in use: a running request's tokens / block size plus half a block (its last block's
        rounding, on average), the reservations, and the chunks of prompts being prefilled."""
        bs = self.shape.block_size
        running = (self.context + bs - 1) // bs + self.batch // 2
        return running + self.reserved + self.prefill_blocks + self.paused_blocks

    def free_blocks(self) -> int:
        return self.shape.kv_blocks - self.used_blocks()


def simulate(shape: ClusterShape, costs: StepCosts, arrival: np.ndarray, input_len: np.ndarray,
             output_len: np.ndarray, concurrency: int | None = None, autoscaler: Autoscaler | None = None,
             interval_s: float = 2.0, window_s: float = 30.0, startup_s: float = 60.0,
             tier: np.ndarray | None = None, tiers: TiersConfig | None = None) -> SimResult:
    """Run the workload (arrays of one entry per request, arrival times non-decreasing) to the end.

    concurrency: the client's cap on requests in flight (pdserve bench --concurrency): a request due
    while the cap is reached is sent when one ends, and its times count from then, as bench's do.
    autoscaler: decides the prefill and decode pools' sizes every interval_s (the shape's sizes are
    where they start); a worker it starts is placeable startup_s later. It sizes the fast lane, when
    its ranges have one, from the priority requests' demand.
    tier: each request's service tier (ServiceTier, its name, or its rank); None: all default.
    tiers: the tier settings (floor, fast lane, flex queue bound, SLOs); None: TiersConfig's defaults.
    """
    n = len(arrival)
    arr = [float(x) for x in arrival]
    n_in = [int(x) for x in input_len]
    n_out = [int(x) for x in output_len]
    if any(b < a for a, b in zip(arr, arr[1:])):
        raise ValueError("arrival times must be non-decreasing")
    nan = math.nan
    first = [nan] * n
    second = [nan] * n
    end = [nan] * n
    rejected = [False] * n
    ctx_join = [0] * n  # decode: context at join minus join step
    prefill_of = [-1] * n
    decode_of = [-1] * n
    ready_at = [math.inf] * n  # when the decode worker's reservation for the request was made
    held = [False] * n  # prefill done, waiting for its destination
    tiers = tiers or TiersConfig()
    tiered = tier is not None
    if tiered and shape.mode != "disaggregated":
        raise ValueError("the simulator serves tiers on disaggregated clusters only")
    rank = [1] * n if not tiered else [int(x) if isinstance(x, (int, np.integer)) else parse_tier(str(
        x.value if isinstance(x, ServiceTier) else x)).rank for x in tier]
    asked = list(rank)  # rank: the tier served, lower than asked once a priority request is downgraded
    done_tok = [1] * n  # tokens a request has (its first comes with the prefill)
    fin_step = [0] * n  # decode step of its last token, while running
    resuming = [False] * n  # preempted, waiting to run again
    paused = [-1] * n  # blocks a preempted request kept (-1: none, it recomputes)
    preempts = [0] * n
    recomputes = [0] * n
    kv_bytes = costs.kv_bytes_per_token
    transport = costs.transport
    step_time = costs.step_time
    first_lat, tok_lat = shape.first_token_latency_s, shape.token_latency_s

    events: list[tuple[float, int, int, int]] = []
    pair_free: dict[tuple[int, int], float] = {}  # (prefill, decode) -> when its last transfer ends
    seq = 0
    running_requests = 0
    router_queue = _Line(arr, rank)
    client_queue: deque[int] = deque()
    in_flight = 0
    overflows = 0
    steps = 0

    def push(t: float, kind: int, who: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, who))

    allw: list[_Decode] = []  # decode-side workers by gid: the decode pool's, the fast lane's, or colocated
    decodes: list[_Decode] = []
    fasts: list[_Decode] = []

    def new_decode(pool: str) -> _Decode:
        ws, sh = (fasts, shape.fast) if pool == "fast" else (decodes, shape.decode or shape.colocated)
        w = _Decode(len(ws), f"{pool}-{len(ws)}", sh, len(allw), _Line(arr, rank),
                    flex_floor(tiers.flex_min_share, sh.max_num_seqs) if tiered else 0)
        ws.append(w)
        allw.append(w)
        return w

    if shape.mode == "disaggregated":
        prefills = [_Prefill(i, shape.prefill) for i in range(shape.prefill.workers)]
        for _ in range(shape.decode.workers):
            new_decode("decode")
        for _ in range(shape.fast.workers if shape.fast else 0):
            new_decode("fast")
        bs = shape.prefill.block_size
    else:
        prefills = []
        for _ in range(shape.colocated.workers):
            new_decode("colocated")
        bs = shape.colocated.block_size

    def blocks(tokens: int) -> int:
        return (tokens + bs - 1) // bs

    window = DemandWindow(window_s, 0.0)
    priority_window = DemandWindow(window_s, 0.0)  # the fast lane's demand
    prefill_line = _Line(arr, rank)  # prompts waiting at the router for a prefill worker with room
    lane_line: deque[int] = deque()  # priority prompts waiting for the fast lane
    flex_inflight = 0  # flex requests past the router's line, not finished
    line_tokens = 0
    prefill_room = PREFILL_QUEUE_STEPS * shape.prefill.token_budget if shape.prefill else 0
    sizes: list[tuple[float, int, int]] = []

    # -- scaling (autoscaler given) ---------------------------------------------------------------
    def leave_if_done(w: _Prefill | _Decode, now: float) -> None:
        """A draining worker leaves once nothing of any request is on it."""
        if w.state != "draining" or w.busy:
            return
        if isinstance(w, _Prefill):
            done = not w.waiting and not w.running and w.free == w.shape.kv_blocks  # no KV held either
        else:
            done = w.active == 0
        if done:
            w.state, w.left = "gone", now

    def scale(now: float) -> None:
        rate, input_len, output_len = window.observe(now)
        live = [w for w in (*prefills, *decodes) if w.state in ("ready", "draining")]
        demand = Demand(rate, input_len, output_len,
                        sum(w.queued_tokens for w in live if isinstance(w, _Prefill)) + line_tokens
                        + round(len(router_queue) * input_len),
                        sum(w.active for w in live if isinstance(w, _Decode)),
                        sum(w.used_blocks() for w in live if isinstance(w, _Decode)))
        pools = {"prefill": prefills, "decode": decodes, "fast": fasts}
        current = {name: sum(w.state in ("starting", "ready") for w in ws) for name, ws in pools.items()}
        own = None
        if "fast" in autoscaler.ranges:
            lane = [w for w in fasts if w.state in ("ready", "draining")]
            own = {"fast": Demand(*priority_window.observe(now), 0, sum(w.active for w in lane),
                                  sum(w.used_blocks() for w in lane))}
        changed = False
        for d in autoscaler.decide(now, demand, {p: current[p] for p in autoscaler.ranges}, own):
            ws = pools[d.pool]
            if d.direction == "up":
                for _ in range(d.desired - d.current):
                    if d.pool == "prefill":
                        w = _Prefill(len(ws), shape.prefill)
                        ws.append(w)
                    else:
                        w = new_decode(d.pool)
                    w.state, w.born = "starting", now
                    push(now + startup_s, _PREFILL_READY if d.pool == "prefill" else _DECODE_READY,
                         w.index if d.pool == "prefill" else w.gid)
            elif d.direction == "down":
                ready = [w for w in ws if w.state == "ready"]
                load = (lambda w: (w.queued_tokens, -w.index)) if d.pool == "prefill" else (lambda w: (w.active, -w.index))
                for w in sorted(ready, key=load)[:min(d.current - d.desired, len(ready) - 1)]:
                    w.state = "draining"
                    leave_if_done(w, now)
            changed |= d.direction != "none"
        if changed:
            sizes.append((now, *(sum(w.state in ("starting", "ready") for w in pools[p]) for p in ("prefill", "decode"))))
        if i < n or running_requests or client_queue:
            push(now + interval_s, _SCALE, 0)

    def ready(w: _Prefill | _Decode, now: float) -> None:
        w.state = "ready"
        dispatch(now)

    # -- router ---------------------------------------------------------------------------------
    def flex_first() -> bool:
        """Whether flex is at default's rank in the router's line: fewer of it in flight than its floor."""
        return tiered and flex_inflight < flex_floor(
            tiers.flex_min_share, sum(w.shape.max_num_seqs for w in decodes if w.state == "ready"))

    def place(r: int, now: float) -> None:
        nonlocal running_requests, line_tokens
        running_requests += 1
        if shape.mode == "colocated":
            d = min(decodes, key=lambda w: (w.active, -w.free_blocks()))
            d.active += 1
            d.waiting.append(r)
            if not d.busy:
                colocated_step(d, now)
            return
        line_tokens += n_in[r]
        if rank[r] == 0 and fasts:
            if tiers.fast_lane_when_full == "wait":
                push(arr[r] + tiers.fast_lane_max_wait_s, _ROUTER, 0)  # the end of its wait for the lane
            lane_line.append(r)
        else:
            prefill_line.append(r)
        dispatch(now)

    def prefill_rooms() -> list[_Prefill]:
        return [w for w in prefills if w.state == "ready" and w.queued_tokens < prefill_room]

    def dispatch(now: float) -> None:
        """Send the prompts in line to prefill workers with room: priority bound for the fast lane first
        (served as default when the lane is full: at once, or after its wait), then the line by tier."""
        nonlocal line_tokens, flex_inflight
        while lane_line:
            r = lane_line[0]
            open_ = [w for w in fasts if w.state == "ready" and decode_room(w, r)] if n_out[r] > 1 else [None]
            if not open_:
                if tiers.fast_lane_when_full == "downgrade" or now >= arr[r] + tiers.fast_lane_max_wait_s:
                    lane_line.popleft()
                    rank[r] = ServiceTier.DEFAULT.rank
                    prefill_line.append(r)
                    continue
                break  # it waits for the lane; the line behind goes on
            room = prefill_rooms()
            if not room:
                return
            lane_line.popleft()
            line_tokens -= n_in[r]
            d = min(open_, key=lambda w: (w.active, -w.free_blocks())) if n_out[r] > 1 else None
            send_prompt(r, min(room, key=lambda w: w.queued_tokens), d, now)
        while prefill_line:
            r = prefill_line.head(flex_first())
            room = prefill_rooms()
            open_ = [w for w in decodes if w.state == "ready" and decode_room(w, r)] if n_out[r] > 1 else [None]
            if not room or not open_:
                return
            prefill_line.remove(r)
            line_tokens -= n_in[r]
            flex_inflight += rank[r] == 2
            d = min(open_, key=lambda w: (w.active, -w.free_blocks())) if n_out[r] > 1 else None
            send_prompt(r, min(room, key=lambda w: w.queued_tokens), d, now)

    def decode_room(d: _Decode, r: int) -> bool:
        """Whether d can take request r's KV: the router's view (router.cluster._decode_room). For a
        priority or default request, flex above its floor counts as room, slots and KV (it is preempted)."""
        active = d.active
        if rank[r] < 2 and d.flex_active > d.floor:
            active -= d.flex_active - d.floor
        if active >= d.shape.max_num_seqs:
            return False
        if rank[r] < 2 and len(d.flex_running) > d.floor:
            return True  # its KV too, as far as the router can tell
        waiting = sum(blocks(n_in[x] + 1) for x in d.to_reserve)
        return d.active == 0 or d.free_blocks() - waiting >= blocks(n_in[r] + 1)

    def send_prompt(r: int, p: _Prefill, d: _Decode | None, now: float) -> None:
        prefill_of[r] = p.index
        p.queued_tokens += n_in[r]
        p.waiting.append(r)
        if n_out[r] > 1:
            decode_of[r] = d.gid
            d.active += 1
            d.flex_active += rank[r] == 2
            d.to_reserve.append(r)
            if not d.busy:
                decode_step(d, now)  # an idle decode worker reserves at once
        if not p.busy:
            prefill_step(p, now)

    def send(r: int, t: float) -> None:
        nonlocal in_flight
        if concurrency is not None and in_flight >= concurrency:
            client_queue.append(r)
            return
        in_flight += 1
        arr[r] = t
        window.arrived(t, n_in[r], n_out[r])
        if asked[r] == 0:
            priority_window.arrived(t, n_in[r], n_out[r])
        if rank[r] == 2 and router_queue.flex() + prefill_line.flex() >= tiers.flex_max_queued:
            rejected[r] = True  # flex is refused at once when its own queue is full
            client_done(t)
        elif running_requests < shape.max_running:
            place(r, t)
        elif len(router_queue) < shape.max_queued:
            router_queue.append(r)
        else:
            rejected[r] = True
            client_done(t)

    def client_done(t: float) -> None:
        nonlocal in_flight
        in_flight -= 1
        if client_queue:
            send(client_queue.popleft(), t)

    def finished(r: int, t: float) -> None:
        nonlocal running_requests, flex_inflight
        end[r] = t
        window.finished(t, n_out[r])
        if asked[r] == 0:
            priority_window.finished(t, n_out[r])
        running_requests -= 1
        flex_inflight -= rank[r] == 2
        if router_queue:
            r = router_queue.head(flex_first())
            router_queue.remove(r)
            place(r, t)
        client_done(t)

    # -- prefill worker -------------------------------------------------------------------------
    def prefill_step(p: _Prefill, now: float) -> None:
        sh = p.shape
        w = _StepWork(sh.token_budget)
        for r, done in p.running:
            if w.budget <= 0:
                break
            w.add(r, done, n_in[r], min(n_in[r] - done, w.budget))
        while p.waiting and w.budget > 0 and len(p.running) < sh.max_num_seqs:
            r = p.waiting[0]
            need = blocks(n_in[r])
            if need > p.free:
                break
            p.waiting.popleft()
            p.free -= need
            p.peak = max(p.peak, sh.kv_blocks - p.free)
            p.running.append([r, 0])
            w.add(r, 0, n_in[r], min(n_in[r], w.budget))
        if not w.chunks:
            p.busy = False
            leave_if_done(p, now)
            return
        nonlocal steps
        steps += 1
        p.busy, p.step, p.step_start = True, w.chunks, now
        push(now + step_time(w.tokens, w.pairs, w.seqs, 0, 0), _PREFILL_END, p.index)

    def prefill_end(p: _Prefill, now: float) -> None:
        dt = now - p.step_start
        p.busy_s += dt
        streamed: dict[int, list[int]] = {}
        after: dict[int, list[int]] = {}
        for r in _completed(p.step, p.running, n_in):
            p.queued_tokens -= n_in[r]
            first[r] = now + first_lat
            if n_out[r] == 1:
                p.free += blocks(n_in[r])
                finished(r, first[r])
                continue
            if ready_at[r] <= p.step_start:  # pushed layer by layer during the step
                streamed.setdefault(decode_of[r], []).append(r)
            elif ready_at[r] < math.inf:  # became ready during the step: sent whole from the held blocks
                after.setdefault(decode_of[r], []).append(r)
            else:
                held[r] = True  # sent once the decode worker reserves
        pi = p.index
        # The requests of one step bound for one decode worker travel as one transfer; a pair's
        # transfers go one after another, in order.
        for dest, rs in streamed.items():
            nbytes = sum(n_in[r] for r in rs) * kv_bytes
            free_at = pair_free.get((pi, dest), 0.0)
            t = now + transport.exposed_time(nbytes, dt)
            if free_at > p.step_start:  # the pair was still busy when the layers began to come
                t = max(t, free_at + transport.send_time(nbytes))
            hand_off(pi, dest, rs, t)
        for dest, rs in after.items():
            send_whole(pi, dest, rs, now)
        dispatch(now)  # its queue shrank: prompts in line may come (they join its next step)
        prefill_step(p, now)

    def hand_off(pi: int, dest: int, rs: list[int], t: float) -> None:
        pair_free[(pi, dest)] = t
        for r in rs:
            push(t, _LANDED, r)

    def send_whole(pi: int, dest: int, rs: list[int], now: float) -> None:
        """Held KV sent at once, after the pair's earlier transfers."""
        nbytes = sum(n_in[r] for r in rs) * kv_bytes
        hand_off(pi, dest, rs, max(now, pair_free.get((pi, dest), 0.0)) + transport.send_time(nbytes))

    # -- decode worker --------------------------------------------------------------------------
    def reserve(d: _Decode, now: float) -> None:
        """Room for the requests waiting on d, by (tier, arrival); a priority or default request that
        finds d full preempts flex above its floor. A preempted request resumes here (joins at once)."""
        sh = d.shape
        while d.to_reserve:
            r = d.to_reserve.head(d.flex_held < d.floor)
            if resuming[r]:
                need = 0 if paused[r] >= 0 else blocks(n_in[r] + done_tok[r] + 1)
            else:
                need = blocks(n_in[r] + 1)
            slot = d.batch + d.num_reserved < sh.max_num_seqs
            fits = d.free_blocks() - need >= d.batch * sh.headroom_blocks
            if not (slot and fits):
                if rank[r] < 2 and preempt(d, kv_short=not fits):
                    continue
                break
            d.to_reserve.remove(r)
            d.flex_held += rank[r] == 2
            if resuming[r]:
                resume(d, r)
                continue
            d.reserved += need
            d.num_reserved += 1
            ready_at[r] = now
            if held[r]:
                held[r] = False
                send_whole(prefill_of[r], decode_of[r], [r], now)

    def landed(r: int, now: float) -> None:
        p = prefills[prefill_of[r]]
        p.free += blocks(n_in[r])
        d = allw[decode_of[r]]
        d.landed.append(r)
        if not p.busy:
            prefill_step(p, now)
        if not d.busy:  # wake it after every landing of this instant (one transfer carries several)
            d.busy = True
            push(now, _WAKE, decode_of[r])

    def join(d: _Decode, r: int) -> None:
        """r's first done_tok[r] tokens are known; its KV (prompt and those) is in d: from step d.k on it decodes."""
        c = n_in[r] + done_tok[r] - d.k
        ctx_join[r] = c
        d.ctx_base += c
        d.batch += 1
        d.joined.append(r)
        fin_step[r] = d.k + n_out[r] - done_tok[r] - 1
        heapq.heappush(d.finish, (fin_step[r], r))
        if rank[r] == 2:
            d.flex_running.add(r)

    def preempt(d: _Decode, kv_short: bool) -> bool:
        """Make room on d for a higher tier: when KV is short, first drop the KV a paused flex request
        kept; else pause d's latest running flex request above flex's floor, keeping its KV unless KV is
        short (then it recomputes when it resumes). False: nothing to preempt."""
        if kv_short:
            kept = next((x for x in d.to_reserve.queues[2] if paused[x] >= 0), None)
            if kept is not None:
                d.paused_blocks -= paused[kept]
                paused[kept] = -1
                recomputes[kept] += 1
                return True
        if d.flex_held <= d.floor or not d.flex_running:
            return False
        r = max(d.flex_running, key=lambda x: (arr[x], x))
        d.flex_running.discard(r)
        d.flex_held -= 1
        d.batch -= 1
        d.ctx_base -= ctx_join[r]
        d.finish.remove((fin_step[r], r))
        heapq.heapify(d.finish)
        if r in d.joined:
            d.joined.remove(r)
        done_tok[r] = d.k + ctx_join[r] - n_in[r]  # its tokens so far (one per step since it joined)
        preempts[r] += 1
        if kv_short:
            paused[r] = -1
            recomputes[r] += 1
        else:
            paused[r] = blocks(n_in[r] + done_tok[r])
            d.paused_blocks += paused[r]
        resuming[r] = True
        d.to_reserve.append(r)
        return True

    def resume(d: _Decode, r: int) -> None:
        resuming[r] = False
        if paused[r] >= 0:
            d.paused_blocks -= paused[r]
            paused[r] = -1
        else:  # its context is computed again, as prompt chunks riding on the next step
            tokens = n_in[r] + done_tok[r]
            rc = d.recompute
            rc[0] += tokens
            rc[1] += attention_pairs(0, tokens)
            rc[2] += 1
        join(d, r)

    def step_done(d: _Decode, now: float) -> None:
        """The tokens of decode step d.k reach their clients; the requests whose last token it was finish."""
        t = now + tok_lat
        for r in d.joined:
            if second[r] != second[r]:  # not yet (a resumed request had it before)
                second[r] = t
        d.joined.clear()
        while d.finish and d.finish[0][0] <= d.k:
            _, r = heapq.heappop(d.finish)
            d.batch -= 1
            d.ctx_base -= ctx_join[r]
            d.active -= 1
            if rank[r] == 2:
                d.flex_active -= 1
                d.flex_held -= 1
                d.flex_running.discard(r)
            finished(r, t)
        d.k += 1
        if prefill_line or lane_line:
            dispatch(now)  # room on d, maybe

    def decode_step(d: _Decode, now: float) -> None:
        # Landed KV joins first (the worker takes it in between steps), then the step reserves room.
        for r in d.landed:
            d.reserved -= blocks(n_in[r] + 1)
            d.num_reserved -= 1
            join(d, r)
        d.landed.clear()
        reserve(d, now)
        if not d.batch:
            d.busy = False
            leave_if_done(d, now)
            return
        decodes_only(d, now, _DECODE_END)

    def decodes_only(d: _Decode, now: float, kind: int) -> None:
        """Steps of d's running batch alone. Steps that end before anything else happens in the
        cluster, with no request joining or finishing, change nothing another part could see: they
        are accounted here in a loop rather than as one event each (the simulation's hot path)."""
        nonlocal steps, overflows
        d.busy = True
        who = d.gid
        horizon = events[0][0] if events else math.inf
        if i < n and arr[i] < horizon:
            horizon = arr[i]
        batch, base, capacity = d.batch, d.ctx_base, d.shape.kv_blocks
        fixed = d.reserved + d.prefill_blocks + d.paused_blocks + batch // 2  # besides the contexts' (used_blocks)
        bs = d.shape.block_size
        last = d.finish[0][0]
        busy = 0.0
        rc = d.recompute
        if rc[0]:  # preempted contexts computed again ride on this step, which ends there
            steps += 1
            dt = step_time(rc[0], rc[1], rc[2], batch, base + batch * d.k)
            d.recompute = [0, 0, 0]
            d.busy_s += dt
            push(now + dt, kind, who)
            return
        while True:
            steps += 1
            ctx = base + batch * d.k
            used = (ctx + bs - 1) // bs + fixed
            if used > capacity:
                overflows += 1
            if used > d.peak:
                d.peak = used
            dt = step_time(0, 0, 0, batch, ctx)
            busy += dt
            t = now + dt
            if d.joined or last <= d.k or t >= horizon:
                d.busy_s += busy
                push(t, kind, who)
                return
            d.k += 1
            now = t

    def decode_end(d: _Decode, now: float) -> None:
        step_done(d, now)
        decode_step(d, now)

    # -- colocated worker -----------------------------------------------------------------------
    def colocated_step(d: _Decode, now: float) -> None:
        sh = d.shape
        w = _StepWork(sh.token_budget - d.batch)
        free = d.free_blocks()
        for r, done in d.prefilling:  # prompts under way first; their blocks grow chunk by chunk
            if w.budget <= 0:
                break
            k = min(n_in[r] - done, w.budget)
            free -= blocks(done + k) - blocks(done)
            w.add(r, done, n_in[r], k)
        while d.waiting and w.budget > 0 and d.batch + len(d.prefilling) < sh.max_num_seqs:
            r = d.waiting[0]
            k = min(n_in[r], w.budget)
            if blocks(k) > free:
                break
            free -= blocks(k)
            d.waiting.popleft()
            d.prefilling.append([r, 0])
            w.add(r, 0, n_in[r], k)
        if not w.chunks:
            if d.batch:
                decodes_only(d, now, _COLOCATED_END)
            else:
                d.busy = False
            return
        nonlocal steps, overflows
        steps += 1
        d.prefill_blocks += d.free_blocks() - free  # what the chunks took
        used = d.used_blocks()
        if used > sh.kv_blocks:  # a prompt under way outgrew the cache: the scheduler would preempt
            overflows += 1
        d.peak = max(d.peak, used)
        d.busy, d.step = True, w.chunks
        dt = step_time(w.tokens, w.pairs, w.seqs, d.batch, d.context)
        d.busy_s += dt
        push(now + dt, _COLOCATED_END, d.gid)

    def colocated_end(d: _Decode, now: float) -> None:
        joined = _completed(d.step, d.prefilling, n_in)
        for r in joined:
            d.prefill_blocks -= blocks(n_in[r])
            first[r] = now + first_lat
        d.step = []
        if d.batch:
            step_done(d, now)
        else:
            d.k += 1
        for r in joined:
            if n_out[r] == 1:
                d.active -= 1
                finished(r, first[r])
            else:
                join(d, r)
        colocated_step(d, now)

    # -- the loop -------------------------------------------------------------------------------
    handlers = {
        _PREFILL_END: lambda who, t: prefill_end(prefills[who], t),
        _DECODE_END: lambda who, t: decode_end(allw[who], t),
        _COLOCATED_END: lambda who, t: colocated_end(allw[who], t),
        _LANDED: lambda who, t: landed(who, t),
        _WAKE: lambda who, t: decode_step(allw[who], t),
        _SCALE: lambda who, t: scale(t),
        _PREFILL_READY: lambda who, t: ready(prefills[who], t),
        _DECODE_READY: lambda who, t: ready(allw[who], t),
        _ROUTER: lambda who, t: dispatch(t),
    }
    if autoscaler is not None:
        if shape.mode != "disaggregated":
            raise ValueError("the simulator autoscales disaggregated pools only")
        push(interval_s, _SCALE, 0)
        sizes.append((0.0, len(prefills), len(decodes)))
    i = 0  # the next request of the schedule (decodes_only reads it)
    while i < n or events:
        if i < n and (not events or arr[i] <= events[0][0]):
            send(i, arr[i])
            i += 1
            continue
        t, _, kind, who = heapq.heappop(events)
        handlers[kind](who, t)
    workers = [*prefills, *allw]
    last = max((t for t in end if t == t), default=0.0)
    worker_seconds = sum(max(0.0, min(w.left, last) - w.born) for w in workers)
    return SimResult(np.array(arr), np.asarray(input_len), np.asarray(output_len),
                     np.array(first), np.array(second), np.array(end), np.array(rejected),
                     {w.name: w.peak for w in workers}, {w.name: w.busy_s for w in workers}, overflows, steps,
                     worker_seconds, sizes, np.array(asked), np.array(rank), np.array(preempts), np.array(recomputes))
