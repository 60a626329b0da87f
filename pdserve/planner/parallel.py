"""Tensor- and expert-parallel sizes compared on the roofline: which fit one GPU's memory per rank, and
which wins for prefill (the time of one prompt: its TTFT before any queueing) and for decode (tokens/s per
GPU at the decode pool's batch).

A size fits when one rank's weights and the KV of one request of the workload's longest length fit
within MEMORY_UTILIZATION of the GPU's memory (the rest is left to activations, the CUDA context,
graphs and communication buffers). The decode batch is the pool's batch cap, or fewer where the rank's
KV cache holds fewer requests at the decode context.

A mixture of experts on tp > 1 ranks has two choices at each size (EngineConfig.expert_parallel_size):
its experts sliced over the ranks like an MLP (EP 1) or split whole over them (EP = TP); both are
compared, each where the model's shape allows it (pdserve.parallel.layout.rank_config).
"""
from __future__ import annotations

from typing import Any

from pdserve.config import ModelConfig
from pdserve.parallel.layout import rank_config
from pdserve.perf.costs import RooflineCosts, attention_pairs
from pdserve.perf.hardware import GB, MEMORY_UTILIZATION, Gpu, roofline

# GPUs of one NVLink node (8 in HGX H100, H200 and A100 boards): a worker's ranks are placed on one node, and
# the roofline costs collectives at the NVLink figure, so a larger size is a what-if, not a worker pdserve runs.
NODE_GPUS = 8


def prefill_time(costs: RooflineCosts, prompt: int, token_budget: int) -> float:
    """One prompt alone on a prefill worker, in chunks of at most token_budget tokens."""
    t, start = 0.0, 0
    while start < prompt:
        n = min(token_budget, prompt - start)
        t += costs.step_time(n, attention_pairs(start, n), int(start + n == prompt), 0, 0)
        start += n
    return t


def parallel_choices(model: ModelConfig, sizes: list[int]) -> list[tuple[int, int]]:
    """(tp, ep) of each size: (tp, 1), and for a mixture of experts on more than one rank (tp, tp) too. A
    size the heads (or a dense model's MLP) cannot be split over is an error; a mixture of experts' choice
    its experts cannot be laid out by is left out, and a size with neither choice is an error."""
    out = []
    for tp in sizes:
        if not model.is_moe or tp == 1:
            rank_config(model, tp)
            out.append((tp, 1))
            continue
        errors = []
        for ep in (1, tp):
            try:
                rank_config(model, tp, ep)
                out.append((tp, ep))
            except ValueError as e:
                errors.append(e)
        if len(errors) == 2:
            raise errors[1]
    return out


