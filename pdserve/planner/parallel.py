"""Tensor-parallel sizes compared on the roofline: which fit one GPU's memory per rank, and which wins
for prefill (the time of one prompt: its TTFT before any queueing) and for decode (tokens/s per GPU at
the decode pool's batch).

A size fits when one rank's weights and the KV of one request of the workload's longest length fit
within MEMORY_UTILIZATION of the GPU's memory (the rest is left to activations, the CUDA context,
graphs and communication buffers). The decode batch is the pool's batch cap, or fewer where the rank's
KV cache holds fewer requests at the decode context.
"""
from __future__ import annotations

from typing import Any

from pdserve.config import ModelConfig
from pdserve.perf.costs import RooflineCosts, attention_pairs
from pdserve.perf.hardware import GB, MEMORY_UTILIZATION, Gpu, roofline


def prefill_time(costs: RooflineCosts, prompt: int, token_budget: int) -> float:
    """One prompt alone on a prefill worker, in chunks of at most token_budget tokens."""
    t, start = 0.0, 0
    while start < prompt:
        n = min(token_budget, prompt - start)
        t += costs.step_time(n, attention_pairs(start, n), int(start + n == prompt), 0, 0)
        start += n
    return t


def compare_tp(model: ModelConfig, device: Gpu, sizes: list[int], prompt: int, token_budget: int,
               batch_cap: int, decode_context: int, longest: int, dtype_bytes: int = 2) -> dict[str, Any]:
    """One row per size (every figure one rank's, times in seconds), and the winners among those that fit.

    prompt: the prefill's prompt tokens; decode_context: tokens of KV each decoding request reads;
    longest: prompt + output tokens of the workload's longest request (the least KV a rank must hold).
    """
    usable = int(device.memory_bytes * MEMORY_UTILIZATION)
    rows = []
    for tp in sizes:
        costs = roofline(model, device, dtype_bytes, tp)  # a size that does not divide the heads fails here
        kv_room = usable - costs.resident_weight_bytes
        kv_tokens = max(0, kv_room) // costs.kv_bytes_per_token
        row: dict[str, Any] = {"tp": tp, "weight_bytes_per_rank": costs.resident_weight_bytes,
                               "kv_bytes_per_token_per_rank": costs.kv_bytes_per_token,
                               "kv_tokens_per_rank": kv_tokens, "fits": kv_tokens >= longest}
        if row["fits"]:
            batch = min(batch_cap, kv_tokens // decode_context)
            ttft = prefill_time(costs, prompt, token_budget)
            step = costs.step_time(0, 0, 0, batch, batch * decode_context)
            chunks = [min(token_budget, prompt - s) for s in range(0, prompt, token_budget)]
            row.update({
                "prefill_s": ttft,
                "prefill_allreduce_share": sum(map(costs.allreduce_time, chunks)) / ttft,
                "prefill_tokens_per_s_per_gpu": prompt / ttft / tp,
                "decode_batch": batch,
                "decode_step_s": step,
                "decode_allreduce_share": costs.allreduce_time(batch) / step,
                "decode_tokens_per_s_per_gpu": batch / step / tp,
            })
        rows.append(row)
    fit = [r for r in rows if r["fits"]]
    return {
        "gpu": device.name, "memory_utilization": MEMORY_UTILIZATION, "prompt_tokens": prompt,
        "prefill_token_budget": token_budget, "decode_batch_cap": batch_cap, "decode_context": decode_context,
        "longest_request_tokens": longest, "sizes": rows,
        "fitting": [r["tp"] for r in fit],
        "prefill_winner": min(fit, key=lambda r: (r["prefill_s"], r["tp"]))["tp"] if fit else None,
        "decode_winner": max(fit, key=lambda r: (r["decode_tokens_per_s_per_gpu"], -r["tp"]))["tp"] if fit else None,
    }


def format_tp(table: dict[str, Any]) -> str:
    head = (f"{'TP':>3} {'fits':>4} {'weights/GPU':>11} {'KV/token/GPU':>12} {'KV room':>9} {'prefill ms':>10} "
            f"{'tok/s/GPU':>9} {'AR':>4} {'batch':>5} {'step ms':>7} {'tok/s/GPU':>9} {'AR':>4}")
    lines = [head, "-" * len(head)]
    for r in table["sizes"]:
        start = (f"{r['tp']:>3} {'yes' if r['fits'] else 'no':>4} {r['weight_bytes_per_rank'] / GB:>9.1f}GB "
                 f"{r['kv_bytes_per_token_per_rank'] / 1024:>10.0f}KB {r['kv_tokens_per_rank']:>9,}")
        if not r["fits"]:
            lines.append(start)
            continue
        lines.append(f"{start} {r['prefill_s'] * 1e3:>10.1f} {r['prefill_tokens_per_s_per_gpu']:>9,.0f} "
                     f"{r['prefill_allreduce_share']:>4.0%} "
                     f"{r['decode_batch']:>5} {r['decode_step_s'] * 1e3:>7.2f} "
                     f"{r['decode_tokens_per_s_per_gpu']:>9,.0f} {r['decode_allreduce_share']:>4.0%}")
    lines += ["", f"tensor parallelism on {table['gpu']} (roofline of datasheet peaks); every figure one GPU's",
              f"fits: its weights and the KV of the longest request ({table['longest_request_tokens']} tokens) within "
              f"{table['memory_utilization']:.0%} of its memory; KV room: tokens of KV it holds beside them",
              f"prefill: one prompt of {table['prompt_tokens']} tokens in chunks of {table['prefill_token_budget']} "
              "(its TTFT before any queueing)",
              f"decode: one step at batch <= {table['decode_batch_cap']} (fewer where the KV room holds fewer), "
              f"{table['decode_context']} tokens of context each; AR: the all-reduces' share of the time"]
    if table["fitting"]:
        lines.append(f"prefill: TP {table['prefill_winner']} wins (shortest prompt time); decode: TP "
                     f"{table['decode_winner']} wins (most tokens/s per GPU)")
    else:
        lines.append("no tensor-parallel size given fits")
    return "\n".join(lines)
