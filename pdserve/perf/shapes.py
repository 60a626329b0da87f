"""Model shapes the roofline costs that pdserve.model does not serve.

DeepSeek-V3 is the mixture of experts that sizes multi-node serving, and its shape differs from what
pdserve.model builds in two ways the roofline must count: a shared expert every token runs beside its k
routed ones, and multi-head latent attention (MLA), whose KV cache is one small latent per token instead
of K and V per head. Counting them here, in the performance model only, lets `pdserve plan` say what such
a model needs (how many GPUs its weights take, what a decode step reads) without teaching the serving
model two features it does not run. The shape is not a preset of pdserve.model.loader, so no engine,
dummy or simulated, can be started on it.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import ModelConfig


@dataclass(frozen=True)
class LatentAttentionShape(ModelConfig):
    """A decoder with multi-head latent attention and shared experts, for the roofline only.

    Attention (per layer): the query goes through a rank-q_lora_rank bottleneck (hidden -> q_lora_rank ->
    heads x (head_dim + qk_rope_head_dim)); keys and values come from a kv_lora_rank latent plus a
    qk_rope_head_dim RoPE key that all heads share (hidden -> kv_lora_rank + qk_rope_head_dim, then the
    latent -> heads x (head_dim + head_dim) for the keys' no-RoPE part and the values); o_proj takes
    heads x head_dim back to hidden. head_dim is both a key's no-RoPE part and a value head.

    The KV cache holds the latent and the RoPE key only: kv_lora_rank + qk_rope_head_dim values per token
    per layer, read whole by every query head, so one "KV head" (num_kv_heads 1) that tensor parallelism
    replicates on every rank. A decode step attends in the latent (the key and value up-projections folded
    into the query and the output), a prefill with the keys and values expanded per head: the roofline
    takes each phase's attention FLOPs from its form.

    num_shared_experts: experts of moe_intermediate_size that every token of a mixture-of-experts layer runs
    besides its num_experts_per_tok routed ones (counted in mlp_params, active or not).
    """

    num_shared_experts: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        # No ModelConfig checks: its architecture is one pdserve.model does not build, which ModelConfig
        # refuses by design; the one instance is the fixed shape below.
        pass

    @property
    def note(self) -> str:
        return (f"{self.architecture} shape, roofline only: multi-head latent attention is not served by pdserve; "
                f"its KV is costed as the latent and RoPE key it caches ({self.kv_lora_rank} + "
                f"{self.qk_rope_head_dim} values a token a layer, whole on every rank)")

    def mlp_params(self, layer: int, active: bool = False) -> int:
        shared = self.num_shared_experts * 3 * self.hidden_size * self.moe_intermediate_size
        return super().mlp_params(layer, active) + (shared if layer in self.moe_layers else 0)

    def attention_params(self, tp: int = 1) -> int:
        """One layer's attention matmul weights on one of tp ranks: the down-projections to the query's
        bottleneck and to the latent whole on every rank (every head needs them), the rest split by head."""
        h, heads, d, rope = self.hidden_size, self.num_heads // tp, self.head_dim, self.qk_rope_head_dim
        whole = h * self.q_lora_rank + h * (self.kv_lora_rank + rope)
        split = self.q_lora_rank * heads * (d + rope) + self.kv_lora_rank * heads * 2 * d + heads * d * h
        return whole + split

    @property
    def kv_values_per_token_per_layer(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def attention_norm_params(self) -> int:
        """The RMSNorms inside one layer's attention (over the query bottleneck and over the latent)."""
        return self.q_lora_rank + self.kv_lora_rank

    @property
    def num_params(self) -> int:
        h = self.hidden_size
        per_layer = self.attention_params() + self.attention_norm_params + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (self.num_layers * per_layer + sum(self.mlp_params(i) for i in range(self.num_layers))
                + embed + h)


# DeepSeek-V3's shape (its config.json's figures; the multi-token-prediction layer left out): 61 layers,
# the first 3 with a dense MLP of 18,432, the other 58 a mixture of 256 routed experts of 2,048 (8 a token)
# and 1 shared expert; 128 heads; MLA with a query bottleneck of 1,536, a KV latent of 512 and a 64-wide
# RoPE key. 671B parameters, 37B active a token.
DEEPSEEK_V3_SHAPE = LatentAttentionShape(
    architecture="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61,
    num_heads=128, num_kv_heads=1, head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=0, eos_token_ids=(1,),
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, norm_topk_prob=True,
    moe_layers=tuple(range(3, 61)), num_shared_experts=1, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64)

# Shapes the roofline knows beside pdserve.model.loader's presets, by name.
ROOFLINE_ONLY_SHAPES: dict[str, ModelConfig] = {"deepseek-v3-shape": DEEPSEEK_V3_SHAPE}
