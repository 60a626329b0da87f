"""Mixture-of-experts models (pdserve.model.moe) against transformers on tiny seeded checkpoints that its own
config classes build (no hub): Qwen3-MoE and Mixtral, each from a checkpoint with a tensor set per expert (what
save_pretrained writes) and from one with packed 3-D expert tensors; greedy tokens and logits through the
engine's paged cache, chunked prefill beside decodes. And what is refused, and said so: an unsupported
architecture, tensor parallelism, weight updates."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams

from test_model_parity import NEW_TOKENS, prompts, run_with_logits, small_engine

EXPERTS, TOP_K = 8, 2
MODELS = {
    "qwen3_moe": dict(head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                      norm_topk_prob=True),
    # Not renormalised, and layer 0 a dense MLP: a model of both kinds of layer.
    "qwen3_moe-mixed": dict(head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                            norm_topk_prob=False, mlp_only_layers=[0]),
    "mixtral": dict(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, sliding_window=None),
}
CLASSES = {"qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
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


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("moe")
    return {(kind, layout): build(root / f"{kind}-{layout}", kind, layout == "packed")
            for kind in MODELS for layout in ("per-expert", "packed")}


def test_the_two_layouts_are_the_two_on_disk(checkpoints):
    from safetensors import safe_open

    for kind in MODELS:
        names = {layout: set(safe_open(str(checkpoints[kind, layout] / "model.safetensors"), "pt").keys())
                 for layout in ("per-expert", "packed")}
        assert any(".experts.7." in n for n in names["per-expert"])
        assert not any(".experts.gate_up_proj" in n for n in names["per-expert"])
        assert "model.layers.2.mlp.experts.gate_up_proj" in names["packed"]


@pytest.mark.parametrize("layout", ["per-expert", "packed"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_tokens_and_logits_match_transformers(checkpoints, kind, layout):
    engine = small_engine(checkpoints[kind, layout])
    cfg = engine.model_config
    assert cfg.num_experts == EXPERTS and cfg.moe_layers == ((1, 2) if kind.endswith("mixed") else (0, 1, 2))
    batch = prompts(cfg.vocab_size)
    ours, our_logits = run_with_logits(engine, batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                      ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[kind, "per-expert"],
                                                           dtype=torch.float32).eval()
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_params
    hf.generation_config.eos_token_id = None  # as ignore_eos: an EOS (Mixtral's 2) is a token like any other
    for prompt, toks, lg in zip(batch, ours, our_logits):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            ref_logits = hf(ref[:, :-1]).logits[0, len(prompt) - 1:]
        assert toks == ref[0, len(prompt):].tolist()
        torch.testing.assert_close(lg, ref_logits, atol=1e-4, rtol=0)
    assert engine.pool.num_used_blocks == 0


def test_tokens_route_unevenly_and_every_chosen_expert_runs(checkpoints):
    """The tiny models exercise grouping: over a prompt some experts get many tokens, some few or none; the
    block's output equals each token's own top-k weighted sum computed one token at a time."""
    engine = LLMEngine(EngineConfig(model=str(checkpoints["qwen3_moe", "packed"])))
    moe = engine.runner.model.layers[1].mlp
    x = torch.randn(64, engine.model_config.hidden_size, generator=torch.Generator().manual_seed(3))
    weights, ids = moe.route(x)
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    assert counts.max() >= 1.5 * counts.min()  # uneven: the busiest expert has half as many tokens again
    with torch.no_grad():
        out = moe(x)
        for t in range(0, 64, 7):
            ref = torch.zeros_like(out[t])
            for w, e in zip(weights[t], ids[t].tolist()):
                gate, up = moe.experts.gate_up_proj[e] @ x[t], moe.experts.gate_up_proj[e] @ x[t]
                gate, up = gate[:32], up[32:]
                ref += w * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
            torch.testing.assert_close(out[t], ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_first_tokens_and_logits_are_fp32s(checkpoints):
    """bf16 weights and activations (routing in fp32 from bf16 logits): every prompt's first greedy token is
    fp32's and the logits are close on average (a token whose top-k experts flip under bf16 rounding moves
    more: the tiny random model's router gaps are small against bf16's 3 significant digits)."""
    batch = prompts(320)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model=str(checkpoints["mixtral", "packed"]), dtype=dtype,
                                        cache=CacheConfig(block_size=4, num_blocks=128)))
        assert engine.runner.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.__dict__[dtype]
        logits[dtype] = torch.cat(run_with_logits(engine, batch, params)[1])  # [prompts, vocab]
    assert torch.equal(logits["float32"].argmax(-1), logits["bfloat16"].argmax(-1))
    fp32 = logits["float32"]
    assert (fp32 - logits["bfloat16"]).abs().mean() < 0.1 * fp32.abs().mean()  # 5 % here


def test_config_counts_active_parameters(checkpoints):
    cfg = ModelConfig.from_hf(json.loads((checkpoints["mixtral", "packed"] / "config.json").read_text()))
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    assert (cfg.architecture, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("mixtral", TOP_K, 128)
    assert cfg.num_params - cfg.num_active_params == cfg.num_layers * (EXPERTS - TOP_K) * 3 * h * i


def test_an_unsupported_architecture_is_named_at_load(tmp_path):
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 320,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM.*supported: LlamaForCausalLM.*Qwen3MoeForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_tensor_parallelism_graphs_and_weight_updates_are_refused(checkpoints):
    path = checkpoints["qwen3_moe", "packed"]
    with pytest.raises(ValueError, match="tensor parallelism of a mixture-of-experts model"):
        LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=2))
    with pytest.raises(ValueError, match="CUDA graphs of a mixture-of-experts model"):
        LLMEngine(EngineConfig(model=str(path), cuda_graphs=True))
    engine = LLMEngine(EngineConfig(model=str(path)))
    with pytest.raises(NotImplementedError, match="weight updates of a mixture-of-experts model"):
        engine.update_weights(str(path), 1)


def test_a_disaggregated_cluster_serves_a_mixture_of_experts_token_exact(ray_local, aloop, checkpoints):
    """Qwen3-MoE (dense and MoE layers) on one prefill and one decode worker: the KV of its prompts moves like a
    dense model's, and every request's tokens are the offline engine's."""
    from pdserve.client import Client
    from pdserve.config import ClusterConfig, PoolConfig, SchedulerConfig

    from served import Served

    engine = EngineConfig(model=str(checkpoints["qwen3_moe-mixed", "packed"]),
                          cache=CacheConfig(block_size=4, num_blocks=128),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32))
    s = Served(aloop, ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.25),
                                    decode=PoolConfig(1, num_cpus=0.25)))
    try:
        batch = prompts(320)
        with Client(s.target) as c:
            got = [c.complete(token_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True, timeout=120).token_ids
                   for p in batch]
        assert got == s.reference(batch, 12)
        s.settle()
    finally:
        s.close()
