"""A discrete-event simulator of a pdserve cluster, fast enough to try many configurations.

It replays a workload (arrival time, prompt and output length of each request) through the parts of
the request path that decide latency, with each step's duration from a cost model
(pdserve.perf.costs):

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
  the token budget, as pdserve.engine.scheduler does;
- speculative decoding, on a pool that has it (PoolShape.speculation): its decode-only steps take the time per
  token of a verification step over the tokens it emits at the pool's acceptance rate
  (pdserve.perf.speculation.SpeculativeCosts: a fluid model, the expected rate rather than runs of tokens).

Prefix caching, given each request's cached tokens (a multi-turn workload: the shared system prompt, and a
conversation's earlier turns and replies, which its decode worker holds and computes the rest of itself: local
prefill): a prompt is computed from its first uncached token (its attention over the cached ones still
counted), its worker's queue and the router's line count only those tokens, and a hand-off moves only their KV.
The hop is kept as it is (a prefill worker's step and hand-off; a colocated worker's chunk): the work and the
bytes are what a local prefill costs, the decode worker's own steps are not lengthened by it. Without cached
tokens (synthetic prompts share none) nothing of this changes anything.

What it leaves out, and why that is safe for sizing: stop strings and EOS (benchmarks set ignore_eos), preemption (a step whose KV would overflow the
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

The parts live in pdserve.planner.simulator (its docstring lists them): the shapes, the result, the workers'
records, and the router, prefill, decode, colocated and scaling parts of the simulation, which this
module puts together around the clock (_Simulation) behind simulate().
"""
from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from pdserve.perf.costs import StepCosts
from pdserve.perf.speculation import SpeculativeCosts
from pdserve.planner.autoscale import Autoscaler, DemandWindow
from pdserve.planner.simulator.colocated import Colocating
from pdserve.planner.simulator.decode import Decoding
from pdserve.planner.simulator.prefill import Prefilling
from pdserve.planner.simulator.result import SimResult
from pdserve.planner.simulator.router import Routing
from pdserve.planner.simulator.scaling import Scaling
from pdserve.planner.simulator.shapes import ClusterShape, PoolShape
from pdserve.planner.simulator.state import (
    COLOCATED_END,
    DECODE_END,
    DECODE_READY,
    LANDED,
    PREFILL_END,
    PREFILL_READY,
    ROUTER,
    SCALE,
    WAKE,
    Decode,
    Line,
    Prefill,
)
from pdserve.tiers import ServiceTier, TiersConfig, flex_floor, parse_tier

__all__ = ["PREFILL_QUEUE_STEPS", "ClusterShape", "PoolShape", "SimResult", "simulate"]

PREFILL_QUEUE_STEPS = 2  # router.cluster.PREFILL_QUEUE_STEPS (pdserve/ cannot import router/)


def simulate(shape: ClusterShape, costs: StepCosts, arrival: np.ndarray, input_len: np.ndarray,
             output_len: np.ndarray, concurrency: int | None = None, autoscaler: Autoscaler | None = None,
             interval_s: float = 2.0, window_s: float = 30.0, startup_s: float = 60.0,
             tier: np.ndarray | None = None, tiers: TiersConfig | None = None,
             cached_len: np.ndarray | None = None) -> SimResult:
    """Run the workload (arrays of one entry per request, arrival times non-decreasing) to the end.

    concurrency: the client's cap on requests in flight (pdserve bench --concurrency): a request due
    while the cap is reached is sent when one ends, and its times count from then, as bench's do.
    autoscaler: decides the prefill and decode pools' sizes every interval_s (the shape's sizes are
    where they start); a worker it starts is placeable startup_s later. It sizes the fast lane, when
    its ranges have one, from the priority requests' demand.
    tier: each request's service tier (ServiceTier, its name, or its rank); None: all default.
    tiers: the tier settings (floor, fast lane, flex queue bound, SLOs); None: TiersConfig's defaults.
    cached_len: each request's prompt tokens the cluster holds already (prefix caching: a shared system prompt,
    a conversation's earlier turns); at least one token of a prompt is computed. None: nothing cached.
    """
    return _Simulation(shape, costs, arrival, input_len, output_len, concurrency, autoscaler, interval_s, window_s,
                       startup_s, tier, tiers, cached_len).run()


