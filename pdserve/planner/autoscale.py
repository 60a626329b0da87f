"""Autoscaling: how many workers each pool needs now, by the planner's cost model.

The live cluster (router.autoscaler) and the simulator (pdserve.planner.simulator) ask the same
Autoscaler, so what the simulator says of the policy over a long trace is what the cluster does.

Each pool is sized from what it must sustain, through the cost model (pdserve.perf.costs), not by
one threshold on one signal:

- prefill: the prompt tokens arriving per second over what one worker computes per second with its
  token budget full, at a utilization whose queueing still lets a prompt of the mean length start
  within the TTFT target; plus the prompt tokens already waiting, which must be computed within the
  TTFT target or, when a new worker takes longer than that to be ready, within its start-up time
  (a worker that arrives after the backlog is gone helps nobody).
- decode: one worker runs at most b* requests, the largest batch whose step (at the mean context)
  stays within the TPOT target and whose KV fits its cache. The requests decoding at once are, by
  Little's law, arrival rate x output length x step time; the pool needs that over b*, and never fewer
  workers than the requests it already holds over b*, nor than its KV in use needs.

- fast (the fast lane, pdserve.tiers): decode's sizing from the priority tier's demand alone (its
  arrivals, the requests and KV on the lane's workers), with priority's TPOT target and b* capped at
  the lane's running-batch cap (its PoolLimits.max_num_seqs). The decode pool keeps the cluster's demand.

Hysteresis: a pool grows as soon as it needs to; it shrinks only to the largest size it needed over
the last scale_down_delay_s seconds (the stabilization window of Kubernetes' HPA), so a burst's lull
between two waves does not drain workers the next wave needs.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pdserve.perf.costs import StepCosts, attention_pairs

# The share of a worker's throughput the sizing plans for at most: the rest absorbs variation in
# arrivals and lengths that the mean does not show.
MAX_UTILIZATION = 0.9
# Decode KV in use that calls for another worker: above it, a growing batch soon preempts.
KV_HIGH_WATER = 0.85


@dataclass(frozen=True)
class PoolLimits:
    """What one worker of a pool can hold and compute per step (its SchedulerConfig and KV cache)."""

    kv_blocks: int
    block_size: int
    max_num_seqs: int
    token_budget: int

    def blocks(self, tokens: float) -> int:
        return math.ceil(tokens / self.block_size)


@dataclass(frozen=True)
class Demand:
    """The load the pools see now."""

    arrival_rate: float  # requests per second over the window
    input_len: float  # mean prompt tokens
    output_len: float  # mean output tokens
    prefill_backlog_tokens: int  # prompt tokens arrived and not yet computed (router queue included)
    decode_requests: int  # requests placed on decode workers and not finished
    decode_kv_blocks: int  # KV blocks in use on the decode workers


# Why a pool has the size it has: the term of the sizing that set it, or its range's bound.
REASONS = ("rate", "backlog", "running", "kv", "minimum", "maximum")


@dataclass(frozen=True)
class Need:
    workers: int
    reason: str  # one of REASONS


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    desired: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "none"


class DemandWindow:
    """Arrivals and finishes: the arrival rate over a sliding window, and the mean lengths of recent
    requests (the last LENGTH_MEMORY, whenever they came: a wave's requests are sized by the lengths of
    the waves before it, not by no data in a quiet window).

    Output length is that of the requests that finished; before MIN_FINISHED have, the requested
    max_tokens (an upper bound, which errs towards more decode workers). The first requests to finish
    are the short ones, so a mean over only those would size a wave's decode pool for outputs it
    mostly does not have.
    """

    LENGTH_MEMORY = 1000
    MIN_FINISHED = 20

    def __init__(self, window_s: float, start: float | None = None):
        """start: when watching began (a rate over less time than that is not a rate); None: the first
        arrival or observation."""
        if window_s <= 0:
            raise ValueError(f"the window must be positive, got {window_s}")
        self.window_s = window_s
        self._arrivals: deque[float] = deque()  # times, within the window
        self._inputs: deque[int] = deque(maxlen=self.LENGTH_MEMORY)
        self._max_tokens: deque[int] = deque(maxlen=self.LENGTH_MEMORY)
        self._outputs: deque[int] = deque(maxlen=self.LENGTH_MEMORY)
        self._start = start

    def arrived(self, now: float, prompt_tokens: int, max_tokens: int) -> None:
        if self._start is None:
            self._start = now
        self._arrivals.append(now)
        self._inputs.append(prompt_tokens)
        self._max_tokens.append(max_tokens)

    def finished(self, now: float, output_tokens: int) -> None:
        self._outputs.append(output_tokens)

    def observe(self, now: float) -> tuple[float, float, float]:
        """(arrival rate over the window ending now, mean prompt tokens, mean output tokens)."""
        if self._start is None:
            self._start = now
        while self._arrivals and self._arrivals[0] < now - self.window_s:
            self._arrivals.popleft()
        rate = 0.0
        if self._arrivals:
            span = max(min(self.window_s, now - self._start), self._arrivals[-1] - self._arrivals[0], 1e-3)
            rate = len(self._arrivals) / span
        outputs = self._outputs if len(self._outputs) >= self.MIN_FINISHED else self._max_tokens
        return rate, _mean(self._inputs), _mean(outputs)


def _mean(values) -> float:
    v = list(values)
    return sum(v) / len(v) if v else 0.0


def prefill_need(costs: StepCosts, limits: PoolLimits, demand: Demand, ttft_s: float, startup_s: float) -> Need:
    """Prefill workers for the demand (before the pool's range is applied)."""
    n_in = max(1, round(demand.input_len))
    k = max(1, limits.token_budget // n_in)  # prompts of the mean length in one full step
    tokens = min(k * n_in, max(limits.token_budget, n_in))
    step = costs.step_time(tokens, k * attention_pairs(0, n_in), k, 0, 0)
    per_worker = tokens / step  # prompt tokens per second, token budget full
    alone = costs.step_time(n_in, attention_pairs(0, n_in), 1, 0, 0)
    # M/D/1: a prompt waits utilization / (2 (1 - utilization)) services on average; the utilization
    # at which wait + service reaches the TTFT target bounds what the sizing plans for.
    slack = max(ttft_s - alone, 0.0) / alone
    rho = min(MAX_UTILIZATION, max(0.1, 2 * slack / (1 + 2 * slack)))
    by_rate = demand.arrival_rate * demand.input_len / (rho * per_worker)
    by_backlog = demand.prefill_backlog_tokens / (per_worker * max(ttft_s, startup_s))
    return _largest({"rate": by_rate, "backlog": by_backlog})


def decode_batch(costs: StepCosts, limits: PoolLimits, input_len: float, output_len: float, tpot_s: float) -> int:
    """b*: the most requests one decode worker runs within the TPOT target, their KV in its cache."""
    ctx = input_len + output_len / 2  # a running request's mean context over its life
    fits = max(1, int(limits.kv_blocks * KV_HIGH_WATER) // max(1, limits.blocks(input_len + output_len)))
    best = 1
    for b in range(1, min(limits.max_num_seqs, fits) + 1):
        if costs.step_time(0, 0, 0, b, round(b * ctx)) > tpot_s:
            break
        best = b
    return best


def decode_need(costs: StepCosts, limits: PoolLimits, demand: Demand, tpot_s: float) -> Need:
    """Decode workers for the demand (before the pool's range is applied)."""
    b = decode_batch(costs, limits, demand.input_len, demand.output_len, tpot_s)
    ctx = demand.input_len + demand.output_len / 2
    step = costs.step_time(0, 0, 0, b, round(b * ctx))
    concurrent = demand.arrival_rate * max(demand.output_len - 1, 0) * step  # Little's law
    return _largest({"rate": concurrent / (MAX_UTILIZATION * b), "running": demand.decode_requests / b,
                     "kv": demand.decode_kv_blocks / (KV_HIGH_WATER * limits.kv_blocks)})


def _largest(terms: dict[str, float]) -> Need:
    reason, value = max(terms.items(), key=lambda kv: kv[1])
    # A hair over an integer is measurement noise, not a worker more.
    return Need(max(0, math.ceil(value - 1e-6)), reason)


class Autoscaler:
    """Decides each autoscaled pool's size at each call; keeps the history the hysteresis needs."""

    def __init__(self, costs: StepCosts | dict[str, StepCosts], limits: dict[str, PoolLimits],
                 ranges: dict[str, tuple[int, int]], ttft_s: float, tpot_s: float, scale_down_delay_s: float,
                 startup_s: float, fast_tpot_s: float | None = None):
        """costs: one worker's step costs, or each pool's (pools of different tensor-parallel sizes);
        fast_tpot_s: the priority tier's TPOT target, which sizes the fast lane (needed when it autoscales)."""
        unknown = set(ranges) - {"prefill", "decode", "fast"}
        if unknown:
            raise ValueError(f"only the prefill, decode and fast pools autoscale, not {sorted(unknown)}")
        if "fast" in ranges and (fast_tpot_s is None or fast_tpot_s <= 0):
            raise ValueError("an autoscaled fast lane needs the priority tier's TPOT target (> 0)")
        for pool, (lo, hi) in ranges.items():
            if not 1 <= lo <= hi:
                raise ValueError(f"{pool}: a range MIN:MAX needs 1 <= MIN <= MAX, got {lo}:{hi}")
        if min(ttft_s, tpot_s) <= 0 or scale_down_delay_s < 0:
            raise ValueError("the TTFT and TPOT targets must be positive and the scale-down delay >= 0")
        self.costs = costs if isinstance(costs, dict) else dict.fromkeys(ranges, costs)
        self.limits, self.ranges = limits, ranges
        self.ttft_s, self.tpot_s, self.scale_down_delay_s = ttft_s, tpot_s, scale_down_delay_s
        self.fast_tpot_s = fast_tpot_s
        self.startup_s = startup_s  # how long a new worker takes to be ready: the latest measured
        self._history: dict[str, deque[tuple[float, Need]]] = {p: deque() for p in ranges}

    def need(self, pool: str, demand: Demand) -> Need:
        """What the pool needs now, within its range."""
        if pool == "prefill":
            need = prefill_need(self.costs[pool], self.limits[pool], demand, self.ttft_s, self.startup_s)
        elif pool == "fast":
            need = decode_need(self.costs[pool], self.limits[pool], demand, self.fast_tpot_s)
        else:
            need = decode_need(self.costs[pool], self.limits[pool], demand, self.tpot_s)
        lo, hi = self.ranges[pool]
        if need.workers < lo:
            return Need(lo, "minimum")
        if need.workers > hi:
            return Need(hi, "maximum")
        return need

    def decide(self, now: float, demand: Demand, current: dict[str, int],
               pool_demand: dict[str, Demand] | None = None) -> list[Decision]:
        """One decision per autoscaled pool; `current` counts its ready and starting workers.
        pool_demand: a pool's own demand where it has one (the fast lane: the priority tier's), else `demand`."""
        out = []
        for pool, history in self._history.items():
            need = self.need(pool, (pool_demand or {}).get(pool, demand))
            history.append((now, need))
            while history[0][0] < now - self.scale_down_delay_s:
                history.popleft()
            n = current[pool]
            if need.workers >= n:
                out.append(Decision(pool, n, need.workers, need.reason))
                continue
            # Down only to what the whole window needed: the largest need in it, and why.
            held = max((h for _, h in history), key=lambda h: h.workers)
            desired = min(n, held.workers)
            out.append(Decision(pool, n, desired, held.reason))
        return out
