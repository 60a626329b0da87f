"""A mixture-of-experts block, in place of a decoder layer's MLP (Qwen3-MoE, Mixtral).

Each token's router logits pick its top-k experts (softmax in fp32, then top-k; the k weights renormalised
to sum 1 where the family does so), the tokens are grouped by expert, each expert touched runs one gated
MLP over its tokens (one matmul for gate and up, one for down), and its outputs, scaled by their routing
weights, are summed back into their tokens' rows. An expert no token chose costs nothing: a decode step
reads the experts its batch touches, not all of them.

The experts' weights are stacked 3-D tensors (`experts.gate_up_proj` [experts, 2 * moe_intermediate,
hidden], gate rows first, and `experts.down_proj` [experts, hidden, moe_intermediate]), the packed layout
newer checkpoints have on disk; checkpoints with one tensor set per expert load into them
(pdserve.model.llama.load_weights). The grouping reads the experts' token counts on the host: on a GPU
that is a synchronisation per layer, so a CUDA graph cannot hold this block (a fused Triton kernel is the
way there; not built).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model import layer_ops


class Router(nn.Module):
    """The router's weight [experts, hidden]: kept in the model's dtype (never quantized: int8 routing would
    change which experts a token picks)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.tp_group = None  # tensor parallelism is refused for these models (pdserve.parallel.layout)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden] -> (weights [tokens, k] in x's dtype, expert ids [tokens, k])."""
        logits = F.linear(x, self.gate.weight)  # [tokens, experts]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [tokens, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden] -> [tokens, hidden]."""
        weights, ids = self.route(x)
        flat, slot_weights = ids.reshape(-1), weights.reshape(-1)  # [tokens * k]: slot j is token j // k's choice
        order = torch.argsort(flat, stable=True)  # the slots grouped by expert, in expert order
        counts = torch.bincount(flat, minlength=self.num_experts)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            slots = order[start:start + n]
            start += n
            tokens = slots // self.top_k
            h = layer_ops.silu_and_mul(F.linear(x[tokens], self.experts.gate_up_proj[e]))  # [n, moe_intermediate]
            h = F.linear(h, self.experts.down_proj[e])  # [n, hidden]
            out.index_add_(0, tokens, h * slot_weights[slots, None])
        return out
