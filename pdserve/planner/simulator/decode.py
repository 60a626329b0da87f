"""A decode worker in the simulation: reservations for the KV on its way (by tier, then arrival),
continuous batching (a landed request joins at the next step), flex preempted and resumed, and the steps of
a running batch alone (decodes_only, the simulation's hot path, which a colocated worker shares)."""
from __future__ import annotations

import heapq
import math

from pdserve.perf.costs import attention_pairs
from pdserve.planner.simulator.state import DECODE_END, WAKE, Decode


class Decoding:
    """The decode workers' part of the simulation (simulator._Simulation, whose state it reads and writes)."""

    def reserve(self, d: Decode, now: float) -> None:
        """Room for the requests waiting on d, by (tier, arrival); a priority or default request that
        finds d full preempts flex above its floor. A preempted request resumes here (joins at once)."""
        sh = d.shape
        while d.to_reserve:
            r = d.to_reserve.head(d.flex_held < d.floor)
            if self.resuming[r]:
                need = 0 if self.paused[r] >= 0 else self.blocks(self.n_in[r] + self.done_tok[r] + 1)
            else:
                need = self.blocks(self.n_in[r] + 1)
            slot = d.batch + d.num_reserved < sh.max_num_seqs
            fits = d.free_blocks() - need >= d.batch * sh.headroom_blocks
            if not (slot and fits):
                if self.rank[r] < 2 and self.preempt(d, kv_short=not fits):
                    continue
                break
            d.to_reserve.remove(r)
            d.flex_held += self.rank[r] == 2
            if self.resuming[r]:
                self.resume(d, r)
                continue
            d.reserved += need
            d.num_reserved += 1
            self.ready_at[r] = now
            if self.held[r]:
                self.held[r] = False
                self.send_whole(self.prefill_of[r], self.decode_of[r], [r], now)

    def landed(self, r: int, now: float) -> None:
        p = self.prefills[self.prefill_of[r]]
        p.free += self.blocks(self.n_in[r])
        d = self.allw[self.decode_of[r]]
        d.landed.append(r)
        if not p.busy:
            self.prefill_step(p, now)
        if not d.busy:  # wake it after every landing of this instant (one transfer carries several)
            d.busy = True
            self.push(now, WAKE, self.decode_of[r])

    def join(self, d: Decode, r: int) -> None:
        """r's first done_tok[r] tokens are known; its KV (prompt and those) is in d: from step d.k on it decodes."""
        c = self.n_in[r] + self.done_tok[r] - d.k
        self.ctx_join[r] = c
        d.ctx_base += c
        d.batch += 1
        d.joined.append(r)
        self.fin_step[r] = d.k + self.n_out[r] - self.done_tok[r] - 1
        heapq.heappush(d.finish, (self.fin_step[r], r))
        if self.rank[r] == 2:
            d.flex_running.add(r)

    def preempt(self, d: Decode, kv_short: bool) -> bool:
        """Make room on d for a higher tier: when KV is short, first drop the KV a paused flex request
        kept; else pause d's latest running flex request above flex's floor, keeping its KV unless KV is
        short (then it recomputes when it resumes). False: nothing to preempt."""
        if kv_short:
            kept = next((x for x in d.to_reserve.queues[2] if self.paused[x] >= 0), None)
            if kept is not None:
                d.paused_blocks -= self.paused[kept]
                self.paused[kept] = -1
                self.recomputes[kept] += 1
                return True
        if d.flex_held <= d.floor or not d.flex_running:
            return False
        r = max(d.flex_running, key=lambda x: (self.arr[x], x))
        d.flex_running.discard(r)
        d.flex_held -= 1
        d.batch -= 1
        d.ctx_base -= self.ctx_join[r]
        d.finish.remove((self.fin_step[r], r))
        heapq.heapify(d.finish)
        if r in d.joined:
            d.joined.remove(r)
        self.done_tok[r] = d.k + self.ctx_join[r] - self.n_in[r]  # its tokens so far (one per step since it joined)
        self.preempts[r] += 1
        if kv_short:
            self.paused[r] = -1
            self.recomputes[r] += 1
        else:
            self.paused[r] = self.blocks(self.n_in[r] + self.done_tok[r])
            d.paused_blocks += self.paused[r]
        self.resuming[r] = True
        d.to_reserve.append(r)
        return True

    def resume(self, d: Decode, r: int) -> None:
        self.resuming[r] = False
        if self.paused[r] >= 0:
            d.paused_blocks -= self.paused[r]
            self.paused[r] = -1
        else:  # its context is computed again, as prompt chunks riding on the next step
            tokens = self.n_in[r] + self.done_tok[r]
            rc = d.recompute
            rc[0] += tokens
            rc[1] += attention_pairs(0, tokens)
            rc[2] += 1
        self.join(d, r)

    def step_done(self, d: Decode, now: float) -> None:
        """The tokens of decode step d.k reach their clients; the requests whose last token it was finish."""
        t = now + self.tok_lat
        for r in d.joined:
            if self.second[r] != self.second[r]:  # not yet (a resumed request had it before)
                self.second[r] = t
        d.joined.clear()
        while d.finish and d.finish[0][0] <= d.k:
            _, r = heapq.heappop(d.finish)
            d.batch -= 1
            d.ctx_base -= self.ctx_join[r]
            d.active -= 1
            if self.rank[r] == 2:
                d.flex_active -= 1
                d.flex_held -= 1
                d.flex_running.discard(r)
            self.finished(r, t)
        d.k += 1
        if self.prefill_line or self.lane_line:
            self.dispatch(now)  # room on d, maybe

    def decode_step(self, d: Decode, now: float) -> None:
        # Landed KV joins first (the worker takes it in between steps), then the step reserves room.
        for r in d.landed:
            d.reserved -= self.blocks(self.n_in[r] + 1)
            d.num_reserved -= 1
            self.join(d, r)
        d.landed.clear()
        self.reserve(d, now)
        if not d.batch:
            d.busy = False
            self.leave_if_done(d, now)
            return
        self.decodes_only(d, now, DECODE_END)

    def decodes_only(self, d: Decode, now: float, kind: int) -> None:
        """Steps of d's running batch alone. Steps that end before anything else happens in the
        cluster, with no request joining or finishing, change nothing another part could see: they
        are accounted here in a loop rather than as one event each (the simulation's hot path)."""
        d.busy = True
        who = d.gid
        horizon = self.events[0][0] if self.events else math.inf
        if self.i < self.n and self.arr[self.i] < horizon:
            horizon = self.arr[self.i]
        batch, base, capacity = d.batch, d.ctx_base, d.shape.kv_blocks
        fixed = d.reserved + d.prefill_blocks + d.paused_blocks + batch // 2  # besides the contexts' (used_blocks)
        bs = d.shape.block_size
        last = d.finish[0][0]
        busy = 0.0
        rc = d.recompute
        if rc[0]:  # preempted contexts computed again ride on this step, which ends there
            self.steps += 1
            dt = d.step_time(rc[0], rc[1], rc[2], batch, base + batch * d.k)
            d.recompute = [0, 0, 0]
            d.busy_s += dt
            self.push(now + dt, kind, who)
            return
        while True:
            self.steps += 1
            ctx = base + batch * d.k
            used = (ctx + bs - 1) // bs + fixed
            if used > capacity:
                self.overflows += 1
            if used > d.peak:
                d.peak = used
            dt = d.step_time(0, 0, 0, batch, ctx)
            busy += dt
            t = now + dt
            if d.joined or last <= d.k or t >= horizon:
                d.busy_s += busy
                self.push(t, kind, who)
                return
            d.k += 1
            now = t

    def decode_end(self, d: Decode, now: float) -> None:
        self.step_done(d, now)
        self.decode_step(d, now)
