"""Tensor-parallel head layouts and the hand-off between a prefill worker of TP A and a decode worker of
TP B (pdserve.parallel.layout): exact layouts, the errors, and every (A, B) moving exactly the KV each
decode rank owns, each head from a prefill rank that holds it."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from pdserve.parallel.layout import HeadTransfer, TPLayout, handoff_plan


def test_layouts_split_or_replicate_kv_heads():
    # 8 query heads, 2 KV heads (GQA 4): TP 1 and 2 split, TP 4 and 8 replicate.
    assert [TPLayout(8, 2, 1).kv_heads(0)] == [[0, 1]]
    assert [TPLayout(8, 2, 2).kv_heads(r) for r in range(2)] == [[0], [1]]
    assert [TPLayout(8, 2, 4).kv_heads(r) for r in range(4)] == [[0], [0], [1], [1]]
    assert [TPLayout(8, 2, 8).kv_heads(r) for r in range(8)] == [[0]] * 4 + [[1]] * 4
    assert [TPLayout(8, 2, t).replication for t in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert list(TPLayout(8, 2, 4).q_heads(3)) == [6, 7] and TPLayout(8, 2, 4).holders(1) == [2, 3]
    # MQA: every rank holds the one KV head.
    assert [TPLayout(8, 1, 4).kv_heads(r) for r in range(4)] == [[0]] * 4
    # SmolLM2-135M's 9 heads and 3 KV heads at TP 3 and 9.
    assert [TPLayout(9, 3, 3).kv_heads(r) for r in range(3)] == [[0], [1], [2]]
    assert [TPLayout(9, 3, 9).kv_heads(r) for r in range(9)] == [[0]] * 3 + [[1]] * 3 + [[2]] * 3


@pytest.mark.parametrize("heads, kv, tp, match", [
    (9, 3, 2, "does not divide the model's 9 attention heads"),
    (12, 4, 6, "neither divides the model's 4 KV heads"),
    (8, 2, 0, ">= 1"),
])
def test_layouts_that_cannot_be_made_are_clear_errors(heads, kv, tp, match):
    with pytest.raises(ValueError, match=match):
        TPLayout(heads, kv, tp)


def test_exact_plans():
    gqa = lambda t: TPLayout(8, 2, t)  # noqa: E731
    assert handoff_plan(gqa(1), gqa(2)) == [HeadTransfer(0, 0, (0,), (0,), (0,)), HeadTransfer(0, 1, (1,), (1,), (0,))]
    # Prefill TP 4 (heads replicated on ranks 0-1 and 2-3) to decode TP 1: one head from each half.
    assert handoff_plan(gqa(4), gqa(1)) == [HeadTransfer(0, 0, (0,), (0,), (0,)), HeadTransfer(2, 0, (1,), (0,), (1,))]
    # Decode TP 4 replicates: each replica receives its head, once each.
    assert [(t.src_rank, t.dst_rank, t.kv_heads) for t in handoff_plan(gqa(1), gqa(4))] == \
        [(0, 0, (0,)), (0, 1, (0,)), (0, 2, (1,)), (0, 3, (1,))]
    # Equal layouts: every rank from its own counterpart, nothing through rank 0.
    assert [(t.src_rank, t.dst_rank) for t in handoff_plan(gqa(4), gqa(4))] == [(0, 0), (1, 1), (2, 2), (3, 3)]


SHAPES = [(8, 2), (8, 1), (8, 8)]


@pytest.mark.parametrize("heads, kv", SHAPES)
def test_every_prefill_decode_pair_moves_exactly_each_decode_ranks_kv(heads, kv):
    """For every (A, B) the model allows: applying the plan to per-rank caches cut from one full cache
    fills each decode rank's cache with exactly its heads, each sent by a rank that holds it; with more
    than one prefill rank holding what a decode rank needs, more than one rank sends."""
    layers, blocks, bs, dim = 2, 3, 4, 5
    full = torch.randn(layers, 2, kv, blocks, bs, dim, generator=torch.Generator().manual_seed(heads * kv))
    sizes = [t for t in (1, 2, 4, 8) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    for a, b in itertools.product(sizes, sizes):
        pre, dec = TPLayout(heads, kv, a), TPLayout(heads, kv, b)
        src = [full[:, :, pre.kv_heads(r)] for r in range(a)]
        dst = [torch.zeros_like(full[:, :, dec.kv_heads(r)]) for r in range(b)]
        plan = handoff_plan(pre, dec)
        for t in plan:
            assert set(t.kv_heads) <= set(pre.kv_heads(t.src_rank)) and set(t.kv_heads) <= set(dec.kv_heads(t.dst_rank))
            dst[t.dst_rank][:, :, list(t.dst_index)] = src[t.src_rank][:, :, list(t.src_index)]
        for r in range(b):
            assert torch.equal(dst[r], full[:, :, dec.kv_heads(r)]), (a, b, r)
        received = [h for t in plan for h in t.kv_heads]
        assert len(received) == sum(len(dec.kv_heads(r)) for r in range(b))  # each needed head once per rank
        senders = {t.src_rank for t in plan}
        needed = {h for r in range(b) for h in dec.kv_heads(r)}
        distinct_holders = {tuple(pre.holders(h)) for h in needed}
        assert len(senders) >= min(len(distinct_holders), a), (a, b, senders)


def test_the_two_sides_must_serve_one_model():
    with pytest.raises(ValueError, match="same model"):
        handoff_plan(TPLayout(8, 2, 2), TPLayout(8, 4, 2))


# --- the offline engine at TP > 1 (ranks in processes of their own, gloo) ------------------------------

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling import SamplingParams  # noqa: E402

NEW_TOKENS = 16


def tp_config(path, tp: int) -> EngineConfig:
    return EngineConfig(model=str(path), tensor_parallel_size=tp, cache=CacheConfig(block_size=4, num_blocks=128),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8))


def tp_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 17, 33, 8)]


def greedy_tokens(config: EngineConfig, batch) -> tuple[list[list[int]], int]:
    with LLMEngine(config) as engine:
        out = [c.token_ids for c in engine.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                           ignore_eos=True))]
        return out, engine.pool.num_used_blocks


def hf_greedy(path, batch) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in batch:
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)
            out.append(ref[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory):
    from conftest import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("tp")
    return {"gqa": build_tiny_checkpoint(root / "gqa", "llama", num_attention_heads=8, num_key_value_heads=2),
            "mqa": build_tiny_checkpoint(root / "mqa", "qwen2", num_attention_heads=8, num_key_value_heads=1),
            # 318 rows: TP 4 holds 80 each, the last rank 78 and 2 rows of padding.
            "odd-vocab": build_tiny_checkpoint(root / "odd", "llama", num_attention_heads=8, num_key_value_heads=2,
                                               vocab_size=318)}


@pytest.mark.parametrize("kind, sizes", [("gqa", (2, 4)), ("mqa", (2, 4)), ("odd-vocab", (4,))])
def test_tp_greedy_tokens_equal_tp1_and_transformers(tp_checkpoints, kind, sizes):
    """8 attention heads over 2 KV heads (TP 2 splits them, TP 4 replicates them) and over 1 (MQA, with
    q/k/v biases), and a vocabulary TP 4 does not divide: the same greedy tokens at every TP size as at
    TP 1 and as transformers; no block left used on rank 0."""
    path = tp_checkpoints[kind]
    batch = tp_prompts(318)
    ref, _ = greedy_tokens(tp_config(path, 1), batch)
    assert ref == hf_greedy(path, batch)
    for tp in sizes:
        tokens, used = greedy_tokens(tp_config(path, tp), batch)
        assert tokens == ref, tp
        assert used == 0


def test_a_rank_holds_its_share_only(tp_checkpoints):
    """Rank r of TP 4 over 8 heads / 2 KV heads: 2 query heads, 1 KV head (replicated), a quarter of
    the MLP, a quarter of the vocabulary's embedding and LM head rows."""
    from pdserve.model.loader import load_shard

    cfg = tp_config(tp_checkpoints["gqa"], 4)
    full = load_shard(cfg, 1, 0).model
    for rank in (0, 3):
        m = load_shard(cfg, 4, rank).model
        d = m.cfg.head_dim
        assert (m.cfg.num_heads, m.cfg.num_kv_heads, m.cfg.intermediate_size) == (2, 1, 32)
        assert m.layers[0].self_attn.qkv_proj.weight.shape == ((2 + 2) * d, 64)
        assert m.layers[0].mlp.down_proj.weight.shape == (64, 32)
        q = m.layers[0].self_attn.qkv_proj.weight[: 2 * d]
        assert torch.equal(q, full.layers[0].self_attn.qkv_proj.weight[rank * 2 * d:(rank + 1) * 2 * d])
        k = m.layers[0].self_attn.qkv_proj.weight[2 * d: 3 * d]
        kv = rank // 2  # TP 4 over 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1
        assert torch.equal(k, full.layers[0].self_attn.qkv_proj.weight[8 * d + kv * d: 8 * d + (kv + 1) * d])
        assert m.lm_head.weight.shape == (80, 64) and (m.vocab_start, m.vocab_size) == (80 * rank, 320)
        assert torch.equal(m.lm_head.weight, full.lm_head.weight[80 * rank:80 * (rank + 1)])
        assert torch.equal(m.embed_tokens.weight, full.embed_tokens.weight[80 * rank:80 * (rank + 1)])


