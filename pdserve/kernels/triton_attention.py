"""Attention over the paged KV cache on the GPU: Triton kernels for decode and for prefill with a cached prefix.

Same interfaces and results as the torch reference in pdserve.model.attention (``_decode_attention_torch``,
``_prefill_attention_torch``), which gathers the blocks into padded dense tensors first; these kernels read
each K/V block where it lies, once, through the block table, with no padding and no copy.

- Decode: one program per (row, KV head) computes all the query heads of the GQA group together, so a
  row's K/V bytes are read once per KV head, not once per query head. The group is padded to 16 rows
  (the smallest tl.dot); decode is memory-bound, so the padding rows cost arithmetic, not bytes.
- Prefill: one program per (tile of BLOCK_M queries, query head). Query j of a chunk of q_len new tokens
  sits at absolute position ctx_len - q_len + j and sees keys 0..that position; the chunk's own K/V are
  in the cache already (pdserve.model.layer_ops writes them before attention), so every key, cached prefix and
  new, is read from the blocks; key tiles past the query tile's last position are never visited.
- Both walk the context in tiles of TILE tokens independent of the cache's block size: each token's
  address comes from its block's table entry, so any block size works (4, 16, 5, ...).
- Numerics: scores, the online softmax and the accumulator are fp32 (exp2 with log2(e) folded into the
  scale); the probabilities are rounded to the cache's dtype before the P.V product, as the torch path
  does; fp32 inputs use IEEE fp32 dot products (no TF32). Under the interpreter, fp32 results match the
  torch path within 1.1e-6 on O(1) values; bf16 ones match fp32 arithmetic on the same values within the
  two roundings (probabilities, output).

Triton's interpreter runs the same kernels on CPU tensors, with numpy, when TRITON_INTERPRET=1 is set
before triton is first imported in the process (triton.language's own helpers, tl.sum, tl.zeros, ..., are
compiled-or-interpreted at that import, so the choice is one per process): tests/conftest.py sets it on
machines without CUDA. Under the interpreter every launch is interpreted, CUDA tensors included. What the
interpreter cannot show: compilation itself, register pressure and speed, TF32 (it multiplies in fp32
whatever the precision asked), and its fp32 -> bf16 conversion truncates where the GPU rounds to nearest.

Status: the tests run these kernels under Triton's interpreter on CPU tensors
(tests/kernels/test_triton_attention.py); compiled on an H200 (2026-11-27) they matched the torch reference in
all 79 cases. Speed there (docs/benchmarks.md): decode read a batch of 64 rows' 4.5 GB of KV at 71 % of the
copy bandwidth; prefill after a cached prefix took ~3x cuDNN's flash attention on a chunk without one. Importing this module needs triton (CUDA builds of torch bring it); pdserve.model.attention
imports it only when a CUDA tensor reaches attention.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of q, the cache and the output
_MIN_DOT = 16  # tl.dot's smallest M, N and K on NVIDIA GPUs

# TRITON_INTERPRET as triton.jit read it when the kernels below were defined (later changes have no effect).
INTERPRETER = bool(triton.knobs.runtime.interpret)


def supports(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether these inputs take the kernels: fp32, bf16 or fp16 q and cache of one dtype on one device,
    head_dim contiguous in the cache, on a CUDA device (or on any device under the interpreter)."""
    return (q.dtype in DTYPES and kv_layer.dtype == q.dtype and kv_layer.stride(-1) == 1
            and q.device == kv_layer.device and (q.is_cuda or INTERPRETER))


def paged_decode_attention(
    q: torch.Tensor,  # [batch, heads, head_dim]
    kv_layer: torch.Tensor,  # [2, kv_heads, num_blocks, block_size, head_dim] of q's dtype
    block_tables: torch.Tensor,  # [batch, max_blocks] int64 (int32 works); entries past a row's context unread
    context_lens: torch.Tensor,  # [batch] int64, >= 1
    scale: float,
    out: torch.Tensor | None = None,  # [batch, heads, head_dim] of q's dtype: written in place
) -> torch.Tensor:  # [batch, heads, head_dim]
    """One query token per row attending to its paged context (pdserve.model.attention._decode_attention_torch)."""
    batch, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = kv_layer.shape[1:]
    group = heads // kv_heads
    assert group * kv_heads == heads, "query heads must be a multiple of KV heads"
    assert kv_layer.stride(-1) == 1, "the cache's head_dim must be contiguous"
    q = q if q.stride(-1) == 1 else q.contiguous()
    dest = out if out is not None and out.stride(-1) == 1 else torch.empty_like(q)
    head_dim_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    _decode_kernel[(batch, kv_heads)](
        q, kv_layer, block_tables, context_lens, dest, scale * math.log2(math.e),
        q.stride(0), q.stride(1), *kv_layer.stride()[:4], block_tables.stride(0), dest.stride(0), dest.stride(1),
        GROUP=group, GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        TILE=64 if head_dim_pad <= 128 else 32, **_dot_options(q),
    )
    if out is not None and dest is not out:
        out.copy_(dest)
    return dest if out is None else out


