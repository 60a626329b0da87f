"""A prefill worker in the simulation: token-budget steps, running chunks first, then waiting prompts in
arrival order; and the hand-off of a finished prompt's KV to its decode worker (pushed during the step when
the reservation was made before it began, else sent whole)."""
from __future__ import annotations

import math

from pdserve.planner.simulator.state import LANDED, PREFILL_END, Prefill, StepWork, completed


class Prefilling:
    """The prefill workers' part of the simulation (simulator._Simulation, whose state it reads and writes)."""

    def prefill_step(self, p: Prefill, now: float) -> None:
        sh = p.shape
        w = StepWork(sh.token_budget)
        for r, done in p.running:
            if w.budget <= 0:
                break
            w.add(r, done, self.n_in[r], min(self.n_in[r] - done, w.budget))
        while p.waiting and w.budget > 0 and len(p.running) < sh.max_num_seqs:
            r = p.waiting[0]
            need = self.blocks(self.n_in[r])
            if need > p.free:
                break
            p.waiting.popleft()
            p.free -= need
            p.peak = max(p.peak, sh.kv_blocks - p.free)
            c = self.n_cached[r]  # served by the prefix cache: computed from there on
            p.running.append([r, c])
            w.add(r, c, self.n_in[r], min(self.n_in[r] - c, w.budget))
        if not w.chunks:
            p.busy = False
            self.leave_if_done(p, now)
            return
        self.steps += 1
        p.busy, p.step, p.step_start = True, w.chunks, now
        self.push(now + self.step_time(w.tokens, w.pairs, w.seqs, 0, 0), PREFILL_END, p.index)

    def prefill_end(self, p: Prefill, now: float) -> None:
        dt = now - p.step_start
        p.busy_s += dt
        streamed: dict[int, list[int]] = {}
        after: dict[int, list[int]] = {}
        for r in completed(p.step, p.running, self.n_in):
            p.queued_tokens -= self.n_new[r]
            self.first[r] = now + self.first_lat
            if self.n_out[r] == 1:
                p.free += self.blocks(self.n_in[r])
                self.finished(r, self.first[r])
                continue
            if self.ready_at[r] <= p.step_start:  # pushed layer by layer during the step
                streamed.setdefault(self.decode_of[r], []).append(r)
            elif self.ready_at[r] < math.inf:  # became ready during the step: sent whole from the held blocks
                after.setdefault(self.decode_of[r], []).append(r)
            else:
                self.held[r] = True  # sent once the decode worker reserves
        pi = p.index
        # The requests of one step bound for one decode worker travel as one transfer; a pair's
        # transfers go one after another, in order.
        for dest, rs in streamed.items():
            nbytes = sum(self.n_new[r] for r in rs) * self.kv_bytes
            free_at = self.pair_free.get((pi, dest), 0.0)
            t = now + self.transport.exposed_time(nbytes, dt)
            if free_at > p.step_start:  # the pair was still busy when the layers began to come
                t = max(t, free_at + self.transport.send_time(nbytes))
            self.hand_off(pi, dest, rs, t)
        for dest, rs in after.items():
            self.send_whole(pi, dest, rs, now)
        self.dispatch(now)  # its queue shrank: prompts in line may come (they join its next step)
        self.prefill_step(p, now)

    def hand_off(self, pi: int, dest: int, rs: list[int], t: float) -> None:
        self.pair_free[(pi, dest)] = t
        for r in rs:
            self.push(t, LANDED, r)

    def send_whole(self, pi: int, dest: int, rs: list[int], now: float) -> None:
        """Held KV sent at once, after the pair's earlier transfers."""
        nbytes = sum(self.n_new[r] for r in rs) * self.kv_bytes
        self.hand_off(pi, dest, rs, max(now, self.pair_free.get((pi, dest), 0.0)) + self.transport.send_time(nbytes))
