"""Mixtures of experts in the roofline and the planner.

A small shape counted by hand (hidden 8, 4 heads of 2, 2 KV heads, vocab 10; layer 0 a dense MLP of 16, layer
1 a mixture of 4 experts of 6, 2 a token), the expected-experts formula against a simulation of uniform
routing, then Qwen3-30B-A3B and DeepSeek-V3's shape through the roofline and `pdserve plan`.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pdserve.config import ModelConfig
from pdserve.engine.utilization import step_flops
from pdserve.perf.costs import RooflineCosts, Transport, expected_experts
from pdserve.perf.hardware import MEMORY_UTILIZATION, gpu, resolve_model, roofline
from pdserve.perf.shapes import LatentAttentionShape
from pdserve.planner.parallel import compare_tp, parallel_choices

LINK = Transport(latency_s=1e-6, bytes_per_s=1e9)


def small_moe(**kw) -> ModelConfig:
    shape = dict(architecture="qwen3_moe", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=2, max_position_embeddings=64, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=6, moe_layers=(1,))
    return ModelConfig(**{**shape, **kw})


def costs(tp: int = 1, ep: int = 1, model: ModelConfig | None = None) -> RooflineCosts:
    return RooflineCosts(model or small_moe(), 2, peak_flops=1000.0, peak_bytes_per_s=1000.0, mfu=1.0, mbu=1.0,
                         overhead_s=0.0, transport=LINK, tp=tp, collective=LINK, ep=ep)


# -- the experts a batch touches ---------------------------------------------------------------------

def test_expected_experts_from_k_to_all():
    assert expected_experts(128, 8, 0) == 0.0
    assert expected_experts(128, 8, 1) == pytest.approx(8)  # one token: its k
    assert expected_experts(128, 8, 10_000) == pytest.approx(128)  # a large batch: all of them
    counts = [expected_experts(128, 8, b) for b in (1, 2, 8, 32, 64, 256)]
    assert counts == sorted(counts) and counts[-1] < 128
    assert expected_experts(4, 4, 1) == 4  # k = E: every token touches all


@pytest.mark.parametrize("experts, k, tokens", [(16, 2, 5), (128, 8, 8), (64, 6, 20)])
def test_expected_experts_matches_uniform_routing(experts, k, tokens):
    """Each token picks k distinct experts uniformly; the mean count of distinct experts over many batches."""
    rng = np.random.default_rng(0)
    trials = 4000
    picks = np.argsort(rng.random((trials, tokens, experts)), axis=-1)[..., :k]  # k distinct per token
    touched = np.zeros((trials, experts), dtype=bool)
    np.put_along_axis(touched, picks.reshape(trials, -1), True, axis=1)
    assert touched.sum(axis=1).mean() == pytest.approx(expected_experts(experts, k, tokens), rel=0.02)


# -- bytes, memory and FLOPs of the small shape -----------------------------------------------------

def test_small_moe_counted_by_hand():
    c = costs()
    # Matmul weights: attention 2 x (8*(8+8) + 8*8 = 192), the dense MLP 3*8*16 = 384, the router 8*4 = 32,
    # 4 experts of 3*8*6 = 144, the LM head 8*10 = 80: 1456 values, all held.
    assert c.weight_bytes == 1456 * 2
    # Held besides: embedding 80, 2 norms a layer, the final norm; every expert counts: the model's num_params.
    assert c.resident_weight_bytes == (1456 + 80 + 2 * 16 + 8) * 2 == small_moe().num_params * 2
    # A step reads the dense weights (880) and the experts its rows touch, once each.
    dense = 2 * 192 + 384 + 32 + 80
    assert c.step_weight_bytes(1) == pytest.approx((dense + 2 * 144) * 2)  # one token: its 2 experts
    assert c.step_weight_bytes(3) == pytest.approx((dense + 4 * (1 - 0.5 ** 3) * 144) * 2)  # 3.5 of 4
    assert c.step_weight_bytes(1000) == pytest.approx(c.weight_bytes)
    # FLOPs: a token runs attention, the dense MLP, the router and its 2 experts; as pdserve.engine.utilization
    # counts them (one decode at context 5).
    assert c.flops(0, 0, 0, 1, 5) == 2 * (2 * 192 + 384 + 32 + 2 * 144) + 2 * 4 * 4 * 2 * 5 + 2 * 8 * 10
    assert c.flops(0, 0, 0, 1, 5) == step_flops(small_moe(), [(4, 1)], 1)
    assert c.flops(7, 28, 1, 0, 0) == step_flops(small_moe(), [(0, 7)], 1)


def test_expert_parallelism_splits_the_experts_and_sends_tokens():
    one, sliced, split = costs(), costs(2, 1), costs(2, 2)
    assert split.experts_per_rank == 2 and sliced.experts_per_rank == 4
    # step_weight_bytes(0) is the weights every step reads: what a rank holds beyond it is its experts
    assert one.weight_bytes - one.step_weight_bytes(0) == 4 * 144 * 2
    for c in (sliced, split):  # half of every expert, or half of the experts whole: half the bytes a rank
        assert c.weight_bytes - c.step_weight_bytes(0) == 2 * 144 * 2
        # ... and half of the experts' bytes a step reads: 3.5 of 4 touched, sliced or 1.75 on each rank
        assert c.step_weight_bytes(3) - c.step_weight_bytes(0) == pytest.approx(3.5 * 144 * 2 / 2)
    # The FLOPs of a token's experts split too: 2 slices a rank (EP 1) or, on average, 1 whole expert (EP 2).
    assert split.flops(0, 0, 0, 1, 0) == sliced.flops(0, 0, 0, 1, 0)
    # Collectives for 3 rows of 8 x 2 bytes: at EP 1, 2 all-reduces a layer (a ring of 2 moves 48 B each). At EP 2,
    # attention's 2 all-reduces and the dense MLP's, then in the MoE layer 2 all-to-alls (a rank owns 2 of the
    # tokens and sends their 2 rows each, half of them away: 32 B) and an all-gather (half of 2 x 2 rows: 32 B).
    allreduce, a2a = 1e-6 + 48e-9, 1e-6 + 32e-9
    assert sliced.collective_time(3) == pytest.approx(4 * allreduce, rel=1e-12)
    assert split.collective_time(3) == pytest.approx(3 * allreduce + 3 * a2a, rel=1e-12)
    assert split.collective_time(0) == one.collective_time(3) == 0.0


def test_expert_parallel_size_must_be_the_ranks_of_a_mixture_of_experts():
    with pytest.raises(ValueError, match="needs a mixture of experts"):
        costs(2, 2, small_moe(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, moe_layers=()))
    with pytest.raises(ValueError, match="must be the worker's rank count"):
        costs(4, 2)
    with pytest.raises(ValueError, match="divide the model's 6 experts"):
        costs(4, 4, small_moe(num_experts=6))


def test_choices_list_ep_beside_tp_for_a_mixture_of_experts_only():
    # experts of 6 do not slice over 4 ranks: only the split choice is left at TP 4
    assert parallel_choices(small_moe(), [1, 2, 4]) == [(1, 1), (2, 1), (2, 2), (4, 4)]
    # 6 experts do not split over 4 ranks: only the sliced choice is left
    assert parallel_choices(small_moe(num_experts=6, moe_intermediate_size=8), [2, 4]) == [(2, 1), (2, 2), (4, 1)]
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):  # neither
        parallel_choices(small_moe(num_experts=6), [4])
    _, llama = resolve_model("llama-3-8b")
    assert parallel_choices(llama, [1, 2, 4]) == [(1, 1), (2, 1), (4, 1)]


# -- Qwen3-30B-A3B on an H100 -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_moe() -> ModelConfig:
    name, m = resolve_model("Qwen3-30B-A3B")
    assert name == "qwen3-30b-a3b" and m.architecture == "qwen3_moe" and m.qk_norm
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (
        2048, 48, 32, 4, 128, 151936)
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.moe_layers) == (128, 8, 768,
                                                                                            tuple(range(48)))
    return m


def test_qwen3_30b_a3b_memory_from_all_parameters_flops_from_active(qwen_moe):
    m = qwen_moe
    assert 30.4e9 < m.num_params < 30.6e9 and 3.3e9 < m.num_active_params < 3.4e9  # "30B, 3B active"
    c = roofline(m, gpu("H100"))
    assert c.resident_weight_bytes == m.num_params * 2  # every expert held
    # FLOPs of one decode token: its active parameters (not the embedding), attention and the LM head
    assert c.flops(0, 0, 0, 1, 100) == step_flops(m, [(99, 1)], 1)
    assert c.flops(0, 0, 0, 1, 0) == pytest.approx(2 * (m.num_active_params - m.vocab_size * m.hidden_size
                                                        - m.num_layers * (2 * m.hidden_size + 2 * m.head_dim)
                                                        - m.hidden_size))


def test_qwen3_30b_a3b_decode_bytes_grow_with_the_batch_then_saturate(qwen_moe):
    m = qwen_moe
    c = roofline(m, gpu("H100"))
    expert = 3 * 2048 * 768 * 2
    everything_but_experts = c.weight_bytes - 48 * 128 * expert
    reads = {b: c.step_weight_bytes(b) for b in (1, 8, 32, 64, 256)}
    assert reads[1] == pytest.approx(everything_but_experts + 48 * 8 * expert)
    for b, r in reads.items():
        assert r == pytest.approx(everything_but_experts + 48 * 128 * (1 - (1 - 8 / 128) ** b) * expert)
    assert list(reads.values()) == sorted(reads.values())
    assert reads[256] == pytest.approx(c.weight_bytes, rel=1e-6)  # all 128 touched
    assert reads[1] < 0.12 * c.weight_bytes
    # ... and so the decode step: memory-bound, its time grows with the experts read, flat once all are
    steps = {b: c.step_time(0, 0, 0, b, b * 1024) for b in (1, 64, 256)}
    assert steps[1] < steps[64] < steps[256]


def test_a_dense_model_reads_its_weights_whatever_the_batch():
    _, m = resolve_model("llama-3-70b")
    for tp in (1, 8):
        c = roofline(m, gpu("H100"), 2, tp)
        assert c.step_weight_bytes(1) == c.step_weight_bytes(512) == c.weight_bytes
        # the roofline before mixtures of experts, written out: every layer's attention and MLP, the LM head
        q, kv = 64 * 128 // tp, c.kv_size_per_rank  # 64 heads of 128
        layer = 8192 * (q + 2 * kv) + q * 8192 + 3 * 8192 * (28672 // tp)
        assert c.weight_bytes == (80 * layer + 8192 * math.ceil(128256 / tp)) * 2
        assert c.flops(0, 0, 0, 64, 64000) == 64 * 2 * 80 * layer + 4 * q * 80 * 64000 + 64 * 2 * 8192 * math.ceil(
            128256 / tp)
        assert c.collective_time(64) == pytest.approx(0 if tp == 1 else 160 * c.collective.send_time(
            2 * 7 / 8 * 64 * 8192 * 2))


def test_compare_tp_lists_ep_choices_for_qwen3_30b_a3b(qwen_moe):
    t = compare_tp(qwen_moe, gpu("H100"), [1, 2, 4, 8], prompt=1024, token_budget=2048, batch_cap=64,
                   decode_context=1152, longest=1280)
    assert [(r["tp"], r["ep"]) for r in t["sizes"]] == [(1, 1), (2, 1), (2, 2), (4, 1), (4, 4), (8, 1), (8, 8)]
    assert t["fitting"] == [1, 2, 4, 8] and len(t["fitting_choices"]) == 7
    rows = {(r["tp"], r["ep"]): r for r in t["sizes"]}
    assert rows[1, 1]["weight_bytes_per_rank"] == qwen_moe.num_params * 2
    for tp in (2, 4, 8):  # same bytes a GPU either way; EP pays for all-to-alls where TP all-reduces
        assert rows[tp, 1]["weight_bytes_per_rank"] == rows[tp, tp]["weight_bytes_per_rank"]
        assert rows[tp, tp]["decode_collective_share"] > rows[tp, 1]["decode_collective_share"]
    best = max(t["sizes"], key=lambda r: r["decode_tokens_per_s_per_gpu"])
    assert (t["decode_winner"], t["decode_winner_ep"]) == (best["tp"], best["ep"])


# -- DeepSeek-V3's shape: the roofline only ------------------------------------------------------------

def test_deepseek_v3_shape_counted():
    name, m = resolve_model("deepseek-v3-shape")
    assert name == "deepseek-v3-shape" and isinstance(m, LatentAttentionShape)
    assert 670e9 < m.num_params < 672e9 and 37e9 < m.num_active_params < 38e9  # "671B, 37B activated"
    # MLA a layer: q down 7168x1536 and up 1536x(128x192), KV down 7168x576 and up 512x(128x256), o 16384x7168
    assert m.attention_params() == 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    # the shared expert runs for every token of a MoE layer; the first 3 layers are dense
    assert m.mlp_params(3, active=True) == 7168 * 256 + 9 * 3 * 7168 * 2048
    assert m.mlp_params(0) == 3 * 7168 * 18432
    c1, c8 = roofline(m, gpu("H100"), 2, 1), roofline(m, gpu("H100"), 2, 8, ep=8)
    assert c1.resident_weight_bytes == m.num_params * 2
    # the latent and RoPE key, 576 values a token a layer, whole on every rank
    assert c1.kv_bytes_per_token == c8.kv_bytes_per_token == 61 * 576 * 2
    # a decode attends in the latent: more FLOPs a context token than a prefill pair with expanded heads
    assert c8.flops(0, 0, 0, 0, 1) == 2 * 16 * (576 + 512) * 61
    assert c8.flops(0, 1, 0, 0, 0) == 2 * 16 * (192 + 128) * 61


def test_deepseek_v3_shape_is_not_served():
    from pdserve.config import EngineConfig
    from pdserve.model.loader import load_info

    with pytest.raises(ValueError, match="needs a preset"):
        load_info(EngineConfig(model="deepseek-v3-shape", load_format="dummy"))


# -- pdserve plan -----------------------------------------------------------------------------------

def test_plan_command_for_qwen3_30b_a3b_lists_ep_choices(tmp_path, capsys):
    from pdserve.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--gpu", "H100", "--model", "qwen3-30b-a3b", "--input-len", "1024", "--output-len", "256",
                 "--num-prompts", "40", "--request-rate", "2", "--max-workers", "2", "--slo-ttft-ms", "2000",
                 "--slo-tpot-ms", "100", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "qwen3-30b-a3b is a mixture of experts: comparing tensor-parallel sizes 1,2,4,8" in printed
    rows = [ln.split()[:3] for ln in printed.splitlines() if ln[:3].strip() in {"1", "2", "4", "8"}][:7]
    assert rows == [["1", "1", "yes"], ["2", "1", "yes"], ["2", "2", "yes"], ["4", "1", "yes"], ["4", "4", "yes"],
                    ["8", "1", "yes"], ["8", "8", "yes"]]
    plan = json.loads(out.read_text())
    tp = plan["tensor_parallel"]
    assert f"decode: TP {tp['decode_winner']} EP {tp['decode_winner_ep']} wins" in printed
    # simulated at the smallest size that fits, which one GPU is
    assert (plan["tensor_parallel_size"], plan["expert_parallel_size"]) == (1, 1)
    assert "every worker is TP 1 EP 1" in printed


def test_plan_command_says_what_deepseek_v3_needs(capsys):
    from pdserve.cli import main

    assert main(["plan", "--gpu", "H100", "--model", "deepseek-v3-shape", "--input-len", "1024", "--output-len",
                 "256", "--num-prompts", "20", "--request-rate", "2", "--max-workers", "1",
                 "--slo-ttft-ms", "2000"]) == 2
    captured = capsys.readouterr()
    assert "multi-head latent attention is not served by pdserve" in captured.out
    _, m = resolve_model("deepseek-v3-shape")
    need = math.ceil(m.num_params * 2 / int(gpu("H100").memory_bytes * MEMORY_UTILIZATION))
    assert need == 19
    assert f"need at least {need} H100s" in captured.out and f"need {need} GPUs" in captured.err
