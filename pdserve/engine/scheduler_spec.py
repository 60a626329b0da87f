"""Speculative decoding in the scheduler: which requests draft, how many tokens, and what a verification
step's emitted tokens do to a request (pdserve.engine.speculative holds the proposer and the acceptance rule).

A running request that decodes (one token to compute) drafts by prompt lookup when it may: its next chunk is
its last token and the drafts, computed in one forward that samples at each position. Each position's logits get
what a plain step's would get there had the drafts before it been sampled (pdserve.engine.speculative.
verification_batch): penalties counting those drafts, min_tokens' banned ids while the position is below
min_tokens, the structured output's mask from the matcher advanced through those drafts (grammar_masks; the
matcher is rolled back once the masks are made, and advanced by the emitted tokens when the step is accounted).
A draft is cut where no verification could keep more (usable): before a token its position may not draw, after
one that ends the request. Stop strings and max_tokens cut the emitted run where they end the request.

The rule, per request: every request speculates (penalties, min_tokens, structured output, logprobs, a group
(n > 1) once its samples have forked, each sample drafting from its own tokens with its own seed) except one
with prompt logprobs still to come or routed experts (a verification computes positions past the accepted ones,
and these report every computed position) and a group before its samples fork (its first sampling draws n
tokens from one row); the others decode one token a step as before, in the same batch. Per step: none
speculates while more requests run than max_batch (SpeculativeConfig.disable_by_batch_size, or the roofline's
free rows), nor on a pipelined engine (a step's emitted count must be known before the next is built).

The drafted tokens' KV is written into the request's blocks as the forward runs; only the accepted ones count
as computed, so a rejected token's slot is overwritten by the next step, and blocks that held nothing but
rejected slots go back to the pool (trim).
"""
from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from pdserve.engine.request import Request
from pdserve.engine.chunk import Chunk
from pdserve.engine.scheduler_types import Role, chunk_of
from pdserve.engine.speculative import DraftState, SpeculativeConfig, free_rows, max_speculating_batch, propose
from pdserve.engine.utilization import device_peaks


