"""Live weight updates (pdserve.weights.update) on tiny real checkpoints: a model loaded from checkpoint A,
updated with checkpoint B's tensors, equals the model loaded from B exactly (fp32, bf16, int8, TP shares)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.model.linear import Linear, quantize_rows
from pdserve.model.loader import load, load_shard
from pdserve.weights.update import (
    StagedUpdate,
    TensorMeta,
    WeightError,
    check_metas,
    expected_tensors,
    stage,
    stage_checkpoint,
)

# llama: GQA and a vocabulary TP 2 and TP 4 do not divide (the last rank's rows padded); qwen2: q/k/v biases
# and tied embeddings; qwen3: q/k norms, head_dim apart from hidden / heads.
ARCHS = {"llama": ("llama", dict(vocab_size=319)),
         "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
         "qwen3": ("qwen3", {})}


def perturbed(src: Path, dst: Path) -> Path:
    """A copy of checkpoint src with every tensor changed."""
    dst.mkdir()
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            tensors[name] = t + 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    from conftest import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("weights")
    out = {}
    for kind, (arch, overrides) in ARCHS.items():
        a = build_tiny_checkpoint(root / f"{kind}-a", arch, **overrides)
        out[kind] = (a, perturbed(a, root / f"{kind}-b"))
    return out


def file_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for f in sorted(path.glob("*.safetensors")) for n, t in load_file(str(f)).items()]


def tensors_of(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, tied ones under each name (int8 weights and scales are buffers)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tensors_of(model).items()}


def ptrs(model) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in tensors_of(model).items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in got:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def engine_config(path: Path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=64),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4), **kw)


def commit_checked(update: StagedUpdate, model) -> None:
    """Commit, and check that it wrote in place: every parameter and buffer keeps its storage."""
    before = ptrs(model)
    update.commit(model)
    assert ptrs(model) == before


@pytest.mark.parametrize("kind", ARCHS)
def test_expected_tensors_are_a_saved_checkpoints(ckpts, kind):
    a, _ = ckpts[kind]
    loaded = load(engine_config(a))
    with safe_open(str(a / "model.safetensors"), framework="pt") as f:
        saved = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert expected_tensors(loaded.info.config) == saved
    assert ("lm_head.weight" in saved) == (kind != "qwen2-tied")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ARCHS)
def test_an_update_to_b_equals_loading_b(ckpts, kind, dtype):
    """Staged from B's tensors or from B's directory; nothing changes before the commit; in place."""
    a, b = ckpts[kind]
    loaded = load(engine_config(a, dtype=dtype))
    model, cfg = loaded.model, loaded.info.config
    want = tensors_of(load(engine_config(b, dtype=dtype)).model)
    before = snapshot(model)
    update = stage(model, cfg, file_tensors(b))
    assert_same(tensors_of(model), before)
    assert update.names == [n for n, _ in file_tensors(b)]
    assert update.num_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    commit_checked(update, model)
    assert_same(tensors_of(model), want)

    model = load(engine_config(a, dtype=dtype)).model
    update = stage_checkpoint(model, cfg, str(b))
    assert_same(tensors_of(model), before)
    commit_checked(update, model)
    assert_same(tensors_of(model), want)


@pytest.mark.parametrize("kind, tp, quantization, dtype", [
    ("llama", 1, None, "float32"), ("llama", 1, "int8", "float32"), ("qwen2-tied", 1, None, "bfloat16"),
    ("llama", 2, None, "float32"), ("qwen2-tied", 2, "int8", "float32")])
def test_adopted_tensors_are_staged_uncopied_and_equal_loading_b(ckpts, kind, tp, quantization, dtype):
    """adopt (a weight group's arena): a tensor or rank's share already as the model holds it is staged where it
    is, never written (int8 layers quantize from it); one in another dtype or not contiguous is copied. The
    commit equals loading B either way."""
    a, b = ckpts[kind]
    for rank in range(tp):
        loaded = load_shard(engine_config(a, dtype=dtype, quantization=quantization), tp, rank)
        model, cfg = loaded.model, loaded.info.config
        want = tensors_of(load_shard(engine_config(b, dtype=dtype, quantization=quantization), tp, rank).model)
        given = file_tensors(b)
        copies = [t.clone() for _, t in given]
        memory = {t.untyped_storage().data_ptr() for _, t in given}
        update = stage(model, cfg, given, tp=tp, rank=rank, adopt=True)
        assert all(torch.equal(t, c) for (_, t), c in zip(given, copies))  # nothing written into what was given
        adopted = [v.untyped_storage().data_ptr() in memory for v in update.buffers().values()]
        if (tp, quantization, dtype) == (1, None, "float32"):
            assert all(adopted)  # every value is the given tensor itself (a fused piece: its rows of it)
        if dtype == "bfloat16":
            assert not any(adopted)  # fp32 files into a bf16 model: converted copies
        commit_checked(update, model)
        assert_same(tensors_of(model), want)


def test_a_trainers_state_dict_applies(ckpts):
    """A bf16 trainer's state_dict of a tied model: "model."-prefixed names and a tied lm_head.weight (skipped)."""
    import transformers

    a, b = ckpts["qwen2-tied"]
    loaded = load(engine_config(a, dtype="bfloat16"))
    trainer = transformers.AutoModelForCausalLM.from_pretrained(b, dtype=torch.bfloat16)
    state = list(trainer.state_dict().items())
    assert "lm_head.weight" in dict(state)
    update = stage(loaded.model, loaded.info.config, state)
    assert "lm_head.weight" not in update.names
    commit_checked(update, loaded.model)
    assert_same(tensors_of(loaded.model), tensors_of(load(engine_config(b, dtype="bfloat16")).model))
    # Names without the "model." prefix are the same tensors.
    model = load(engine_config(a, dtype="bfloat16")).model
    stage(model, loaded.info.config, [(n.removeprefix("model."), t) for n, t in state]).commit(model)
    assert_same(tensors_of(model), tensors_of(loaded.model))


def test_int8_rows_are_linear_quantize_int8s_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(48, 40, generator=g) * torch.logspace(-4, 2, 48)[:, None]).to(dtype)
        w[3] = 0  # an all-zero row (a padded vocabulary row): the scale's floor
        lin = Linear(40, 48).to(dtype)
        lin.weight.data.copy_(w)
        lin.quantize_int8()
        q, scale = quantize_rows(w)  # what stage quantizes staged rows with
        assert q.dtype == torch.int8 and torch.equal(q, lin.weight)
        assert scale.dtype == torch.float32 and torch.equal(scale, lin.scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2-tied"])
def test_int8_update_equals_loading_b_int8(ckpts, kind, dtype):
    """int8 weights and scales bit-exact; a tied LM head, quantized apart from its embedding, follows it."""
    a, b = ckpts[kind]
    loaded = load(engine_config(a, dtype=dtype, quantization="int8"))
    model, cfg = loaded.model, loaded.info.config
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.int8 and model.lm_head.scale is not None
    want = tensors_of(load(engine_config(b, dtype=dtype, quantization="int8")).model)
    before = snapshot(model)
    update = stage(model, cfg, file_tensors(b))
    assert_same(tensors_of(model), before)
    commit_checked(update, model)
    assert_same(tensors_of(model), want)
    model = load(engine_config(a, dtype=dtype, quantization="int8")).model
    commit_checked(stage_checkpoint(model, cfg, str(b)), model)
    assert_same(tensors_of(model), want)


@pytest.mark.parametrize("kind, tp, quantization", [
    ("llama", 2, None), ("llama", 4, None), ("llama", 2, "int8"), ("qwen2-tied", 2, None),
    ("qwen2-tied", 4, "int8"), ("qwen3", 2, None)])
def test_a_ranks_update_equals_its_share_of_b(ckpts, kind, tp, quantization):
    """Each rank staged with B's full tensors (or B's directory) equals load_shard of B: the heads, MLP
    columns and vocabulary rows of its share (llama's 319 rows: the last rank's padded)."""
    a, b = ckpts[kind]
    for rank in range(tp):
        loaded = load_shard(engine_config(a, quantization=quantization), tp, rank)
        model, cfg = loaded.model, loaded.info.config
        want = tensors_of(load_shard(engine_config(b, quantization=quantization), tp, rank).model)
        before = snapshot(model)
        update = stage(model, cfg, file_tensors(b), tp=tp, rank=rank)
        assert_same(tensors_of(model), before)
        commit_checked(update, model)
        assert_same(tensors_of(model), want)
        model = load_shard(engine_config(a, quantization=quantization), tp, rank).model
        commit_checked(stage_checkpoint(model, cfg, str(b), tp=tp, rank=rank), model)
        assert_same(tensors_of(model), want)


def test_a_partial_update_changes_only_its_tensors(ckpts):
    a, b = ckpts["llama"]
    loaded = load(engine_config(a))
    model, cfg = loaded.model, loaded.info.config
    old, new = snapshot(model), tensors_of(load(engine_config(b)).model)
    names = ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"]
    bt = dict(file_tensors(b))
    update = stage(model, cfg, [(n, bt[n]) for n in names])
    assert update.names == names
    commit_checked(update, model)
    got = tensors_of(model)
    inter, q, kv = cfg.intermediate_size, cfg.q_size, cfg.kv_size
    changed = {"layers.1.mlp.gate_up_proj.weight": slice(inter, 2 * inter),
               "layers.0.self_attn.qkv_proj.weight": slice(q, q + kv), "norm.weight": slice(None)}
    for k, t in got.items():
        rows = changed.get(k)
        if rows is None:
            assert torch.equal(t, old[k]), k
            continue
        assert torch.equal(t[rows], new[k][rows]) and not torch.equal(t[rows], old[k][rows]), k
        mask = torch.ones(t.shape[0], dtype=torch.bool)
        mask[rows] = False
        assert torch.equal(t[mask], old[k][mask]), k


BAD = [
    (TensorMeta("model.layers.0.mlp.up_proj.weight", (10, 64), torch.float32),
     r"tensor 'model.layers.0.mlp.up_proj.weight': shape \(10, 64\), expected \(128, 64\)"),
    (TensorMeta("model.layers.2.mlp.up_proj.weight", (128, 64), torch.float32),
     "tensor 'model.layers.2.mlp.up_proj.weight': no such tensor"),
    (TensorMeta("model.layers.0.mlp.fc.weight", (128, 64), torch.float32), "'model.layers.0.mlp.fc.weight'"),
    (TensorMeta("model.norm.weight", (64,), torch.int64), "tensor 'model.norm.weight': dtype int64"),
    (TensorMeta("norm.weight", (64,), torch.float32), "tensor 'norm.weight': given twice"),
]


@pytest.mark.parametrize("bad, match", BAD)
def test_a_bad_tensor_is_named_and_nothing_is_applied(ckpts, bad, match):
    a, b = ckpts["llama"]
    loaded = load(engine_config(a))
    model, cfg = loaded.model, loaded.info.config
    # B's other tensors, before the bad one (they hold model.norm.weight: norm.weight is the same tensor again).
    good = [(n, t) for n, t in file_tensors(b) if n != bad.name]
    metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in good]
    with pytest.raises(WeightError, match=match):
        check_metas(metas + [bad], cfg)
    before = snapshot(model)
    with pytest.raises(WeightError, match=match):
        stage(model, cfg, good + [(bad.name, torch.zeros(bad.shape, dtype=bad.dtype))])
    assert_same(tensors_of(model), before)


