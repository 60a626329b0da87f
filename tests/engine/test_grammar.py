"""Structured output's parts without a model: compiling each kind (and refusing what does not compile), the cache by
value, a matcher's replay and mask (only EOS once complete, ids past the tokenizer never), the sampler's bitmask, and
the scheduler's hand-off replay. SmolLM2's tokenizer is the one read (no weights are loaded)."""
from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.grammar import GrammarError, Grammars, bitmask_words
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling import SamplingParams, apply_token_bitmask
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_types import Role
from pdserve.engine.structured import StructuredOutput

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from pdserve.model.loader import default_model_path
    from pdserve.model.tokenizer import Tokenizer

    try:
        return Tokenizer.from_pretrained(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok, VOCAB, tok.eos_token_ids)


def allowed(mask: torch.Tensor) -> set[int]:
    bits = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)
    return set(torch.nonzero(bits).view(-1).tolist())


def schema() -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(SCHEMA))


def test_every_kind_compiles_and_its_text_is_accepted(tok, grammars):
    cases = [(schema(), '{"a": 12, "b": "y"}'), (StructuredOutput("json_object"), '{"k": [1, 2]}'),
             (StructuredOutput("regex", r"\d{3}-[a-z]+"), "123-abc"),
             (StructuredOutput("choice", json.dumps(["yes", "no", 'a "quoted" one'])), 'a "quoted" one'),
             (StructuredOutput("grammar", 'root ::= "x" [0-9]+'), "x42")]
    for so, text in cases:
        m = grammars.matcher(so, tok.encode(text))
        assert allowed(m.mask()) <= set(tok.eos_token_ids) | set(range(VOCAB)) and not m.terminated
        assert m.accept(tok.eos_token_ids[0]) and m.terminated, so


@pytest.mark.parametrize("so, says", [
    (StructuredOutput("json_schema", '{"type": "nope"}'), "nope"),
    (StructuredOutput("json_schema", "{not json"), "json_schema"),
    (StructuredOutput("regex", "([a-"), "regex"),
    (StructuredOutput("choice", "[]"), "non-empty"),
    (StructuredOutput("choice", '["a", 1]'), "strings"),
    (StructuredOutput("grammar", "root ::= "), "grammar"),
    (StructuredOutput("grammar", 'root ::= undefined_rule'), "undefined_rule"),
])
def test_what_does_not_compile_says_why(grammars, so, says):
    with pytest.raises(GrammarError, match=says):
        grammars.compile(so)


def test_compiled_once_by_value_and_the_cache_is_bounded(tok):
    g = Grammars(tok, VOCAB, tok.eos_token_ids, cache_size=2)
    first = g.compile(StructuredOutput("regex", "a+"))
    assert g.compile(StructuredOutput("regex", "a+")) is first  # an equal value: the same grammar
    g.compile(StructuredOutput("regex", "b+"))
    g.compile(StructuredOutput("regex", "c+"))
    assert len(g._cache) == 2 and g.compile(StructuredOutput("regex", "a+")) is not first


def test_a_complete_output_allows_only_eos(tok, grammars):
    m = grammars.matcher(schema(), tok.encode('{"a": 1, "b": "x"}'))
    assert allowed(m.mask()) == set(tok.eos_token_ids)
    half = grammars.matcher(schema(), tok.encode('{"a": 1, "b": '))
    assert not allowed(half.mask()) & set(tok.eos_token_ids) and tok.encode('"')[0] in allowed(half.mask())


def test_ids_past_the_tokenizer_are_never_allowed(tok):
    wide = VOCAB + 64  # a model whose logits are wider than its tokenizer's vocabulary
    g = Grammars(tok, wide, tok.eos_token_ids)
    m = g.matcher(StructuredOutput("json_object"))
    mask = m.mask()
    assert mask.shape == (bitmask_words(wide),) and max(allowed(mask)) < VOCAB
    logits = torch.zeros(2, wide)
    out = apply_token_bitmask(logits, torch.tensor([1]), mask[None])
    assert torch.isinf(out[1, VOCAB:]).all() and (out[0] == 0).all()


def test_replay_rejects_a_token_the_grammar_does_not_allow(tok, grammars):
    good = tok.encode('{"a": 1')
    with pytest.raises(GrammarError, match=f"output token {len(good)} "):
        grammars.matcher(schema(), good + tok.encode("]"))


def test_banned_ids_leave_the_mask_unless_nothing_would_be_left(tok, grammars):
    eos = tok.eos_token_ids
    open_ = grammars.matcher(StructuredOutput("regex", "a*"))
    assert set(eos) <= allowed(open_.mask()) and not set(eos) & allowed(open_.mask(eos))
    done = grammars.matcher(schema(), tok.encode('{"a": 1, "b": "x"}'))
    assert allowed(done.mask(eos)) == set(eos)  # min_tokens cannot hold back the only way to end


def test_apply_token_bitmask_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    vocab, rows = 100, torch.tensor([0, 2])
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, bitmask_words(vocab)), dtype=torch.int32, generator=g)
    logits = torch.randn(3, vocab, generator=g)
    out = apply_token_bitmask(logits, rows, bitmask)
    for k, r in enumerate(rows.tolist()):
        for t in range(vocab):
            bit = (int(bitmask[k, t // 32]) >> (t % 32)) & 1
            assert out[r, t] == (logits[r, t] if bit else float("-inf"))
    assert torch.equal(out[1], logits[1])
    assert torch.isfinite(logits).all()  # a new tensor: the raw logits stay for their logprobs


def _scheduler(tok, grammars) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), KVCacheManager(BlockPool(64, 4)),
                  tok.eos_token_ids, 1024, Role.DECODE)
    s.grammars = grammars
    return s


def test_a_hand_off_replays_the_tokens_so_far_and_its_first_token(tok, grammars):
    s = _scheduler(tok, grammars)
    params = SamplingParams(max_tokens=64, structured=schema())
    so_far = tok.encode('{"a": 7')
    req = Request("r", [1, 2, 3], params, seed=0)
    req.token_ids += so_far  # a resumed attempt: the router's tokens
    req.remote_kv = True
    s.add(req)
    s.schedule()  # reserves its blocks: WAITING_FOR_KV
    assert req.status is RequestStatus.WAITING_FOR_KV
    with pytest.raises(GrammarError, match="first token"):
        s.kv_arrived("r", tok.encode("]"))
    assert req.status is RequestStatus.WAITING_FOR_KV  # nothing changed: the caller fails it
    (first,) = s.kv_arrived("r", tok.encode(","))
    assert first.finish_reason is None and req.status is RequestStatus.RUNNING
    assert tok.encode(' "')[0] in allowed(req.grammar.mask())


def test_a_resumed_request_whose_tokens_break_its_grammar_is_refused(tok, grammars):
    s = _scheduler(tok, grammars)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=8, structured=schema()), seed=0)
    req.token_ids += tok.encode("not json")
    with pytest.raises(GrammarError, match="output token 0"):
        s.add(req)
    assert "r" not in s.requests
