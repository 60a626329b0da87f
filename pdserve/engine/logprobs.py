"""Log-probabilities of tokens: what a request asks for with `logprobs` / `prompt_logprobs`, as they leave
the engine.

A TokenLogprob is one position's: the token there (sampled, or the prompt's own), its log-probability,
its rank in the distribution, and the k most likely tokens with theirs. The distribution is the model's
raw log_softmax or, for sampled tokens in "processed" mode, the one the sampler drew from
(pdserve.engine.sampling.SamplingParams.logprobs_mode).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float  # -inf where the processed distribution masked the token out
    rank: int  # 1 + the number of tokens with a strictly higher logprob
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (token id, logprob), most likely first


# A prompt's log-probabilities: one per prompt token; the first is None (it has no prefix to be given).
PromptLogprobs = tuple[TokenLogprob | None, ...]
