"""The per-layer operations of the decoder, each one call: a fused kernel where one applies (on CPU
pdserve/kernels/csrc/layer_ops.cpp, built by pdserve.kernels.cpu_kernels; on CUDA the Triton kernels of
pdserve.kernels.triton_layer_ops), the torch reference everywhere else.

At decode these ops touch a few KB each; their cost is the count of operations around them (on CPU torch's
per-op overhead, on a GPU one kernel launch each), which the kernels cut from ~35 to ~4 per layer. The
torch versions define the semantics.

Environment: ``PDSERVE_CPU_KERNELS=torch`` forces the torch versions on CPU (and F.linear in
pdserve.model.linear); ``PDSERVE_GPU_KERNELS=torch`` forces them on CUDA.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_kernels, triton_kernels

GPU_ENV_VAR = "PDSERVE_GPU_KERNELS"  # 'torch' forces the torch versions on CUDA; 'auto' (or unset) the kernels


def _gpu(t: torch.Tensor) -> ModuleType | None:
    """pdserve.kernels.triton_layer_ops when this CUDA activation takes its kernels, else None (torch)."""
    if not t.is_cuda:  # the CPU path never imports triton
        return None
    module = triton_kernels("triton_layer_ops", "the layer ops on CUDA use the torch versions")
    if module is None or not module.supports(t) or not cpu_kernels.enabled(GPU_ENV_VAR):
        return None
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim]. Normalised in fp32, rounded to x's dtype, then scaled (as the reference models do)."""
    gpu = _gpu(x)
    if gpu is not None:
        return gpu.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, when x is given); returns rms_norm(residual). [tokens, dim] each."""
    if cpu_kernels.applies(residual) and residual.is_contiguous() and (x is None or x.is_contiguous()):
        return torch.ops.pdserve.add_rms_norm(x, residual, weight, eps)
    gpu = _gpu(residual)
    if gpu is not None and (x is None or gpu.supports(x)):
        return gpu.add_rms_norm(x, residual, weight, eps)
    if x is not None:
        residual.add_(x)
    return rms_norm(residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [tokens, 2 * d] -> silu(gate) * up: [tokens, d]."""
    if cpu_kernels.applies(gate_up) and gate_up.is_contiguous():
        return torch.ops.pdserve.silu_and_mul(gate_up)
    gpu = _gpu(gate_up)
    if gpu is not None:
        return gpu.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [tokens, heads, head_dim]; cos, sin: [tokens, 1, head_dim // 2] of x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new K/V (each [tokens, kv_heads, head_dim]) into their cache slots."""
    kv_heads, num_blocks, block_size, head_dim = kv_layer.shape[1:]
    flat = kv_layer.view(2, kv_heads, num_blocks * block_size, head_dim)
    flat[0].index_copy_(1, slot_mapping, k.transpose(0, 1))  # [kv_heads, tokens, head_dim]
    flat[1].index_copy_(1, slot_mapping, v.transpose(0, 1))


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                   kv_layer: torch.Tensor, slot_mapping: torch.Tensor, heads: int, kv_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [tokens, (heads + 2 kv_heads) * head_dim]; rope_cos/sin: the fp32 tables [max_pos, head_dim // 2].

    RoPE on q and k at each token's position, k and v written to their cache slots; returns q, k, v as
    [tokens, heads or kv_heads, head_dim] (views of qkv on the kernel path).
    """
    t = qkv.shape[0]
    head_dim = kv_layer.shape[-1]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(t, heads, head_dim)  # [tokens, heads, head_dim]
    k = k.view(t, kv_heads, head_dim)  # [tokens, kv_heads, head_dim]
    v = v.view(t, kv_heads, head_dim)
    if cpu_kernels.applies(qkv) and qkv.is_contiguous() and kv_layer.dtype == qkv.dtype and kv_layer.is_contiguous():
        torch.ops.pdserve.rope_and_cache(qkv, positions, rope_cos, rope_sin, kv_layer, slot_mapping, heads, kv_heads)
        return q, k, v  # views of qkv, rotated in place
    gpu = _gpu(qkv)
    if gpu is not None and kv_layer.dtype == qkv.dtype and kv_layer.stride(-1) == 1:
        return gpu.rope_and_cache(qkv, positions, rope_cos, rope_sin, kv_layer, slot_mapping, heads, kv_heads)
    cos = rope_cos[positions].unsqueeze(1).to(qkv.dtype)  # [tokens, 1, head_dim // 2]
    sin = rope_sin[positions].unsqueeze(1).to(qkv.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv(kv_layer, k, v, slot_mapping)
    return q, k, v
