"""Placement: prompts wait in the router's line (router.line) until a prefill worker has room for the
prompt and, if a token follows the first, a worker of its decode pool has room for its KV; they are
placed in the line's order, whenever the pools change (a step's stats, a worker joining or leaving).

router.cluster carries each request through its attempts and asks `Dispatch.place` for its workers;
which worker of a pool takes it is router.placement's pure choice.

What placement knows of the workers' prefix caches (ClusterConfig.prefix_routing):
- exact: the workers' KV events (router.kv_index), plus the prompts placed on a prefill worker lately (PENDING_S);
  a session's turns go to the decode worker of its last turn while it has room.
- estimate: the router's record of the prompts it placed on each worker (Estimate: block hashes, least recently
  placed dropped past the worker's KV blocks), on both hops; what a worker evicted or computed beyond the prompt
  (its replies) is not in it. Session keys are not read.
- random: nothing; a random worker with room on each hop, never a local prefill.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Sequence

from pdserve.config import ClusterConfig
from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.request import Request
from pdserve.tiers import ServiceTier, flex_floor
from router.line import Entry, Line
from router.placement import DecodeLoad, PrefillLoad, cached_score, pick_decode, pick_prefill
from router.pools import Pools
from router.workers import Worker

log = logging.getLogger(__name__)

# A prefill worker is sent a prompt only while fewer than this many steps' worth of prompt tokens (its
# token budget a step) are queued on it, the step it runs included: one step running and the next one
# ready; and only when a decode worker has room for the prompt's KV (Dispatch.decode_room). The rest
# wait here, in line. So a worker that joins (a replacement, or one the autoscaler started)
# takes its share of a backlog that arrived before it, and no prompt is computed only for its KV to
# wait on the prefill worker for a full decode worker. The line's order is by service tier, then arrival
# (router.line).
PREFILL_QUEUE_STEPS = 2
MAX_SESSIONS = 65536  # session keys remembered (each its last decode worker), least recently used dropped
# Prompts placed on a prefill worker in the last PENDING_S seconds (at most PENDING_PROMPTS of them) count as
# in its cache until its KV events say so: a burst of prompts with one prefix (a shared system prompt) goes
# to one worker, which computes that prefix once (pdserve.engine.scheduler holds the rest a step).
PENDING_S = 30.0
PENDING_PROMPTS = 64


class PoolEmpty(Exception):
    """A pool the prompt needs stayed empty for pool_wait_timeout_s."""

    def __init__(self, pool: str):
        super().__init__(pool)
        self.pool = pool


class Estimate:
    """The router's record of the prompts it placed on each worker: their block hashes, least recently placed
    dropped once a worker's record passes its KV blocks (the worker evicts on its own, unseen)."""

    def __init__(self) -> None:
        self._held: dict[str, collections.OrderedDict[bytes, None]] = {}

    def placed(self, worker_id: str, hashes: Sequence[bytes], capacity: int) -> None:
        held = self._held.setdefault(worker_id, collections.OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while capacity > 0 and len(held) > capacity:
            held.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)

    def match(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain the router placed on the worker (and has not dropped)."""
        held = self._held.get(worker_id, {})
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


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
        self._counted: dict[str, ServiceTier] = {}  # placed attempts, by the tier in_flight counts them at
        self._pending: dict[str, collections.deque[tuple[float, list[bytes]]]] = {}  # prefill worker -> placed
        # Session key -> the decode worker of its last turn (the most recent MAX_SESSIONS sessions).
        self._sessions: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.routing = config.prefix_routing
        self._estimate = Estimate()  # prefix_routing "estimate" only
        self._random = random.Random(0)  # prefix_routing "random" only
        self._seqs = {name: config.engine_for(pc).scheduler.max_num_seqs for name, pc in config.pools.items()}
        if config.mode == "disaggregated":
            budget = config.engine_for(config.prefill).scheduler.max_num_batched_tokens
            self._prefill_room = PREFILL_QUEUE_STEPS * budget
            pools.listeners.append(self.dispatch)

    def forget_cache(self, worker_id: str) -> None:
        """A worker's prefix cache was flushed: what the router knew it held (its events, the placements) goes."""
        self._pools.kv_index.forget(worker_id)
        self._estimate.forget(worker_id)

    def released(self, wrid: str) -> None:
        """A placed attempt ended: it is no longer in flight."""
        tier = self._counted.pop(wrid, None)
        if tier is not None:
            self.in_flight[tier] -= 1




    async def place(self, req: Request, wrid: str, target: str | None, avoid: tuple[str, ...],
                    session: str | None = None) -> tuple[Worker | None, Worker | None]:
        """Wait in line until a prefill worker has room for the prompt and, if a token follows the first,
        a worker of its decode pool (`target`) has room for its KV; returns both, the request counted on
        them. A priority prompt needs prefill room only: it goes to a prefill worker at the head of the
        line at once, and when no worker of its decode pool has room then, its decode worker is None:
        the caller finds one with `place_kv` while the prompt is computed (the KV held meanwhile).

        A decode worker that already holds all of the prompt but a short suffix (at most
        local_prefill_max_tokens, router.kv_index) computes that suffix itself: the prefill worker is then
        None, and nothing is handed off."""
        e = Entry(wrid, req.num_tokens, target, avoid, req.token_ids, ServiceTier.of_rank(req.tier),
                  local_ok=self._local_ok(req), session=session)
        if target == "fast" and self.config.tiers.fast_lane_when_full == "downgrade" \
                and not any(self.decode_room(w, e.tokens) for w in self._pools.by_name["fast"]):
            self.downgrade(req, e)
        self.waiting_prompt_tokens += e.tokens
        try:
            return await self._wait(e, req, lane_deadline=None)
        finally:
            self.waiting_prompt_tokens -= e.tokens

    async def place_kv(self, req: Request, wrid: str, prefill: Worker, target: str,
                       avoid: tuple[str, ...]) -> Worker:
        """A decode worker for a prompt already placed on `prefill` (place returned no decode worker): the
        first of the target pool with room. A prompt bound for the fast lane waits for it up to
        fast_lane_max_wait_s, then is served as default, on the decode pool; it keeps its place in line,
        ahead of the prompts that arrived after it."""
        e = Entry(wrid, req.num_tokens, target, avoid, (), ServiceTier.of_rank(req.tier), prefill=prefill)
        lane_deadline = None
        if target == "fast":
            lane_deadline = asyncio.get_running_loop().time() + self.config.tiers.fast_lane_max_wait_s
        return (await self._wait(e, req, lane_deadline))[1]

    async def _wait(self, e: Entry, req: Request, lane_deadline: float | None) -> tuple[Worker, Worker | None]:
        """In line until placed (dispatch), an empty pool's wait runs out (PoolEmpty), or the caller leaves."""
        loop = asyncio.get_running_loop()
        self.line.add(e)
        empty_since = None
        try:
            self.dispatch()
            while not e.placed.done():
                now = loop.time()
                needs = ([] if e.prefill is not None else ["prefill"]) + ([e.target] if e.target else [])
                empty = [pool for pool in needs if not self._pools.by_name[pool]]
                if empty:
                    empty_since = empty_since or now
                    if now - empty_since >= self.config.pool_wait_timeout_s:
                        raise PoolEmpty(empty[0])
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

    def downgrade(self, req: Request, e: Entry) -> None:
        """The fast lane is full: the request is served as default, on the decode pool. It keeps its place
        in line (its prefill goes first; its KV waits ahead of those that arrived after it)."""
        log.info("request %s: the fast lane is full; served as default", e.wrid)
        req.tier = ServiceTier.DEFAULT.rank
        e.target = "decode"
        e.served = ServiceTier.DEFAULT
        self.downgrades += 1
        if self._counted.get(e.wrid) is not None:  # placed on its prefill worker already: counted as served
            self.in_flight[self._counted[e.wrid]] -= 1
            self._counted[e.wrid] = ServiceTier.DEFAULT
            self.in_flight[ServiceTier.DEFAULT] += 1

    def dispatch(self) -> None:
        """Place every prompt in line whose workers have room, in the line's order (router.line)."""
        if not len(self.line):
            return
        prefill_ready = self._pools.by_name["prefill"]
        prefill_full = not prefill_ready  # then only prompts already computed can be placed
        decode_slots = len(self._pools.by_name["decode"]) * self._seqs.get("decode", 0)
        slack = flex_floor(self.config.tiers.flex_min_share, decode_slots) - self.in_flight[ServiceTier.FLEX]
        blocked: set[tuple[str, bool]] = set()  # (decode pool, flex?) with no room for the first in line bound there
        for e in self.line.order(slack):
            if e.placed.done():
                continue
            flex = e.tier is ServiceTier.FLEX
            if e.local_ok and e.target is not None and e.prefill is None and self._place_local(e, blocked, flex):
                continue
            prefill: list[Worker] = []
            if e.prefill is None:
                if prefill_full:
                    continue
                prefill = [w for w in prefer(prefill_ready, e.avoid) if w.queued_tokens < self._prefill_room]
                if not prefill:
                    prefill_full = True  # every prompt behind it that needs a prefill worker waits too
                    continue
            decode: list[Worker] = []
            if e.target is not None:
                decode = self._with_room(e, blocked, flex)
                if not decode:
                    blocked.add((e.target, flex))  # the ones behind it bound there wait (flex holds back only flex)
                    if e.prefill is not None or e.tier is not ServiceTier.PRIORITY:
                        continue
                    # priority: to its prefill worker now, its KV's destination later (place_kv)
            d = decode[self._pick_decode(e, decode)] if decode else None
            if e.prefill is None:
                p = prefill[self._random.randrange(len(prefill)) if self.routing == "random" else
                            pick_prefill([PrefillLoad(x.queued_tokens, self._cached_prefill(x, e)) for x in prefill])]
                self._placed_prefill(p, e)
                p.queued_tokens += e.tokens
                p.requests.add(e.wrid)  # until its KV has reached the decode worker (the first decode token)
                self._count(e)
            else:
                p = e.prefill
            self._set(e, p, d)

    def _with_room(self, e: Entry, blocked: set[tuple[str, bool]], flex: bool) -> list[Worker]:
        """The workers of the entry's decode pool with room for its KV (none if that pool is held back)."""
        if (e.target, False) in blocked or (e.target, flex) in blocked:
            return []
        return [w for w in prefer(self._pools.by_name[e.target], e.avoid) if self.decode_room(w, e.tokens, e.tier)]

    def _place_local(self, e: Entry, blocked: set[tuple[str, bool]], flex: bool) -> bool:
        """Place the entry on a decode worker alone if the one placement would pick holds a prefix of its prompt
        and lacks at most local_prefill_max_tokens: it computes those itself (no prefill worker, no hand-off).
        A prompt no decode worker holds any of goes the disaggregated way, however short."""
        decode = self._with_room(e, blocked, flex)
        if not decode:
            return False
        d = decode[self._pick_decode(e, decode)]
        cached = self._cached(d, e)
        if not cached or e.tokens - cached > self.config.local_prefill_max_tokens:
            return False
        self._count(e)
        self._set(e, None, d)
        return True

    def _set(self, e: Entry, p: Worker | None, d: Worker | None) -> None:
        if d is not None:
            if self.routing == "estimate":
                self._record(d, e)
            if e.session is not None and self.routing == "exact":
                self._sessions[e.session] = d.worker_id
                self._sessions.move_to_end(e.session)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            d.requests.add(e.wrid)
            if e.tier is ServiceTier.FLEX:
                d.flex.add(e.wrid)
        self.line.remove(e)
        e.placed.set_result((p, d))

    def _count(self, e: Entry) -> None:
        self._counted[e.wrid] = e.served or e.tier
        self.in_flight[e.served or e.tier] += 1

    def _cached(self, w: Worker, e: Entry) -> int:
        """Tokens of the entry's prompt the worker's prefix cache holds (router.kv_index), at its weight version;
        with prefix_routing "estimate", those the router placed there; "random": none."""
        if self.routing == "random":
            return 0
        version = w.stats.weight_version if w.stats is not None else 0
        if self.routing == "exact":  # a prefix in the worker's KV tiers counts, below a resident one
            resident, tiered = self._pools.kv_index.match_tiers(w.worker_id, e.hashes(self.block_size, version))
            return cached_score(resident * self.block_size, tiered * self.block_size)
        return self._estimate.match(w.worker_id, e.hashes(self.block_size, version)) * self.block_size

    def _record(self, w: Worker, e: Entry) -> None:
        """prefix_routing "estimate": the worker holds the entry's prompt now, as far as the router knows."""
        version = w.stats.weight_version if w.stats is not None else 0
        self._estimate.placed(w.worker_id, e.hashes(self.block_size, version),
                              w.stats.kv_blocks_total if w.stats is not None else 0)

    def held_prefix(self, w: Worker, req: Request, prefill: Worker | None = None) -> tuple[int, int]:
        """(leading full blocks of the request's tokens a decode worker's prefix cache holds, the weight version it
        holds them at), by the index: a partial hand-off moves only the rest. The last token is always moved.
        Nothing held while the prefill worker serves another version (a weight update under way): its KV and the
        decode worker's prefix would be of two versions."""
        version = w.stats.weight_version if w.stats is not None else 0
        if prefill is not None and prefill.stats is not None and prefill.stats.weight_version != version:
            return 0, version
        hashes = hash_prompt_blocks(req.token_ids[:req.num_tokens - 1], self.block_size, version)
        return self._pools.kv_index.match(w.worker_id, hashes), version

    def _cached_prefill(self, w: Worker, e: Entry) -> int:
        """Tokens of the entry's prompt a prefill worker holds, or will once the prompts placed on it lately are
        computed (their blocks not yet in its events)."""
        if self.routing != "exact":
            return self._cached(w, e)
        hashes = e.hashes(self.block_size, w.stats.weight_version if w.stats is not None else 0)
        recent = self._pending.get(w.worker_id, ())
        now = time.monotonic()
        while recent and now - recent[0][0] > PENDING_S:
            recent.popleft()
        pending = max((_common(hashes, h) for _, h in recent), default=0) * self.block_size
        return max(self._cached(w, e), pending)

    def _placed_prefill(self, w: Worker, e: Entry) -> None:
        if self.routing == "estimate":
            self._record(w, e)
        hashes = e.hashes(self.block_size, w.stats.weight_version if w.stats is not None else 0)
        self._pending.setdefault(w.worker_id, collections.deque(maxlen=PENDING_PROMPTS)).append(
            (time.monotonic(), hashes))

    def _pick_decode(self, e: Entry, decode: list[Worker]) -> int:
        """The decode worker of the session's last turn if it has room (the caller's list holds only those
        with room), else by where the KV is against the load (router.placement)."""
        if self.routing == "random":
            return self._random.randrange(len(decode))
        last = self._sessions.get(e.session) if e.session is not None else None
        for i, w in enumerate(decode):
            if w.worker_id == last:
                return i
        return pick_decode([self.decode_load(x, self._cached(x, e)) for x in decode],
                           self.config.placement_load_tokens)

    def _local_ok(self, req: Request) -> bool:
        """Whether a decode worker may compute this request's prompt itself: no prompt logprobs (those are the
        prefill worker's), no routed experts (a local prefill is worth it for the prefix it takes from the cache,
        whose experts are unknown: pdserve.engine.routed_experts), disaggregated mode, and local prefill on. A
        group's n samples fork there as they would from a hand-off."""
        return self.config.mode == "disaggregated" and self.config.local_prefill_max_tokens > 0 \
            and self.routing != "random" and req.params.prompt_logprobs is None \
            and not req.params.return_routed_experts

    def unplace(self, e: Entry, p: Worker | None, d: Worker | None) -> None:
        if d is not None:
            d.requests.discard(e.wrid)
            d.flex.discard(e.wrid)
        if e.prefill is None:
            if p is not None:
                p.queued_tokens -= e.tokens
                p.requests.discard(e.wrid)
            self.released(e.wrid)

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
        if self._active(w) >= seqs:
            return False
        s = w.stats
        if s is None or not w.requests:
            return True
        bs = self.block_size
        free = s.kv_blocks_total - s.kv_blocks_used - -(-s.waiting_tokens // bs)
        return free >= -(-(prompt_tokens + 1) // bs)

    def decode_load(self, w: Worker, cached_tokens: int = 0) -> DecodeLoad:
        s = w.stats
        free = s.kv_blocks_total - s.kv_blocks_used if s else 0
        return DecodeLoad(self._active(w), free, s.kv_blocks_total if s else 0, cached_tokens)

    def _active(self, w: Worker) -> int:
        """A decode worker's requests: this router's, or with router replicas every router's as the
        worker last reported them, if more."""
        if self.config.router_name is None or w.stats is None:
            return len(w.requests)
        return max(len(w.requests), w.stats.running + w.stats.waiting)


def prefer(pool: list[Worker], avoid: Sequence[str]) -> list[Worker]:
    """The pool without the workers to avoid, unless that leaves nobody."""
    return [w for w in pool if w.worker_id not in avoid] or pool


def _common(a: list[bytes], b: list[bytes]) -> int:
    """Leading block hashes two chains share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
