"""Tensor parallelism in the roofline and the planner.

A small shape counted by hand (hidden 8, 4 heads of 2, 2 KV heads, MLP 16, 2 layers, vocab 10): TP 2 splits
its KV heads, TP 4 replicates them (one per rank, each on two ranks); then Llama-3-70B on H100s through
`pdserve plan --tensor-parallel-sizes`.
"""
from __future__ import annotations

import json

import pytest

from pdserve.config import ModelConfig
from pdserve.perf.costs import RooflineCosts, Transport, kv_heads_per_rank
from pdserve.perf.hardware import (
    ALLREDUCE_LATENCY_S,
    DECODE_MBU,
    LINK_EFFICIENCY,
    STEP_OVERHEAD_S,
    gpu,
    resolve_model,
    roofline,
)
from pdserve.planner.parallel import compare_tp, prefill_time

LINK = Transport(latency_s=0.0, bytes_per_s=1e12)


def small(**kw) -> ModelConfig:
    shape = dict(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=2, max_position_embeddings=64)
    return ModelConfig(**{**shape, **kw})


def costs(tp: int, model: ModelConfig | None = None, collective: Transport | None = LINK, **kw) -> RooflineCosts:
    args = dict(dtype_bytes=2, peak_flops=1000.0, peak_bytes_per_s=1000.0, mfu=1.0, mbu=1.0, overhead_s=0.5,
                transport=LINK)
    return RooflineCosts(model or small(), tp=tp, collective=collective, **{**args, **kw})


# -- bytes and FLOPs per rank ------------------------------------------------------------------------

def test_kv_heads_split_when_tp_divides_them_and_are_replicated_beyond():
    assert [kv_heads_per_rank(small(), tp) for tp in (1, 2, 4)] == [2, 1, 1]
    _, llama70b = resolve_model("llama-3-70b")
    assert [kv_heads_per_rank(llama70b, tp) for tp in (1, 2, 4, 8, 16, 32, 64)] == [8, 4, 2, 1, 1, 1, 1]


def test_bytes_per_rank_counted_by_hand():
    # A layer's matmul weights on one rank: q (8 x 8/tp), k and v (8 x kv heads on the rank x 2), o (8/tp x 8),
    # gate, up and down (3 x 8 x 16/tp); the LM head 8 x ceil(10/tp) (vocab-parallel, padded).
    one, two, four = costs(1), costs(2), costs(4)
    # TP 1: 2 layers x (8*(8+8) + 8*8 + 3*8*16 = 576) + 8*10 = 1232 values
    assert one.weight_bytes == 1232 * 2
    # TP 2, KV split (1 head a rank): 2 x (8*(4+4) + 4*8 + 3*8*8 = 288) + 8*5 = 616
    assert two.weight_bytes == 616 * 2
    # TP 4, KV replicated (still 1 head a rank): 2 x (8*(2+4) + 2*8 + 3*8*4 = 160) + 8*3 = 344
    assert four.weight_bytes == 344 * 2
    # Held besides: the embedding (sharded like the LM head), 2 norms a layer and the final one (replicated).
    assert one.resident_weight_bytes == (1232 + 80 + 2 * 16 + 8) * 2 == small().num_params * 2
    assert two.resident_weight_bytes == (616 + 40 + 2 * 16 + 8) * 2
    assert four.resident_weight_bytes == (344 + 24 + 2 * 16 + 8) * 2
    # KV per token: 2 (K and V) x 2 layers x the rank's KV heads x 2 x 2 bytes
    assert [c.kv_bytes_per_token for c in (one, two, four)] == [32, 16, 16]


def test_llama_3_70b_per_rank():
    _, m = resolve_model("llama-3-70b")
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
            m.vocab_size) == (8192, 28672, 80, 64, 8, 128, 128256)
    h100 = gpu("H100")
    by_tp = {tp: roofline(m, h100, 2, tp) for tp in (1, 8, 16)}
    assert by_tp[1].resident_weight_bytes == m.num_params * 2 == 141_107_412_992
    # TP 8: q, o, MLP, embedding and LM head an eighth each, one KV head (128) for k and v, norms whole
    layer = 8192 * (1024 + 2 * 128) + 1024 * 8192 + 3 * 8192 * 3584 + 2 * 8192
    assert by_tp[8].resident_weight_bytes == (80 * layer + 2 * 8192 * 16032 + 8192) * 2 == 17_640_734_720
    # TP 16 replicates each KV head on two ranks: k, v and the KV per token stay TP 8's
    assert by_tp[8].kv_bytes_per_token == by_tp[16].kv_bytes_per_token == 2 * 80 * 128 * 2
    layer16 = 8192 * (512 + 2 * 128) + 512 * 8192 + 3 * 8192 * 1792 + 2 * 8192
    assert by_tp[16].resident_weight_bytes == (80 * layer16 + 2 * 8192 * 8016 + 8192) * 2