class Speculation:
    """A scheduler's speculation: the configuration, each request's adaptive draft length, and the counts the
    worker's metrics report (drafted and accepted tokens, verifications by accepted length)."""

    def __init__(self, config: SpeculativeConfig, ridge_rows: int):
        self.config = config
        self.max_batch = max_speculating_batch(config, ridge_rows)
        self.drafted = 0  # tokens drafted and verified
        self.accepted = 0  # of those, accepted
        self.verifications = 0
        self.acceptance_lengths: collections.Counter[int] = collections.Counter()  # accepted per verification
        self._state: dict[str, DraftState] = {}

    @staticmethod
    def eligible(req: Request) -> bool:
        """Whether the request may speculate (the per-request rule in the module's docstring)."""
        # A structured output speculates through its matcher: without one (a worker that cannot compile it
        # refuses the request) it does not.
        return ((req.params.structured is None or req.grammar is not None) and req.prompt_logprobs is None
                and req.routed is None and req.unresolved == 0 and req.fanout == 1)

    def draft(self, req: Request, batch: int, max_model_len: int, budget: int) -> list[int]:
        """The tokens req drafts this step ([] for none): at most its adaptive k, the budget's tokens less one,
        and what its max_tokens and the model's context leave after the token the step always emits."""
        if batch > self.max_batch or not self.eligible(req):
            return []
        state = self._state.setdefault(req.request_id, DraftState(self.config.num_speculative_tokens))
        room = min(state.k, budget - 1, req.params.max_tokens - req.num_output_tokens - 1,
                   max_model_len - req.num_tokens - 1)
        if room <= 0:
            return []
        return propose(req.token_ids, room, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def note(self, req: Request, drafted: int, accepted: int) -> None:
        """A verification's outcome: the counts, and the request's next draft length."""
        self.drafted += drafted
        self.accepted += accepted
        self.verifications += 1
        self.acceptance_lengths[accepted] += 1
        state = self._state.get(req.request_id)
        if state is not None:
            state.update(drafted, accepted, self.config.num_speculative_tokens)

    def forget(self, req: Request) -> None:
        self._state.pop(req.request_id, None)

    def stats(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "verifications": self.verifications,
                "acceptance_lengths": dict(self.acceptance_lengths)}


def trim(kv, req: Request) -> None:
    """Give back the request's blocks past those its tokens and the next one's KV need (blocks allocated for
    drafted slots that were rejected). They were never offered to the prefix cache: only computed full blocks
    are."""
    keep = kv.blocks_needed(req.num_tokens)
    extra: Sequence[int] = req.block_ids[keep:]
    if extra:
        kv.pool.free(list(extra)[::-1])
        del req.block_ids[keep:]


def speculation_for(config, role: Role, runner, pipelined: bool, simulated: bool) -> Speculation | None:
    """An engine's speculation (config: its EngineConfig), where configured: decode and colocated engines of one
    rank that are not pipelined (a pipelined step would need its emitted count before the next is built) and run a model
    (a simulated engine's tokens are not the model's). Without disable_by_batch_size, the batch it stops at
    comes from the device's ridge point (pdserve.engine.speculative.free_rows): its peaks as configured, from
    the GPU table, or measured here."""
    spec = config.speculative
    # A tensor-parallel engine's ranks run every LM head call together: rank 0's verification would be one
    # they do not make. Not supported yet.
    if spec is None or role is Role.PREFILL or pipelined or simulated or config.tensor_parallel_size > 1:
        return None
    rows = 1
    if spec.disable_by_batch_size is None:
        peaks = device_peaks(runner.device, config.peak_flops, config.peak_bytes_per_second)
        model = getattr(runner, "model", None)
        weight_bytes = next(model.parameters()).element_size() if model is not None else 2
        rows = free_rows(peaks.flops_per_second, peaks.bytes_per_second, weight_bytes)
    return Speculation(spec, rows)


def held_back(params, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end a request (EOS unless it ignores EOS, its stop ids): what min_tokens holds back."""
    return (*(() if params.ignore_eos else eos_token_ids), *params.stop_token_ids)


def usable(req: Request, draft: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    """The draft cut where no verification could keep more of it: before its first token that the position may
    not draw (an id min_tokens holds back there, one the request's grammar does not allow after the drafts
    before it: the target's processed logits give it no chance), and after its first token that ends the
    request (an EOS or stop id, one that completes the grammar: nothing after it is emitted). The request's
    matcher is left where it was."""
    params, m = req.params, req.grammar
    ends = set(held_back(params, eos_token_ids))
    out: list[int] = []
    try:
        for i, t in enumerate(draft):
            if t in ends and req.num_output_tokens + i < params.min_tokens:
                break
            if m is not None and not m.accept(t):
                break
            out.append(t)
            if t in ends or (m is not None and m.terminated):
                break
    finally:
        if m is not None and out:
            m.rollback(len(out))
    return out


def grammar_masks(req: Request, first: torch.Tensor, draft: Sequence[int],
                  eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """A speculative chunk's masks under structured output, [len(draft) + 1, words] int32: first (the mask
    after the request's tokens, chunk_of's), then the matcher's after each draft, the ids min_tokens holds back
    taken out while the position is below min_tokens (pdserve.engine.grammar.Matcher.mask). The draft is
    usable's (each token allowed; only its last may complete the grammar, and the position after that one is
    never emitted: it repeats the mask before). The matcher is rolled back to where it was."""
    m, params = req.grammar, req.params
    held = held_back(params, eos_token_ids)
    rows = [first]
    accepted = 0
    try:
        for i, t in enumerate(draft, 1):
            ok = m.accept(t)
            assert ok, "a usable draft's tokens are allowed by the grammar"
            accepted += 1
            below = req.num_output_tokens + i < params.min_tokens
            rows.append(rows[-1] if m.terminated else m.mask(held if below else ()))
    finally:
        if accepted:
            m.rollback(accepted)
    return torch.stack(rows)


def step_chunks(scheduled: list[tuple[Request, int]], drafts: dict[Request, list[int]],
                eos_token_ids: tuple[int, ...]) -> list[Chunk]:
    """A step's chunks (pdserve.engine.scheduler_types.chunk_of); a drafting request's is its last token and its
    drafts (Chunk.draft), with a mask per position under structured output (grammar_masks)."""
    return [chunk_of(r, n, eos_token_ids) if r not in drafts else draft_chunk(r, drafts[r], eos_token_ids)
            for r, n in scheduled]


def draft_chunk(req: Request, draft: list[int], eos_token_ids: tuple[int, ...]) -> Chunk:
    """A drafting request's chunk: chunk_of's one-token chunk (its history, banned ids, first mask), its tokens
    the last known one and the drafts, and under structured output a mask per position."""
    chunk = chunk_of(req, 1, eos_token_ids)._replace(token_ids=[req.token_ids[-1], *draft], draft=tuple(draft))
    if req.grammar is not None:
        chunk = chunk._replace(mask=grammar_masks(req, chunk.mask, draft, eos_token_ids))
    return chunk
