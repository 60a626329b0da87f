"""Decode attention over the paged KV cache on CPU: a C++ kernel that reads each K/V block in place, once.

The torch path in pdserve.attention gathers every decode row's blocks into a padded dense tensor and runs
two matmuls over it (about three passes over the KV bytes, padding included). The kernel in
csrc/paged_decode_attention.cpp walks each row's block table instead, one (row, kv head) task per
thread-pool slot (torch's intra-op pool, so ``torch.set_num_threads`` governs it), computing the
query heads of a GQA group together. fp32, contiguous cache only; pdserve.attention uses the torch
path for everything else.

Build: compiled on first use with torch.utils.cpp_extension (needs a C++ compiler and ninja) into
``$TORCH_EXTENSIONS_DIR`` when set, else ``pdserve.cache.cache_root() / "torch_extensions"``
(``$PDSERVE_CACHE_DIR``, default ~/.cache/pdserve), in a directory named after the Python and torch
versions, so processes and runs share one build and rebuild only when the source or flags change.
The first build takes tens of seconds; later processes only load the library. Flags: ``-O3`` and
OpenMP (to use torch's thread pool); the hot function is multiversioned in the source (AVX2+FMA and
baseline x86-64, picked at load time), so the build is portable without ``-march=native``. If the
build fails, one warning is logged and the process uses the torch path from then on.

Environment:
    PDSERVE_CPU_ATTENTION=torch   always use the torch path (A/B runs, debugging). Read at every call.
    PDSERVE_CPU_ATTENTION=auto    (or unset) use the kernel when the inputs allow it and it builds.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_CPU_ATTENTION"
_NAME = "pdserve_paged_decode_attention"
_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode_attention.cpp"

_lock = threading.Lock()
_op = None  # the loaded torch op, once built
_failed = False  # the build failed in this process: never try again
_warned_values: set[str] = set()


def build_directory() -> Path:
    """Where the extension is built and cached (created on demand)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        base = Path(root)
    else:
        from pdserve.cache import cache_root

        base = cache_root() / "torch_extensions"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}".replace("+", "_")
    return base / tag / _NAME


def _build():
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r}, or $CXX) on PATH")
    if shutil.which("ninja") is None:
        # The `ninja` wheel puts its binary next to the interpreter, which is not on PATH unless the
        # virtual environment is activated; torch looks for it on PATH.
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    openmp = []
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        # at::parallel_for is inline over `#pragma omp parallel`: without -fopenmp it runs serially. The
        # library links libgomp.so.1, which resolves to the copy torch has already loaded (same soname).
        openmp = ["-fopenmp"]
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=["-O3", *openmp],
                       extra_ldflags=openmp,
                       build_directory=str(directory), is_python_module=False, verbose=False)
    return torch.ops.pdserve.paged_decode_attention_out


def _load():
    global _op, _failed
    if _op is None and not _failed:
        with _lock:
            if _op is None and not _failed:
                try:
                    _op = _build()
                except Exception as e:  # noqa: BLE001 - any build or load failure means: use torch
                    _failed = True
                    log.warning("CPU paged attention kernel unavailable, using the torch path: %s", e)
    return _op


def available() -> bool:
    """Whether the kernel is built and loaded (building it now if this process has not tried yet)."""
    return _load() is not None


def enabled() -> bool:
    """False when PDSERVE_CPU_ATTENTION forces the torch path."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower()
    if value in ("", "auto"):
        return True
    if value == "torch":
        return False
    if value not in _warned_values:
        _warned_values.add(value)
        log.warning("%s=%r not understood (expected 'auto' or 'torch'); using 'auto'", ENV_VAR, value)
    return True


def supports(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> bool:
    """Whether these decode inputs take the kernel: CPU, fp32, contiguous cache, int64 metadata, not
    forced off by the environment, and the kernel builds."""
    # Runs once per decode group and layer: cheap properties first (device.type costs ~0.7 us).
    return (q.dtype == torch.float32 and kv_layer.dtype == torch.float32
            and block_tables.dtype == torch.int64 and context_lens.dtype == torch.int64
            and q.is_cpu and kv_layer.is_cpu and block_tables.is_cpu and context_lens.is_cpu
            and kv_layer.is_contiguous()
            and enabled() and available())


def paged_decode_attention(
    q: torch.Tensor,  # [batch, heads, head_dim] fp32
    kv_layer: torch.Tensor,  # [2, kv_heads, num_blocks, block_size, head_dim] fp32, contiguous
    block_tables: torch.Tensor,  # [batch, max_blocks] int64; entries past a row's context are ignored
    context_lens: torch.Tensor,  # [batch] int64, >= 1
    scale: float,
    out: torch.Tensor | None = None,  # [batch, heads, head_dim] fp32 contiguous, written in place
) -> torch.Tensor:
    """One query token per row attending to its paged context. Raises if the kernel is unavailable
    (callers check supports() first)."""
    op = _load()
    if op is None:
        raise RuntimeError("the CPU paged attention kernel is not available")
    args = (q.contiguous(), kv_layer, block_tables.contiguous(), context_lens.contiguous(), scale)
    if out is not None and out.is_contiguous():
        return op(*args, out)
    result = op(*args, torch.empty(q.shape, dtype=q.dtype))
    return result if out is None else out.copy_(result)
