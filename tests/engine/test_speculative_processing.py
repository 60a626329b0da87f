"""Speculative verification's processing without a model (pdserve.engine.speculative.verification_batch, verify;
pdserve.engine.scheduler_spec.usable, grammar_masks): each drafted position's logits get exactly what the plain
sampler gives that position (penalties counting the drafts before it, min_tokens' banned ids while below it, the
grammar's mask after the drafts before it), greedy verification emits what plain steps would, sampled
verification keeps the processed distribution; drafts are cut where nothing more can be kept, and the matcher
is left where it was; the scheduler drafts under a grammar and advances it by the emitted tokens. SmolLM2's
tokenizer is read for the grammar cases (no weights are loaded)."""
from __future__ import annotations

import collections
import json

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling import SamplingBatch, SamplingParams, process_logits, sample, scale_logits
from pdserve.engine.scheduler_spec import grammar_masks, usable
from pdserve.engine.speculative import verification_batch, verify
from pdserve.engine.structured import StructuredOutput

from test_grammar import grammars, tok  # noqa: F401  (fixtures: SmolLM2's tokenizer and its compiler)

VOCAB = 12
EOS = (11,)
HISTORY = [3, 4, 5, 3, 7, 2, 2]  # prompt [3, 4, 5], then output [3, 7, 2, 2]: output_index 4
DRAFT = [2, 9, 3]
KINDS = {
    "penalties": SamplingParams(max_tokens=32, repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.9),
    "min_tokens": SamplingParams(max_tokens=32, min_tokens=6, stop_token_ids=[10]),
    "both": SamplingParams(max_tokens=32, min_tokens=5, repetition_penalty=0.7, frequency_penalty=-0.4),
}


def plain_batch(params: SamplingParams, i: int, temperature: float) -> SamplingBatch:
    """What a plain step gives the request at verification position i: its tokens and DRAFT[:i] sampled."""
    p = SamplingParams(**{**params.__dict__, "temperature": temperature})
    index = 4 + i
    banned = (*EOS, *p.stop_token_ids) if index < p.min_tokens else ()
    return SamplingBatch.build([p], [7], [index], histories=[HISTORY + DRAFT[:i]] if p.penalized else (),
                               banned=[banned])


