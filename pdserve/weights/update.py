"""Named full tensors applied to one worker's model: validated, staged in the model's own format, committed.

An update names tensors as a checkpoint does (Hugging Face names, full shapes). ``check_metas`` validates
a whole update's names, shapes and dtypes before any byte moves. ``stage`` turns each tensor into what the
model holds: its dtype, int8 weights with per-row scales (pdserve.model.linear), one tensor-parallel rank's
share (pdserve.parallel.layout.shard_weights), the q/k/v and gate/up pieces placed in their fused
parameters' rows. The staged values wait on the model's device until ``StagedUpdate.commit`` copies them
in place: no parameter or buffer is rebound, so CUDA graphs captured on the model stay valid.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.config import ModelConfig
from pdserve.model.linear import Linear, quantize_rows
from pdserve.model.llama import LlamaModel
from pdserve.model.loader import _safetensors_weights, _weights_dir, resolve_format
from pdserve.parallel.layout import rank_config, shard_weights

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The config fields that decide which tensors a model holds and their shapes.
_SHAPE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                 "vocab_size", "tie_word_embeddings", "attention_bias", "qk_norm")

# safetensors' dtype names (a lazy slice's get_dtype()).
_FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


class WeightError(ValueError):
    """A named tensor that cannot be applied: unknown name, wrong shape, non-floating dtype."""


@dataclass(frozen=True)
class TensorMeta:
    name: str  # Hugging Face name, with or without the "model." prefix
    shape: tuple[int, ...]  # the full tensor's shape (never a tensor-parallel share)
    dtype: torch.dtype


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this (whole-model) config holds, by its Hugging Face name -> full shape."""
    if cfg.is_moe:
        raise NotImplementedError(f"weight updates of a mixture-of-experts model ({cfg.architecture}) are not "
                                  f"supported yet")
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)):
            out[f"{p}self_attn.{proj}.weight"] = (rows, h)
            if cfg.attention_bias:  # q/k/v only: the model's o_proj has no bias
                out[f"{p}self_attn.{proj}.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


class _Checker:
    """check_metas, one tensor at a time: True to apply it, False to skip it, WeightError if it is bad."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.shapes = {k.removeprefix("model."): s for k, s in expected_tensors(cfg).items()}
        self.seen: set[str] = set()

    def __call__(self, meta: TensorMeta) -> bool:
        key = meta.name.removeprefix("model.")
        if "rotary_emb" in key:  # RoPE tables are computed, never loaded
            return False
        tied_head = key == "lm_head.weight" and self.cfg.tie_word_embeddings  # the embedding's, skipped
        full = (self.cfg.vocab_size, self.cfg.hidden_size) if tied_head else self.shapes.get(key)
        if full is None:
            raise WeightError(f"tensor {meta.name!r}: no such tensor in this model")
        if key in self.seen:
            raise WeightError(f"tensor {meta.name!r}: given twice")
        if tuple(meta.shape) != full:
            raise WeightError(f"tensor {meta.name!r}: shape {tuple(meta.shape)}, expected {full}")
        if meta.dtype not in _FLOAT_DTYPES:
            raise WeightError(f"tensor {meta.name!r}: dtype {str(meta.dtype).removeprefix('torch.')}, "
                              "expected float32, bfloat16 or float16")
        self.seen.add(key)
        return not tied_head


def check_metas(metas: Iterable[TensorMeta], cfg: ModelConfig) -> list[TensorMeta]:
    """Validate a whole update's metadata before any byte moves: each name known (with or without the
    "model." prefix), its full shape, a floating dtype, no name twice. A tied model's "lm_head.weight" and
    "rotary_emb" buffers are accepted and skipped. Raises WeightError naming the first bad tensor and why;
    returns the metas to apply."""
    check = _Checker(cfg)
    return [m for m in metas if check(m)]


@dataclass(frozen=True)
class _Entry:
    module: str  # the model's submodule
    attr: str  # its parameter or buffer
    start: int | None  # first row of a fused parameter's piece; None: the whole tensor
    value: torch.Tensor


class StagedUpdate:
    """New values for some of a model's parameters, already in the model's own format (its dtype; int8 +
    per-row scale; its tensor-parallel rank's share), held aside until commit. Staging never touches the
    model."""

    def __init__(self) -> None:
        self.names: list[str] = []  # Hugging Face names staged, in order
        self.num_bytes = 0  # bytes of the staged values
        self._entries: list[_Entry] = []

    def buffers(self) -> dict[tuple[str, str, int | None], torch.Tensor]:
        """Its values by destination: memory a later update may stage into (stage's `spare`) once this one is
        committed."""
        return {(e.module, e.attr, e.start): e.value for e in self._entries}

    def _add(self, module: str, attr: str, start: int | None, value: torch.Tensor) -> None:
        self._entries.append(_Entry(module, attr, start, value))
        self.num_bytes += value.numel() * value.element_size()

    @torch.no_grad()
    def commit(self, model: LlamaModel) -> None:
        """Copy every staged value into the model in place (never rebinding a parameter or buffer: CUDA
        graphs captured on the model keep their pointers). Every destination is checked before the first
        copy."""
        dsts = []
        for e in self._entries:
            dst = getattr(model.get_submodule(e.module), e.attr)
            if e.start is not None:
                dst = dst.narrow(0, e.start, e.value.shape[0])
            if dst.shape != e.value.shape or dst.dtype != e.value.dtype or dst.device != e.value.device:
                raise ValueError(f"{e.module}.{e.attr}: staged {tuple(e.value.shape)} {e.value.dtype} on "
                                 f"{e.value.device}, the model holds {tuple(dst.shape)} {dst.dtype} on {dst.device}")
            dsts.append(dst)
        for dst, e in zip(dsts, self._entries):
            dst.copy_(e.value)


def stage(model: LlamaModel, cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]],
          tp: int = 1, rank: int = 0, spare: StagedUpdate | None = None, adopt: bool = False) -> StagedUpdate:
    """Stage Hugging Face-named full tensors for model, rank `rank` of a TP `tp` worker (tp 1: the whole
    model); cfg is the whole model's config. Each tensor is validated as check_metas does (WeightError: the
    update is dropped), cut to the rank's share, converted to the model's format and kept on its device. A
    subset of the model's tensors is a valid (partial) update. spare: an update already committed, whose memory
    this one reuses where a value has the same destination (memory written for the first time costs page
    faults: on a CPU host several times the copy itself). adopt: a tensor (or its rank's share) already in the
    model's dtype, on its device and contiguous is staged as it is, not copied: the caller gives tensors it will
    not change before the commit (a weight group's receive arena)."""
    return _stage(model, cfg, tensors, tp, rank, spare, adopt)


def default_weights_root(model_path: str) -> str:
    """Where checkpoints of weight updates may be read from unless configured (EngineConfig.weights_root): the
    directory that holds the served model (a Hugging Face directory's parent, a .gguf file's directory), so its
    siblings, the next versions, and nothing else the workers can see."""
    return str(Path(model_path).resolve().parent)


def checkpoint_path(path: str, root: str) -> str:
    """`path` resolved (symlinks followed, `..` gone), if it and every file an update reads there (config.json,
    *.safetensors) lie under `root`; WeightError otherwise, which says nothing of what exists outside it."""
    root_real = os.path.realpath(root)

    def inside(p: str) -> bool:
        return os.path.commonpath([os.path.realpath(p), root_real]) == root_real

    if not os.path.isabs(path):
        raise WeightError(f"checkpoint path {path!r} must be absolute (a path on the workers)")
    if not inside(path):
        raise WeightError(f"checkpoint path {path!r} is not under the weights root (--weights-root): updates read "
                          "checkpoints there only")
    real = os.path.realpath(path)
    if os.path.isdir(real):
        for f in sorted(Path(real).glob("*.safetensors")) + [Path(real) / "config.json"]:
            if f.exists() and not inside(str(f)):
                raise WeightError(f"checkpoint {path!r}: {f.name} links outside the weights root (--weights-root)")
    return real


def stage_checkpoint(model: LlamaModel, cfg: ModelConfig, path: str, tp: int = 1, rank: int = 0,
                     spare: StagedUpdate | None = None) -> StagedUpdate:
    """Stage every tensor of a checkpoint: a Hugging Face directory of safetensors (a rank reads only its
    share's bytes) or a .gguf file (through the loader's dequantized cache). Its config.json must give the
    model cfg's shape (WeightError if not)."""
    path, fmt = resolve_format(path, "auto")
    directory = _weights_dir(path, fmt)
    theirs = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    diff = [f"{f} {getattr(theirs, f)}, expected {getattr(cfg, f)}" for f in _SHAPE_FIELDS
            if getattr(theirs, f) != getattr(cfg, f)]
    if diff:
        raise WeightError(f"checkpoint {path!r} is another model's shape: {'; '.join(diff)}")
    return _stage(model, cfg, _safetensors_weights(Path(directory), lazy=True), tp, rank, spare)


@torch.no_grad()
def _stage(model: LlamaModel, cfg: ModelConfig, weights: Iterable[tuple[str, Any]], tp: int,
           rank: int, spare: StagedUpdate | None = None, adopt: bool = False) -> StagedUpdate:
    """stage() of tensors or lazy file slices (only a slice's share is read, after its metadata passed)."""
    want = rank_config(cfg, tp)  # raises if tp cannot lay out cfg
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} of a TP {tp} worker")
    diff = [f for f in _SHAPE_FIELDS if getattr(model.cfg, f) != getattr(want, f)]
    if diff:
        raise ValueError(f"the model is not rank {rank} of a TP {tp} share of this config (differs in {diff})")
    dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device  # the embedding is never int8
    separate_head = cfg.tie_word_embeddings and model.lm_head.weight is not model.embed_tokens.weight  # int8
    check = _Checker(cfg)
    update = StagedUpdate()
    reuse = spare.buffers() if spare is not None else {}
    finite: list[tuple[str, torch.Tensor]] = []  # each share's all-finite flag, read once at the end (one sync)
    for name, weight in weights:
        if not check(TensorMeta(name, _shape(weight), _dtype(name, weight))):
            continue
        _, share = next(shard_weights([(name, weight)], cfg, tp, rank))
        finite.append((name, torch.isfinite(share).all()))
        key = name.removeprefix("model.")
        module, attr, start = _destination(model, key)
        _place(update, model, module, attr, start, share, dtype, device, reuse, adopt)
        if key == "embed_tokens.weight" and separate_head:  # a tied LM head quantized apart from the embedding
            _place(update, model, "lm_head", "weight", None, share, dtype, device, reuse, adopt)
        update.names.append(name)
    bad = [name for name, ok in finite if not bool(ok)]
    if bad:  # a NaN or an infinity would poison every token (and the KV) computed with it
        raise WeightError(f"tensor {bad[0]!r}: NaN or infinite values" + (f" (and {len(bad) - 1} more)" if bad[1:] else ""))
    return update


def _destination(model: LlamaModel, key: str) -> tuple[str, str, int | None]:
    """(submodule, parameter, first row of its piece or None) a Hugging Face name goes to in this model (its
    rank's shape), as loading places it (LlamaModel.locate)."""
    target, piece = model.locate(key)
    module, attr = target.rsplit(".", 1)
    return module, attr, None if piece is None else piece[1]


def _place(update: StagedUpdate, model: LlamaModel, module: str, attr: str, start: int | None,
           share: torch.Tensor, dtype: torch.dtype, device: torch.device,
           reuse: dict[tuple[str, str, int | None], torch.Tensor], adopt: bool = False) -> None:
    """Stage share as model.<module>.<attr>[start:] holds it: the model's dtype, or int8 and its rows' scales."""
    mod = model.get_submodule(module)
    dst = getattr(mod, attr)
    if start is not None:
        dst = dst.narrow(0, start, share.shape[0])
    if tuple(dst.shape) != tuple(share.shape):
        raise WeightError(f"{module}.{attr}: share {tuple(share.shape)}, the model holds {tuple(dst.shape)}")
    # As the loader does: copy into the model's dtype (then quantize, for an int8 layer's weight).
    want = dtype if dst.dtype == torch.int8 else dst.dtype
    if adopt and share.dtype == want and share.device == device and share.is_contiguous():
        value = share  # already as the model holds it (int8 layers quantize from it below, leaving it as is)
    else:
        value = reuse.pop((module, attr, start), None)
        if value is None or value.shape != share.shape or value.dtype != want or value.device != device:
            value = torch.empty(share.shape, dtype=want, device=device)
        value.copy_(share)
    if isinstance(mod, Linear) and attr == "weight" and mod.scale is not None:
        q, scale = quantize_rows(value)  # as loading it quantizes, bit for bit
        update._add(module, "weight", start, q)
        update._add(module, "scale", start, scale)
    else:
        update._add(module, attr, start, value)


def _shape(weight) -> tuple[int, ...]:
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) else tuple(weight.get_shape())


def _dtype(name: str, weight) -> torch.dtype:
    if isinstance(weight, torch.Tensor):
        return weight.dtype
    kind = weight.get_dtype()
    if kind not in _FILE_DTYPES:
        raise WeightError(f"tensor {name!r}: dtype {kind}, expected float32, bfloat16 or float16")
    return _FILE_DTYPES[kind]


@torch.no_grad()
def model_tensors(model: LlamaModel, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """A whole model's weights by their Hugging Face names and full shapes, as a checkpoint holds them: fused
    parameters split again, int8 weights dequantized (fp32; quantizing them again gives the same int8 values
    and scales: each row's largest value is 127 x its scale). Not for a tensor-parallel rank's share."""
    for name, shape in expected_tensors(cfg).items():
        module, attr, start = _destination(model, name.removeprefix("model."))
        mod = model.get_submodule(module)
        value = getattr(mod, attr)
        if isinstance(mod, Linear) and attr == "weight" and mod.scale is not None:
            value = value.to(torch.float32) * mod.scale[:, None]
        if start is not None:
            value = value.narrow(0, start, shape[0])
        yield name, value.detach().to("cpu").contiguous()


def export_checkpoint(model: LlamaModel, cfg: ModelConfig, directory: str | Path, config_json: str | Path) -> int:
    """Write the model's weights as a Hugging Face checkpoint (model.safetensors + the given config.json) that
    stage_checkpoint, or a worker starting from it, reads back exactly; its bytes."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = dict(model_tensors(model, cfg))
    save_file(tensors, str(directory / "model.safetensors"))
    shutil.copy(config_json, directory / "config.json")
    return sum(t.numel() * t.element_size() for t in tensors.values())
