"""The simulation's records: the line every queue serves by (tier, arrival), the prompt chunks of one step,
the event kinds, and each worker's state (a prefill worker; a decode-side one: decode pool, fast lane or
colocated), with what placement and the KV accounting read from it."""
from __future__ import annotations

import itertools
import math
from collections import deque

from pdserve.perf.costs import attention_pairs
from pdserve.planner.simulator.shapes import PoolShape


class Line:
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


class StepWork:
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
PREFILL_END, DECODE_END, COLOCATED_END, LANDED, WAKE, SCALE, PREFILL_READY, DECODE_READY, ROUTER = range(9)


def completed(step: list[tuple[int, int]], in_progress: list[list[int]], n_in: list[int]) -> list[int]:
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


class Lifecycle:
    """When a worker was asked for, when it left, and whether placement sees it."""

    born = 0.0
    left = math.inf
    state = "ready"  # starting | ready | draining | gone


class Prefill(Lifecycle):
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


class Decode(Lifecycle):
    def __init__(self, index: int, name: str, shape: PoolShape, gid: int, line: Line, floor: int):
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
        self.step_time = None  # the pool's step costs (its speculation's, if it has one): set by the simulation
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