def test_a_size_that_does_not_divide_the_heads_is_an_error():
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide the model's 4 attention heads"):
        costs(3)
    with pytest.raises(ValueError, match="does not divide"):
        costs(8)
    # 12 heads over 6 ranks is 2 each, but a rank's 2 query heads would straddle 2 of the 4 KV heads
    with pytest.raises(ValueError, match="neither divides the model's 4 KV heads"):
        costs(6, small(num_heads=12, num_kv_heads=4, hidden_size=24))
    with pytest.raises(ValueError, match="needs the all-reduce"):
        costs(2, collective=None)


# -- the all-reduce and the step ---------------------------------------------------------------------

def test_allreduce_is_two_ring_all_reduces_a_layer():
    c = costs(4, collective=Transport(latency_s=1e-6, bytes_per_s=1e9))
    # 3 rows x 8 hidden x 2 bytes = 48 B; a ring moves 2 * 3/4 of it: 1 us + 72 B / 1 GB/s, 2 a layer, 2 layers
    assert c.collective_time(3) == pytest.approx(4 * (1e-6 + 72e-9), rel=1e-12)
    assert costs(1, collective=None).collective_time(3) == 0.0
    assert c.collective_time(0) == 0.0


def test_step_adds_the_all_reduces_to_the_roofline():
    c = costs(2, collective=Transport(latency_s=0.01, bytes_per_s=100.0))
    # One decode with 5 tokens of context on a rank: FLOPs 2 x 2 layers x 288 + 4 x 4 q x 2 layers x 5 pairs
    # + 2 x 8 x 5 (LM head) = 1392; bytes 1232 + 16 x 6 = 1328: compute-bound at 1000 FLOP/s and B/s.
    assert c.flops(0, 0, 0, 1, 5) == 1392
    assert c.bytes(0, 1, 5) == 1328
    allreduce = 4 * (0.01 + 16 / 100)  # 1 row: 16 B, a ring of 2 moves all of it
    assert c.step_time(0, 0, 0, 1, 5) == pytest.approx(0.5 + 1.392 + allreduce, rel=1e-12)


def test_tp_1_is_the_roofline_without_tensor_parallelism():
    _, m = resolve_model("llama-3-8b")
    h100 = gpu("H100")
    plain = RooflineCosts(m, 2, h100.flops, h100.bytes_per_s, 0.6, 0.8, 0.002, LINK)
    assert roofline(m, h100).step_time(0, 0, 0, 64, 64 * 1000) == plain.step_time(0, 0, 0, 64, 64 * 1000)
    assert roofline(m, h100).step_time(4096, 4096 * 4097 // 2, 1, 0, 0) == plain.step_time(4096, 4096 * 4097 // 2,
                                                                                          1, 0, 0)


def test_prefill_time_chunks_the_prompt():
    c = costs(2)
    assert prefill_time(c, 5, 2) == pytest.approx(
        c.step_time(2, 3, 0, 0, 0) + c.step_time(2, 2 * 2 + 3, 0, 0, 0) + c.step_time(1, 4 + 1, 1, 0, 0))


# -- Llama-3-70B on H100s ----------------------------------------------------------------------------

def test_compare_tp_on_h100():
    _, m = resolve_model("llama-3-70b")
    t = compare_tp(m, gpu("H100"), [1, 2, 4, 8], prompt=1024, token_budget=2048, batch_cap=64, decode_context=1152,
                   longest=1280)
    rows = {r["tp"]: r for r in t["sizes"]}
    assert not rows[1]["fits"] and "prefill_s" not in rows[1]  # 141 GB of weights, 72 GB usable
    assert t["fitting"] == [2, 4, 8]
    # TP 2: 72 GB - 70.56 GB of weights leaves room for 8,819 tokens of 160 KiB: 7 requests of 1152
    assert rows[2]["kv_tokens_per_rank"] == (72 * 10**9 - 70_555_025_408) // 163_840 == 8819
    assert rows[2]["decode_batch"] == 7 and rows[4]["decode_batch"] == rows[8]["decode_batch"] == 64
    # TP 8's decode step, by hand: memory-bound (weights read + 64 contexts of KV + the new tokens' KV) plus
    # 160 all-reduces of 64 x 8192 x 2 B over NVLink 4 (450 GB/s a direction, derated)
    read = 17_375_428_608 + 40_960 * (64 * 1152 + 64)
    allreduce = 160 * (ALLREDUCE_LATENCY_S + 2 * 7 / 8 * 64 * 8192 * 2 / (450e9 * LINK_EFFICIENCY))
    step = STEP_OVERHEAD_S + read / (3.35e12 * DECODE_MBU) + allreduce
    assert rows[8]["decode_step_s"] == pytest.approx(step, rel=1e-12)
    assert rows[8]["decode_collective_share"] == pytest.approx(allreduce / step, rel=1e-12)
    assert rows[8]["decode_tokens_per_s_per_gpu"] == pytest.approx(64 / step / 8, rel=1e-12)
    assert t["prefill_winner"] == 8 and t["decode_winner"] == 4
    assert rows[2]["prefill_s"] > rows[4]["prefill_s"] > rows[8]["prefill_s"]