def spec_batch(params: SamplingParams, temperature: float) -> SamplingBatch:
    p = SamplingParams(**{**params.__dict__, "temperature": temperature})
    banned = (*EOS, *p.stop_token_ids) if 4 < p.min_tokens else ()
    return verification_batch(p, 7, 4, DRAFT, list(HISTORY) if p.penalized else None, banned)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_position_is_processed_as_the_plain_step_there(kind, temperature):
    logits = torch.randn(len(DRAFT) + 1, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    params = KINDS[kind]
    batch = spec_batch(params, temperature)
    got = process_logits(logits, batch)
    got_scaled = scale_logits(got, batch)
    for i in range(len(DRAFT) + 1):
        plain = plain_batch(params, i, temperature)
        want = process_logits(logits[i:i + 1], plain)
        assert torch.equal(got[i:i + 1], want), (kind, i)
        assert torch.equal(got_scaled[i:i + 1], scale_logits(want, plain)), (kind, i)
    assert not torch.equal(got, logits)  # the processing did something at every kind


def test_greedy_verification_emits_plain_decodings_tokens():
    """Drafts equal to what plain greedy steps choose are all kept (then the bonus), whatever the penalties and the
    banned ids do to each position; a draft of the raw argmax that the processing moves is rejected there."""
    g = torch.Generator().manual_seed(5)
    for kind, params in KINDS.items():
        p = SamplingParams(**{**params.__dict__, "temperature": 0.0})
        for trial in range(20):
            logits = torch.randn(len(DRAFT) + 1, VOCAB, generator=g) * 4
            # Plain decoding from HISTORY, one token at a time, with the drafts forced to its choices.
            chosen = []
            for i in range(len(DRAFT) + 1):
                history = HISTORY + chosen
                index = 4 + i
                banned = (*EOS, *p.stop_token_ids) if index < p.min_tokens else ()
                b = SamplingBatch.build([p], [1], [index], histories=[history] if p.penalized else (), banned=[banned])
                chosen.append(int(sample(logits[i:i + 1], b)[0][0]))
            batch = verification_batch(p, 1, 4, chosen[:-1], list(HISTORY) if p.penalized else None,
                                       (*EOS, *p.stop_token_ids) if 4 < p.min_tokens else ())
            emitted, _ = verify(logits, chosen[:-1], p, 1, 4, batch)
            assert emitted == chosen, (kind, trial)


def _freqs(samples, vocab):
    c = collections.Counter(samples)
    return torch.tensor([c[i] / len(samples) for i in range(vocab)])


def test_sampled_verification_keeps_the_processed_distribution():
    """Sampled verification draws by the rejection rule (accept_sampled, whose statistics
    test_speculative_unit checks) from each position's processed distribution: the same draws as accept_sampled
    given the plain steps' distributions, and over many seeds the first emitted token is distributed as position
    0's, the second (where the first draft was kept) as position 1's (penalties counting that draft, the ids
    min_tokens holds back lifted there)."""
    from pdserve.engine.sampling import token_seed
    from pdserve.engine.speculative import accept_sampled

    params = SamplingParams(max_tokens=32, temperature=0.9, min_tokens=5, repetition_penalty=1.5,
                            frequency_penalty=0.7, top_k=8)
    logits = torch.tensor([[1.0, 0.5, 2.0, 0.0, -1.0, 0.3, 0.2, 1.5, 0.1, 0.9, 0.4, 2.5]] * 2)
    draft = [0]
    probs = torch.cat([scale_logits(process_logits(logits[i:i + 1], b), b).softmax(-1) for i, b in enumerate(
        SamplingBatch.build([params], [0], [4 + i], histories=[HISTORY + draft[:i]],
                            banned=[EOS if 4 + i < 5 else ()]) for i in range(2))])
    assert probs[0, 11] == 0 and probs[1, 11] > 0.1  # EOS held back at position 0 only
    assert probs[1, 0] < probs[0, 0]  # the kept draft is penalized at position 1
    batch = verification_batch(params, 0, 4, draft, list(HISTORY), EOS)
    runs = []
    for seed in range(3000):
        got = verify(logits, draft, params, seed, 4, batch)[0]
        if seed < 50:
            gen = torch.Generator().manual_seed(token_seed(seed, 4))
            assert got == accept_sampled(probs, draft, gen), seed
        runs.append(got)
    assert (_freqs([r[0] for r in runs], VOCAB) - probs[0]).abs().max() < 0.035
    second = [r[1] for r in runs if len(r) > 1]
    assert len(second) == pytest.approx(len(runs) * probs[0, 0].item(), rel=0.1)
    assert (_freqs(second, VOCAB) - probs[1]).abs().max() < 0.05


def _request(grammars, tok, params: SamplingParams, text: str = "") -> Request:
    req = Request("r", [1, 2, 3], params, seed=0)
    req.token_ids += tok.encode(text) if text else []
    if params.structured is not None:
        req.grammar = grammars.matcher(params.structured, req.output_token_ids)
    return req


def test_usable_cuts_what_no_verification_can_keep(tok, grammars):
    eos = tuple(tok.eos_token_ids)
    free = _request(grammars, tok, SamplingParams(max_tokens=32, min_tokens=3, stop_token_ids=[77]))
    assert usable(free, [5, 6, eos[0], 8], eos) == [5, 6]  # EOS at output index 2 < min_tokens: never drawn
    assert usable(free, [5, 6, 7, eos[0], 8], eos) == [5, 6, 7, eos[0]]  # allowed at 3, and ends the request
    assert usable(free, [5, 77, 8], eos) == [5]  # a stop id held back at index 1
    ignoring = _request(grammars, tok, SamplingParams(max_tokens=32, ignore_eos=True))
    assert usable(ignoring, [eos[0], 5], eos) == [eos[0], 5]  # EOS ends nothing
    so = StructuredOutput("regex", "[0-9]{3}")
    digits = _request(grammars, tok, SamplingParams(max_tokens=32, structured=so), "1")
    two, three, x = tok.encode("2")[0], tok.encode("3")[0], tok.encode("x")[0]
    assert usable(digits, [two, x, three], eos) == [two]  # "x" breaks the grammar
    assert usable(digits, [two, three, eos[0], two], eos) == [two, three, eos[0]]  # EOS completes it
    # the matcher is where it was: after "1", "2" is allowed and "x" is not
    assert digits.grammar.accept(two) and not digits.grammar.accept(x)


def test_grammar_masks_follow_the_drafts_and_roll_back(tok, grammars):
    schema = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                         "required": ["a"], "additionalProperties": False}))
    eos = tuple(tok.eos_token_ids)
    params = SamplingParams(max_tokens=32, structured=schema, min_tokens=9)
    req = _request(grammars, tok, params, '{"a": ')
    draft = tok.encode("12}")
    first = req.grammar.mask(eos)
    masks = grammar_masks(req, first, draft, eos)
    assert masks.shape == (len(draft) + 1, first.shape[0])
    for i in range(len(draft) + 1):
        alone = grammars.matcher(schema, req.output_token_ids + draft[:i])
        below = req.num_output_tokens + i < params.min_tokens
        assert torch.equal(masks[i], alone.mask(eos if below else ())), i
    # rolled back: the matcher still takes the first draft token, and its mask is the first row's
    assert torch.equal(req.grammar.mask(eos), first)
    # a draft that completes the grammar: the position after its last token repeats the one before
    done = grammars.matcher(schema, req.output_token_ids + draft)
    assert done.accept(eos[0]) and done.terminated
    masks = grammar_masks(req, first, [*draft, eos[0]], eos)
    assert torch.equal(masks[-1], masks[-2]) and not req.grammar.terminated


