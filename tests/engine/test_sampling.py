from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.sampling import SamplingBatch, SamplingParams, apply_top_k_top_p, sample, token_seed


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(seed=-3), "seed"), (dict(stop=("",)), "stop"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
])
def test_invalid_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_top_k_top_p_mask_exactly():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    out = apply_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.6, 0.86]))
    kept = torch.isfinite(out)
    # top-k 2; top-p 0.6 keeps 0.5 + 0.2 (mass before 0.15 is 0.7 >= 0.6); 0.86 keeps four tokens
    assert kept.tolist() == [[True, True, False, False, False], [True, True, False, False, False],
                             [True, True, True, True, False]]
    assert torch.equal(out[kept], logits[kept])


def test_top_p_always_keeps_top_token():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([1e-6]))
    assert torch.isfinite(out).tolist() == [[True, False, False]]


def batch(params, seeds, idx):
    return SamplingBatch.build(params, seeds, idx)


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    ps = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
          SamplingParams(temperature=2.0, top_k=5)]
    out, _ = sample(logits, batch(ps, [1, 2, 3, 4], [0, 0, 0, 0]))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert out[3] in logits[3].topk(5).indices


def test_same_seed_and_index_same_token_regardless_of_row():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0)
    alone, _ = sample(logits, batch([p], [42], [3]))
    other = torch.randn(2, 1000)
    mixed, _ = sample(torch.cat([other[:1], logits, other[1:]]), batch([p, p, p], [7, 42, 9], [0, 3, 5]))
    assert mixed[1] == alone[0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(3000, 3).contiguous()
    p = SamplingParams(temperature=1.0)
    out, _ = sample(logits, batch([p] * 3000, [5] * 3000, list(range(3000))))
    freq = torch.bincount(out, minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.03)


def test_token_seed_spreads():
    seeds = {token_seed(s, i) for s in range(20) for i in range(50)}
    assert len(seeds) == 1000
    assert all(0 <= s < 2**63 for s in seeds)


def test_top_k_minus_one_is_off():
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams().top_k


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan])
def test_min_p_is_bounded(value):
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=value)


def test_min_p_masks_tokens_below_its_share_of_the_top_after_temperature():
    """min_p 0.3: a token stays if its probability (after the temperature) is at least 0.3 x the top token's.
    The probabilities 0.5, 0.2, 0.15, 0.1, 0.05 keep the first three at temperature 1 (0.15 = 0.3 x 0.5) and
    all five at temperature 4 (flatter: the smallest is 0.05^(1/4) / 0.5^(1/4) = 0.56 of the top)."""
    from pdserve.engine.sampling import apply_min_p

    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    out = apply_min_p(logits, torch.tensor([0.3, 0.0, 1.0]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False, False], [True] * 5,
                                            [True, False, False, False, False]]
    # Sampled many times, a min_p row never draws a masked token; the temperature is applied first.
    many = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 64))
    for temperature, allowed in ((1.0, {0, 1, 2}), (4.0, {0, 1, 2, 3, 4})):
        ps = [SamplingParams(temperature=temperature, min_p=0.3)] * 64
        drawn, _ = sample(many, batch(ps, list(range(64)), [0] * 64))
        assert set(drawn.tolist()) <= allowed
        assert set(drawn.tolist()) == allowed  # 64 draws reach every kept token (each has >= 4% here)
    # The processed logprobs are those of the masked distribution.
    p = SamplingParams(temperature=1.0, min_p=0.3, logprobs=4, logprobs_mode="processed")
    _, lps = sample(logits[:1], batch([p], [1], [0]))
    assert lps.top_logprobs[0, 3].item() == -math.inf
    assert lps.top_logprobs[0, :3].exp().sum().item() == pytest.approx(1.0)
