"""Placement: prompts wait in the router's line (router.line) until a prefill worker has room for the
prompt and, if a token follows the first, a worker of its decode pool has room for its KV; they are
placed in the line's order, whenever the pools change (a step's stats, a worker joining or leaving).

router.cluster carries each request through its attempts and asks `Dispatch.place` for its workers;
which worker of a pool takes it is router.placement's pure choice.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence

from pdserve.config import ClusterConfig
from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.request import Request
from pdserve.tiers import ServiceTier, flex_floor
from router.line import Entry, Line
from router.placement import DecodeLoad, PrefillLoad, pick_decode, pick_prefill
from router.pools import Pools, Worker

log = logging.getLogger(__name__)

# A prefill worker is sent a prompt only while fewer than this many steps' worth of prompt tokens (its
# token budget a step) are queued on it, the step it runs included: one step running and the next one
# ready; and only when a decode worker has room for the prompt's KV (Dispatch.decode_room). The rest
# wait here, in line. So a worker that joins (a replacement, or one the autoscaler started)
# takes its share of a backlog that arrived before it, and no prompt is computed only for its KV to
# wait on the prefill worker for a full decode worker. The line's order is by service tier, then arrival
# (router.line).
PREFILL_QUEUE_STEPS = 2


class PoolEmpty(Exception):
    """A pool the prompt needs stayed empty for pool_wait_timeout_s."""

    def __init__(self, pool: str):
        super().__init__(pool)
        self.pool = pool


class Dispatch:
    """The line and the placements made from it: what is waiting, what is in flight, by tier."""

    def __init__(self, config: ClusterConfig, pools: Pools, block_size: int):
        self.config = config
        self._pools = pools
        self.block_size = block_size
        # Prompts waiting for workers with room (PREFILL_QUEUE_STEPS, decode_room), by tier then arrival.
        self.line = Line()
        self.waiting_prompt_tokens = 0
        self.in_flight: collections.Counter[ServiceTier] = collections.Counter()  # placed, by tier served
        self.downgrades = 0  # priority requests served as default (the fast lane was full)
        self._seqs = {name: config.engine_for(pc).scheduler.max_num_seqs for name, pc in config.pools.items()}
        if config.mode == "disaggregated":
            budget = config.engine_for(config.prefill).scheduler.max_num_batched_tokens
            self._prefill_room = PREFILL_QUEUE_STEPS * budget
            pools.listeners.append(self.dispatch)

    def released(self, tier: ServiceTier) -> None:
        """A placed request's attempt ended."""
        self.in_flight[tier] -= 1




    async def place(self, req: Request, wrid: str, target: str | None,
                     avoid: tuple[str, ...]) -> tuple[Worker, Worker | None]:
        """Wait in line (router.line) until a prefill worker has room for the prompt and, if a token follows
        the first, a worker of its decode pool (`target`) has room for its KV; returns both, the request
        already counted on them. A priority request bound for a full fast lane waits up to
        fast_lane_max_wait_s, or not at all (fast_lane_when_full), then is served as default."""
        tiers, loop = self.config.tiers, asyncio.get_running_loop()
        e = Entry(wrid, req.num_tokens, target, avoid, hash_prompt_blocks(req.token_ids, self.block_size),
                  ServiceTier.of_rank(req.tier))
        lane_deadline = None
        if target == "fast":
            if tiers.fast_lane_when_full == "downgrade" \
                    and not any(self.decode_room(w, e.tokens) for w in self._pools.by_name["fast"]):
                self.downgrade(req, e)
            else:
                lane_deadline = loop.time() + tiers.fast_lane_max_wait_s
        self.line.add(e)
        self.waiting_prompt_tokens += e.tokens
        empty_since = None
        try:
            self.dispatch()
            while not e.placed.done():
                now = loop.time()
                if not self._pools.by_name["prefill"] or (e.target and not self._pools.by_name[e.target]):
                    empty_since = empty_since or now
                    if now - empty_since >= self.config.pool_wait_timeout_s:
                        raise PoolEmpty(e.target if self._pools.by_name["prefill"] else "prefill")
                else:
                    empty_since = None
                deadlines = [d for d in (lane_deadline, empty_since and empty_since + self.config.pool_wait_timeout_s)
                             if d]
                await asyncio.wait([e.placed], timeout=max(min(deadlines) - now, 0) if deadlines else None)
                if not e.placed.done() and lane_deadline is not None and loop.time() >= lane_deadline:
                    lane_deadline = None
                    self.downgrade(req, e)
                    self.dispatch()
            return e.placed.result()
        except BaseException:
            if e.placed.done() and not e.placed.cancelled():
                self.unplace(e, *e.placed.result())  # placed as it was leaving: give the room back
            else:
                e.placed.cancel()
            self.line.remove(e)
            self.dispatch()  # it may have held others back
            raise
        finally:
            self.waiting_prompt_tokens -= e.tokens

    def downgrade(self, req: Request, e: Entry) -> None:
        """The fast lane is full: the request is served as default, on the decode pool."""
        log.info("request %s: the fast lane is full; served as default", e.wrid)
        req.tier = ServiceTier.DEFAULT.rank
        e.target = "decode"
        self.downgrades += 1
        if e in self.line:
            self.line.move(e, ServiceTier.DEFAULT)
        else:
            e.tier = ServiceTier.DEFAULT

    def dispatch(self) -> None:
        """Place every prompt in line whose workers have room, in the line's order (router.line)."""
        prefill_ready = self._pools.by_name["prefill"]
        if not len(self.line) or not prefill_ready:
            return
        decode_slots = len(self._pools.by_name["decode"]) * self._seqs.get("decode", 0)
        slack = flex_floor(self.config.tiers.flex_min_share, decode_slots) - self.in_flight[ServiceTier.FLEX]
        blocked: set[tuple[str, bool]] = set()  # (decode pool, flex?) with no room for the first in line bound there
        for e in self.line.order(slack):
            if e.placed.done():
                continue
            prefill = [w for w in prefer(prefill_ready, e.avoid) if w.queued_tokens < self._prefill_room]
            if not prefill:
                return  # every prompt behind it needs a prefill worker too
            flex = e.tier is ServiceTier.FLEX
            if (e.target, False) in blocked or (e.target, flex) in blocked:
                continue  # one before it, bound for the same pool, waits (flex waiting holds back only flex)
            decode: list[Worker] = []
            if e.target is not None:
                decode = [w for w in prefer(self._pools.by_name[e.target], e.avoid)
                          if self.decode_room(w, e.tokens, e.tier)]
                if not decode:
                    blocked.add((e.target, flex))
                    continue
            p = prefill[pick_prefill([PrefillLoad(x.queued_tokens, x.prefix.match(e.hashes) * self.block_size)
                                      for x in prefill])]
            d = decode[pick_decode([self.decode_load(x) for x in decode])] if decode else None
            p.prefix.add(e.hashes)
            p.queued_tokens += e.tokens
            p.requests.add(e.wrid)  # until its KV has reached the decode worker (the first decode token)
            if d is not None:
                d.requests.add(e.wrid)
                if e.tier is ServiceTier.FLEX:
                    d.flex.add(e.wrid)
            self.in_flight[e.tier] += 1
            self.line.remove(e)
            e.placed.set_result((p, d))

    def unplace(self, e: Entry, p: Worker, d: Worker | None) -> None:
        p.queued_tokens -= e.tokens
        p.requests.discard(e.wrid)
        if d is not None:
            d.requests.discard(e.wrid)
            d.flex.discard(e.wrid)
        self.in_flight[e.tier] -= 1

    def decode_room(self, w: Worker, prompt_tokens: int, tier: ServiceTier = ServiceTier.DEFAULT) -> bool:
        """Whether a decode worker can take another request's KV now, by its latest stats: fewer
        requests than its max_num_seqs, and blocks for the prompt beyond those its waiting requests
        will take (or nothing on it at all: it takes whatever fits its cache). Stats come with every
        decode step, so requests sent between two of them may still have to wait there for room.
        A request of a higher tier than flex also finds room where flex requests run above flex's floor:
        the decode worker preempts them for it (pdserve.engine.scheduler)."""
        seqs = self._seqs[w.pool]
        if tier is not ServiceTier.FLEX and w.flex:  # every slot but those flex's floor holds
            floor = flex_floor(self.config.tiers.flex_min_share, seqs)
            return len(w.requests) - len(w.flex) < seqs - min(len(w.flex), floor)
        if len(w.requests) >= seqs:
            return False
        s = w.stats
        if s is None or not w.requests:
            return True
        bs = self.block_size
        free = s.kv_blocks_total - s.kv_blocks_used - -(-s.waiting_tokens // bs)
        return free >= -(-(prompt_tokens + 1) // bs)

    def decode_load(self, w: Worker) -> DecodeLoad:
        s = w.stats
        free = s.kv_blocks_total - s.kv_blocks_used if s else 0
        return DecodeLoad(len(w.requests), free, s.kv_blocks_total if s else 0)


def prefer(pool: list[Worker], avoid: Sequence[str]) -> list[Worker]:
    """The pool without the workers to avoid, unless that leaves nobody."""
    return [w for w in pool if w.worker_id not in avoid] or pool
