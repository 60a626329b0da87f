"""One sequence's part of a step: the tokens it computes, where they sit, and whether it samples.

The unit the schedulers hand the runner (pdserve.engine.runner) and the CUDA graphs pad
(pdserve.engine.cuda_graphs); a module of its own so that neither imports the other for it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pdserve.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import torch


class Chunk(NamedTuple):
    token_ids: list[int]  # tokens computed this step
    start: int  # position of token_ids[0] in the sequence
    block_ids: list[int]  # the sequence's block table (covers start + len(token_ids) slots)
    sample: SamplingParams | None  # None: a prefill chunk that does not reach the sequence's end
    seed: int = 0
    output_index: int = 0  # index of the token to sample in the request's output
    # Pipelined decode: the chunk's last token is the previous step's sampled row pending_row, still on
    # the device (its value in token_ids is a placeholder).
    pending_row: int | None = None
    # A sampling chunk whose request has penalties: the request's tokens so far, prompt then output (the
    # request's own list: read when the step is built, before it changes; a pipelined one's last token
    # may be PENDING, read from pending_row).
    history: list[int] | None = None
    # Token ids the sampler may not draw (min_tokens holds EOS and the stop ids back).
    banned: tuple[int, ...] = ()
    # Prompt logprobs: (k, targets): the chunk's first len(targets) positions each get the logprob of
    # the prompt token that follows it, targets[i] being the one after position start + i.
    prompt_logprobs: tuple[int, list[int]] | None = None
    # A group's first sampling (SamplingParams.n): this many tokens are drawn from the chunk's last
    # logits, sample j with seed sample_seed(seed, j).
    fanout: int = 1
    # Structured output (pdserve.engine.grammar): the bitmask [words] int32 of the tokens the sample may draw,
    # filled when the step is built from its matcher (a group's first sampling: every sample's, one state); a
    # speculative chunk's is [len(draft) + 1, words], one row per position (pdserve.engine.scheduler_spec).
    mask: torch.Tensor | None = None
    # Speculative decoding (pdserve.engine.speculative): the drafted tokens, token_ids[1:] (token_ids[0] is the
    # request's last known token). The chunk samples at each of its positions; the runner verifies the drafts
    # (StepResult.verified) and the chunk takes no row of the step's ordinary sampling.
    draft: tuple[int, ...] = ()
    # A draft model's sampled drafts: the distributions [len(draft), vocab] they were drawn from, the q of the
    # rejection rule (pdserve.engine.speculative.accept_sampled). None: prompt lookup's, or a greedy request's.
    draft_probs: torch.Tensor | None = None
    # Routed experts (pdserve.engine.routed_experts): the step records the top-k experts of the chunk's tokens.
    routed_experts: bool = False
