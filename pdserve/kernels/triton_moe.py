"""The mixture-of-experts block's experts on the GPU: a fused Triton kernel pair over all experts at once.

Same result as pdserve.model.moe.MoE.forward after routing: each token's k chosen experts run their gated
MLP on it, and the outputs, scaled by the routing weights, are summed into the token's row. That forward
groups the tokens by expert with a Python loop over the experts' counts, read on the host; here the
grouping stays on the device and two launches cover every expert:

- Slots: slot j = t * k + i is token t's i-th choice (expert ids[t, i], weight weights[t, i]).
  `align_by_expert` sorts the T * k slots by expert and pads each expert's run to a multiple of BLOCK_M
  rows, so every block of BLOCK_M rows belongs to one expert. It is torch ops only, with nothing read
  back to the host: the number of blocks depends on the routing, so the launch grid is its upper bound
  (every expert touched padding at most BLOCK_M - 1 rows) and the blocks past the used ones carry expert
  -1, their programs returning at once.
- Kernel 1 (`_gate_up_kernel`), one program per (block, BLOCK_N columns of the intermediate): gathers the
  block's token rows of x, multiplies them by the expert's gate rows and up rows (two fp32 accumulators,
  one pass over H), and writes silu(gate) * up, rounded to x's dtype as the torch path rounds its
  intermediate, into row `slot` of h [T * k, I].
- Kernel 2 (`_down_kernel`), one program per (block, BLOCK_N columns of the output): h's rows of the block
  times the expert's down_proj, scaled by each slot's routing weight, written in fp32 to row `slot` of
  per_slot [T * k, H].
- The k slots of a token are then summed in torch (per_slot viewed [T, k, H], summed over k, a fixed
  order: no atomics, the same bits on every run) and rounded once to x's dtype.

A padding row reads and writes nothing (its loads and stores are masked); an expert no token chose
launches no work beyond an idle program per unused block, and its weights are never read. Weights are
read once per block that uses them: BLOCK_M large enough to hold an expert's tokens reads each expert
once per BLOCK_N column tile.

Numerics: fp32 accumulation everywhere; fp32 inputs use IEEE fp32 dot products (no TF32), bf16/fp16 go to
the dot products as they are (on the interpreter widened to fp32 first, see
pdserve.kernels.triton_attention._dot_options). Under the interpreter fp32 results match fp64 arithmetic
within ~2e-7 of the largest output (the tests hold them to 1e-5, and to the torch block itself); bf16 ones
match fp64 arithmetic on the same values within the roundings of h and of the output
(tests/kernels/test_triton_moe.py gives the bound).

Status: the tests run these kernels under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
tests/conftest.py on machines without CUDA); compiled on an H200 (2026-11-27) they matched the torch
reference in every test, a model-sized block included. Their speed, the block sizes' defaults included, is
unmeasured. Whether CUDA graphs can capture
`align_by_expert` (stable sort, scatter, searchsorted) is unverified. pdserve.model.moe calls them for a CUDA
tensor (not under expert parallelism, whose ranks group their own tokens).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_attention import DTYPES, INTERPRETER, _dot_options

_MIN_DOT = 16  # tl.dot's smallest M, N and K on NVIDIA GPUs


def supports(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether these inputs take the kernels: fp32, bf16 or fp16 activations and expert weights of one dtype
    on one device, a CUDA device (or any device under the interpreter)."""
    return (x.dtype in DTYPES and gate_up.dtype == x.dtype and down.dtype == x.dtype
            and gate_up.device == x.device and down.device == x.device and (x.is_cuda or INTERPRETER))


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The T * k slots of ids [T, k] sorted by expert into blocks of block_m rows, one expert per block.

    Returns, all on ids' device:
    - slots [max_blocks * block_m] int32: the slot (t * k + i) each row holds; T * k on padding rows. An
      expert's slots are in ascending order, its rows start at its first block, experts in id order.
    - block_expert [max_blocks] int32: each block's expert; -1 for the blocks past the used ones.
    - used [] int64: the number of blocks used (sum over experts of ceil(count / block_m)).
    max_blocks = (T * k + min(E, T * k) * (block_m - 1)) // block_m bounds the blocks any routing can use,
    so the shapes depend on T, k, E and block_m only and nothing is read back to the host.
    """
    flat = ids.reshape(-1).long()
    n = flat.numel()
    max_blocks = (n + min(num_experts, n) * (block_m - 1)) // block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would read the largest id on the host
    blocks = (counts + block_m - 1) // block_m  # [E] blocks of each expert
    block_end = torch.cumsum(blocks, 0)  # [E] one past each expert's last block
    first_row = (block_end - blocks) * block_m  # [E] each expert's first row
    first_sorted = torch.cumsum(counts, 0) - counts  # [E] each expert's first position in sorted order
    order = torch.argsort(flat, stable=True)  # [n] the slots by expert
    expert = flat[order]
    rows = first_row[expert] + torch.arange(n, device=flat.device) - first_sorted[expert]
    slots = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=flat.device)
    slots.scatter_(0, rows, order.int())
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=flat.device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).int()  # E: past the used blocks
    return slots, block_expert, block_end[-1]


def fused_moe(
    x: torch.Tensor,  # [T, H] fp32, bf16 or fp16
    gate_up: torch.Tensor,  # [E, 2 * I, H] of x's dtype: gate rows first, then up rows
    down: torch.Tensor,  # [E, H, I] of x's dtype
    weights: torch.Tensor,  # [T, k] routing weights, any float dtype (read as fp32)
    ids: torch.Tensor,  # [T, k] expert ids in [0, E), int64 or int32
    *,
    block_m: int | None = None,  # rows (slots) per block; None: see _block_m
    block_n: int = 64,  # output columns per program (of I in kernel 1, of H in kernel 2)
    block_k: int = 32,  # reduction step (over H in kernel 1, over I in kernel 2)
) -> torch.Tensor:  # [T, H] of x's dtype
    """sum over i < k of weights[t, i] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = ids[t, i]:
    the experts of pdserve.model.moe.MoE.forward, given its route(x). Any strides; block sizes are powers
    of two >= 16 (tl.dot's smallest)."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    assert gate_up.shape == (num_experts, 2 * inter, hidden), "gate_up must be [E, 2 * I, H]"
    assert down.shape == (num_experts, hidden, inter), "down must be [E, H, I]"
    assert ids.shape == weights.shape == (tokens, top_k), "ids and weights must be [T, k]"
    assert supports(x, gate_up, down), "x, gate_up and down: one dtype of DTYPES, one CUDA device (or interpreter)"
    if tokens == 0:
        return torch.zeros_like(x)
    block_m = block_m or _block_m(tokens * top_k, num_experts)
    for b in (block_m, block_n, block_k):
        assert b >= _MIN_DOT and b & (b - 1) == 0, "block sizes must be powers of two >= 16"

    num_slots = tokens * top_k
    slots, block_expert, _ = align_by_expert(ids.to(x.device), num_experts, block_m)
    max_blocks = block_expert.shape[0]
    flat_weights = weights.reshape(-1).to(device=x.device, dtype=torch.float32)
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    per_slot = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **_dot_options(x))

    _gate_up_kernel[(max_blocks, triton.cdiv(inter, block_n))](
        x, gate_up, slots, block_expert, h, num_slots, hidden, inter,
        *x.stride(), *gate_up.stride(), *h.stride(), TOP_K=top_k, **meta)
    _down_kernel[(max_blocks, triton.cdiv(hidden, block_n))](
        h, down, slots, block_expert, flat_weights, per_slot, num_slots, hidden, inter,
        *h.stride(), *down.stride(), *per_slot.stride(), **meta)
    return per_slot.view(tokens, top_k, hidden).sum(1).to(x.dtype)


