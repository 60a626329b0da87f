"""The decoder layer's small ops on the GPU, one Triton launch each: add + RMSNorm, RoPE + KV-cache write,
SiLU-and-multiply.

Same results as the torch versions in pdserve.model.layer_ops, which take 7 to 14 kernels each. A decode
step of a 32-layer model ran ~1,500 kernels, ~1,100 of them these ops', each a few microseconds on a few
KB: on an H200 they were a third of the step's GPU time (docs/benchmarks.md). With these kernels a layer
is nine launches: two norms, four matrix products, RoPE and the cache write, attention, SiLU-and-multiply.

Numerics follow the torch versions' roundings: with 16-bit activations the sum of the residual add, the
normalised row, the RoPE products and the SiLU are each rounded to the activation dtype where torch rounds
them, and the arithmetic between is fp32. RoPE and SiLU-and-multiply match torch bit for bit where the
exp of the SiLU does; the norm's sum of squares is summed in another order than torch's (fp32, relative
differences ~1e-7 before rounding).

Triton's interpreter runs these on CPU tensors (tests/kernels/test_triton_layer_ops.py); on a GPU they are
compiled. pdserve.model.layer_ops calls them for CUDA tensors unless PDSERVE_GPU_KERNELS=torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_attention import DTYPES, INTERPRETER


def supports(t: torch.Tensor) -> bool:
    """Whether this activation takes the kernels: a 2-D row-major tensor (last dim contiguous) of fp32,
    bf16 or fp16 on a CUDA device (or any device under the interpreter)."""
    return t.dim() == 2 and t.dtype in DTYPES and t.stride(-1) == 1 and (t.is_cuda or INTERPRETER)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place (when x is given); returns rms_norm(residual) (pdserve.model.layer_ops.add_rms_norm).
    x, residual: [rows, dim]; weight: [dim]."""
    rows, dim = residual.shape
    out = torch.empty_like(residual)
    if not rows:
        return out
    src = residual if x is None else x
    _rms_norm_kernel[(rows,)](
        src, residual, weight, out, dim, eps, src.stride(0), residual.stride(0), out.stride(0),
        HAS_ADD=x is not None, BLOCK=triton.next_power_of_2(dim), num_warps=_warps(dim),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, dim] -> rms_norm(x) (pdserve.model.layer_ops.rms_norm); x is not written."""
    return add_rms_norm(None, x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * d] -> silu(gate) * up: [rows, d]."""
    rows, two_d = gate_up.shape
    d = two_d // 2
    out = torch.empty(rows, d, dtype=gate_up.dtype, device=gate_up.device)
    if not rows:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_mul_kernel[(rows, triton.cdiv(d, block))](gate_up, out, d, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                   kv_layer: torch.Tensor, slot_mapping: torch.Tensor, heads: int, kv_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on q and k in place in qkv [tokens, (heads + 2 kv_heads) * head_dim] at each token's position,
    k and v written to their cache slots (pdserve.model.layer_ops.rope_and_cache); returns q, k, v as views
    of qkv [tokens, heads or kv_heads, head_dim]. rope_cos/sin: fp32 [max_pos, head_dim // 2]."""
    t = qkv.shape[0]
    head_dim = kv_layer.shape[-1]
    half = head_dim // 2
    assert kv_layer.stride(-1) == 1 and rope_cos.stride(-1) == 1 and rope_sin.stride(-1) == 1
    if t:
        _rope_cache_kernel[(t, heads + 2 * kv_heads)](
            qkv, positions, rope_cos, rope_sin, kv_layer, slot_mapping, qkv.stride(0), rope_cos.stride(0),
            *kv_layer.stride()[:4],
            HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=half, HALF_PAD=triton.next_power_of_2(half),
            BLOCK_SIZE=kv_layer.shape[3],
        )
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim)


def _warps(dim: int) -> int:
    return 4 if dim <= 2048 else 8 if dim <= 8192 else 16


# --- kernels ---------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, dim, eps, stride_x, stride_r, stride_o,
                     HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    """One row: s = round(x + residual) written back to the residual (HAS_ADD), else s = residual; then
    round(s * rsqrt(mean(s^2) + eps)) * weight, rounded (16-bit) or not (fp32)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if HAS_ADD:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        r = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * stride_r + cols, r, mask=mask)
    s = r.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, 0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (s * inv).to(r.dtype).to(tl.float32)  # torch rounds the normalised row before the weight
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, d, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(gu_ptr + row * stride_in + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_in + d + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # torch rounds silu's output
    tl.store(out_ptr + row * stride_out + cols, (silu * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, slot_ptr, stride_t, stride_rope,
                       stride_kv, stride_kvh, stride_kvb, stride_kvt,  # of the layer's cache: K/V, head, block, token
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Program (token, head): head < HEADS a query head, rotated in place; then KV_HEADS key heads, rotated
    in place and written to the cache; then KV_HEADS value heads, written to the cache."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, HALF_PAD)
    mask = i < HALF
    base = qkv_ptr + tok * stride_t + head * HEAD_DIM
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    cache = kv_ptr + (slot // BLOCK_SIZE) * stride_kvb + (slot % BLOCK_SIZE) * stride_kvt
    if head < HEADS + KV_HEADS:
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        x1 = tl.load(base + i, mask=mask, other=0.0)
        x2 = tl.load(base + HALF + i, mask=mask, other=0.0)
        dt = x1.dtype
        # The tables are fp32; torch casts them to the activations' dtype, then each product and sum rounds.
        c = tl.load(cos_ptr + pos * stride_rope + i, mask=mask, other=0.0).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_rope + i, mask=mask, other=0.0).to(dt).to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        r1 = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
        r2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
        tl.store(base + i, r1, mask=mask)
        tl.store(base + HALF + i, r2, mask=mask)
        if head >= HEADS:
            k_cache = cache + (head - HEADS) * stride_kvh
            tl.store(k_cache + i, r1.to(kv_ptr.dtype.element_ty), mask=mask)
            tl.store(k_cache + HALF + i, r2.to(kv_ptr.dtype.element_ty), mask=mask)
    else:
        v_cache = cache + stride_kv + (head - HEADS - KV_HEADS) * stride_kvh
        v1 = tl.load(base + i, mask=mask, other=0.0)
        v2 = tl.load(base + HALF + i, mask=mask, other=0.0)
        tl.store(v_cache + i, v1.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache + HALF + i, v2.to(kv_ptr.dtype.element_ty), mask=mask)
