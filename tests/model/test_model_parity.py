"""Numerical parity with Hugging Face transformers on tiny seeded checkpoints, through the paged cache."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams

ARCHS = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3"]
PROMPT_LENS = [5, 17, 33, 8, 1]
NEW_TOKENS = 32


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def small_engine(path, **sched) -> LLMEngine:
    # Small blocks and a small token budget: prompts span several blocks, prefills are chunked and
    # share steps with decodes.
    return LLMEngine(EngineConfig(
        model=str(path), cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=sched.get("budget", 16), max_num_seqs=sched.get("seqs", 8)),
    ))


def run_with_logits(engine: LLMEngine, batch: list[list[int]], params: SamplingParams):
    """The engine's own step path, keeping each request's sampled-row logits."""
    rids = [engine.add_request(p, params) for p in batch]
    tokens = {r: [] for r in rids}
    logits = {r: [] for r in rids}
    while engine.has_unfinished:
        step = engine.scheduler.schedule()
        res = engine.runner.execute(step.chunks)
        for i, row in zip(res.sampling_chunks, res.logits):
            logits[step.requests[i].request_id].append(row)
        for out in engine.process(engine.core.account(step, res)):
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[r] for r in rids], [torch.stack(logits[r]) for r in rids]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_logits_match_transformers(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    engine = small_engine(path)
    batch = prompts(engine.model_config.vocab_size)
    ours, our_logits = run_with_logits(engine, batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                      ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, toks, lg in zip(batch, ours, our_logits):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)
            ref_tokens = ref[0, len(prompt):].tolist()
            # Logits predicting each generated token, from one forward over the whole sequence.
            ref_logits = hf(ref[:, :-1]).logits[0, len(prompt) - 1:]
        assert toks == ref_tokens
        assert lg.shape == ref_logits.shape
        torch.testing.assert_close(lg, ref_logits, atol=1e-4, rtol=0)
    assert engine.pool.num_used_blocks == 0
    engine.pool.check_integrity()


def test_model_config_reads_hf_configs(tiny_checkpoints):
    cfg = ModelConfig.from_hf(json.loads((tiny_checkpoints["qwen2"] / "config.json").read_text()))
    assert (cfg.architecture, cfg.attention_bias, cfg.qk_norm) == ("qwen2", True, False)
    cfg = ModelConfig.from_hf(json.loads((tiny_checkpoints["qwen3"] / "config.json").read_text()))
    assert (cfg.qk_norm, cfg.head_dim) == (True, 16)
    cfg = ModelConfig.from_hf(json.loads((tiny_checkpoints["llama3-rope"] / "config.json").read_text()))
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0 and cfg.rope_theta == 500000.0
    assert cfg.tie_word_embeddings


@pytest.mark.parametrize("arch", ARCHS)
def test_num_params_matches_transformers(tiny_checkpoints, arch):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints[arch])
    assert ModelConfig.from_hf(hf.config.to_dict()).num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("dtype,atol", [("bfloat16", 0.15), ("float16", 0.02)])
def test_half_precision_close_to_fp32(tiny_checkpoints, dtype, atol):
    path = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    batch = prompts(320)
    _, ref = run_with_logits(small_engine(path), batch, params)
    eng = LLMEngine(EngineConfig(model=str(path), dtype=dtype, cache=CacheConfig(block_size=4, num_blocks=128)))
    assert eng.runner.kv_cache.dtype == getattr(torch, dtype)
    _, got = run_with_logits(eng, batch, params)
    for a, b in zip(got, ref):
        scale = b.abs().max()
        assert (a - b).abs().max() / scale < atol


def test_torch_path_matches_transformers(tiny_checkpoints, monkeypatch):
    """The torch reference ops (every CPU kernel forced off) hold the same parity as the kernels above."""
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "torch")
    test_greedy_tokens_and_logits_match_transformers(tiny_checkpoints, "qwen3")
    test_greedy_tokens_and_logits_match_transformers(tiny_checkpoints, "qwen2")


# Reduced precision against fp32 on the same checkpoint. Bounds on max |logit error| / max |logit| of a
# step, over every step while the tokens agree, with the worst case measured over the three tiny
# checkpoints in brackets: bf16 0.15 (0.036-0.108), int8 weights 0.2 (0.047-0.135), both 0.2 (0.063-0.138).
# (Random tiny models have large logits and no training to make them robust; the real model's greedy
# tokens are compared in bench.engine.vs_llamacpp.) Where tokens part, fp32's margin measured 0.02-1.03 x
# the step's error.
REDUCED = [("bfloat16", None, 0.15), ("float32", "int8", 0.2), ("bfloat16", "int8", 0.2)]


@pytest.mark.parametrize("dtype,quantization,bound", REDUCED)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_reduced_precision_close_to_fp32(tiny_checkpoints, arch, dtype, quantization, bound):
    """Logits within the bound while the tokens agree; and where greedy tokens part, fp32's own top-2
    margin there is within the error the bound allows (a near-tie, not a wrong model)."""
    path = tiny_checkpoints[arch]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    batch = prompts(320)
    ref_tokens, ref_logits = run_with_logits(small_engine(path), batch, params)
    eng = LLMEngine(EngineConfig(model=str(path), dtype=dtype, quantization=quantization,
                                 cache=CacheConfig(block_size=4, num_blocks=128)))
    tokens, logits = run_with_logits(eng, batch, params)
    compared = 0
    for ours, ref, lg, ref_lg in zip(tokens, ref_tokens, logits, ref_logits):
        for i, (a, b) in enumerate(zip(ours, ref)):
            scale = ref_lg[i].abs().max()
            err = (lg[i] - ref_lg[i]).abs().max()
            assert err / scale < bound, f"step {i}: logit error {err / scale:.3f} of the largest logit"
            compared += 1
            if a != b:
                top2 = ref_lg[i].topk(2).values
                assert top2[0] - top2[1] <= 2 * err, f"tokens part at step {i} with a clear fp32 margin"
                break
    assert compared >= len(batch) * 4  # the check saw more than the first tokens
    assert eng.pool.num_used_blocks == 0
