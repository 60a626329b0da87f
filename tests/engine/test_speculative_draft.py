"""Speculative decoding with a draft model in the offline engine (pdserve.engine.draft_model), on tiny checkpoints
of one vocabulary: greedy output token-identical with speculation on and off, with the target as its own draft
(every draft accepted) and with other drafts; sampled output distributed as the target's (checked statistically
against the target's exact distribution, computed with transformers); the draft's KV given back at finish, cancel
and preemption; no drafting after a weight update; a draft of another vocabulary refused at start."""
from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.speculative import SpeculativeConfig

from conftest import build_tiny_checkpoint, perturbed_checkpoint

PROMPTS = [[(7 * i + j) % 320 for j in range(5 + 9 * i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_checkpoints, tmp_path_factory) -> dict[str, str]:
    """The target (the tiny Llama), a draft near it (its weights moved by noise: most drafts kept, not all), one
    of another shape (one layer, its own random weights: few kept) and one of another vocabulary."""
    target = tiny_checkpoints["llama"]
    root = tmp_path_factory.mktemp("drafts")
    return {"target": str(target),
            "near": str(perturbed_checkpoint(target, root / "near", scale=0.03, seed=3)),
            "other": str(build_tiny_checkpoint(root / "other", "llama", num_hidden_layers=1, hidden_size=32,
                                               intermediate_size=64)),
            "vocab": str(build_tiny_checkpoint(root / "vocab", "llama", vocab_size=300))}


def engine(target: str, draft: str | None, k: int = 4, **cache) -> LLMEngine:
    spec = None if draft is None else SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=k,
                                                        disable_by_batch_size=4096)
    return LLMEngine(EngineConfig(model=target, speculative=spec, cache=CacheConfig(**cache),
                                  scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048)))


@pytest.fixture(scope="module")
def reference(models):
    with engine(models["target"], None) as e:
        return [c.token_ids for c in e.generate(PROMPTS, GREEDY)]


def all_given_back(e: LLMEngine) -> bool:
    draft = e.scheduler.speculation.draft_model
    return (e.pool.num_free_blocks == e.pool.num_blocks and draft.pool.num_free_blocks == draft.pool.num_blocks
            and draft.num_seqs == 0)


@pytest.mark.parametrize("draft, k", [("target", 4), ("near", 3), ("other", 5), ("other", 1)])
def test_greedy_token_exact_on_and_off(models, reference, draft, k):
    with engine(models["target"], models[draft], k) as e:
        got = e.generate(PROMPTS, GREEDY)
        assert [c.token_ids for c in got] == reference
        s = e.scheduler.speculation
        assert s.drafted > 0 and max(s.acceptance_lengths) <= k
        if draft == "target":  # its own draft: every draft is the target's token
            assert s.accepted == s.drafted
        if draft == "other":
            assert s.accepted < s.drafted  # rejections happened: the target's token replaced them
        assert all_given_back(e)


def test_cancel_and_preemption_free_the_drafts_kv(models, reference):
    """A cache of few blocks preempts running requests (their draft KV freed, computed again when they resume) and
    the output stays exact; a cancelled request's draft KV goes with it."""
    with engine(models["target"], models["near"], 4, num_blocks=24, block_size=4) as e:
        assert [c.token_ids for c in e.generate(PROMPTS, GREEDY)] == reference
        assert e.scheduler.num_preemptions > 0 and e.scheduler.speculation.drafted > 0
        assert all_given_back(e)
        rid = e.add_request(PROMPTS[3], GREEDY)
        for _ in range(3):
            e.step()
        assert e.scheduler.speculation.draft_model.num_seqs == 1
        e.abort(rid)
        assert all_given_back(e)


def test_a_weight_update_stops_the_draft(models, weight_versions):
    """After the target's weights change, nothing is drafted (the draft was paired with the old ones): the output is
    the new weights' plain output, and the stats say the draft is stale."""
    new = str(weight_versions[1])
    with engine(new, None) as plain:
        want = [c.token_ids for c in plain.generate(PROMPTS[:2], GREEDY)]
    with engine(models["target"], models["target"]) as e:
        e.generate(PROMPTS[:1], GREEDY)
        s = e.scheduler.speculation
        drafted = s.drafted
        assert drafted > 0 and s.stats()["draft_stale"] is False
        e.update_weights(new, 1)
        assert [c.token_ids for c in e.generate(PROMPTS[:2], GREEDY)] == want
        assert s.drafted == drafted and s.stats()["draft_stale"] is True
        assert all_given_back(e)


def test_a_draft_of_another_vocabulary_is_refused(models):
    with pytest.raises(ValueError, match="vocabulary of 300 tokens.*320"):
        engine(models["target"], models["vocab"])


def _exact_marginals(path: str, prompt: list[int], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's exact distributions of output tokens 1 and 2 (temperature 1, top-k), summed over the tokens
    before them, by transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def dist(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1]
        top = logits.topk(top_k)
        return torch.zeros_like(logits).scatter(0, top.indices, top.values.softmax(-1))

    p0 = dist(prompt)
    first, second = torch.zeros_like(p0), torch.zeros_like(p0)
    for t0 in p0.nonzero().flatten().tolist():
        p1 = dist(prompt + [t0])
        first += p0[t0] * p1
        for t1 in p1.nonzero().flatten().tolist():
            second += p0[t0] * p1[t1] * dist(prompt + [t0, t1])
    return first, second


def test_sampled_output_is_distributed_as_the_targets(models):
    """2000 seeded requests (temperature 1, top-k 3) with a draft near the target, whose q differs from the
    target's p: output tokens 1 and 2 (drawn by verifications: token 0 comes from the prompt's step) follow the
    target's exact distributions within sampling error, while drafts are both kept and rejected."""
    prompt, n = PROMPTS[1], 2000
    first, second = _exact_marginals(models["target"], prompt, 3)
    with engine(models["target"], models["near"], 3) as e:
        params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s, ignore_eos=True) for s in range(n)]
        got = e.generate([prompt] * n, params)
        s = e.scheduler.speculation
        assert 0 < s.accepted < s.drafted
        assert all_given_back(e)
    for i, want in ((1, first), (2, second)):
        freq = torch.bincount(torch.tensor([c.token_ids[i] for c in got]), minlength=want.numel()).float() / n
        assert (freq - want).abs().max() < 0.04, (i, freq.topk(5), want.topk(5))