class _Simulation(Routing, Prefilling, Decoding, Colocating, Scaling):
    """One run of simulate(): the requests' records, the workers, the router's lines and queues, and the
    clock (a heap of events). Each part's methods (the classes it is made of) read and write this state."""

    def __init__(self, shape: ClusterShape, costs: StepCosts, arrival: np.ndarray, input_len: np.ndarray,
                 output_len: np.ndarray, concurrency: int | None, autoscaler: Autoscaler | None, interval_s: float,
                 window_s: float, startup_s: float, tier: np.ndarray | None, tiers: TiersConfig | None,
                 cached_len: np.ndarray | None = None):
        self.shape, self.concurrency, self.autoscaler = shape, concurrency, autoscaler
        self.input_len, self.output_len = input_len, output_len
        self.interval_s, self.startup_s = interval_s, startup_s
        self.n = n = len(arrival)
        self.arr = arr = [float(x) for x in arrival]
        self.n_in = [int(x) for x in input_len]
        self.n_out = [int(x) for x in output_len]
        # Prefix caching: the tokens of each prompt served from a cache, and those left to compute (and to move).
        self.n_cached = [0] * n if cached_len is None else [min(max(int(c), 0), k - 1)
                                                              for c, k in zip(cached_len, self.n_in)]
        self.n_new = [k - c for k, c in zip(self.n_in, self.n_cached)]
        if any(b < a for a, b in zip(arr, arr[1:])):
            raise ValueError("arrival times must be non-decreasing")
        nan = math.nan
        self.first = [nan] * n
        self.second = [nan] * n
        self.end = [nan] * n
        self.rejected = [False] * n
        self.ctx_join = [0] * n  # decode: context at join minus join step
        self.prefill_of = [-1] * n
        self.decode_of = [-1] * n
        self.ready_at = [math.inf] * n  # when the decode worker's reservation for the request was made
        self.held = [False] * n  # prefill done, waiting for its destination
        self.tiers = tiers or TiersConfig()
        self.tiered = tiered = tier is not None
        if tiered and shape.mode != "disaggregated":
            raise ValueError("the simulator serves tiers on disaggregated clusters only")
        self.rank = rank = [1] * n if not tiered else [int(x) if isinstance(x, (int, np.integer)) else parse_tier(str(
            x.value if isinstance(x, ServiceTier) else x)).rank for x in tier]
        self.asked = list(rank)  # rank: the tier served, lower than asked once a priority request is downgraded
        self.done_tok = [1] * n  # tokens a request has (its first comes with the prefill)
        self.fin_step = [0] * n  # decode step of its last token, while running
        self.resuming = [False] * n  # preempted, waiting to run again
        self.paused = [-1] * n  # blocks a preempted request kept (-1: none, it recomputes)
        self.preempts = [0] * n
        self.recomputes = [0] * n
        self.kv_bytes = costs.kv_bytes_per_token
        self.transport = costs.transport
        self.costs, self.step_time = costs, costs.step_time
        self.first_lat, self.tok_lat = shape.first_token_latency_s, shape.token_latency_s

        self.events: list[tuple[float, int, int, int]] = []
        self.pair_free: dict[tuple[int, int], float] = {}  # (prefill, decode) -> when its last transfer ends
        self.seq = 0
        self.running_requests = 0
        self.router_queue = Line(arr, rank)
        self.client_queue: deque[int] = deque()
        self.in_flight = 0
        self.overflows = 0
        self.steps = 0

        self.allw: list[Decode] = []  # decode-side workers by gid: the decode pool's, the fast lane's, or colocated
        self.decodes: list[Decode] = []
        self.fasts: list[Decode] = []
        if shape.mode == "disaggregated":
            self.prefills = [Prefill(i, shape.prefill) for i in range(shape.prefill.workers)]
            for _ in range(shape.decode.workers):
                self.new_decode("decode")
            for _ in range(shape.fast.workers if shape.fast else 0):
                self.new_decode("fast")
            self.bs = shape.prefill.block_size
        else:
            self.prefills = []
            for _ in range(shape.colocated.workers):
                self.new_decode("colocated")
            self.bs = shape.colocated.block_size

        self.window = DemandWindow(window_s, 0.0)
        self.priority_window = DemandWindow(window_s, 0.0)  # the fast lane's demand
        self.prefill_line = Line(arr, rank)  # prompts waiting at the router for a prefill worker with room
        self.lane_line: deque[int] = deque()  # priority prompts waiting for the fast lane
        self.flex_inflight = 0  # flex requests past the router's line, not finished
        self.line_tokens = 0
        self.prefill_room = PREFILL_QUEUE_STEPS * shape.prefill.token_budget if shape.prefill else 0
        self.sizes: list[tuple[float, int, int]] = []
        self.i = 0  # the next request of the schedule (decodes_only reads it)

    def push(self, t: float, kind: int, who: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, who))

    def new_decode(self, pool: str) -> Decode:
        shape = self.shape
        ws, sh = (self.fasts, shape.fast) if pool == "fast" else (self.decodes, shape.decode or shape.colocated)
        w = Decode(len(ws), f"{pool}-{len(ws)}", sh, len(self.allw), Line(self.arr, self.rank),
                   flex_floor(self.tiers.flex_min_share, sh.max_num_seqs) if self.tiered else 0)
        # A speculating pool's decode steps: the time per token of its verifications (pdserve.perf.speculation).
        w.step_time = self.step_time if sh.speculation is None else \
            SpeculativeCosts(self.costs, sh.speculation).step_time
        ws.append(w)
        self.allw.append(w)
        return w

    def blocks(self, tokens: int) -> int:
        return (tokens + self.bs - 1) // self.bs

    def run(self) -> SimResult:
        """The clock: the next request of the schedule or the next event, whichever comes first, to the end."""
        handlers = {
            PREFILL_END: lambda who, t: self.prefill_end(self.prefills[who], t),
            DECODE_END: lambda who, t: self.decode_end(self.allw[who], t),
            COLOCATED_END: lambda who, t: self.colocated_end(self.allw[who], t),
            LANDED: lambda who, t: self.landed(who, t),
            WAKE: lambda who, t: self.decode_step(self.allw[who], t),
            SCALE: lambda who, t: self.scale(t),
            PREFILL_READY: lambda who, t: self.ready(self.prefills[who], t),
            DECODE_READY: lambda who, t: self.ready(self.allw[who], t),
            ROUTER: lambda who, t: self.dispatch(t),
        }
        if self.autoscaler is not None:
            if self.shape.mode != "disaggregated":
                raise ValueError("the simulator autoscales disaggregated pools only")
            self.push(self.interval_s, SCALE, 0)
            self.sizes.append((0.0, len(self.prefills), len(self.decodes)))
        n, arr, events = self.n, self.arr, self.events
        while self.i < n or events:
            if self.i < n and (not events or arr[self.i] <= events[0][0]):
                self.send(self.i, arr[self.i])
                self.i += 1
                continue
            t, _, kind, who = heapq.heappop(events)
            handlers[kind](who, t)
        workers = [*self.prefills, *self.allw]
        end = self.end
        last = max((t for t in end if t == t), default=0.0)
        worker_seconds = sum(max(0.0, min(w.left, last) - w.born) for w in workers)
        return SimResult(np.array(arr), np.asarray(self.input_len), np.asarray(self.output_len),
                         np.array(self.first), np.array(self.second), np.array(end), np.array(self.rejected),
                         {w.name: w.peak for w in workers}, {w.name: w.busy_s for w in workers}, self.overflows,
                         self.steps, worker_seconds, self.sizes, np.array(self.asked), np.array(self.rank),
                         np.array(self.preempts), np.array(self.recomputes))
