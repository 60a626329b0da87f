"""The GPUs the roofline knows, the efficiency factors it assumes, and the models it can be asked about.

Peaks are the vendors' datasheet figures: dense (no sparsity) 16-bit tensor-core FLOP/s, HBM or GDDR
bandwidth, memory, and the link between two GPUs of one node (NVLink per direction where the part has
it, PCIe Gen4 x16 per direction otherwise), which a KV hand-off and a tensor-parallel all-reduce cross.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import ModelConfig
from pdserve.perf.costs import RooflineCosts, Transport
from pdserve.perf.shapes import ROOFLINE_ONLY_SHAPES


@dataclass(frozen=True)
class Gpu:
    name: str
    flops: float  # dense bf16/fp16 tensor-core FLOP/s
    bytes_per_s: float  # memory bandwidth
    memory_bytes: int
    link_bytes_per_s: float  # GPU-to-GPU, one direction


# Datasheet peaks, never measured here. The GPU-to-GPU link, per GPU and per direction (datasheets give
# both directions together):
# - H100 SXM5: NVLink 4, 900 GB/s (NVIDIA H100 Tensor Core GPU datasheet) -> 450 GB/s per direction
# - H200 SXM: NVLink 4, 900 GB/s (NVIDIA H200 Tensor Core GPU datasheet) -> 450 GB/s
# - A100 SXM4: NVLink 3, 600 GB/s (NVIDIA A100 Tensor Core GPU datasheet) -> 300 GB/s
# - L40S, L4: no NVLink; PCIe Gen4 x16, 64 GB/s both directions (NVIDIA L40S and L4 datasheets) -> 32 GB/s
# A ring all-reduce's bus bandwidth is at most this per-direction figure.
GB = 10**9
GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("H100", 989e12, 3.35e12, 80 * GB, 450 * GB),  # SXM5; NVLink 4: 900 GB/s both directions
    Gpu("H200", 989e12, 4.8e12, 141 * GB, 450 * GB),  # SXM; same compute as H100, HBM3e
    Gpu("A100", 312e12, 2.039e12, 80 * GB, 300 * GB),  # SXM4 80GB; NVLink 3: 600 GB/s both directions
    Gpu("L40S", 362e12, 864 * GB, 48 * GB, 32 * GB),  # PCIe Gen4 x16
    Gpu("L4", 121e12, 300 * GB, 24 * GB, 32 * GB),  # PCIe Gen4 x16
)}

# Efficiency factors of the roofline (each <= 1, so no prediction beats the datasheet):
# - PREFILL_MFU: share of peak FLOP/s a long prefill's matmuls and attention reach. Serving engines
#   with FlashAttention-class kernels report 50-65 % on H100 for prompts of thousands of tokens;
#   0.6 is the middle (and the GPU issue's target is >= 50 %).
# - DECODE_MBU: share of peak bandwidth a decode step's weight and KV reads reach; well-tuned engines
#   reach 80-90 % at batch >= 8 (the GPU issue's target is 87 % at batch 64).
# - STEP_OVERHEAD_S: host time per step that the device cannot hide (scheduling, sampling, launches
#   outside a CUDA graph); a few ms is typical of Python engines with graphs.
# - LINK_EFFICIENCY and LINK_LATENCY_S: what a KV transfer over the link achieves of its peak, and
#   its start-up cost.
# - MEMORY_UTILIZATION: share of the GPU's memory the worker takes (weights + KV cache), as vLLM's
#   gpu_memory_utilization default.
PREFILL_MFU = 0.6
DECODE_MBU = 0.8
STEP_OVERHEAD_S = 0.002
LINK_EFFICIENCY = 0.7
LINK_LATENCY_S = 50e-6
MEMORY_UTILIZATION = 0.9
# - ALLREDUCE_LATENCY_S: start-up cost of one all-reduce between tensor-parallel ranks (kernel launch and
#   synchronisation); assumed, of the order of a small NCCL all-reduce within an NVLink node. Its bus
#   bandwidth is the link's peak times LINK_EFFICIENCY.
ALLREDUCE_LATENCY_S = 10e-6


def gpu(name: str) -> Gpu:
    for key, g in GPUS.items():
        if key.lower() == name.strip().lower():
            return g
    raise ValueError(f"unknown GPU {name!r}; the roofline knows {', '.join(GPUS)} (or give --profile FILE)")


def roofline(model: ModelConfig, device: Gpu, dtype_bytes: int = 2, tp: int = 1, ep: int = 1) -> RooflineCosts:
    """The step and hand-off costs of `model` on `device`, from its datasheet peaks; with tp > 1, of a
    worker of tp such GPUs (every figure one rank's), a mixture of experts' experts sliced over them (ep 1)
    or split whole (ep = tp). The roofline takes one efficiency for both phases' work: whichever bound
    (compute or memory) dominates a step is derated by its own factor. All-to-alls cross the same link as
    all-reduces, at the same latency per call."""
    link = device.link_bytes_per_s * LINK_EFFICIENCY
    return RooflineCosts(model, dtype_bytes, device.flops, device.bytes_per_s, PREFILL_MFU, DECODE_MBU,
                         STEP_OVERHEAD_S, Transport(LINK_LATENCY_S, link), tp, Transport(ALLREDUCE_LATENCY_S, link),
                         ep)


def kv_budget_bytes(device: Gpu, weight_bytes: int) -> int:
    """KV cache one worker (one rank of a tensor-parallel worker) of this GPU can hold next to its weights."""
    budget = int(device.memory_bytes * MEMORY_UTILIZATION) - weight_bytes
    if budget <= 0:
        raise ValueError(f"the weights ({weight_bytes / GB:.1f} GB) do not fit in a {device.name} "
                         f"({device.memory_bytes / GB:.0f} GB at {MEMORY_UTILIZATION:.0%}): split them over "
                         "GPUs with --tensor-parallel-sizes")
    return budget


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def resolve_model(name_or_path: str) -> tuple[str, ModelConfig]:
    """(name, shape) from a preset name (pdserve.model.loader.DUMMY_PRESETS: smollm2-135m, llama-3-8b,
    llama-3-70b, qwen3-30b-a3b; or a shape only the roofline knows, pdserve.perf.shapes: deepseek-v3-shape;
    dashes and case do not matter), a config.json, a Hugging Face directory or a .gguf."""
    from pdserve.config import EngineConfig
    from pdserve.model.loader import DUMMY_PRESETS, load_info

    for preset, cfg in DUMMY_PRESETS.items():
        if _key(preset) == _key(name_or_path):
            return preset, ModelConfig.from_hf(dict(cfg))
    for name, shape in ROOFLINE_ONLY_SHAPES.items():
        if _key(name) == _key(name_or_path):
            return name, shape
    path = Path(name_or_path)
    if path.is_file() and path.suffix == ".json":
        return path.stem, ModelConfig.from_hf(json.loads(path.read_text()))
    if not path.exists():
        raise ValueError(f"unknown model {name_or_path!r}: give a preset ({', '.join(DUMMY_PRESETS)}; for the "
                         f"roofline only, {', '.join(ROOFLINE_ONLY_SHAPES)}), a config.json, a Hugging Face directory "
                         "or a .gguf file")
    return path.name, load_info(EngineConfig(model=str(path))).config