def test_the_scheduler_drafts_under_a_grammar_and_advances_it_by_the_emitted_tokens(tok, grammars, monkeypatch):
    """A decode worker's structured request drafts (its draft cut where the grammar breaks), its chunk carries one
    mask per position, and the step's emitted tokens advance its matcher; an emitted EOS that completes the grammar
    ends it (STOP), and its blocks go back."""
    from pdserve.config import SchedulerConfig
    from pdserve.engine.block_pool import BlockPool
    from pdserve.engine.kv_cache import KVCacheManager
    from pdserve.engine.request import FinishReason
    from pdserve.engine.runner import StepResult
    from pdserve.engine.scheduler import Scheduler
    from pdserve.engine.scheduler_spec import Speculation
    from pdserve.engine.scheduler_types import Role
    from pdserve.engine.speculative import SpeculativeConfig

    eos = tuple(tok.eos_token_ids)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), KVCacheManager(BlockPool(64, 4)), eos,
                  1024, Role.DECODE)
    s.grammars = grammars
    s.speculation = Speculation(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8), 1)
    so = StructuredOutput("regex", "[0-9]{4}")
    d = {c: tok.encode(c)[0] for c in "0123456789x"}
    monkeypatch.setattr("pdserve.engine.scheduler_spec.propose", lambda tokens, k, lo, hi: [d["2"], d["x"], d["3"]])
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=16, structured=so), seed=0)
    req.remote_kv = True
    s.add(req)
    s.schedule()
    s.kv_arrived("r", [d["1"]])
    step = s.schedule()
    (chunk,) = step.chunks
    assert chunk.draft == (d["2"],) and chunk.token_ids == [d["1"], d["2"]]  # "x" breaks the grammar: cut there
    assert chunk.mask.shape[0] == 2
    assert torch.equal(chunk.mask[1], grammars.matcher(so, [d["1"], d["2"]]).mask())
    empty = (torch.empty(0, dtype=torch.int64), torch.empty(0, 8), [])
    s.update(step, StepResult(*empty, verified={0: ([d["2"], d["5"]], None)}))  # the draft kept, then "5"
    assert req.output_token_ids == [d["1"], d["2"], d["5"]] and req.num_computed_tokens == 3 + 2
    assert torch.equal(req.grammar.mask(), grammars.matcher(so, req.output_token_ids).mask())
    monkeypatch.setattr("pdserve.engine.scheduler_spec.propose", lambda tokens, k, lo, hi: [d["7"], eos[0], d["7"]])
    step = s.schedule()
    assert step.chunks[0].draft == (d["7"], eos[0])  # cut after the EOS that completes the grammar
    out = s.update(step, StepResult(*empty, verified={0: ([d["7"], eos[0], d["1"]], None)}))
    assert [t.token for t in out] == [d["7"], eos[0]] and out[-1].finish_reason == FinishReason.STOP
    assert req.finished and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