def test_a_tp_size_the_heads_cannot_take_is_an_error_at_start(tp_checkpoints):
    with pytest.raises(ValueError, match="does not divide the model's 8 attention heads"):
        LLMEngine(tp_config(tp_checkpoints["gqa"], 3))


@pytest.mark.slow
def test_smollm2_at_tp3_equals_tp1():
    """SmolLM2-135M (9 heads, 3 KV heads, MLP 1536) split over 3 ranks: the same greedy tokens."""
    from pdserve.model.loader import default_model_path

    try:
        model = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    batch = tp_prompts(49000)[:3]
    ref, _ = greedy_tokens(tp_config(model, 1), batch)
    tokens, used = greedy_tokens(tp_config(model, 3), batch)
    assert tokens == ref and used == 0


def test_serve_flags_and_config_keys_set_each_pools_tp(tmp_path):
    from router.cli import cluster_config_from_args, parse_args

    c = cluster_config_from_args(parse_args(["serve", "--prefill-tensor-parallel-size", "4",
                                             "--decode-tensor-parallel-size", "2", "--fast-lane-workers", "1",
                                             "--tensor-parallel-timeout", "9"]))
    assert [c.engine_for(p).tensor_parallel_size for p in (c.prefill, c.decode, c.fast)] == [4, 2, 2]
    assert c.engine.tensor_parallel_timeout_s == 9.0
    c = cluster_config_from_args(parse_args(["serve", "--tensor-parallel-size", "2", "--decode-tensor-parallel-size",
                                             "1"]))
    assert [c.engine_for(p).tensor_parallel_size for p in (c.prefill, c.decode)] == [2, 1]
    f = tmp_path / "serve.yaml"
    f.write_text("mode: colocated\ntensor-parallel-size: 2\n")
    c = cluster_config_from_args(parse_args(["serve", "--config", str(f)]))
    assert c.engine_for(c.colocated).tensor_parallel_size == 2
    f.write_text("prefill-tensor-parallel-size: 2\ndecode_tensor_parallel_size: 4\n")
    c = cluster_config_from_args(parse_args(["serve", "--config", str(f)]))
    assert [c.engine_for(p).tensor_parallel_size for p in (c.prefill, c.decode)] == [2, 4]
    with pytest.raises(ValueError, match="one size"):
        cluster_config_from_args(parse_args(["serve", "--mode", "colocated", "--decode-tensor-parallel-size", "2"]))


