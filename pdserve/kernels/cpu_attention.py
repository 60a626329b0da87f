"""Decode attention over the paged KV cache on CPU: a C++ kernel that reads each K/V block in place, once.

The torch path in pdserve.model.attention gathers every decode row's blocks into a padded dense tensor and runs
two matmuls over it (about three passes over the KV bytes, padding included). The kernel in
csrc/paged_decode_attention.cpp walks each row's block table instead, one (row, kv head) task per
thread-pool slot (torch's intra-op pool, so ``torch.set_num_threads`` governs it), computing the
query heads of a GQA group together. fp32 or bf16 (K and V read as stored, the arithmetic in fp32), contiguous cache only; pdserve.model.attention uses the torch
path for everything else.

Build: with the other CPU kernels, by pdserve.kernels.cpu_kernels (cached per machine; torch path if it fails).

Environment:
    PDSERVE_CPU_ATTENTION=torch   always use the torch path (A/B runs, debugging). Read at every call.
                                  (PDSERVE_CPU_KERNELS=torch does it for every CPU kernel.)
    PDSERVE_CPU_ATTENTION=auto    (or unset) use the kernel when the inputs allow it and it builds.
"""
from __future__ import annotations

import torch

from pdserve.kernels import cpu_kernels

ENV_VAR = "PDSERVE_CPU_ATTENTION"
DTYPES = (torch.float32, torch.bfloat16)  # of q, the cache and the output


def available() -> bool:
    """Whether the kernel is built and loaded (building it now if this process has not tried yet)."""
    return cpu_kernels.available()


def enabled() -> bool:
    """False when PDSERVE_CPU_ATTENTION (or PDSERVE_CPU_KERNELS) forces the torch path."""
    return cpu_kernels.enabled(ENV_VAR) and cpu_kernels.enabled()


def supports(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> bool:
    """Whether these decode inputs take the kernel: CPU, fp32 or bf16, contiguous cache, int64 metadata, not
    forced off by the environment, and the kernel builds."""
    # Runs once per decode group and layer: cheap properties first (device.type costs ~0.7 us).
    return (q.dtype in DTYPES and kv_layer.dtype == q.dtype
            and block_tables.dtype == torch.int64 and context_lens.dtype == torch.int64
            and q.is_cpu and kv_layer.is_cpu and block_tables.is_cpu and context_lens.is_cpu
            and kv_layer.is_contiguous()
            and enabled() and available())


def paged_decode_attention(
    q: torch.Tensor,  # [batch, heads, head_dim] fp32 or bf16
    kv_layer: torch.Tensor,  # [2, kv_heads, num_blocks, block_size, head_dim] of q's dtype, contiguous
    block_tables: torch.Tensor,  # [batch, max_blocks] int64; entries past a row's context are ignored
    context_lens: torch.Tensor,  # [batch] int64, >= 1
    scale: float,
    out: torch.Tensor | None = None,  # [batch, heads, head_dim] of q's dtype, contiguous, written in place
) -> torch.Tensor:
    """One query token per row attending to its paged context. Raises if the kernel is unavailable
    (callers check supports() first)."""
    if not cpu_kernels.available():
        raise RuntimeError("the CPU paged attention kernel is not available")
    op = torch.ops.pdserve.paged_decode_attention_out
    args = (q.contiguous(), kv_layer, block_tables.contiguous(), context_lens.contiguous(), scale)
    if out is not None and out.is_contiguous():
        return op(*args, out)
    result = op(*args, torch.empty(q.shape, dtype=q.dtype))
    return result if out is None else out.copy_(result)
