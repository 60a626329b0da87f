"""What each service tier costs: the fast lane's size and batch cap, and each tier's device time per output
token against default's, from the cost model `pdserve plan` uses (a profile or a GPU's roofline).

The price of speed is computed, not guessed. A decode step reads every weight once whatever its batch, so
the device time of one output token is step_time(b) / b at the batch b a tier runs at:

- priority runs on the fast lane, whose batch is capped at the largest b whose step (at the mean
  context) stays within priority's TPOT target: fewer requests share each weight read, so each token
  costs more;
- default runs at b*, the largest batch within default's TPOT target (the decode sizing of
  pdserve.planner.autoscale.decode_batch);
- flex is decoded in the default pool's batches, on the slots default leaves idle (it is preempted
  first): its tokens cost what default's do at that batch, and one more flex request in a batch with a
  free slot adds only step_time(b) - step_time(b - 1) to the step (reported as its marginal cost).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdserve.perf.costs import StepCosts
from pdserve.planner.autoscale import Demand, PoolLimits, decode_batch, decode_need
from pdserve.tiers import TIERS, ServiceTier, TierSLO

FLEX_ASSUMPTION = ("flex is decoded in the default pool's batches on slots default leaves idle: its tokens cost "
                   "what default's do at default's batch; the marginal figure is what one more request adds to "
                   "a step with a free slot")


def decode_step(costs: StepCosts, batch: int, context: float) -> float:
    """One decode step of `batch` requests at the mean context `context`."""
    return costs.step_time(0, 0, 0, batch, round(batch * context))


def tier_prices(costs: StepCosts, limits: PoolLimits, input_len: float, output_len: float,
                slos: dict[ServiceTier, TierSLO], mix: dict[ServiceTier, float], rate: float | None = None
                ) -> dict[str, Any]:
    """The fast lane's batch cap and size, and each tier's device-seconds per output token and its ratio to
    default's. rate: requests per second of the whole mix (None: the lane's size is not given)."""
    ctx = input_len + output_len / 2  # a running request's mean context over its life
    batch = {ServiceTier.PRIORITY: decode_batch(costs, limits, input_len, output_len,
                                                slos[ServiceTier.PRIORITY].tpot_s),
             ServiceTier.DEFAULT: decode_batch(costs, limits, input_len, output_len,
                                               slos[ServiceTier.DEFAULT].tpot_s)}
    batch[ServiceTier.FLEX] = batch[ServiceTier.DEFAULT]
    per_token = {t: decode_step(costs, b, ctx) / b for t, b in batch.items()}
    base = per_token[ServiceTier.DEFAULT]
    tiers = {}
    for t in TIERS:
        step = decode_step(costs, batch[t], ctx)
        tiers[t.value] = {"share": mix.get(t, 0.0), "ttft_target_ms": slos[t].ttft_s * 1e3,
                          "tpot_target_ms": slos[t].tpot_s * 1e3, "batch": batch[t], "step_ms": step * 1e3,
                          "tpot_met": step <= slos[t].tpot_s, "device_s_per_token": per_token[t],
                          "relative_to_default": per_token[t] / base}
    b = batch[ServiceTier.DEFAULT]
    tiers["flex"]["marginal_device_s_per_token"] = (decode_step(costs, b, ctx) - decode_step(costs, b - 1, ctx)
                                                    if b > 1 else per_token[ServiceTier.FLEX])
    lane_cap = batch[ServiceTier.PRIORITY]
    workers = None
    priority_rate = None
    if rate is not None:
        priority_rate = rate * mix.get(ServiceTier.PRIORITY, 0.0)
        need = decode_need(costs, replace(limits, max_num_seqs=lane_cap),
                           Demand(priority_rate, input_len, output_len, 0, 0, 0), slos[ServiceTier.PRIORITY].tpot_s)
        workers = max(need.workers, 1 if priority_rate > 0 else 0)
    return {"input_len": input_len, "output_len": output_len, "mean_context": ctx,
            "fast_lane": {"max_running": lane_cap, "workers": workers, "priority_rate": priority_rate,
                          "price_multiplier": tiers["priority"]["relative_to_default"]},
            "tiers": tiers, "assumptions": FLEX_ASSUMPTION}


def format_prices(prices: dict[str, Any]) -> str:
    head = (f"{'tier':9} {'share':>6} {'TTFT target':>12} {'TPOT target':>12} {'batch':>6} {'step':>8} "
            f"{'device-ms/token':>16} {'x default':>10}")
    lines = [f"service tiers at the mean context of {prices['mean_context']:.0f} tokens "
             f"(prompt {prices['input_len']:.0f}, output {prices['output_len']:.0f}):", head, "-" * len(head)]
    for name, t in prices["tiers"].items():
        lines.append(f"{name:9} {t['share']:6.0%} {t['ttft_target_ms']:10.0f} ms {t['tpot_target_ms']:9.0f} ms "
                     f"{t['batch']:6d} {t['step_ms']:5.1f} ms{'' if t['tpot_met'] else '!'} "
                     f"{t['device_s_per_token'] * 1e3:16.3f} {t['relative_to_default']:9.2f}x")
    lane = prices["fast_lane"]
    size = (f"{lane['workers']} worker(s) for its {lane['priority_rate']:.2f} req/s of priority"
            if lane["workers"] is not None else "size: give a request rate")
    flex = prices["tiers"]["flex"]
    lines += [f"fast lane: max running {lane['max_running']} (the largest batch within priority's TPOT target), "
              f"{size}; a priority token costs {lane['price_multiplier']:.2f}x a default one",
              f"flex: {prices['assumptions']}: {flex['marginal_device_s_per_token'] * 1e3:.3f} device-ms a token",
              "step: one decode step at that batch (! : above the tier's TPOT target even at batch 1)"]
    return "\n".join(lines)