def test_plan_command_with_tensor_parallel_sizes(tmp_path, capsys):
    from pdserve.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", "--gpu", "H100", "--model", "llama-3-70b", "--tensor-parallel-sizes", "8,1,2,4",
               "--input-len", "1024", "--output-len", "256", "--num-prompts", "40", "--request-rate", "2",
               "--max-workers", "2", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert [ln.split()[:3] for ln in lines if ln[:3].strip() in {"1", "2", "4", "8"}][:4] == [
        ["1", "no", "141.1GB"], ["2", "yes", "70.6GB"], ["4", "yes", "35.3GB"], ["8", "yes", "17.6GB"]]
    assert "prefill: TP 8 wins (shortest prompt time); decode: TP 4 wins (most tokens/s per GPU)" in printed
    assert "every worker is TP 2" in printed
    plan = json.loads(out.read_text())
    assert plan["tensor_parallel_size"] == 2
    tp = plan["tensor_parallel"]
    assert tp["fitting"] == [2, 4, 8] and tp["prompt_tokens"] == 1024 and tp["decode_context"] == 1152
    assert [r["weight_bytes_per_rank"] for r in tp["sizes"]] == [141_107_412_992, 70_555_025_408, 35_278_831_616,
                                                                 17_640_734_720]
    # the simulation ran on TP 2's KV cache: a GPU's 72 GB less its 70.56 GB of weights
    assert plan["candidates"][0]["kv_cache_bytes"] == (72 * 10**9 - 70_555_025_408) // (163_840 * 16) * 163_840 * 16


def test_plan_compares_tp_sizes_itself_when_the_model_does_not_fit_one_gpu(capsys):
    """`pdserve plan --gpu H100 --model llama-3-70b` alone says which TP sizes fit and which wins."""
    from pdserve.cli import main

    assert main(["plan", "--gpu", "H100", "--model", "llama-3-70b", "--input-len", "1024", "--output-len", "256",
                 "--num-prompts", "20", "--request-rate", "2", "--max-workers", "1", "--slo-ttft-ms", "2000",
                 "--slo-tpot-ms", "100"]) == 0
    printed = capsys.readouterr().out
    assert "llama-3-70b does not fit one H100: comparing tensor-parallel sizes 1,2,4,8" in printed
    assert [ln.split()[:2] for ln in printed.splitlines() if ln[:3].strip() in {"1", "2", "4", "8"}][:4] == [
        ["1", "no"], ["2", "yes"], ["4", "yes"], ["8", "yes"]]
    assert "prefill: TP 8 wins" in printed and "decode: TP 4 wins" in printed


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "H100", "--model", "llama-3-70b", "--tensor-parallel-sizes", "2,3"],
     "tensor-parallel size 3 does not divide the model's 64 attention heads"),
    (["--gpu", "L4", "--model", "llama-3-70b", "--tensor-parallel-sizes", "1,2"], "no tensor-parallel size of [1, 2]"),
    (["--profile", "x.json", "--tensor-parallel-sizes", "2"], "--tensor-parallel-sizes goes with --gpu"),
])
def test_plan_command_tp_errors(argv, message, capsys):
    from pdserve.cli import main

    assert main(["plan", "--max-workers", "2", "--num-prompts", "5", "--slo-ttft-ms", "1000"] + argv) == 2
    assert message in capsys.readouterr().err


def test_tp_sizes_must_be_a_list_of_positive_numbers(capsys):
    from pdserve.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--gpu", "H100", "--model", "llama-3-70b", "--max-workers", "1",
              "--tensor-parallel-sizes", "0,2"])
    assert "tensor-parallel sizes must be >= 1" in capsys.readouterr().err
