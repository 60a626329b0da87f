"""The kernels the model calls where they pay, each with a torch reference elsewhere in the model.

cpu_kernels.py       builds and loads the C++ extension (csrc/*.cpp) once per machine: paged decode
                     attention, int8/fp linear, fused layer ops, as torch.ops.pdserve.*
cpu_attention.py     decode attention over the paged KV cache on CPU (the extension's kernel)
triton_attention.py  decode and prefill attention over the paged KV cache on the GPU (Triton; runs in
                     Triton's interpreter on CPU tensors for the tests)
triton_moe.py        a mixture-of-experts block's experts on the GPU, grouped by expert on the device
                     (Triton)
triton_layer_ops.py  the decoder layer's small ops on the GPU, one launch each: add + RMSNorm, RoPE + KV-cache
                     write, SiLU-and-multiply (Triton)

Imports only pdserve.derived (where the built extension is kept): kernels know tensors, not models.
"""
from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)


@functools.cache
def triton_kernels(name: str, instead: str) -> ModuleType | None:
    """pdserve.kernels.<name> (a Triton module), imported at its first CUDA call; None, logged once, where triton
    does not import (`instead` says what runs then)."""
    try:
        return importlib.import_module(f"pdserve.kernels.{name}")
    except ImportError as e:
        log.warning("triton does not import (%s): %s", e, instead)
        return None
