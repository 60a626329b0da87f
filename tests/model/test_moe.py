"""Mixture-of-experts models (pdserve.model.moe) against transformers on tiny seeded checkpoints that its own
config classes build (no hub): Qwen3-MoE and Mixtral, each from a checkpoint with a tensor set per expert (what
save_pretrained writes) and from one with packed 3-D expert tensors; greedy tokens and logits through the
engine's paged cache, chunked prefill beside decodes; and the same over 2 and 4 ranks, the experts sliced
(tensor parallelism) or split whole (expert parallelism, tokens sent to them all-to-all). int8 experts, the
per-expert token counts, and what is refused, and said so: an unsupported architecture, an expert-parallel size
the model or the ranks cannot take, CUDA graphs, weight updates."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams

from test_model_parity import NEW_TOKENS, prompts, run_with_logits, small_engine

from moe_models import EXPERTS, MODELS, TOP_K, build


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


def assert_matches_transformers(engine: LLMEngine, checkpoints, kind: str) -> None:
    """Greedy tokens equal transformers' generate and every sampled row's fp32 logits are within 1e-4 (or 2e-5 of its largest) of its
    forward's; no KV block is left used."""
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
        # 1e-4, or 2e-5 of the largest logit where that is more (Qwen2-MoE's shared expert: logits up to 13)
        torch.testing.assert_close(lg, ref_logits, atol=max(1e-4, 2e-5 * ref_logits.abs().max().item()), rtol=0)
    assert engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("layout", ["per-expert", "packed"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_tokens_and_logits_match_transformers(checkpoints, kind, layout):
    assert_matches_transformers(small_engine(checkpoints[kind, layout]), checkpoints, kind)


# (ranks, expert-parallel size, model, layout): each model and each layout at each layout of the experts.
PARALLEL = [(2, 1, "qwen3_moe", "packed"), (2, 1, "mixtral", "per-expert"),
            (2, 2, "qwen3_moe-mixed", "per-expert"), (2, 2, "mixtral", "packed"),
            (4, 4, "qwen3_moe", "per-expert"), (4, 4, "qwen3_moe-mixed", "packed"),
            (2, 1, "qwen2_moe", "packed"), (2, 2, "qwen2_moe", "per-expert")]


@pytest.mark.parametrize("tp, ep, kind, layout", PARALLEL)
def test_sliced_or_split_experts_match_transformers(checkpoints, tp, ep, kind, layout):
    """Attention over 2 or 4 ranks, the experts sliced over them (ep 1) or split whole (ep = ranks: every token
    goes to its experts' ranks and back all-to-all): the same tokens and logits as transformers, on one rank."""
    with LLMEngine(EngineConfig(model=str(checkpoints[kind, layout]), cache=CacheConfig(block_size=4, num_blocks=128),
                                scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
                                tensor_parallel_size=tp, expert_parallel_size=ep)) as engine:
        assert engine.core.config.tensor_parallel_size == tp
        assert_matches_transformers(engine, checkpoints, kind)


def test_an_expert_parallel_rank_holds_only_its_experts(checkpoints):
    """At ep 2 rank 1 reads experts 4..7 of the checkpoint, renumbered 0..3, whatever the layout; at ep 1 over 2
    ranks each expert's intermediate rows are cut in half (gate rows and up rows alike)."""
    from safetensors import safe_open

    from pdserve.parallel.layout import rank_config, shard_weights

    for layout in ("per-expert", "packed"):
        path = checkpoints["qwen3_moe", layout] / "model.safetensors"
        with safe_open(str(path), "pt") as f:
            whole = {n: f.get_tensor(n) for n in f.keys()}
        cfg = small_engine(checkpoints["qwen3_moe", layout]).model_config
        assert rank_config(cfg, 2, 2).experts_per_rank == EXPERTS // 2
        split = dict(shard_weights(whole.items(), cfg, 2, 1, ep=2))
        sliced = dict(shard_weights(whole.items(), cfg, 2, 1, ep=1))
        i = cfg.moe_intermediate_size
        if layout == "per-expert":
            assert {n for n in split if ".experts." in n and n.startswith("model.layers.1.")} == \
                {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj",
                                                                                            "down_proj")}
            assert torch.equal(split["model.layers.1.mlp.experts.0.up_proj.weight"],
                               whole["model.layers.1.mlp.experts.4.up_proj.weight"])
            assert torch.equal(sliced["model.layers.1.mlp.experts.5.down_proj.weight"],
                               whole["model.layers.1.mlp.experts.5.down_proj.weight"][:, i // 2:])
        else:
            packed = whole["model.layers.1.mlp.experts.gate_up_proj"]  # [experts, 2 i, hidden]
            assert torch.equal(split["model.layers.1.mlp.experts.gate_up_proj"], packed[4:])
            assert torch.equal(sliced["model.layers.1.mlp.experts.gate_up_proj"],
                               torch.cat([packed[:, i // 2: i], packed[:, i + i // 2:]], dim=1))
        assert torch.equal(split["model.layers.1.mlp.gate.weight"], whole["model.layers.1.mlp.gate.weight"])


def test_int8_experts_are_their_dequantized_weights(checkpoints):
    """int8 experts (one scale per output row of each expert, as the dense layers; the router stays fp32): the
    block computes what fp32 experts holding the dequantized weights compute, and the whole int8 model's logits
    stay close to fp32's."""
    batch = prompts(320)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engines, logits = {}, {}
    for quantization in (None, "int8"):
        engines[quantization] = LLMEngine(EngineConfig(model=str(checkpoints["qwen3_moe", "packed"]),
                                                       quantization=quantization,
                                                       cache=CacheConfig(block_size=4, num_blocks=128)))
        moe = engines[quantization].runner.model.layers[0].mlp
        assert moe.experts.gate_up_proj.dtype == (torch.int8 if quantization else torch.float32)
        assert moe.gate.weight.dtype == torch.float32
        logits[quantization] = torch.cat(run_with_logits(engines[quantization], batch, params)[1])
    # As tests/model/test_model_parity.py bounds int8 dense models: max |logit error| / max |logit| per prompt
    # within 0.2 (measured 0.05-0.14 here, the routing kept); where a prompt's greedy token parts (one of 5,
    # from an expert choice flipped by the error) fp32's own top-2 margin is within that prompt's error.
    for ref, q in zip(logits[None], logits["int8"]):
        err = (ref - q).abs().max()
        top2 = ref.topk(2).values
        assert err <= 0.2 * ref.abs().max() or top2[0] - top2[1] <= 2 * err, (err, ref.abs().max())
        if ref.argmax() != q.argmax():
            assert top2[0] - top2[1] <= 2 * err
    int8, fp32 = engines["int8"].runner.model.layers[0].mlp, engines[None].runner.model.layers[0].mlp
    e = int8.experts
    with torch.inference_mode():
        fp32.experts.gate_up_proj.copy_(e.gate_up_proj.float() * e.gate_up_scale[..., None])
        fp32.experts.down_proj.copy_(e.down_proj.float() * e.down_scale[..., None])
        x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(int8(x), fp32(x), atol=1e-5, rtol=1e-5)


def test_the_experts_token_counts_are_the_routing(checkpoints):
    """Each expert's count is the tokens its layers routed to it: every computed token counts k times per MoE
    layer, and the counts equal the routing of the same hidden states recomputed."""
    engine = small_engine(checkpoints["qwen3_moe-mixed", "packed"])
    assert engine.core.expert_tokens() == (0,) * EXPERTS  # nothing computed yet
    batch = prompts(320)
    engine.generate(batch, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    counts = engine.core.expert_tokens()
    computed = engine.core.tokens_processed
    assert len(counts) == EXPERTS and sum(counts) == computed * TOP_K * 2  # two MoE layers
    assert max(counts) > min(counts)  # uneven: the load imbalance the metric shows
    layer = engine.runner.model.layers[1].mlp
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    before = layer.counts.clone()
    with torch.inference_mode():
        layer(x)
    assert torch.equal(layer.counts - before, torch.bincount(layer.route(x)[1].reshape(-1), minlength=EXPERTS))


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


def test_what_cannot_be_laid_out_graphs_and_weight_updates_are_refused(checkpoints, tmp_path):
    from conftest import build_tiny_checkpoint

    path = checkpoints["qwen3_moe", "packed"]
    with pytest.raises(ValueError, match="expert_parallel_size .3. must be 1 or the worker's rank count"):
        EngineConfig(model=str(path), tensor_parallel_size=2, expert_parallel_size=3)
    from dataclasses import replace

    from pdserve.parallel.layout import rank_config

    cfg = small_engine(path).model_config
    with pytest.raises(ValueError, match="expert-parallel size 2 does not divide the model's 5 experts"):
        rank_config(replace(cfg, num_experts=5), 2, 2)
    with pytest.raises(ValueError, match="tensor-parallel size 4 does not divide the experts' MLP size 6"):
        rank_config(replace(cfg, moe_intermediate_size=6), 4, 1)
    dense = build_tiny_checkpoint(tmp_path / "dense", "llama")
    with pytest.raises(ValueError, match="expert parallelism needs a mixture-of-experts model; llama is dense"):
        LLMEngine(EngineConfig(model=str(dense), expert_parallel_size=2))
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


def test_dummy_shares_agree_on_what_every_rank_holds_whole(checkpoints):
    """Random (dummy) weights over 2 expert-parallel ranks: the routers and Qwen2-MoE's shared expert, whole on
    every rank, are the same on both (their routing decides the all-to-all sizes every rank computes alone);
    the experts each rank holds are its own."""
    from pdserve.model.loader import load_shard

    config = EngineConfig(model=str(checkpoints["qwen2_moe", "packed"]), load_format="dummy", expert_parallel_size=2)
    ranks = [dict(load_shard(config, 2, r).model.named_parameters()) for r in range(2)]
    whole = [n for n in ranks[0] if n.endswith(".mlp.gate.weight") or ".shared_expert." in n]
    assert len(whole) == 3 * 4  # each layer's router, shared expert (gate_up, down) and its gate
    assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in whole)
    assert not torch.equal(ranks[0]["layers.0.mlp.experts.gate_up_proj"], ranks[1]["layers.0.mlp.experts.gate_up_proj"])


def test_pool_and_engine_sizes_combine_as_documented(tmp_path):
    """A pool's expert-parallel size above 1 makes it that many ranks; a pool that sets EP 1 alone keeps the
    engine's ranks (its experts sliced over them); a simulated engine refuses EP (one GPU a worker); the serve
    command refuses a pool whose given TP differs from its EP."""
    from pdserve.config import ClusterConfig, PoolConfig
    from router.cli import build_parser, cluster_config_from_args

    engine = EngineConfig(model="smollm2-135m", load_format="dummy", tensor_parallel_size=4, expert_parallel_size=4)
    cluster = ClusterConfig(engine=engine, prefill=PoolConfig(expert_parallel_size=1),
                            decode=PoolConfig(expert_parallel_size=2))
    assert (cluster.engine_for(cluster.prefill).tensor_parallel_size, cluster.engine_for(cluster.prefill)
            .expert_parallel_size) == (4, 1)
    assert (cluster.engine_for(cluster.decode).tensor_parallel_size, cluster.engine_for(cluster.decode)
            .expert_parallel_size) == (2, 2)
    with pytest.raises(ValueError, match="a simulated engine stands for one GPU"):
        EngineConfig(model="llama3-8b", load_format="sim", dtype="bfloat16", expert_parallel_size=2)
    args = build_parser().parse_args(["serve", "--expert-parallel-size", "2", "--prefill-tensor-parallel-size", "1"])
    with pytest.raises(ValueError, match="the prefill pool's expert-parallel size 2 must equal its ranks"):
        cluster_config_from_args(args)
    args = build_parser().parse_args(["serve", "--decode-expert-parallel-size", "2"])
    pools = cluster_config_from_args(args).pools
    assert (pools["decode"].tensor_parallel_size, pools["prefill"].tensor_parallel_size) == (2, 1)
