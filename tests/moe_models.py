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




# transformers and pdserve compute the router's logits in different orders of summation: they agree to ~1e-5.
# Where a layer's k-th and (k+1)-th logits (or two chosen ones) are closer than this, either order is right.
ROUTER_ATOL = 1e-4


def hf_router_logits(hf, sequence: list[int]) -> torch.Tensor:
    """transformers' router logits of a sequence's positions 0 .. len - 2 (the last token is never an input):
    [positions, moe layers, experts] fp32."""
    with torch.no_grad():
        out = hf(torch.tensor([sequence[:-1]]), output_router_logits=True)
    return torch.stack([lg.float() for lg in out.router_logits], dim=1)


def assert_routed_like_hf(hf, sequence: list[int], ids) -> int:
    """ids ([positions, moe layers, k], the routed experts of sequence's positions 0 .. len - 2) are
    transformers' router top-k, most probable first: equal, except where transformers' own logits are within
    ROUTER_ATOL of a tie, where each chosen id's logit must be within ROUTER_ATOL of the logit ranked in its
    place. Returns how many (position, layer) rows were such near-ties."""
    logits = hf_router_logits(hf, sequence)
    ids = torch.as_tensor(ids, dtype=torch.int64)
    assert ids.shape == (len(sequence) - 1, logits.shape[1], TOP_K), ids.shape
    top = torch.topk(logits, TOP_K + 1, dim=-1)
    near = (top.values[..., :-1] - top.values[..., 1:]).min(dim=-1).values < ROUTER_ATOL  # [positions, layers]
    exact = (ids == top.indices[..., :TOP_K]).all(dim=-1)
    assert bool((exact | near).all()), f"rows {(~(exact | near)).nonzero().tolist()[:5]} differ from transformers'"
    chosen = torch.gather(logits, -1, ids)  # each chosen id's logit, in our order
    assert bool(((chosen - top.values[..., :TOP_K]).abs() <= ROUTER_ATOL).all()), "a near-tie chose off the top k"
    return int((near & ~exact).sum())
