"""Autoscaling in the simulation: the autoscaler asked every interval with the demand the router would see;
a worker asked for is placeable startup_s later, a drained one leaves once nothing of any request is on it."""
from __future__ import annotations

from pdserve.planner.autoscale import Demand
from pdserve.planner.simulator.state import DECODE_READY, PREFILL_READY, SCALE, Decode, Prefill


class Scaling:
    """The scaling part of the simulation (simulator._Simulation, whose state it reads and writes)."""

    def leave_if_done(self, w: Prefill | Decode, now: float) -> None:
        """A draining worker leaves once nothing of any request is on it."""
        if w.state != "draining" or w.busy:
            return
        if isinstance(w, Prefill):
            done = not w.waiting and not w.running and w.free == w.shape.kv_blocks  # no KV held either
        else:
            done = w.active == 0
        if done:
            w.state, w.left = "gone", now

    def scale(self, now: float) -> None:
        rate, input_len, output_len = self.window.observe(now)
        live = [w for w in (*self.prefills, *self.decodes) if w.state in ("ready", "draining")]
        demand = Demand(rate, input_len, output_len,
                        sum(w.queued_tokens for w in live if isinstance(w, Prefill)) + self.line_tokens
                        + round(len(self.router_queue) * input_len),
                        sum(w.active for w in live if isinstance(w, Decode)),
                        sum(w.used_blocks() for w in live if isinstance(w, Decode)))
        pools = {"prefill": self.prefills, "decode": self.decodes, "fast": self.fasts}
        current = {name: sum(w.state in ("starting", "ready") for w in ws) for name, ws in pools.items()}
        own = None
        if "fast" in self.autoscaler.ranges:
            lane = [w for w in self.fasts if w.state in ("ready", "draining")]
            own = {"fast": Demand(*self.priority_window.observe(now), 0, sum(w.active for w in lane),
                                  sum(w.used_blocks() for w in lane))}
        changed = False
        for d in self.autoscaler.decide(now, demand, {p: current[p] for p in self.autoscaler.ranges}, own):
            ws = pools[d.pool]
            if d.direction == "up":
                for _ in range(d.desired - d.current):
                    if d.pool == "prefill":
                        w = Prefill(len(ws), self.shape.prefill)
                        ws.append(w)
                    else:
                        w = self.new_decode(d.pool)
                    w.state, w.born = "starting", now
                    self.push(now + self.startup_s, PREFILL_READY if d.pool == "prefill" else DECODE_READY,
                              w.index if d.pool == "prefill" else w.gid)
            elif d.direction == "down":
                ready = [w for w in ws if w.state == "ready"]
                load = (lambda w: (w.queued_tokens, -w.index)) if d.pool == "prefill" else (lambda w: (w.active, -w.index))
                for w in sorted(ready, key=load)[:min(d.current - d.desired, len(ready) - 1)]:
                    w.state = "draining"
                    self.leave_if_done(w, now)
            changed |= d.direction != "none"
        if changed:
            self.sizes.append((now, *(sum(w.state in ("starting", "ready") for w in pools[p])
                                      for p in ("prefill", "decode"))))
        if self.i < self.n or self.running_requests or self.client_queue:
            self.push(now + self.interval_s, SCALE, 0)

    def ready(self, w: Prefill | Decode, now: float) -> None:
        w.state = "ready"
        self.dispatch(now)
