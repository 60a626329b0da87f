"""Tiny seeded mixture-of-experts checkpoints built with transformers' own config classes (no hub download):
Qwen3-MoE (renormalised, and not with a dense first layer), Qwen2-MoE (a shared expert) and Mixtral, with a tensor set per expert or with
packed 3-D expert tensors. Shared by the model tests and the expert-parallel cluster tests."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

EXPERTS, TOP_K = 8, 2
MODELS = {
    "qwen3_moe": dict(head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                      norm_topk_prob=True),
    # Not renormalised, and layer 0 a dense MLP: a model of both kinds of layer.
    "qwen3_moe-mixed": dict(head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                            norm_topk_prob=False, mlp_only_layers=[0]),
    "mixtral": dict(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, sliding_window=None),
    # A shared expert beside the routed ones, with its sigmoid gate; q/k/v biases; top-k not renormalised.
    "qwen2_moe": dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
}
CLASSES = {"qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
           "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}


def build(directory: Path, kind: str, packed: bool) -> Path:
    """A seeded random tiny checkpoint (initializer_range 0.3: logit and router gaps are large). packed: the
    experts as 3-D tensors (transformers' own parameters, saved as they are) instead of one set per expert."""
    config_cls, model_cls = CLASSES[kind.split("-")[0]]
    config = config_cls(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        initializer_range=0.3, rms_norm_eps=1e-6, tie_word_embeddings=False, **MODELS[kind])
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    if packed:
        for f in directory.glob("*.safetensors"):
            f.unlink()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    return directory


