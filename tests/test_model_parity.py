"""Numerical parity with Hugging Face transformers on tiny seeded checkpoints, through the paged cache."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.sampling import SamplingParams

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