def prefill_attention(
    q: torch.Tensor,  # [q_len, heads, head_dim]
    k_new: torch.Tensor | None,  # unused: this chunk's K/V are read from the cache, where they already are
    v_new: torch.Tensor | None,
    kv_layer: torch.Tensor,  # [2, kv_heads, num_blocks, block_size, head_dim] of q's dtype
    blocks: torch.Tensor,  # [blocks] of this sequence, int64 (int32 works)
    ctx_len: int,  # tokens attended: cached prefix + this chunk
    scale: float,
) -> torch.Tensor:  # [q_len, heads, head_dim]
    """One sequence's chunk of new tokens attending causally to its first ctx_len tokens
    (pdserve.model.attention._prefill_attention_torch)."""
    q_len, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = kv_layer.shape[1:]
    group = heads // kv_heads
    assert group * kv_heads == heads, "query heads must be a multiple of KV heads"
    assert kv_layer.stride(-1) == 1, "the cache's head_dim must be contiguous"
    assert 0 < q_len <= ctx_len <= blocks.shape[0] * block_size, "the blocks must hold ctx_len tokens"
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    head_dim_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    tile = 64 if head_dim_pad <= 128 else 32
    _prefill_kernel[(triton.cdiv(q_len, tile), heads)](
        q, kv_layer, blocks, out, q_len, ctx_len, scale * math.log2(math.e),
        q.stride(0), q.stride(1), *kv_layer.stride()[:4], out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=tile, TILE=tile, **_dot_options(q),
    )
    return out


def _dot_options(q: torch.Tensor) -> dict:
    """What the dot products take their operands as, and at what precision.

    On the GPU, bf16/fp16 operands go to the tensor cores as they are (products exact, fp32 accumulation)
    and fp32 operands use IEEE fp32 (Triton's default there is TF32, ~1e-3 relative error). Triton's
    interpreter multiplies bf16 operands as their raw uint16 bits (triton 3.9), so there they are widened
    to fp32 first: the same exact products and fp32 sums, in another order.
    """
    if q.dtype == torch.float32 or INTERPRETER:
        return dict(DOT_DTYPE=tl.float32, DOT_PRECISION="ieee")
    return dict(DOT_DTYPE=tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16, DOT_PRECISION="tf32")


# --- kernels ---------------------------------------------------------------------------------------------
# Offsets that scale with the cache are int64: one layer's cache can pass 2**31 elements.

@triton.jit
def _attend(q, q_pos, kv_ptr, k_base, table, kv_end, d, scale_log2, stride_kv, stride_kvb, stride_kvt,
            ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            TILE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax attention of q [ROWS, HEAD_DIM_PAD] over the keys at positions [0, kv_end) of one
    KV head (k_base) through a block table, row r seeing the positions up to q_pos[r] (causal); the
    [ROWS, HEAD_DIM_PAD] output. Every row must see position 0 (it is in the first tile)."""
    m = tl.full([ROWS], float("-inf"), tl.float32)  # running max of the scaled scores
    l = tl.zeros([ROWS], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    for start in range(0, kv_end, TILE):
        pos = start + tl.arange(0, TILE)  # [TILE] key positions
        valid = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offs = block * stride_kvb + (pos % BLOCK_SIZE) * stride_kvt  # [TILE]
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_base + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [TILE, HEAD_DIM_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [ROWS, TILE]
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every row sees position 0, in the first tile
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(k_base + stride_kv + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        p = p.to(kv_ptr.dtype.element_ty).to(DOT_DTYPE)  # rounded to the cache's dtype, as the torch path does
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m = m_new
    return acc / l[:, None]


@triton.jit
def _decode_kernel(
    q_ptr, kv_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    scale_log2,  # softmax scale * log2(e): exp2 below is exp of the scaled scores
    stride_qb, stride_qh,
    stride_kv, stride_kvh, stride_kvb, stride_kvt,  # of the cache: K/V, KV head, block, token
    stride_btb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16: the rows of the dots
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,  # context tokens per iteration
    DOT_DTYPE: tl.constexpr,  # the dots' operand dtype (see _dot_options)
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    ctx_len = tl.load(context_lens_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    heads = kv_head * GROUP + g  # [GROUP_PAD] query heads of this KV head
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(DOT_DTYPE)

    # One query position per row, the last: every key of the context.
    q_pos = tl.zeros([GROUP_PAD], tl.int64) + (ctx_len - 1)
    o = _attend(q, q_pos, kv_ptr, kv_ptr + kv_head * stride_kvh, block_tables_ptr + row * stride_btb, ctx_len, d,
                scale_log2, stride_kv, stride_kvb, stride_kvt, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE,
                DOT_DTYPE, DOT_PRECISION)
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["q_len", "ctx_len"])  # lengths change every call: one compiled variant
def _prefill_kernel(
    q_ptr, kv_ptr, blocks_ptr, out_ptr,
    q_len, ctx_len,
    scale_log2,  # softmax scale * log2(e)
    stride_qt, stride_qh,
    stride_kv, stride_kvh, stride_kvb, stride_kvt,  # of the cache: K/V, KV head, block, token
    stride_ot, stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # queries per program
    TILE: tl.constexpr,  # keys per iteration
    DOT_DTYPE: tl.constexpr,  # the dots' operand dtype (see _dot_options)
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the chunk
    q_pos = ctx_len - q_len + i  # absolute positions; rows past q_len see every key and are not stored
    d = tl.arange(0, HEAD_DIM_PAD)
    q_mask = (i[:, None] < q_len) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + i[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(DOT_DTYPE)

    # Causal: no query of this tile sees past its last row's position.
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + (tl.program_id(0) + 1) * BLOCK_M)
    o = _attend(q, q_pos, kv_ptr, kv_ptr + kv_head * stride_kvh, blocks_ptr, kv_end, d, scale_log2, stride_kv,
                stride_kvb, stride_kvt, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE, DOT_DTYPE, DOT_PRECISION)
    tl.store(out_ptr + i[:, None].to(tl.int64) * stride_ot + head * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=q_mask)
