"""Attention over a paged KV cache: a clear torch implementation that runs anywhere.

Cache layout, one tensor for the whole model: ``[num_layers, 2, num_kv_heads, num_blocks, block_size,
head_dim]``. Per layer, K (or V) is ``[kv_heads, blocks, block_size, head_dim]``, so gathering a batch
of block tables along dim 1 yields ``[kv_heads, batch, context, head_dim]`` with no further copy: the
layout batched matmuls want. A request's used blocks are an index_select along dim 3 of the whole
tensor, which is what the KV transfer ships.

A step's tokens are ordered decodes first (one query token each), then prefill chunks (several query
tokens each, attended one sequence at a time with SDPA). Decodes are sorted by context length and
attended in groups of similar length, each padded only to its own longest context: the gather and the
matmuls are memory-bound, and one batch padded to its longest sequence would move about twice the
bytes on a mixed-length batch.

On CPU with an fp32 or bf16 contiguous cache, decode attention runs a C++ kernel instead (pdserve.kernels.cpu_attention)
that reads each row's K/V blocks in place, once, with no padding; PDSERVE_CPU_ATTENTION=torch forces
the torch path below, which stays the reference and serves every other device and dtype.

On CUDA, decode and prefill with a cached prefix run Triton kernels (pdserve.kernels.triton_attention) that read
the blocks in place the same way, when triton imports (CUDA builds of torch bring it) and the dtype is
fp32, bf16 or fp16; the torch path gathers the prefix and hands SDPA a dense boolean mask.
PDSERVE_GPU_ATTENTION=torch (read at every call) forces the torch path there, for A/B runs and as the way
out if the kernels misbehave.
FlashInfer is not wired: its paged kernels take a plan() per step (host-side metadata) that belongs where
the step's metadata is built (pdserve.engine.runner), not in this per-layer call.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_attention, cpu_kernels, triton_kernels


GPU_ENV_VAR = "PDSERVE_GPU_ATTENTION"  # 'torch' forces the torch path on CUDA; 'auto' (or unset) the kernels


@dataclass
class DecodeGroup:
    """Consecutive decode rows attended together, padded to the group's longest context."""

    block_tables: torch.Tensor  # [rows, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [rows] int64, tokens attended (including the new one)


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence attends to, for one step."""

    slot_mapping: torch.Tensor  # [tokens] int64: block_id * block_size + offset of each new token
    num_decodes: int  # the first num_decodes sequences (and tokens) are single-token decodes
    decode_groups: list[DecodeGroup]  # covering the decode rows in order
    prefill_query_lens: list[int]  # per prefill sequence: new tokens this step
    prefill_context_lens: list[int]  # per prefill sequence: tokens attended (cached + new)
    prefill_block_tables: list[torch.Tensor]  # per prefill sequence: [blocks] int64


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim] (this step's keys, already in the cache)
    v: torch.Tensor,  # [tokens, kv_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, kv_heads, num_blocks, block_size, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [tokens, heads, head_dim]
    out = torch.empty_like(q)
    start = 0
    for g in meta.decode_groups:
        end = start + g.context_lens.shape[0]
        _decode_attention(q[start:end], kv_layer, g.block_tables, g.context_lens, scale, out=out[start:end])
        start = end
    assert start == meta.num_decodes
    for q_len, ctx_len, blocks in zip(meta.prefill_query_lens, meta.prefill_context_lens, meta.prefill_block_tables):
        end = start + q_len
        out[start:end] = _prefill_attention(q[start:end], k[start:end], v[start:end], kv_layer, blocks, ctx_len, scale)
        start = end
    return out


def _decode_attention(
    q: torch.Tensor,  # [batch, heads, head_dim]
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks]
    context_lens: torch.Tensor,  # [batch]
    scale: float,
    out: torch.Tensor | None = None,  # [batch, heads, head_dim], contiguous: written in place
) -> torch.Tensor:
    if cpu_attention.supports(q, kv_layer, block_tables, context_lens):
        return cpu_attention.paged_decode_attention(q, kv_layer, block_tables, context_lens, scale, out=out)
    gpu = _gpu_kernels(q, kv_layer)
    if gpu is not None:
        return gpu.paged_decode_attention(q, kv_layer, block_tables, context_lens, scale, out=out)
    result = _decode_attention_torch(q, kv_layer, block_tables, context_lens, scale)
    return result if out is None else out.copy_(result)


def _decode_attention_torch(
    q: torch.Tensor,  # [batch, heads, head_dim]
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks]
    context_lens: torch.Tensor,  # [batch]
    scale: float,
) -> torch.Tensor:
    batch, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = kv_layer.shape[1:]
    ctx = block_tables.shape[1] * block_size
    # K and V of every row in one gather: [2, kv_heads, batch, ctx, head_dim]
    k, v = kv_layer.index_select(2, block_tables.reshape(-1)).view(2, kv_heads, batch, ctx, head_dim)
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)  # [kv_heads, batch, group, head_dim]
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)  # [kv_heads, batch, group, ctx]
    pad = torch.arange(ctx, device=q.device)[None, :] >= context_lens[:, None]  # [batch, ctx]
    scores.masked_fill_(pad[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v)  # [kv_heads, batch, group, head_dim]
    return out.transpose(0, 1).reshape(batch, heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,  # [q_len, heads, head_dim]
    k_new: torch.Tensor,  # [q_len, kv_heads, head_dim] (also in the cache already)
    v_new: torch.Tensor,
    kv_layer: torch.Tensor,
    blocks: torch.Tensor,  # [blocks] of this sequence
    ctx_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, heads, head_dim]
    # Without a cached prefix the torch path is SDPA's plain causal attention over the fresh keys
    # (FlashAttention on CUDA), which has run on GPUs; the kernel serves the prefix case it lacks.
    gpu = _gpu_kernels(q, kv_layer) if ctx_len > q.shape[0] else None
    if gpu is not None:
        return gpu.prefill_attention(q, k_new, v_new, kv_layer, blocks, ctx_len, scale)
    return _prefill_attention_torch(q, k_new, v_new, kv_layer, blocks, ctx_len, scale)


def _prefill_attention_torch(
    q: torch.Tensor,  # [q_len, heads, head_dim]
    k_new: torch.Tensor,  # [q_len, kv_heads, head_dim]
    v_new: torch.Tensor,
    kv_layer: torch.Tensor,
    blocks: torch.Tensor,  # [blocks] of this sequence
    ctx_len: int,
    scale: float,
) -> torch.Tensor:
    q_len = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
    if ctx_len == q_len:
        # Nothing cached before this chunk: attend to the fresh keys, plain causal.
        k = k_new.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, q_len, head_dim]
        v = v_new.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kv_heads, _, block_size, head_dim = kv_layer.shape[1:]
        n = -(-ctx_len // block_size)
        k = kv_layer[0].index_select(1, blocks[:n]).view(kv_heads, n * block_size, head_dim)[:, :ctx_len]
        v = kv_layer[1].index_select(1, blocks[:n]).view(kv_heads, n * block_size, head_dim)[:, :ctx_len]
        # Query j sits at absolute position ctx_len - q_len + j and sees keys up to and including it.
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx_len]
        o = F.scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)  # [q_len, heads, head_dim]


def _gpu_kernels(q: torch.Tensor, kv_layer: torch.Tensor) -> ModuleType | None:
    """pdserve.kernels.triton_attention when these inputs take its kernels: CUDA tensors of a dtype it supports,
    triton importable, not forced off by PDSERVE_GPU_ATTENTION=torch; else None (the torch path)."""
    if not q.is_cuda:  # the CPU path never imports triton
        return None
    module = _triton_attention()
    if module is None or not module.supports(q, kv_layer) or not cpu_kernels.enabled(GPU_ENV_VAR):
        return None
    return module


def gpu_decode_in_place() -> bool:
    """Whether decode attention on CUDA reads each row's blocks in place up to its context (the Triton
    kernel), rather than gathering and masking the whole padded block table (the torch path)."""
    return _triton_attention() is not None and cpu_kernels.enabled(GPU_ENV_VAR)


def _triton_attention() -> ModuleType | None:
    return triton_kernels("triton_attention", "attention on CUDA uses the torch path")
