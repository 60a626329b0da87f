"""Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norm), and with mixture-of-
experts blocks (pdserve.model.moe) in place of some or all MLPs: Qwen2-MoE, Qwen3-MoE, Mixtral.

With tensor parallelism each rank holds a share (pdserve.parallel.layout) and all-reduces the outputs
of o_proj and down_proj (set_tensor_parallel). The model never sees requests: ``forward(input_ids, positions, attention metadata, kv_cache)`` returns
hidden states of the step's tokens; ``compute_logits`` projects only the rows that will be sampled.
q/k/v and gate/up projections are fused (one matmul each); ``load_weights`` maps Hugging Face names.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model import layer_ops
from pdserve.model.attention import AttentionMetadata, paged_attention
from pdserve.model.linear import Linear
from pdserve.model.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """rms_norm(x); or, given the residual stream, residual += x in place and rms_norm(residual)."""
        if residual is None:
            return layer_ops.rms_norm(x, self.weight, self.eps)
        return layer_ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum x over a tensor-parallel group's ranks, in place (a row-parallel layer's partial sums)."""
    if group is not None:
        group.allreduce([x]).wait()
    return x


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.tp_group = None  # tensor parallelism: o_proj's partial sums are all-reduced over it

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, kv_layer: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [tokens, (heads + 2 kv_heads) * head_dim]
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE, in place in qkv
            q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size: self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        q, k, v = layer_ops.rope_and_cache(qkv, positions, *rope, kv_layer, meta.slot_mapping,
                                           self.num_heads, self.num_kv_heads)
        o = paged_attention(q, k, v, kv_layer, meta, self.scale)  # [tokens, heads, head_dim]
        return all_reduce(self.o_proj(o.view(t, self.q_size)), self.tp_group)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.tp_group = None  # tensor parallelism: down_proj's partial sums are all-reduced over it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x))), self.tp_group)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if index in cfg.moe_layers else MLP(cfg)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kv_layer: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: this layer's input, residual: the stream before it (None at the first layer, where h is
        the stream). Returns (MLP output, stream): the next layer adds the first to the second, fused
        with its norm, so the residual adds cost no separate passes."""
        if residual is None:
            residual = h  # the embedding lookup's output, ours to update in place
            x = self.input_layernorm(h)
        else:
            x = self.input_layernorm(h, residual)
        h = self.self_attn(x, positions, rope, meta, kv_layer)
        x = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # Given an empty weight, so it is not initialised at random: the checkpoint fills it (pdserve.model.loader
        # builds the model on the meta device, where a random init imports torch._dynamo, ~1.4 s of every
        # worker's start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Tensor parallelism: this rank's embedding and LM head rows are the whole vocabulary's
        # [vocab_start, vocab_start + cfg.vocab_size); vocab_size is the whole vocabulary's size.
        self.tp_group = None
        self.vocab_start, self.vocab_size = 0, cfg.vocab_size
        self.tie_weights()
        self.register_buffer("rope_cos", torch.empty(cfg.max_position_embeddings, cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_position_embeddings, cfg.head_dim // 2), persistent=False)
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)compute the fp32 RoPE tables [max_pos, head_dim // 2] on the model's device."""
        if self.rope_cos.is_meta:
            return
        device = self.rope_cos.device
        pos = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, rope_inv_freq(self.cfg).to(device))
        self.rope_cos = freqs.cos()
        self.rope_sin = freqs.sin()

    def set_tensor_parallel(self, group, rank: int = 0, expert_parallel: bool = False) -> None:
        """This model is rank's share (pdserve.parallel.layout): all-reduce the row-parallel layers
        (o_proj, down_proj) and the vocab-parallel embedding over group, a process group of the worker's
        ranks, and all-gather the vocab-parallel LM head's logits. A mixture of experts' blocks all-reduce
        their experts' slices too, or, expert_parallel, dispatch tokens to the ranks holding their experts."""
        self.tp_group = group
        for layer in self.layers:
            layer.self_attn.tp_group = group
            if expert_parallel and isinstance(layer.mlp, MoE):
                layer.mlp.set_expert_parallel(group, rank)
            else:
                layer.mlp.tp_group = group

    def expert_tokens(self) -> list[int]:
        """Tokens routed to each expert so far, summed over the mixture-of-experts layers (every rank routes
        every token: rank 0's counts are the worker's); [] for a dense model."""
        blocks = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]
        counts = [b.counts for b in blocks if b.counts is not None]
        if not counts:
            return [0] * blocks[0].num_experts if blocks else []
        return torch.stack(counts).sum(0).tolist()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: each rank looks up the ids in its rows (zeros for the others'), then one all-reduce.
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.cfg.vocab_size)
        h = self.embed_tokens(local.clamp(0, self.cfg.vocab_size - 1))
        h = h * mine.unsqueeze(1).to(h.dtype)
        return all_reduce(h, self.tp_group)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [tokens]; kv_cache: [layers, 2, kv_heads, blocks, block_size, head_dim].

        layer_done(i) is called after layer i (its KV is written): a prefill worker starts sending that
        layer's KV while the next layers compute.
        """
        h = self.embed(input_ids)  # [tokens, hidden]
        residual = None
        rope = (self.rope_cos, self.rope_sin)
        for i, (layer, kv_layer) in enumerate(zip(self.layers, kv_cache)):
            h, residual = layer(h, residual, positions, rope, meta, kv_layer)
            if layer_done is not None:
                layer_done(i)
        return self.norm(h, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, hidden] -> fp32 logits [rows, vocab] (with tensor parallelism: on every rank,
        each rank's vocabulary slice all-gathered)."""
        logits = self.lm_head(hidden).float()
        if self.tp_group is None:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_group.size())]
        self.tp_group.allgather([parts], [logits]).wait()
        return torch.cat(parts, dim=1)[:, : self.vocab_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; every parameter must be set. Experts
        come one tensor set per expert (Qwen3-MoE's gate/up/down_proj, Mixtral's w1/w3/w2 under
        block_sparse_moe) or packed 3-D (experts.gate_up_proj, experts.down_proj)."""
        params = dict(self.named_parameters())  # tied lm_head appears once, as embed_tokens.weight
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            target, piece = self.locate(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            dst = params[target]
            if piece is not None:
                expert, off, rows = piece
                dst = (dst if expert is None else dst[expert]).narrow(0, off, rows)
            if dst.shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, model {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(f"{target}#{piece}")
        missing = [t for t in params if not self._covered(t, loaded)]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _pieces(self, target: str) -> list[tuple[int | None, int, int]]:
        """The pieces a fused or stacked parameter is loaded in from a per-tensor checkpoint: (expert or None,
        first row, rows); [] for a parameter loaded whole."""
        c = self.cfg
        kind = target.rsplit(".", 2)[-2:]
        if kind[0] == "qkv_proj":
            return [(None, 0, c.q_size), (None, c.q_size, c.kv_size), (None, c.q_size + c.kv_size, c.kv_size)]
        if kind[0] == "gate_up_proj":
            i = c.shared_expert_intermediate_size if ".shared_expert." in target else c.intermediate_size
            return [(None, 0, i), (None, i, i)]
        experts = c.experts_per_rank or c.num_experts  # this share's
        if kind == ["experts", "gate_up_proj"]:
            i = c.moe_intermediate_size
            return [(e, off, i) for e in range(experts) for off in (0, i)]
        if kind == ["experts", "down_proj"]:
            return [(e, 0, c.hidden_size) for e in range(experts)]
        return []

    def _covered(self, target: str, loaded: set[str]) -> bool:
        """Whether a parameter was loaded whole or in all its pieces (a stacked one may come either way)."""
        whole, pieces = f"{target}#None" in loaded, self._pieces(target)
        if not pieces:
            return whole
        return all(f"{target}#{p}" in loaded for p in pieces) or (whole and ".experts." in target)

    def locate(self, name: str) -> tuple[str, tuple[int | None, int, int] | None]:
        """A Hugging Face tensor name (without "model.") -> (the parameter it goes to, its piece of it or None for
        all of it); also where a weight update puts it (pdserve.weights.update)."""
        c = self.cfg
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the MoE block
        name = name.replace(".mlp.shared_expert_gate.", ".mlp.shared_expert.gate.")  # Qwen2-MoE's
        parts = name.split(".")
        if len(parts) == 7 and parts[3] == "experts":  # layers.L.mlp.experts.E.<proj>.weight: one expert's
            e, proj = int(parts[4]), _EXPERT_PROJ.get(parts[5])
            if proj is None:
                return name, None
            param, index = proj
            rows = c.hidden_size if param == "down_proj" else c.moe_intermediate_size
            return ".".join(parts[:4] + [param]), (e, index * c.moe_intermediate_size, rows)
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, index = _FUSED[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
            return target, self._pieces(target)[index]
        return name, None


# A per-tensor checkpoint's names for the pieces of the fused parameters: (parameter, piece).
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# One expert's tensors in a checkpoint with a tensor set per expert: (stacked parameter, piece).
_EXPERT_PROJ = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
                "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}
