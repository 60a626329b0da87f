"""A mixture-of-experts block, in place of a decoder layer's MLP (Qwen2-MoE, Qwen3-MoE, Mixtral).

Each token's router logits pick its top-k experts (softmax in fp32, then top-k; the k weights renormalised
to sum 1 where the family does so), the tokens are grouped by expert, each expert touched runs one gated
MLP over its tokens (one matmul for gate and up, one for down), and its outputs, scaled by their routing
weights, are summed back into their tokens' rows, expert by expert. An expert no token chose costs nothing:
a decode step reads the experts its batch touches, not all of them.

The experts' weights are stacked 3-D tensors (`experts.gate_up_proj` [experts, 2 * moe_intermediate,
hidden], gate rows first, and `experts.down_proj` [experts, hidden, moe_intermediate]), the packed layout
newer checkpoints have on disk; checkpoints with one tensor set per expert load into them
(pdserve.model.llama.load_weights). The grouping reads the experts' token counts on the host; on a GPU the
block runs instead as a fused Triton kernel pair that groups on the device (pdserve.kernels.triton_moe,
compiled and checked against the torch block on an H200; no MoE model has been served on a GPU yet), except
with expert parallelism.

Over the R ranks of a worker (attention tensor-parallel over them, so every rank holds every token's
hidden state after it) the experts are laid out one of two ways (pdserve.parallel.layout.rank_config):

- tensor-parallel (expert_parallel_size 1): every rank holds every expert's 1/R slice of the intermediate
  size; its outputs are partial sums, all-reduced, as a dense MLP's are.
- expert-parallel (expert_parallel_size R): rank r holds experts [r E/R, (r+1) E/R) whole. Every rank routes
  every token (the same result everywhere), owns 1/R of the tokens, and sends each of its tokens' k choices
  to the rank holding that expert (all-to-all); the expert ranks run their experts and send the weighted
  outputs back (all-to-all); each rank sums its tokens' k outputs in expert order, as one rank would; an
  all-gather gives every rank every token's output again. Each token's experts are computed once, on the
  rank that holds them, and no rank reads another's expert weights.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.kernels import triton_kernels
from pdserve.model import layer_ops
from pdserve.model.linear import Linear, linear, quantize_rows


def _triton_moe() -> ModuleType | None:
    return triton_kernels("triton_moe", "mixture-of-experts blocks on CUDA run expert by expert")


class Router(nn.Module):
    """The router's weight [experts, hidden]: kept in the model's dtype (never quantized: int8 routing would
    change which experts a token picks)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class Experts(nn.Module):
    """This rank's experts, stacked; with int8 weights (quantize_int8) one fp32 scale per output row of each."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_scale: torch.Tensor | None
        self.down_scale: torch.Tensor | None
        self.register_buffer("gate_up_scale", None)  # [experts, 2 * intermediate] fp32, int8 weights only
        self.register_buffer("down_scale", None)  # [experts, hidden]

    def matmul(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """x @ expert e's gate_up_proj or down_proj, through the dense layers' path (pdserve.model.linear: on
        CPU the kernel for a decode step's few rows an expert, F.linear for a prefill's many)."""
        scale = getattr(self, f"{name.removesuffix('_proj')}_scale")
        return linear(x, getattr(self, name)[e], None if scale is None else scale[e])

    @torch.no_grad()
    def quantize_int8(self) -> None:
        """Each expert's weights to int8 with one symmetric scale per output row, as pdserve.model.linear does
        for a dense layer (the router stays in the model's dtype)."""
        assert self.gate_up_scale is None, "already quantised"
        for name in ("gate_up_proj", "down_proj"):
            q, scale = quantize_rows(getattr(self, name))  # scale: [experts, rows]
            delattr(self, name)
            self.register_buffer(name, q)
            setattr(self, f"{name.removesuffix('_proj')}_scale", scale)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.shared_expert_intermediate_size, bias=False)
        self.down_proj = Linear(cfg.shared_expert_intermediate_size, cfg.hidden_size, bias=False)
        self.gate = Router(cfg.hidden_size, 1)  # shared_expert_gate: one logit a token, kept in the model's dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x)))
        return torch.sigmoid(F.linear(x, self.gate.weight)) * h


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.local_experts = cfg.experts_per_rank or cfg.num_experts
        self.experts = Experts(self.local_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        # Qwen2-MoE: a shared expert every token runs, scaled by sigmoid(shared_expert_gate . x). Sliced over
        # the ranks like the experts (its partial sums join theirs in the all-reduce) or, with expert
        # parallelism, whole on every rank (pdserve.parallel.layout).
        self.shared_expert = SharedExpert(cfg) if cfg.shared_expert_intermediate_size else None
        self.tp_group = None  # experts sliced over the ranks: their partial sums are all-reduced over it
        self.ep_group, self.ep_rank = None, 0  # experts split over the ranks (set_expert_parallel)
        # Tokens routed to each expert so far (its load: pdserve_worker_expert_tokens), on the device; made at
        # the first forward (a model built on the meta device has no values to keep).
        self.counts: torch.Tensor | None = None
        # A forward's top-k ids, appended by route() while a pdserve.engine.routed_experts.RouteCapture holds a
        # list here (a request asked for its routed experts); None otherwise: nothing is kept.
        self.routed: list[torch.Tensor] | None = None

    def set_expert_parallel(self, group, rank: int) -> None:
        """This rank holds experts [rank * local_experts, (rank + 1) * local_experts) of a group of ranks."""
        assert self.local_experts * group.size() == self.num_experts, "rank_config sizes the local experts"
        self.ep_group, self.ep_rank = group, rank

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden] -> (weights [tokens, k] in x's dtype, expert ids [tokens, k])."""
        logits = F.linear(x, self.gate.weight)  # [tokens, experts]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [tokens, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed is not None:
            self.routed.append(ids)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden] -> [tokens, hidden]."""
        weights, ids = self.route(x)
        flat, slot_weights = ids.reshape(-1), weights.reshape(-1)  # [tokens * k]: slot j is token j // k's choice
        if self.counts is None:
            self.counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        self.counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host synchronisation
        if self.ep_group is not None:
            out = self._expert_parallel(x, flat, slot_weights)
            return out if self.shared_expert is None else out + self.shared_expert(x)
        kernel = _triton_moe() if x.is_cuda else None  # every expert in two launches, grouped on the device
        if kernel is not None and kernel.supports(x, self.experts.gate_up_proj, self.experts.down_proj):
            out = kernel.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        else:
            order = torch.argsort(flat, stable=True)  # the slots grouped by expert, in expert order
            tokens = order // self.top_k
            out = torch.zeros_like(x)
            out.index_add_(0, tokens, self._run(x[tokens], flat[order], slot_weights[order], first=0))
        if self.shared_expert is not None:
            out += self.shared_expert(x)
        if self.tp_group is not None:
            self.tp_group.allreduce([out]).wait()
        return out

    def _run(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, first: int) -> torch.Tensor:
        """Rows x [n, hidden] bound for experts (global ids, sorted, all this rank's: first .. first +
        local_experts) -> each row's expert output times its weight [n, hidden]."""
        counts = torch.bincount(experts - first, minlength=self.local_experts)
        out = torch.empty_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            rows = slice(start, start + n)
            start += n
            h = layer_ops.silu_and_mul(self.experts.matmul("gate_up_proj", e, x[rows]))
            h = self.experts.matmul("down_proj", e, h)  # [n, hidden]
            out[rows] = h * weights[rows, None]
        return out

    def _expert_parallel(self, x: torch.Tensor, flat: torch.Tensor, slot_weights: torch.Tensor) -> torch.Tensor:
        """Dispatch each owned token's choices to their experts' ranks, run this rank's experts, combine (see the
        module's docstring). Every rank knows the whole routing, so every rank knows every send and receive
        count: no counts are exchanged."""
        group, rank, k = self.ep_group, self.ep_rank, self.top_k
        ranks, tokens = group.size(), x.shape[0]
        per_rank = -(-tokens // ranks)  # tokens each rank owns (the last ones fewer)
        owner = torch.arange(flat.numel(), device=flat.device) // k // per_rank  # [slots]
        dest = flat // self.local_experts  # the rank holding each slot's expert
        # Slots by owner, then expert (stable): an owner's sends grouped by destination in expert order, and
        # a destination's receipts, source after source, in that same order.
        perm = torch.argsort(owner * self.num_experts + flat, stable=True)
        pairs = torch.bincount(owner * ranks + dest, minlength=ranks * ranks).view(ranks, ranks).tolist()
        send_counts, recv_counts = pairs[rank], [pairs[src][rank] for src in range(ranks)]
        sent = perm[owner[perm] == rank]  # this rank's tokens' slots, in send order
        received = perm[dest[perm] == rank]  # the slots this rank's experts run, in receive order
        inbox = x.new_empty(len(received), x.shape[1])
        group.alltoall_base(inbox, x[sent // k].contiguous(), recv_counts, send_counts, dist.AllToAllOptions()).wait()
        # Run the experts grouped by expert, then put the outputs back in receive order.
        by_expert = torch.argsort(flat[received], stable=True)
        results = torch.empty_like(inbox)
        results[by_expert] = self._run(inbox[by_expert], flat[received][by_expert], slot_weights[received][by_expert],
                                       first=rank * self.local_experts)
        back = x.new_empty(len(sent), x.shape[1])
        group.alltoall_base(back, results, send_counts, recv_counts, dist.AllToAllOptions()).wait()
        mine = x.new_zeros(per_rank, x.shape[1])
        mine.index_add_(0, sent // k - rank * per_rank, back)  # each token's k outputs, in expert order
        parts = [torch.empty_like(mine) for _ in range(ranks)]
        group.allgather([parts], [mine]).wait()
        return torch.cat(parts)[:tokens]