def test_a_kv_budget_is_per_rank():
    """--kv-cache-mib is each rank's: a rank holds its KV heads of every block, so TP 2 over 2 KV heads
    holds twice TP 1's blocks, and TP 4 (each KV head on two ranks) no more than TP 2."""
    from pdserve.config import ModelConfig

    cfg = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    cache = CacheConfig(block_size=4, memory_bytes=1 << 20)
    blocks = [cache.resolve_num_blocks(cfg, torch.float32, tp) for tp in (1, 2, 4)]
    per_block = 2 * 2 * 2 * 8 * 4 * 4  # K and V, layers, KV heads, head_dim, block_size, fp32
    assert blocks == [(1 << 20) // per_block, (1 << 20) // (per_block // 2), (1 << 20) // (per_block // 2)]
    assert CacheConfig(num_blocks=7).resolve_num_blocks(cfg, torch.float32, 4) == 7


def test_a_rank_reads_only_its_share_of_the_checkpoint(tp_checkpoints):
    """From the file each rank reads its share's bytes only (lazy slices), and the share is the same as
    cutting the whole tensors: at TP 4 over 2 KV heads a rank reads a quarter of the weights (half of k
    and v, whose heads it shares with one other rank), not the checkpoint."""
    from safetensors import safe_open

    from pdserve.model.loader import load_info
    from pdserve.parallel.layout import shard_weights

    path = tp_checkpoints["gqa"]
    cfg = load_info(tp_config(path, 4)).config
    (file,) = path.glob("*.safetensors")

    class Counted:
        def __init__(self, inner, tally):
            self.inner, self.tally = inner, tally

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            out = self.inner[index]
            self.tally.append(out.numel())
            return out

    with safe_open(str(file), framework="pt") as f:
        whole = {name: f.get_tensor(name) for name in f.keys()}
        total = sum(t.numel() for t in whole.values())
        for rank in range(4):
            tally: list[int] = []
            lazy = dict(shard_weights(((n, Counted(f.get_slice(n), tally)) for n in f.keys()), cfg, 4, rank))
            eager = dict(shard_weights(whole.items(), cfg, 4, rank))
            assert lazy.keys() == eager.keys() and all(torch.equal(lazy[n], eager[n]) for n in lazy)
            assert sum(tally) < 0.3 * total, (rank, sum(tally), total)


def test_tp_group_samples_equal_tp1(tp_checkpoints):
    """n samples on a TP 2 engine (its ranks cannot copy blocks: each forked sample computes the prompt's
    partial block again) equal TP 1's, which copies it."""
    path = tp_checkpoints["gqa"]
    batch = tp_prompts(318)[:2]  # 5 and 17 tokens: partial last blocks of 4
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True)
    with LLMEngine(tp_config(path, 1)) as engine:
        ref = [c.token_ids for c in engine.generate(batch, params)]
    with LLMEngine(tp_config(path, 2)) as engine:
        assert not engine.scheduler.can_copy_blocks
        assert [c.token_ids for c in engine.generate(batch, params)] == ref
        assert engine.core.prompt_tokens_computed == sum(len(p) + 2 * (len(p) % 4) for p in batch)
        assert engine.pool.num_used_blocks == 0


