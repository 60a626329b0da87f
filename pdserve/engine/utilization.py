"""How well a worker uses its hardware: model FLOPs and bytes moved per step, and the device's peaks.

Prefill is compute-bound: its figure of merit is MFU, achieved FLOP/s over the device's peak.
Decode is memory-bound: its figure of merit is MBU, bytes of weights and KV read per second over the
device's peak bandwidth. Both counts are analytic (from the model's shape and the step's chunks), the
convention of the PaLM MFU definition: matmul FLOPs of the forward pass, 2 per multiply-add, attention
included, embedding lookup and element-wise ops excluded.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.config import ModelConfig
from pdserve.derived import cache_root

# Dense (no sparsity) 16-bit tensor-core peak FLOP/s and memory bandwidth in bytes/s, from the vendors'
# datasheets; matched by substring of torch.cuda.get_device_name().
DEVICE_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 4.8e12),
    "H100 NVL": (835e12, 3.9e12),
    "H100 PCIe": (756e12, 2.0e12),
    "H100": (989e12, 3.35e12),  # SXM
    "A100-SXM4-80GB": (312e12, 2.039e12),
    "A100-SXM4-40GB": (312e12, 1.555e12),
    "A100-PCIE-80GB": (312e12, 1.935e12),
    "A100": (312e12, 1.555e12),
    "L40S": (362e12, 864e9),
    "L4": (121e12, 300e9),
    "A10G": (125e12, 600e9),
}


@dataclass(frozen=True)
class DevicePeaks:
    flops_per_second: float
    bytes_per_second: float
    source: str  # "table", "configured" or "measured"


def linear_flops_per_token(cfg: ModelConfig) -> int:
    """Matmul FLOPs of one token through the decoder layers (q/k/v/o and the MLP, or the router and the
    token's experts in a mixture-of-experts layer), without the lm_head."""
    h = cfg.hidden_size
    attention = 2 * h * (cfg.q_size + 2 * cfg.kv_size) + 2 * cfg.q_size * h
    return sum(attention + 2 * cfg.mlp_params(i, active=True) for i in range(cfg.num_layers))


def attention_flops(cfg: ModelConfig, context_len: int) -> int:
    """QK^T and PV of one query token attending to context_len tokens, over all layers and heads."""
    return cfg.num_layers * 2 * 2 * cfg.q_size * context_len


def lm_head_flops(cfg: ModelConfig) -> int:
    return 2 * cfg.hidden_size * cfg.vocab_size


def step_flops(cfg: ModelConfig, chunks: Sequence[tuple[int, int]], sampled_rows: int) -> int:
    """FLOPs of one step. chunks: (start, num_tokens) of each sequence's new tokens; the lm_head runs
    only on the sampled rows."""
    total, per_token = 0, linear_flops_per_token(cfg)  # a sum over the layers: once a step, not once a chunk
    for start, n in chunks:
        total += n * per_token
        # Token i of the chunk attends to start + i + 1 tokens: sum over the chunk in closed form.
        total += attention_flops(cfg, 1) * (n * start + n * (n + 1) // 2)
    return total + sampled_rows * lm_head_flops(cfg)


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of the matmul weights a step reads once, whatever its batch: layers and lm_head (a mixture of
    experts: one token's experts only, the least a step reads; a batch reads every expert it touches)."""
    return (linear_flops_per_token(cfg) // 2 + cfg.hidden_size * cfg.vocab_size) * dtype_bytes


def step_bytes(cfg: ModelConfig, chunks: Sequence[tuple[int, int]], dtype_bytes: int,
               weight_dtype_bytes: int | None = None) -> int:
    """Bytes a step reads from memory: every weight once, and for each sequence the K and V of its
    whole context (what attention reads; new tokens' K/V included). Weights are stored with
    weight_dtype_bytes per value (1 for int8) when given, else as the KV cache's dtype_bytes."""
    kv_per_token = 2 * cfg.num_layers * cfg.kv_size * dtype_bytes
    context = sum(start + n for start, n in chunks)
    return weight_bytes(cfg, weight_dtype_bytes or dtype_bytes) + context * kv_per_token


def device_peaks(device: torch.device, flops: float | None = None, bandwidth: float | None = None) -> DevicePeaks:
    """Configured values win; then the table for known GPUs; otherwise a short measurement here."""
    if flops and bandwidth:
        return DevicePeaks(flops, bandwidth, "configured")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (f, b) in DEVICE_PEAKS.items():
            if key in name:
                return DevicePeaks(flops or f, bandwidth or b, "table")
    mf, mb = measured_peaks(device)
    return DevicePeaks(flops or mf, bandwidth or mb, "measured")


def measured_peaks(device: torch.device) -> tuple[float, float]:
    """measure_peaks once per machine, device and thread count, kept in the derived cache (pdserve.derived):
    every worker on a host would otherwise spend ~0.6 s of its start measuring the same two numbers again, and
    each worker's would differ by the noise of its moment. A later figure of the same key is the first one's."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    key = hashlib.sha256(f"{device.type}\0{name}\0{os.cpu_count()}\0{torch.get_num_threads()}\0"
                         f"{torch.__version__}\0{platform.machine()}".encode()).hexdigest()[:32]
    path = cache_root() / "peaks" / f"{key}.json"
    try:
        kept = json.loads(path.read_text())
        return float(kept["flops_per_second"]), float(kept["bytes_per_second"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    flops, bandwidth = measure_peaks(device)
    try:  # written whole and renamed: a worker starting beside this one reads all of it or none
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"device": name, "threads": torch.get_num_threads(), "flops_per_second": flops,
                                   "bytes_per_second": bandwidth}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: measured again at the next start
    return flops, bandwidth


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return platform.processor() or "cpu"


def synced_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of fn, the device's queued work finished before and after it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def measure_peaks(device: torch.device, seconds: float = 0.3) -> tuple[float, float]:
    """Best observed fp32 matmul FLOP/s and copy bandwidth (read + write) on this device, in ~2*seconds."""
    a = torch.randn(1024, 1024, device=device)
    b = torch.randn(1024, 1024, device=device)
    src = torch.empty(16 << 20, device=device)  # 64 MiB
    dst = torch.empty_like(src)
    best_f = best_b = 0.0
    for fn, work, kind in ((lambda: torch.mm(a, b), 2 * 1024**3, "f"), (lambda: dst.copy_(src), 2 * src.nbytes, "b")):
        fn()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            rate = work / synced_seconds(fn, device)
            if kind == "f":
                best_f = max(best_f, rate)
            else:
                best_b = max(best_b, rate)
    return best_f, best_b