def _block_m(num_slots: int, num_experts: int) -> int:
    """Rows per block: the mean slots per expert rounded up to a power of two, within [16, 64]. A decode
    step's few slots per expert waste little padding; a prefill's many read each expert's weights once per
    64 rows. A guess: never timed."""
    return min(64, max(_MIN_DOT, triton.next_power_of_2(-(-num_slots // num_experts))))


# --- kernels ---------------------------------------------------------------------------------------------
# Offsets into the expert weights are int64: E * 2I * H passes 2**31 elements in large models.

@triton.jit(do_not_specialize=["num_slots"])  # changes every step: one compiled variant
def _gate_up_kernel(
    x_ptr, w_ptr, slots_ptr, block_expert_ptr, h_ptr,
    num_slots, H, I,
    stride_xt, stride_xh,
    stride_we, stride_wn, stride_wk,  # of gate_up: expert, output row (gate then up), hidden
    stride_hs, stride_hi,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # the dots' operand dtype (see triton_attention._dot_options)
    DOT_PRECISION: tl.constexpr,
):
    """h[slot, n] = silu(gate[e, n] . x[token]) * (up[e, n] . x[token]) for the block's slots and BLOCK_N
    columns n of the intermediate."""
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block).to(tl.int64)
    if e < 0:  # past the blocks the routing used
        return
    slot = tl.load(slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = slot < num_slots  # false on padding rows
    token = (slot // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] intermediate columns
    n_ok = n < I
    x_rows = x_ptr + token[:, None] * stride_xt
    w_gate = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N] gate rows of the expert
    w_up = w_gate + I * stride_wn  # the up rows follow the I gate rows

    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < H
        a = tl.load(x_rows + kk[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_gate + kk[:, None] * stride_wk, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]: gate^T
        wu = tl.load(w_up + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
        a = a.to(DOT_DTYPE)
        gate = tl.dot(a, wg.to(DOT_DTYPE), gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, wu.to(DOT_DTYPE), up, input_precision=DOT_PRECISION)
    out = gate * tl.sigmoid(gate) * up  # silu(gate) * up, in fp32
    tl.store(h_ptr + slot[:, None].to(tl.int64) * stride_hs + n[None, :] * stride_hi,
             out.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    h_ptr, w_ptr, slots_ptr, block_expert_ptr, weights_ptr, out_ptr,
    num_slots, H, I,
    stride_hs, stride_hi,
    stride_we, stride_wn, stride_wk,  # of down: expert, output column (hidden), intermediate
    stride_os, stride_oh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[slot, n] = weights[slot] * (down[e, n] . h[slot]) in fp32 for the block's slots and BLOCK_N
    columns n of the hidden size."""
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block).to(tl.int64)
    if e < 0:
        return
    slot = tl.load(slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = slot < num_slots
    slot = slot.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden columns
    n_ok = n < H
    h_rows = h_ptr + slot[:, None] * stride_hs
    w_cols = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < I
        a = tl.load(h_rows + kk[None, :] * stride_hi, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # down^T
        acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    weight = tl.load(weights_ptr + slot, mask=row_ok, other=0.0)  # [BLOCK_M] fp32
    tl.store(out_ptr + slot[:, None] * stride_os + n[None, :] * stride_oh, acc * weight[:, None],
             mask=row_ok[:, None] & n_ok[None, :])
