"""Speculative decoding on a real local Ray cluster: serving SmolLM2, a decode pool of two workers (2P2D) and a
colocated pool speculating by prompt lookup stream greedy output token-identical to the offline engine without
speculation (penalized, min_tokens and JSON schema requests among them), a stop string ends a stream
mid-verification where plain decoding ends it, the workers report drafted and accepted tokens, and every KV block is
given back; and a tensor-parallel prefill pool (TP 2) handing off to a speculating decode worker (TP 1), on a tiny
checkpoint whose heads TP 2 can split."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.config import ClusterConfig, PoolConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.speculative import SpeculativeConfig
from pdserve.engine.structured import StructuredOutput
from router.cluster import Cluster

from conftest import smol_1p1d_engine_config, wait_for
from served import collect_all

SPEC = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8)
TEXTS = [
    "Rewrite this file exactly, renaming add to plus:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
    "    return a - b\n",
    "Write a short poem about autumn.",
]


@pytest.fixture(scope="module")
def case():
    engine = smol_1p1d_engine_config()
    offline = LLMEngine(engine)
    tok = offline.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in TEXTS]
    params = [SamplingParams(max_tokens=40, temperature=0.0) for _ in prompts]
    # Requests whose drafted positions need the plain step's processing: penalties, min_tokens (the short
    # reply would end before it), a JSON schema (the decode worker's own matcher, from the hand-off's token).
    schema = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                                         "required": ["name"]}))
    prompts += [prompts[0], tok.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                                    add_generation_prompt=True), prompts[0]]
    params += [SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3),
               SamplingParams(max_tokens=28, temperature=0.0, min_tokens=24),
               SamplingParams(max_tokens=40, temperature=0.0, structured=schema)]
    want = offline.generate(prompts, params)
    # A stop string in the copied part: the stream must end exactly where plain decoding ends it.
    stop = want[0].text[20:24]
    stopped = offline.generate([prompts[0]], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0]
    return engine, prompts, params, want, (stop, stopped)


# Two of each, not one: every request still goes through one prefill and one decode worker (what 1P1D would
# check), and both decode workers must speculate.
@pytest.mark.parametrize("shape", ["2P2D", "colocated"])
def test_cluster_greedy_token_exact_with_speculation(ray_local, aloop, case, shape):
    engine, prompts, params, want, (stop, stopped) = case
    n = 2 if shape == "2P2D" else 1
    pool = PoolConfig(n, num_cpus=0.25, speculative=SPEC)
    mode = "colocated" if shape == "colocated" else "disaggregated"
    pools = dict(colocated=pool) if mode == "colocated" else dict(prefill=PoolConfig(n, num_cpus=0.25), decode=pool)
    cluster = Cluster(ClusterConfig(engine=engine, mode=mode, **pools))
    aloop.run(cluster.start(), timeout=600)
    try:
        got = aloop.run(collect_all(cluster, prompts, params), timeout=300)
        assert [g[0] for g in got] == [w.token_ids for w in want]
        assert [g[1] for g in got] == [w.text for w in want]
        (tokens, text, reason), = aloop.run(collect_all(
            cluster, [prompts[0]], [dataclasses.replace(params[0], stop=(stop,))]), timeout=300)
        assert (tokens, text) == (stopped.token_ids, stopped.text) and reason == "stop"
        stats = aloop.run(cluster.stats())
        spec = [s.speculation for s in stats if s.speculation]
        assert len(spec) == n and sum(x["drafted"] for x in spec) > 0 and sum(x["accepted"] for x in spec) > 0
        assert all(not s.speculation for s in stats if s.pool == "prefill")
        wait_for(lambda: sum(s.kv_blocks_used for s in aloop.run(cluster.stats())) == 0, timeout=60,
                 what="every KV block given back")
    finally:
        aloop.run(cluster.shutdown())


def test_tp_prefill_hands_off_to_a_speculating_decode_worker(ray_local, aloop, tmp_path):
    """TP (2, 1): a prefill worker of two ranks computes the prompt, a one-rank decode worker speculates; greedy
    output equals the offline engine's without speculation. The tiny model's greedy replies fall into loops, which
    prompt lookup drafts from."""
    from conftest import build_tiny_checkpoint
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig

    path = build_tiny_checkpoint(tmp_path / "gqa", "llama", num_attention_heads=8, num_key_value_heads=2)
    engine = EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8))
    prompts = [[(7 * i + j) % 320 for j in range(5 + 9 * i)] for i in range(3)]
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) for _ in prompts]
    with LLMEngine(engine) as offline:
        want = offline.generate(prompts, params)
    cluster = Cluster(ClusterConfig(
        engine=engine, prefill=PoolConfig(1, num_cpus=0.1, tensor_parallel_size=2, torch_threads=1),
        decode=PoolConfig(1, num_cpus=0.1, tensor_parallel_size=1, torch_threads=1, speculative=SPEC)))
    aloop.run(cluster.start(), timeout=600)
    try:
        got = aloop.run(collect_all(cluster, prompts, params), timeout=300)
        assert [g[0] for g in got] == [w.token_ids for w in want]
        spec = [s.speculation for s in aloop.run(cluster.stats()) if s.speculation]
        assert len(spec) == 1 and spec[0]["drafted"] > 0, spec
        wait_for(lambda: sum(s.kv_blocks_used for s in aloop.run(cluster.stats())) == 0, timeout=60,
                 what="every KV block given back")
    finally:
        aloop.run(cluster.shutdown())


def test_1p2d_with_a_draft_model_greedy_exact_and_resumed_after_a_fault(ray_local, aloop, tmp_path, tiny_checkpoints):
    """Decode workers drafting with a draft model (the tiny Llama's weights moved by noise): greedy output equals the
    offline engine's without speculation; a stream whose decode worker is killed mid-stream resumes on the other one,
    which computes the draft's KV of the prompt and the tokens streamed so far and drafts on, token-exact; the draft's
    KV blocks, like the target's, are all given back."""
    import contextlib

    import ray

    from conftest import perturbed_checkpoint
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig

    draft = perturbed_checkpoint(tiny_checkpoints["llama"], tmp_path / "draft", scale=0.03, seed=3)
    spec = SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=3, disable_by_batch_size=8)
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=4, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    prompts = [[(7 * i + j) % 320 for j in range(5 + 9 * i)] for i in range(3)]
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) for _ in prompts]
    with LLMEngine(engine) as offline:
        want = offline.generate(prompts, params)
        long = offline.generate([prompts[2]], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))[0]
    cluster = Cluster(ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.1, torch_threads=1),
                                    decode=PoolConfig(2, num_cpus=0.1, torch_threads=1, speculative=spec)))
    aloop.run(cluster.start(), timeout=600)
    try:
        got = aloop.run(collect_all(cluster, prompts, params), timeout=300)
        assert [g[0] for g in got] == [w.token_ids for w in want]
        spec_stats = [s.speculation for s in aloop.run(cluster.stats()) if s.speculation]
        assert len(spec_stats) == 2 and sum(x["drafted"] for x in spec_stats) > 0
        assert all(x["method"] == "draft_model" and x["draft_stale"] is False for x in spec_stats)
        lost = cluster.retries["decode_lost"]

        async def killed_midway() -> list[int]:
            tokens: list[int] = []
            killed = False
            gen = cluster.generate(prompts[2], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True),
                                   "resumed")
            async with contextlib.aclosing(gen) as outs:
                async for out in outs:
                    assert out.error is None, out.error
                    tokens += out.new_token_ids
                    if not killed and len(tokens) >= 8:
                        # worker-side ids are "{rid}#{attempt}" (router.retries)
                        victim = next(w for w in cluster.pools["decode"] if "resumed#0" in w.requests)
                        ray.kill(victim.handle, no_restart=True)
                        killed = True
            return tokens

        assert aloop.run(killed_midway(), timeout=300) == long.token_ids
        assert cluster.retries["decode_lost"] == lost + 1
        wait_for(lambda: all(s.kv_blocks_used == 0 and s.speculation.get("draft_kv_blocks_used", 0) == 0
                             for s in aloop.run(cluster.stats())), timeout=60,
                 what="every KV block, the target's and the draft's, given back")
    finally:
        aloop.run(cluster.shutdown())


def test_a_draft_of_another_vocabulary_is_refused_before_workers_start(ray_local, aloop, tmp_path, tiny_checkpoints):
    from conftest import build_tiny_checkpoint
    from pdserve.config import EngineConfig

    other = build_tiny_checkpoint(tmp_path / "vocab", "llama", vocab_size=300)
    spec = SpeculativeConfig(method="draft_model", model=str(other))
    cluster = Cluster(ClusterConfig(engine=EngineConfig(model=str(tiny_checkpoints["llama"])),
                                    prefill=PoolConfig(1, num_cpus=0.1), decode=PoolConfig(1, num_cpus=0.1,
                                                                                           speculative=spec)))
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        aloop.run(cluster.start(), timeout=120)
    assert not cluster.pools.get("decode")  # refused before any worker started
    aloop.run(cluster.shutdown())
