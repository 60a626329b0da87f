"""Linear layers whose weights are stored as the model's dtype or as int8 (weight-only quantisation).

At decode a linear layer is a matrix-vector product: its cost is reading the weight once. On CPU, for up to
KERNEL_MAX_ROWS rows, ``forward`` runs ``torch.ops.pdserve.linear`` (pdserve/kernels/csrc/linear.cpp, built by pdserve.kernels.cpu_kernels),
which streams fp32, bf16 or int8 weights at close to the memory bandwidth; elsewhere, or when the kernel
is unavailable or forced off, it runs ``F.linear`` (dequantising int8 weights on the fly).

int8: symmetric, one fp32 scale per output channel (row of W): ``W ~= q * scale[:, None]`` with
``scale = max|W[row]| / 127`` and q in [-127, 127]. Activations stay in the model's dtype.

Environment: ``PDSERVE_CPU_KERNELS=torch`` forces F.linear on CPU (A/B runs); ``auto`` or unset uses the
kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_kernels

QUANTIZATIONS = ("int8",)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.scale: torch.Tensor | None
        self.register_buffer("scale", None)  # [out] fp32 for int8 weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in] -> [tokens, out]
        return linear(x, self.weight, self.scale, self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantized(self.weight, self.scale, dtype)

    @torch.no_grad()
    def quantize_int8(self) -> None:
        """Replace the weight by its int8 values and per-channel scales (in place, once)."""
        assert self.scale is None, "already quantised"
        q, scale = quantize_rows(self.weight)
        del self.weight
        self.register_buffer("weight", q)
        self.scale = scale

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={str(self.weight.dtype).removeprefix('torch.')}")


# The most rows of x for which the CPU kernel runs a weight of this dtype; above, F.linear (an int8 weight
# dequantized first). The kernel streams the weight once for up to 4 rows at a time, which wins at a decode
# step's few rows; a blocked GEMM wins over many. Measured by bench.engine.linear_rows on a 2-core AMD EPYC (AVX2):
# F.linear took 0.8-1.05x the kernel's time at 16 fp32 rows, 0.7x at 256; 0.9-1.1x at 3 bf16 rows (no bf16
# in AVX2: the kernel widens each weight), 0.16x at 256; int8 0.6-0.95x from 256 rows, 1.2-1.5x at 64.
KERNEL_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 2, torch.int8: 128}


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, in] @ weight [out, in].T (+ bias): the CPU kernel where it applies and pays (KERNEL_MAX_ROWS),
    else F.linear; an int8 weight with its per-row scale (a dense layer's, or one expert's)."""
    if x.dim() == 2 and x.shape[0] <= KERNEL_MAX_ROWS.get(weight.dtype, 0) and cpu_kernels.applies(x):
        return torch.ops.pdserve.linear(x, weight, scale, bias)
    return F.linear(x, dequantized(weight, scale, x.dtype), bias)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and fp32 scales of a weight [..., rows, in], one symmetric scale per row (its last dim):
    w ~= q * scale[..., None], scale = max|row| / 127. A dense layer's weight, a stack of experts' weights, and
    a weight update's staged rows (pdserve.weights.update) all quantize here, so they agree bit for bit."""
    w = w.detach().to(torch.float32)
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / 127.0  # [..., rows]
    return torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8), scale


def dequantized(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return weight
    return (weight.to(torch.float32) * scale[:, None]).to(dtype)


def quantize(model: nn.Module, method: str) -> None:
    """Quantise every pdserve Linear of the model, and every mixture-of-experts block's experts
    (pdserve.model.moe.Experts), in place: each module with a quantize_int8 (the embedding table and the
    experts' router stay as they are)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {method!r}; expected one of {list(QUANTIZATIONS)}")
    for module in model.modules():
        if callable(getattr(module, "quantize_int8", None)):
            module.quantize_int8()
