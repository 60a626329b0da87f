"""A colocated worker in the simulation: one scheduler for both phases, decodes first, then prompt chunks in
the rest of the token budget; its decode-only steps and finished tokens are a decode worker's (decode.py)."""
from __future__ import annotations

from pdserve.planner.simulator.state import COLOCATED_END, Decode, StepWork, completed


class Colocating:
    """The colocated workers' part of the simulation (simulator._Simulation, whose state it reads and writes)."""

    def colocated_step(self, d: Decode, now: float) -> None:
        sh = d.shape
        w = StepWork(sh.token_budget - d.batch)
        free = d.free_blocks()
        for r, done in d.prefilling:  # prompts under way first; their blocks grow chunk by chunk
            if w.budget <= 0:
                break
            k = min(self.n_in[r] - done, w.budget)
            free -= self.blocks(done + k) - self.blocks(done)
            w.add(r, done, self.n_in[r], k)
        while d.waiting and w.budget > 0 and d.batch + len(d.prefilling) < sh.max_num_seqs:
            r = d.waiting[0]
            c = self.n_cached[r]  # served by the prefix cache: its blocks are taken, nothing computed
            k = min(self.n_in[r] - c, w.budget)
            if self.blocks(c + k) > free:
                break
            free -= self.blocks(c + k)
            d.waiting.popleft()
            d.prefilling.append([r, c])
            w.add(r, c, self.n_in[r], k)
        if not w.chunks:
            if d.batch:
                self.decodes_only(d, now, COLOCATED_END)
            else:
                d.busy = False
            return
        self.steps += 1
        d.prefill_blocks += d.free_blocks() - free  # what the chunks took
        used = d.used_blocks()
        if used > sh.kv_blocks:  # a prompt under way outgrew the cache: the scheduler would preempt
            self.overflows += 1
        d.peak = max(d.peak, used)
        d.busy, d.step = True, w.chunks
        dt = d.step_time(w.tokens, w.pairs, w.seqs, d.batch, d.context)
        d.busy_s += dt
        self.push(now + dt, COLOCATED_END, d.gid)

    def colocated_end(self, d: Decode, now: float) -> None:
        joined = completed(d.step, d.prefilling, self.n_in)
        for r in joined:
            d.prefill_blocks -= self.blocks(self.n_in[r])
            self.first[r] = now + self.first_lat
        d.step = []
        if d.batch:
            self.step_done(d, now)
        else:
            d.k += 1
        for r in joined:
            if self.n_out[r] == 1:
                d.active -= 1
                self.finished(r, self.first[r])
            else:
                self.join(d, r)
        self.colocated_step(d, now)
