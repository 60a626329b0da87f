"""Penalties and min_tokens in the sampler (pdserve.engine.sampling) and through the offline engine.

- Penalties.apply / sample on random logits against references: presence and frequency from OpenAI's
  formula over the output's tokens, repetition from transformers' RepetitionPenaltyLogitsProcessor over the
  prompt's and the output's, combined; a PENDING last token (pipelined decode) read from the device;
- greedy decoding with a repetition penalty equals transformers' generate token for token (SmolLM2 and a
  tiny checkpoint);
- min_tokens holds EOS and the stop ids back (the engine on SmolLM2; `sample`: banned ids are never drawn);
- pipelined decode gives the tokens of the plain loop for penalized requests;
- SamplingParams rejects out-of-range values, naming the field.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import transformers
from transformers import RepetitionPenaltyLogitsProcessor

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.request import PENDING, FinishReason
from pdserve.engine.sampling import Penalties, SamplingBatch, SamplingParams, sample
from pdserve.model.loader import load

VOCAB = 50


def smollm2():
    """The session's SmolLM2 (pdserve's LoadedModel, transformers' model), loaded once for both files."""
    from test_logprobs import smollm2_or_skip

    return smollm2_or_skip()


@pytest.fixture(scope="module")
def gqa(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return str(path), load(EngineConfig(model=str(path)))


def engine(path, loaded, pipelined: bool | None = None, num_blocks: int = 256) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, pipelined_decode=pipelined,
                                  cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)), loaded)


def chat(loaded, text: str) -> list[int]:
    return loaded.info.tokenizer.apply_chat_template([{"role": "user", "content": text}])


# --- 5. the formulas on random logits -----------------------------------------------------------------------------