def compare_tp(model: ModelConfig, device: Gpu, sizes: list[int], prompt: int, token_budget: int,
               batch_cap: int, decode_context: int, longest: int, dtype_bytes: int = 2) -> dict[str, Any]:
    """One row per choice (every figure one rank's, times in seconds), and the winners among those that fit.

    prompt: the prefill's prompt tokens; decode_context: tokens of KV each decoding request reads;
    longest: prompt + output tokens of the workload's longest request (the least KV a rank must hold).
    "fitting" and the winners are tensor-parallel sizes; a mixture of experts' rows also carry their EP
    ("fitting_choices", "prefill_winner_ep", "decode_winner_ep").
    """
    usable = int(device.memory_bytes * MEMORY_UTILIZATION)
    rows = []
    for tp, ep in parallel_choices(model, sizes):
        costs = roofline(model, device, dtype_bytes, tp, ep)
        kv_room = usable - costs.resident_weight_bytes
        kv_tokens = max(0, kv_room) // costs.kv_bytes_per_token
        row: dict[str, Any] = {"tp": tp, "ep": ep, "weight_bytes_per_rank": costs.resident_weight_bytes,
                               "kv_bytes_per_token_per_rank": costs.kv_bytes_per_token,
                               "kv_tokens_per_rank": kv_tokens, "fits": kv_tokens >= longest}
        if row["fits"]:
            batch = min(batch_cap, kv_tokens // decode_context)
            ttft = prefill_time(costs, prompt, token_budget)
            step = costs.step_time(0, 0, 0, batch, batch * decode_context)
            chunks = [min(token_budget, prompt - s) for s in range(0, prompt, token_budget)]
            row.update({
                "prefill_s": ttft,
                "prefill_collective_share": sum(map(costs.collective_time, chunks)) / ttft,
                "prefill_tokens_per_s_per_gpu": prompt / ttft / tp,
                "decode_batch": batch,
                "decode_step_s": step,
                "decode_collective_share": costs.collective_time(batch) / step,
                "decode_tokens_per_s_per_gpu": batch / step / tp,
            })
        rows.append(row)
    fit = [r for r in rows if r["fits"]]
    weights = model.num_params * dtype_bytes
    prefill = min(fit, key=lambda r: (r["prefill_s"], r["tp"], r["ep"])) if fit else None
    decode = max(fit, key=lambda r: (r["decode_tokens_per_s_per_gpu"], -r["tp"], -r["ep"])) if fit else None
    table = {
        "gpu": device.name, "memory_utilization": MEMORY_UTILIZATION, "prompt_tokens": prompt,
        "prefill_token_budget": token_budget, "decode_batch_cap": batch_cap, "decode_context": decode_context,
        "longest_request_tokens": longest, "dtype_bytes": dtype_bytes, "expert_parallel": model.is_moe,
        # the fewest GPUs whose usable memory holds the weights alone, no KV: a floor under any size that fits
        "weight_bytes": weights, "gpus_for_weights": -(-weights // usable), "sizes": rows,
        "fitting": sorted({r["tp"] for r in fit}),
        "prefill_winner": prefill["tp"] if fit else None,
        "decode_winner": decode["tp"] if fit else None,
    }
    if model.is_moe:
        table.update({"fitting_choices": [[r["tp"], r["ep"]] for r in fit],
                      "prefill_winner_ep": prefill["ep"] if fit else None,
                      "decode_winner_ep": decode["ep"] if fit else None})
    return table


def format_tp(table: dict[str, Any]) -> str:
    moe = table["expert_parallel"]
    head = (f"{'TP':>3} {'EP':>3} " if moe else f"{'TP':>3} ") + (
        f"{'fits':>4} {'weights/GPU':>11} {'KV/token/GPU':>12} {'KV room':>9} {'prefill ms':>10} "
        f"{'tok/s/GPU':>9} {'comm':>4} {'batch':>5} {'step ms':>7} {'tok/s/GPU':>9} {'comm':>4}")
    lines = [head, "-" * len(head)]
    for r in table["sizes"]:
        start = (f"{r['tp']:>3} {r['ep']:>3} " if moe else f"{r['tp']:>3} ") + (
            f"{'yes' if r['fits'] else 'no':>4} {r['weight_bytes_per_rank'] / GB:>9.1f}GB "
            f"{r['kv_bytes_per_token_per_rank'] / 1024:>10.0f}KB {r['kv_tokens_per_rank']:>9,}")
        if not r["fits"]:
            lines.append(start)
            continue
        lines.append(f"{start} {r['prefill_s'] * 1e3:>10.1f} {r['prefill_tokens_per_s_per_gpu']:>9,.0f} "
                     f"{r['prefill_collective_share']:>4.0%} "
                     f"{r['decode_batch']:>5} {r['decode_step_s'] * 1e3:>7.2f} "
                     f"{r['decode_tokens_per_s_per_gpu']:>9,.0f} {r['decode_collective_share']:>4.0%}")
    parallelism = "tensor and expert parallelism" if moe else "tensor parallelism"
    lines += ["", f"{parallelism} on {table['gpu']} (roofline of datasheet peaks); every figure one GPU's",
              f"fits: its weights and the KV of the longest request ({table['longest_request_tokens']} tokens) within "
              f"{table['memory_utilization']:.0%} of its memory; KV room: tokens of KV it holds beside them",
              f"prefill: one prompt of {table['prompt_tokens']} tokens in chunks of {table['prefill_token_budget']} "
              "(its TTFT before any queueing)",
              f"decode: one step at batch <= {table['decode_batch_cap']} (fewer where the KV room holds fewer), "
              f"{table['decode_context']} tokens of context each; comm: the share of the time in collectives "
              "(all-reduces" + (", and with EP > 1 the all-to-alls and all-gathers of the experts)" if moe else ")")]
    if any(r["tp"] > NODE_GPUS for r in table["sizes"]):
        lines.append(f"TP above {NODE_GPUS} spans nodes: a what-if (a worker's ranks share one node; its collectives "
                     "are costed at the NVLink figure, which is optimistic across nodes)")
    if moe:
        lines.append("EP 1: every expert sliced over the ranks; EP = TP: the experts split whole over them. A step "
                     "reads the experts its tokens touch, E (1 - (1 - k/E)^tokens) a layer with uniform routing")
    if table["fitting"]:
        prefill = f"TP {table['prefill_winner']}" + (f" EP {table['prefill_winner_ep']}" if moe else "")
        decode = f"TP {table['decode_winner']}" + (f" EP {table['decode_winner_ep']}" if moe else "")
        lines.append(f"prefill: {prefill} wins (shortest prompt time); decode: {decode} wins (most tokens/s per GPU)")
    else:
        lines.append(f"no tensor-parallel size given fits: the weights alone ({table['weight_bytes'] / GB:,.0f} GB at "
                     f"{table['dtype_bytes']} bytes a value) need at least {table['gpus_for_weights']} "
                     f"{table['gpu']}s")
    return "\n".join(lines)
