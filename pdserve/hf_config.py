"""Reading a Hugging Face config.json: which family a checkpoint is, its RoPE scaling, its mixture-of-experts
fields. Pure parsing, no torch: pdserve.config.ModelConfig.from_hf builds on it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")  # the families
# The registry of checkpoints served: a config.json's `architectures` entry -> the family pdserve.model builds
# (one decoder, pdserve.model.llama, whose options each family sets in ModelConfig.from_hf).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}


def family_of(cfg: dict[str, Any]) -> str:
    """The family of a Hugging Face config.json: by its `architectures` (ValueError naming an unsupported one
    and the supported list), else by its model_type (configs written without architectures)."""
    names = cfg.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if names:
        raise ValueError(f"unsupported architecture {names[0]!r}; supported: {', '.join(ARCHITECTURES)}")
    return cfg.get("model_type", "llama")



@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def moe_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a Hugging Face config: Qwen2-MoE and Qwen3-MoE (every
    decoder_sparse_step-th layer not in mlp_only_layers; norm_topk_prob as given; Qwen2-MoE's shared expert)
    and Mixtral (every layer,
    top-k weights always renormalised)."""
    if model_type == "mixtral":
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                    moe_layers=tuple(range(cfg["num_hidden_layers"])))
    # The hub's Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts.
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    if model_type in ("qwen2_moe", "qwen3_moe") and experts > 0:
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"],
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    moe_layers=tuple(i for i in range(cfg["num_hidden_layers"])
                                     if i not in dense and (i + 1) % step == 0),
                    shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0)
                    if model_type == "qwen2_moe" else 0)
    return {}