def test_tp_speculation_is_token_exact(tp_checkpoints, monkeypatch):
    """Speculation on a TP 2 engine: every rank runs each verification's LM head rows (a collective), rank 0 alone
    keeps the result. Drafted by an oracle (tests/oracle.py: the reference's next 2 tokens, then a wrong one), greedy
    output equals TP 1's without speculation and seeded sampling equals TP 1's with the same drafts, each greedy
    verification keeping at most the 2 right drafts; a draft model on TP ranks is refused with the reason."""
    from oracle import Oracle

    from pdserve.engine.speculative import SpeculativeConfig

    path = tp_checkpoints["gqa"]
    batch = tp_prompts(318)[:3]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=5, ignore_eos=True)
    oracle = Oracle(318, accept=2)
    monkeypatch.setattr("pdserve.engine.scheduler_spec.propose", oracle)
    spec = dataclasses.replace(tp_config(path, 1), speculative=SpeculativeConfig(
        num_speculative_tokens=3, disable_by_batch_size=8))
    with LLMEngine(tp_config(path, 1)) as engine:
        ref = engine.generate(batch, greedy)
    oracle.refs = [(p, r.token_ids) for p, r in zip(batch, ref)]
    with LLMEngine(spec) as engine:
        ref_sampled = [c.token_ids for c in engine.generate(batch, sampled)]
    with LLMEngine(dataclasses.replace(spec, tensor_parallel_size=2)) as engine:
        assert [c.token_ids for c in engine.generate(batch, greedy)] == [r.token_ids for r in ref]
        s = engine.scheduler.speculation
        assert 0 < s.accepted < s.drafted and max(s.acceptance_lengths) == 2, (s.drafted, s.accepted)
        assert [c.token_ids for c in engine.generate(batch, sampled)] == ref_sampled
        assert engine.pool.num_used_blocks == 0
    with pytest.raises(ValueError, match="draft model on a tensor-parallel worker"):
        dataclasses.replace(tp_config(path, 2), speculative=SpeculativeConfig(
            method="draft_model", model=str(path), num_speculative_tokens=2))