def test_check_metas_skips_what_loading_skips(ckpts):
    a, _ = ckpts["qwen2-tied"]
    cfg = load(engine_config(a)).info.config
    metas = [TensorMeta(n, s, torch.bfloat16) for n, s in expected_tensors(cfg).items()]
    extra = [TensorMeta("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), torch.float16),
             TensorMeta("model.layers.0.self_attn.rotary_emb.inv_freq", (8,), torch.float32)]
    assert check_metas(metas + extra, cfg) == metas
    with pytest.raises(WeightError, match=r"'lm_head.weight': shape \(3, 64\)"):
        check_metas([TensorMeta("lm_head.weight", (3, 64), torch.float32)], cfg)


def test_another_models_checkpoint_or_share_is_refused(ckpts, tmp_path):
    a, _ = ckpts["llama"]
    qa, _ = ckpts["qwen3"]
    loaded = load(engine_config(a))
    with pytest.raises(WeightError, match="vocab_size 320, expected 319"):
        stage_checkpoint(loaded.model, loaded.info.config, str(qa))
    with pytest.raises(ValueError, match="not rank 0 of a TP 2 share"):
        stage(loaded.model, loaded.info.config, [], tp=2, rank=0)


def test_a_gguf_checkpoint_stages_through_the_dequantized_cache(ckpts, tmp_path):
    """B written as an F32 GGUF (llama: q/k rows permuted as llama.cpp stores them) equals B's directory."""
    import gguf

    from pdserve.model.gguf_loader import permute_qk

    a, b = ckpts["llama"]
    loaded = load(engine_config(a))
    model, cfg = loaded.model, loaded.info.config
    path = tmp_path / "b.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for add, value in ((w.add_block_count, cfg.num_layers), (w.add_context_length, cfg.max_position_embeddings),
                       (w.add_embedding_length, cfg.hidden_size), (w.add_feed_forward_length, cfg.intermediate_size),
                       (w.add_head_count, cfg.num_heads), (w.add_head_count_kv, cfg.num_kv_heads),
                       (w.add_key_length, cfg.head_dim), (w.add_value_length, cfg.head_dim),
                       (w.add_rope_dimension_count, cfg.head_dim), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_rope_freq_base, cfg.rope_theta), (w.add_vocab_size, cfg.vocab_size)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in file_tensors(b):
        if name.endswith("q_proj.weight"):
            t = permute_qk(t, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            t = permute_qk(t, cfg.num_kv_heads)
        if name not in names:
            _, _, i, *module, kind = name.split(".")
            names[name] = f"blk.{i}.{layer['.'.join(module)]}.{kind}"
        w.add_tensor(names[name], t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    commit_checked(stage_checkpoint(model, cfg, str(path)), model)
    assert_same(tensors_of(model), tensors_of(load(engine_config(b)).model))


def test_greedy_tokens_after_an_update_are_bs(ckpts):
    """An engine serving A, updated to B in place, generates B's greedy tokens (its prefix cache reset)."""
    a, b = ckpts["llama"]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 319, (n,), generator=g).tolist() for n in (5, 11, 17)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    loaded = load(engine_config(a))
    engine = LLMEngine(engine_config(a), loaded)
    tokens_a = [c.token_ids for c in engine.generate(prompts, params)]
    want = [c.token_ids for c in LLMEngine(engine_config(b)).generate(prompts, params)]
    assert tokens_a != want
    stage(engine.runner.model, loaded.info.config, file_tensors(b)).commit(engine.runner.model)
    assert engine.pool.reset_prefix_cache()
    assert [c.token_ids for c in engine.generate(prompts, params)] == want
