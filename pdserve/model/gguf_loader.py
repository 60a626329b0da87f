"""Read a GGUF checkpoint (llama.cpp's format) into Hugging Face names, shapes and config fields.

Only the dense decoder families the model implements are accepted: `llama` (which also covers
Mistral: llama.cpp writes it as arch `llama`), `qwen2` and `qwen3`. Weights come out one at a time,
dequantized to float32, so peak memory is one tensor on top of the memory-mapped file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# GGUF arch -> (HF architectures entry, HF model_type)
_HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# blk.{i}.<gguf name> -> model.layers.{i}.<hf name>; the .weight/.bias suffix carries over.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half row order -> the interleaved order llama.cpp's converter writes for arch llama.

    Within each head, HF rotates row j with row j + head_dim/2; llama.cpp's RoPE rotates adjacent
    rows (2j, 2j+1), so the converter interleaves the two halves. Works for weights and biases.
    """
    rest, half = _head_split(w, n_head)
    # [n_head, 2, head_dim//2, *rest] -> [n_head, head_dim//2, 2, *rest]
    return w.reshape(n_head, 2, half, *rest).transpose(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Exact inverse of permute_qk: llama.cpp interleaved rows -> HF rotate-half rows."""
    rest, half = _head_split(w, n_head)
    # [n_head, head_dim//2, 2, *rest] -> [n_head, 2, head_dim//2, *rest]
    return w.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(w.shape)


def _head_split(w: torch.Tensor, n_head: int) -> tuple[tuple[int, ...], int]:
    rows = w.shape[0]
    if n_head <= 0 or rows % (2 * n_head) != 0:
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of even size")
    return tuple(w.shape[1:]), rows // n_head // 2


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file's config (Hugging Face config.json fields) and lazily dequantized weights."""

    path: Path
    config: dict[str, Any]
    # (hf_name, tensor) pairs in file order; tensor data stays memory-mapped until weights() runs.
    _tensors: tuple[tuple[str, ReaderTensor], ...] = field(repr=False)

    @property
    def architecture(self) -> str:
        return self.config["model_type"]

    def tensor_names(self) -> list[str]:
        """Hugging Face parameter names present in the file, without reading any tensor data."""
        return [name for name, _ in self._tensors]

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, float32 tensor in torch [out, in] layout), dequantizing one at a time."""
        unpermute = self.architecture == "llama"
        heads = {
            "q_proj": self.config["num_attention_heads"],
            "k_proj": self.config["num_key_value_heads"],
        }
        for name, tensor in self._tensors:
            w = _to_torch(tensor)
            proj = name.split(".")[-2]
            if unpermute and proj in heads:
                w = unpermute_qk(w, heads[proj])
            yield name, w


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Parse a GGUF file's metadata and tensor index; no tensor is dequantized here."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise ValueError(f"{path}: not a model GGUF (no general.architecture)")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    gguf_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in gguf_names:
        # llama3-style frequency scaling is baked into this tensor rather than the metadata;
        # ignoring it would silently give wrong positions beyond the original context.
        raise NotImplementedError(f"{path}: rope_freqs.weight (llama3-style RoPE scaling) is not supported")
    for qtype in {t.tensor_type for t in reader.tensors}:
        _check_dequantizable(qtype, path)
    config = _config(reader, arch, gguf_names)
    tensors = tuple((_hf_name(t.name, config["num_hidden_layers"], path), t) for t in reader.tensors)
    return GGUFCheckpoint(path=path, config=config, _tensors=tensors)


def _config(reader: GGUFReader, arch: str, gguf_names: set[str]) -> dict[str, Any]:
    def key(suffix: str) -> Any:
        return _field(reader, f"{arch}.{suffix}")

    def required(suffix: str) -> Any:
        value = key(suffix)
        if value is None:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{suffix}")
        if isinstance(value, list):
            raise NotImplementedError(f"per-layer values for {arch}.{suffix} are not supported")
        return value

    hidden = int(required("embedding_length"))
    n_head = int(required("attention.head_count"))
    n_kv_head = int(key("attention.head_count_kv") or n_head)
    head_dim = int(key("attention.key_length") or hidden // n_head)
    rope_dim = key("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise NotImplementedError(f"partial rotary embedding ({rope_dim} of {head_dim} dims) is not supported")

    vocab_size = key("vocab_size")
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab_size = len(tokens.data)  # one data index per array element: no need to decode strings

    architecture, model_type = _HF_ARCH[arch]
    eps = key("attention.layer_norm_rms_epsilon")
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": head_dim,
        "max_position_embeddings": int(required("context_length")),
        "rms_norm_eps": _f32_to_float(eps if eps is not None else 1e-6),
        "rope_theta": _f32_to_float(key("rope.freq_base") or 10000.0),
        "rope_scaling": _rope_scaling(key),
        "tie_word_embeddings": "output.weight" not in gguf_names,
        "attention_bias": "blk.0.attn_q.bias" in gguf_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def _rope_scaling(key: Callable[[str], Any]) -> dict[str, Any] | None:
    kind = key("rope.scaling.type")
    factor = key("rope.scaling.factor")
    if kind is None and key("rope.scale_linear") not in (None, 1.0):
        kind, factor = "linear", key("rope.scale_linear")  # older files' spelling of linear scaling
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = _f32_to_float(factor)
    original = key("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _field(reader: GGUFReader, name: str) -> Any:
    field_ = reader.fields.get(name)
    return None if field_ is None else field_.contents()


def _f32_to_float(value: float) -> float:
    # GGUF stores floats as float32; print the shortest decimal that round-trips in float32 so that
    # 1e-5 reads back as 1e-05 (what config.json said), not 9.999999747378752e-06.
    return float(str(np.float32(value)))


def _hf_name(gguf_name: str, num_layers: int, path: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES or int(match[1]) >= num_layers:
        raise ValueError(f"{path}: unexpected tensor {gguf_name!r} for a dense llama/qwen model")
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def _check_dequantizable(qtype: GGMLQuantizationType, path: Path) -> None:
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return
    # gguf has no public "is supported" query; dequantizing one zero block is the cheap probe.
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor type {qtype.name} cannot be dequantized by gguf") from None


def _to_torch(tensor: ReaderTensor) -> torch.Tensor:
    # tensor.shape is ggml's ne order (innermost first); torch wants it reversed: [out, in].
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    # tensor.data is already [out, in] in elements (F32/F16) or in bytes per row (quantized, BF16);
    # dequantize turns bytes back into elements along the last axis.
    values = dequantize(tensor.data, tensor.tensor_type)
    # F32 comes back as a read-only view of the memory map: copy so torch owns writable memory.
    values = np.require(values, dtype=np.float32, requirements=["C", "W"])
    if values.size != int(tensor.n_elements):
        raise ValueError(f"{tensor.name}: dequantized {values.size} values, expected {tensor.n_elements}")
    return torch.from_numpy(values.reshape(shape))
