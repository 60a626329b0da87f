"""One sequence's part of a step: the tokens it computes, where they sit, and whether it samples.

The unit the schedulers hand the runner (pdserve.engine.runner) and the CUDA graphs pad
(pdserve.engine.cuda_graphs); a module of its own so that neither imports the other for it.
"""
from __future__ import annotations

from typing import NamedTuple

from pdserve.engine.sampling import SamplingParams


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