# (params, prompt, output): every kind alone and combined, negative penalties, a repetition penalty below 1,
# tokens repeated in the output and shared with the prompt, a row with no output yet, and an unpenalized row.
ROWS = [
    (SamplingParams(presence_penalty=0.7), [1, 2, 3], [4, 4, 5]),
    (SamplingParams(frequency_penalty=0.5), [6, 7], [7, 8, 8, 8, 9]),
    (SamplingParams(repetition_penalty=1.5), [10, 11, 12, 10], [12, 13]),
    (SamplingParams(presence_penalty=-0.4, frequency_penalty=1.2, repetition_penalty=0.7), [14, 15, 14],
     [15, 16, 16, 17]),
    (SamplingParams(), [1, 2], [3]),
    (SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0), [18, 19, 20], []),
    (SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=1.1), [0], [0, 0, 21, 49]),
]


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One row: transformers' repetition penalty over prompt + output, then OpenAI's frequency and presence
    penalties over the output (logit -= frequency * count + presence * (count > 0))."""
    x = logits[None].clone()
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompt + output]), x)
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[-1]).float()
    return (x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float())[0]


def random_logits(seed: int) -> torch.Tensor:
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    for r, (_, prompt, output) in enumerate(ROWS):
        # The tokens a row has seen lead: the penalties decide its greedy token. Half of them negative.
        seen = sorted(set(prompt + output))
        logits[r, seen] = logits[r].abs().max() + torch.arange(1, len(seen) + 1, dtype=torch.float32) * 0.3
        logits[r, seen[::2]] *= -1
    return logits


def build(params, histories, pending=(), previous=None) -> SamplingBatch:
    return SamplingBatch.build(params, seeds=list(range(len(params))), output_index=[len(o) for _, _, o in ROWS],
                               histories=histories, pending=pending, previous=previous)


def histories() -> list[list[int] | None]:
    return [prompt + output if p.penalized else None for p, prompt, output in ROWS]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_apply_matches_the_references(seed):
    logits = random_logits(seed)
    before = logits.clone()
    batch = build([p for p, _, _ in ROWS], histories())
    assert batch.penalties is not None and batch.penalties.rows.tolist() == [0, 1, 2, 3, 5, 6]
    got = batch.penalties.apply(logits)
    assert torch.equal(logits, before)  # a new tensor: the raw logits stay for raw logprobs
    want = torch.stack([reference(logits[r], prompt, output, p) for r, (p, prompt, output) in enumerate(ROWS)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert torch.equal(got[4], logits[4])
    changed = (got != logits).any(dim=-1).tolist()
    assert changed == [True, True, True, True, False, True, True]
    # Presence and frequency look at the output only: a prompt-only token keeps its logit.
    assert got[0, 1] == logits[0, 1] and got[1, 6] == logits[1, 6]


def test_pending_token_counts_as_output():
    """Pipelined decode: a row's last output token is PENDING on the host, read from the step before's
    sampled tokens on the device; the result is that of the full history."""
    logits = random_logits(3)
    hist = histories()
    want = build([p for p, _, _ in ROWS], hist).penalties.apply(logits)
    previous = torch.tensor([5, 33, 0])  # the step before's sampled rows; the pending tokens are at 0 and 2
    pending_hist = [list(h) if h is not None else None for h in hist]
    pending = [None] * len(ROWS)
    for r, src in ((3, 2), (6, 0)):  # rows whose last output tokens (17, 49) are still on the device
        previous[src] = pending_hist[r][-1]
        pending_hist[r][-1] = PENDING
        pending[r] = src
    penalties = build([p for p, _, _ in ROWS], pending_hist, pending, previous).penalties
    assert penalties.pending is not None
    torch.testing.assert_close(penalties.apply(logits), want, atol=0, rtol=0)
    # The pending tokens matter: without them the rows' logits are others.
    for r in (3, 6):
        p, prompt, output = ROWS[r]
        assert not torch.equal(reference(logits[r], prompt, output[:-1], p), want[r])


def test_sample_draws_from_the_penalized_logits():
    logits = random_logits(4)
    want = torch.stack([reference(logits[r], prompt, output, p) for r, (p, prompt, output) in enumerate(ROWS)])
    # Greedy: the argmax of the penalized logits, which the seen tokens' lead makes differ from the raw one.
    greedy = [replace(p, temperature=0.0, logprobs=5, logprobs_mode="processed") for p, _, _ in ROWS]
    tokens, lp = sample(logits, build(greedy, histories()))
    assert tokens.tolist() == want.argmax(-1).tolist()
    assert tokens.tolist() != logits.argmax(-1).tolist()
    torch.testing.assert_close(lp.top_logprobs, want.log_softmax(-1).topk(5).values, atol=1e-5, rtol=0)
    # Sampling, processed: the sampled tokens' logprobs and the top 20 under log_softmax(penalized / T);
    # raw rows beside them read the raw logits.
    params = [replace(p, temperature=0.8, seed=9, logprobs=20, logprobs_mode="processed" if r % 2 else "raw")
              for r, (p, _, _) in enumerate(ROWS)]
    tokens, lp = sample(logits, build(params, histories()))
    for r in range(len(ROWS)):
        dist = (want[r] / 0.8 if r % 2 else logits[r]).log_softmax(-1)
        assert lp.logprob[r].item() == pytest.approx(dist[tokens[r]].item(), abs=1e-5)
        torch.testing.assert_close(lp.top_logprobs[r], dist.topk(20).values, atol=1e-5, rtol=0)
        assert lp.rank[r].item() == 1 + int((dist > dist[tokens[r]]).sum())
    # Over many draws the frequencies follow the penalized distribution, not the raw one.
    row, (p, prompt, output) = 6, ROWS[6]
    n = 4000
    params = [replace(p, temperature=1.0)] * n
    batch = SamplingBatch.build(params, [77] * n, [len(output)] * n, histories=[prompt + output] * n)
    batch = replace(batch, output_index=tuple(range(n)))  # the same row n times, each with noise of its own
    drawn, _ = sample(logits[row].expand(n, VOCAB).contiguous(), batch)
    freq = torch.bincount(drawn, minlength=VOCAB).float() / n
    assert (freq - want[row].softmax(-1)).abs().max() < 0.03
    assert (freq - logits[row].softmax(-1)).abs().max() > 0.1


@pytest.mark.parametrize("name", [pytest.param("smollm2", marks=pytest.mark.slow), "gqa"])
def test_greedy_repetition_penalty_equals_transformers_generate(name, gqa):
    if name == "smollm2":
        loaded, hf = smollm2()
        path, prompt = None, chat(loaded, "Repeat the word hello ten times.")
        hf_kwargs = dict(eos_token_id=list(loaded.info.eos_token_ids), pad_token_id=2)
        plain_kw: dict = {}
    else:
        path, loaded = gqa
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompt = torch.randint(0, VOCAB * 6, (9,), generator=torch.Generator().manual_seed(5)).tolist()
        hf_kwargs = dict(min_new_tokens=16, pad_token_id=0)
        plain_kw = dict(ignore_eos=True)
    eng = engine(path, loaded)
    for penalty in (1.3, 0.8):
        params = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=penalty, **plain_kw)
        plain, ours = eng.generate([prompt, prompt], [replace(params, repetition_penalty=1.0), params])
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=penalty,
                              **hf_kwargs)[0, len(prompt):].tolist()
        assert ours.token_ids == ref, penalty
        assert ours.token_ids != plain.token_ids, penalty  # the penalty decided some tokens


# --- 6. min_tokens ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_min_tokens_holds_eos_and_stop_ids_back_on_smollm2():
    loaded, _ = smollm2()
    eos = set(loaded.info.eos_token_ids)
    prompt = chat(loaded, "Is the sky blue? Answer yes or no.")
    base = SamplingParams(max_tokens=40, temperature=0.0)
    free = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64)), loaded).generate([prompt], base)[0]
    assert free.finish_reason is FinishReason.STOP and free.token_ids[-1] in eos and len(free.token_ids) < 6
    stop_id = free.token_ids[-2]  # the answer's last token before EOS: a stop id it would stop at too
    eng = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64)), loaded)
    stopped, held = eng.generate([prompt, prompt], [replace(base, stop_token_ids=(stop_id,)),
                                                    replace(base, stop_token_ids=(stop_id,), min_tokens=12,
                                                            max_tokens=16)])
    assert stopped.token_ids == free.token_ids[:-1] and stopped.finish_reason is FinishReason.STOP
    assert len(held.token_ids) >= 12
    assert not set(held.token_ids[:12]) & (eos | {stop_id})
    assert held.token_ids[:1] == free.token_ids[:1]  # held back, not a different answer
    # ignore_eos with min_tokens: the stop id is still held back, EOS is not banned (nor ending the request).
    ignored = eng.generate([prompt], replace(base, max_tokens=14, min_tokens=14, ignore_eos=True,
                                             stop_token_ids=(stop_id,)))[0]
    assert len(ignored.token_ids) == 14 and stop_id not in ignored.token_ids
    assert ignored.token_ids[:len(free.token_ids) - 2] == free.token_ids[:-2]


@pytest.mark.parametrize("pipelined", [False, True])
def test_min_tokens_boundary_on_a_tiny_model(gqa, pipelined):
    """min_tokens m bans the stop ids for output tokens 0 .. m-1 exactly: a stop id the free greedy run
    produces at index m - 1 is held back there; one it produces at index m ends the request there."""
    path, loaded = gqa
    eng = engine(path, loaded, pipelined=pipelined)
    prompt = torch.randint(1, 300, (6,), generator=torch.Generator().manual_seed(12)).tolist()
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = eng.generate([prompt], base)[0].token_ids
    # An index m whose token is new there and whose next token is new too (neither appeared before).
    m = next(m for m in range(4, 20) if free[m - 1] not in free[:m - 1] and free[m] not in free[:m])
    at_m, before_m = eng.generate([prompt, prompt], [replace(base, min_tokens=m, stop_token_ids=(free[m],)),
                                                     replace(base, min_tokens=m, stop_token_ids=(free[m - 1],))])
    assert at_m.token_ids == free[:m + 1] and at_m.finish_reason is FinishReason.STOP
    assert before_m.token_ids[:m - 1] == free[:m - 1] and before_m.token_ids[m - 1] != free[m - 1]
    assert eng.pool.num_used_blocks == 0


def test_banned_ids_are_never_drawn():
    n = 256
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(6))
    banned = (3, 7, 11)
    logits[:, list(banned)] += 20.0  # the likeliest tokens by far
    kinds = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=1.0, logprobs=5),
             SamplingParams(temperature=1.5, top_k=4, logprobs=5, logprobs_mode="processed"),
             SamplingParams(temperature=0.7, top_p=0.9, logprobs=5, logprobs_mode="processed")]
    params = [kinds[r % len(kinds)] for r in range(n)]
    rows_banned = [banned if r % 8 < 4 else () for r in range(n)]  # half the rows ban them
    tokens, lp = sample(logits, SamplingBatch.build(params, list(range(n)), [r // 8 for r in range(n)],
                                                    banned=rows_banned))
    for r in range(n):
        if rows_banned[r]:
            assert tokens[r].item() not in banned
            top = set(lp.top_ids[r].tolist())
            if params[r].logprobs_mode == "processed":
                assert not top & set(banned)  # -inf in the distribution drawn from
            else:
                assert set(banned) <= top  # raw: the model's own view, banned or not
        else:
            assert tokens[r].item() in banned  # drawn when allowed (they hold almost all the mass)
    # min_tokens through the batch: a greedy row's EOS lead does not win while banned.
    eos_first = torch.full((1, VOCAB), -1.0)
    eos_first[0, 2] = 10.0
    tok, _ = sample(eos_first, SamplingBatch.build([SamplingParams(temperature=0.0)], [0], [0], banned=[(2,)]))
    assert tok.item() != 2


# --- 7. pipelined decode with penalties ---------------------------------------------------------------------------

def test_pipelined_decode_with_penalties_equals_plain(gqa, monkeypatch):
    path, loaded = gqa
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (7, 12, 5, 9)]
    free = engine(path, loaded).generate([prompts[2]], SamplingParams(max_tokens=24, temperature=0.0,
                                                                      ignore_eos=True))[0]
    stop_id = free.token_ids[2]
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, seed=5, presence_penalty=0.6, frequency_penalty=0.4,
                       repetition_penalty=1.3, ignore_eos=True, logprobs=3, logprobs_mode="processed"),
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, ignore_eos=True,
                       logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=10, stop_token_ids=(stop_id,), ignore_eos=True,
                       repetition_penalty=1.2),
        SamplingParams(max_tokens=24, temperature=0.9, seed=6, frequency_penalty=1.5, ignore_eos=True),
    ]
    pending_steps = []
    apply = Penalties.apply

    def counting_apply(self, logits):
        pending_steps.append(self.pending is not None)
        return apply(self, logits)

    monkeypatch.setattr(Penalties, "apply", counting_apply)
    results = {}
    for pipelined in (False, True):
        eng = engine(path, loaded, pipelined=pipelined)
        assert eng.core.pipelined is pipelined
        pending_steps.clear()
        results[pipelined] = eng.generate(prompts, params)
        assert any(pending_steps) is pipelined  # pipelined: the penalties read PENDING tokens on the device
        assert eng.pool.num_used_blocks == 0
    for a, b in zip(results[False], results[True]):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    held = results[True][2].token_ids
    assert len(held) >= 10 and stop_id not in held[:10]
    # The penalties decided tokens: without them the same requests give other ones.
    unpenalized = engine(path, loaded).generate(
        prompts, [replace(p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0) for p in params])
    for i in (0, 1, 3):
        assert unpenalized[i].token_ids != results[True][i].token_ids


# --- 8. validation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(frequency_penalty=math.inf), "frequency_penalty"), (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"), (dict(min_tokens=17), "min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(logprobs_mode="x"), "logprobs_mode"), (dict(logprobs_mode="RAW"), "logprobs_mode"),
])
def test_sampling_params_reject_out_of_range_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_range_ends():
    for kwargs in (dict(logprobs=0), dict(logprobs=20, prompt_logprobs=20), dict(presence_penalty=-2.0),
                   dict(frequency_penalty=2.0), dict(repetition_penalty=1e-3), dict(min_tokens=16),
                   dict(logprobs_mode="processed")):
        SamplingParams(**kwargs)
    assert not SamplingParams(logprobs=5).penalized
    assert SamplingParams(repetition_penalty=1.01).penalized and SamplingParams(presence_penalty=-0.1).penalized
