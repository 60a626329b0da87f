"""The router in the simulation: admission (max_running, max_queued, flex's own queue bound, the client's
concurrency cap), the lines prompts wait in (the fast lane's, and the one by tier) until a prefill worker and a
decode worker have room, and placement by router.placement's rules."""
from __future__ import annotations

from pdserve.planner.simulator.state import ROUTER, Decode, Prefill
from pdserve.tiers import ServiceTier, flex_floor


class Routing:
    """The router's part of the simulation (simulator._Simulation, whose state it reads and writes)."""

    def flex_first(self) -> bool:
        """Whether flex is at default's rank in the router's line: fewer of it in flight than its floor."""
        return self.tiered and self.flex_inflight < flex_floor(
            self.tiers.flex_min_share, sum(w.shape.max_num_seqs for w in self.decodes if w.state == "ready"))

    def place(self, r: int, now: float) -> None:
        self.running_requests += 1
        if self.shape.mode == "colocated":
            d = min(self.decodes, key=lambda w: (w.active, -w.free_blocks()))
            d.active += 1
            d.waiting.append(r)
            if not d.busy:
                self.colocated_step(d, now)
            return
        self.line_tokens += self.n_new[r]
        if self.rank[r] == 0 and self.fasts:
            if self.tiers.fast_lane_when_full == "wait":
                self.push(self.arr[r] + self.tiers.fast_lane_max_wait_s, ROUTER, 0)  # the end of its wait for the lane
            self.lane_line.append(r)
        else:
            self.prefill_line.append(r)
        self.dispatch(now)

    def prefill_rooms(self) -> list[Prefill]:
        return [w for w in self.prefills if w.state == "ready" and w.queued_tokens < self.prefill_room]

    def dispatch(self, now: float) -> None:
        """Send the prompts in line to prefill workers with room: priority bound for the fast lane first
        (served as default when the lane is full: at once, or after its wait), then the line by tier."""
        while self.lane_line:
            r = self.lane_line[0]
            open_ = ([w for w in self.fasts if w.state == "ready" and self.decode_room(w, r)] if self.n_out[r] > 1
                     else [None])
            if not open_:
                if (self.tiers.fast_lane_when_full == "downgrade"
                        or now >= self.arr[r] + self.tiers.fast_lane_max_wait_s):
                    self.lane_line.popleft()
                    self.rank[r] = ServiceTier.DEFAULT.rank
                    self.prefill_line.append(r)
                    continue
                break  # it waits for the lane; the line behind goes on
            room = self.prefill_rooms()
            if not room:
                return
            self.lane_line.popleft()
            self.line_tokens -= self.n_new[r]
            d = min(open_, key=lambda w: (w.active, -w.free_blocks())) if self.n_out[r] > 1 else None
            self.send_prompt(r, min(room, key=lambda w: w.queued_tokens), d, now)
        while self.prefill_line:
            r = self.prefill_line.head(self.flex_first())
            room = self.prefill_rooms()
            open_ = ([w for w in self.decodes if w.state == "ready" and self.decode_room(w, r)] if self.n_out[r] > 1
                     else [None])
            if not room or not open_:
                return
            self.prefill_line.remove(r)
            self.line_tokens -= self.n_new[r]
            self.flex_inflight += self.rank[r] == 2
            d = min(open_, key=lambda w: (w.active, -w.free_blocks())) if self.n_out[r] > 1 else None
            self.send_prompt(r, min(room, key=lambda w: w.queued_tokens), d, now)

    def decode_room(self, d: Decode, r: int) -> bool:
        """Whether d can take request r's KV: the router's view (router.cluster._decode_room). For a
        priority or default request, flex above its floor counts as room, slots and KV (it is preempted)."""
        active = d.active
        if self.rank[r] < 2 and d.flex_active > d.floor:
            active -= d.flex_active - d.floor
        if active >= d.shape.max_num_seqs:
            return False
        if self.rank[r] < 2 and len(d.flex_running) > d.floor:
            return True  # its KV too, as far as the router can tell
        waiting = sum(self.blocks(self.n_in[x] + 1) for x in d.to_reserve)
        return d.active == 0 or d.free_blocks() - waiting >= self.blocks(self.n_in[r] + 1)

    def send_prompt(self, r: int, p: Prefill, d: Decode | None, now: float) -> None:
        self.prefill_of[r] = p.index
        p.queued_tokens += self.n_new[r]
        p.waiting.append(r)
        if self.n_out[r] > 1:
            self.decode_of[r] = d.gid
            d.active += 1
            d.flex_active += self.rank[r] == 2
            d.to_reserve.append(r)
            if not d.busy:
                self.decode_step(d, now)  # an idle decode worker reserves at once
        if not p.busy:
            self.prefill_step(p, now)

    def send(self, r: int, t: float) -> None:
        if self.concurrency is not None and self.in_flight >= self.concurrency:
            self.client_queue.append(r)
            return
        self.in_flight += 1
        self.arr[r] = t
        self.window.arrived(t, self.n_in[r], self.n_out[r])
        if self.asked[r] == 0:
            self.priority_window.arrived(t, self.n_in[r], self.n_out[r])
        if self.rank[r] == 2 and self.router_queue.flex() + self.prefill_line.flex() >= self.tiers.flex_max_queued:
            self.rejected[r] = True  # flex is refused at once when its own queue is full
            self.client_done(t)
        elif self.running_requests < self.shape.max_running:
            self.place(r, t)
        elif len(self.router_queue) < self.shape.max_queued:
            self.router_queue.append(r)
        else:
            self.rejected[r] = True
            self.client_done(t)

    def client_done(self, t: float) -> None:
        self.in_flight -= 1
        if self.client_queue:
            self.send(self.client_queue.popleft(), t)

    def finished(self, r: int, t: float) -> None:
        self.end[r] = t
        self.window.finished(t, self.n_out[r])
        if self.asked[r] == 0:
            self.priority_window.finished(t, self.n_out[r])
        self.running_requests -= 1
        self.flex_inflight -= self.rank[r] == 2
        if self.router_queue:
            r = self.router_queue.head(self.flex_first())
            self.router_queue.remove(r)
            self.place(r, t)
        self.client_done(t)
