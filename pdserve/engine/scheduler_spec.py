"""Speculative decoding in the scheduler: which requests draft, how many tokens, and what a verification
step's emitted tokens do to a request (pdserve.engine.speculative holds the proposer and the acceptance rule).

A running request that decodes (one token to compute) drafts when it may, by prompt lookup or with a draft model
(pdserve.engine.draft_model): its next chunk is its last token and the drafts, computed in one forward that samples
at each position. Each position's logits get what a plain step's would get there had the drafts before it been
sampled (pdserve.engine.speculative.verification_batch): penalties counting those drafts, min_tokens' banned ids
while the position is below min_tokens, the structured output's mask from the matcher advanced through those
drafts (grammar_masks; the matcher is rolled back once the masks are made, and advanced by the emitted tokens when
the step is accounted). A prompt-lookup draft is cut where no verification could keep more (usable): before a
token its position may not draw, after one that ends the request. Stop strings and max_tokens cut the emitted run
where they end the request.

A draft model's drafts are drawn once the step's requests are placed (fill_drafts), all the step's drafting
requests in the draft's k forwards; until then each holds its room's PENDING placeholders. Its distribution q is
the raw logits' after temperature, min-p, top-k and top-p, so only requests that the sampler draws from the raw
logits draft with it (no penalties, min_tokens reached, no structured output: `plain`). After a weight update the
draft no longer matches the target: no request drafts with it from then on (stats says "draft_stale" and the
worker logs it), so a stale draft never slows a request unseen.

The rule, per request: every request speculates (penalties, min_tokens, structured output, logprobs, a group
(n > 1) once its samples have forked, each sample drafting from its own tokens with its own seed) except one
with prompt logprobs still to come or routed experts (a verification computes positions past the accepted ones,
and these report every computed position) and a group before its samples fork (its first sampling draws n
tokens from one row), and, with a draft model, one that is not plain; the others decode one token a step as
before, in the same batch. Per step: none
speculates while more requests run than max_batch (SpeculativeConfig.disable_by_batch_size, or the roofline's
free rows), nor on a pipelined engine (a step's emitted count must be known before the next is built).

The drafted tokens' KV is written into the request's blocks as the forward runs; only the accepted ones count
as computed, so a rejected token's slot is overwritten by the next step, and blocks that held nothing but
rejected slots go back to the pool (trim).
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

import torch

from pdserve.engine.request import PENDING, Request, RequestStatus
from pdserve.engine.chunk import Chunk
from pdserve.engine.scheduler_types import Role, chunk_of
from pdserve.engine.speculative import DraftState, SpeculativeConfig, free_rows, max_speculating_batch, propose
from pdserve.engine.utilization import device_peaks

log = logging.getLogger(__name__)


class Speculation:
    """A scheduler's speculation: the configuration, each request's adaptive draft length, and the counts the
    worker's metrics report (drafted and accepted tokens, verifications by accepted length); with a draft model
    (method draft_model), the draft and whether a weight update has left it stale."""

    def __init__(self, config: SpeculativeConfig, ridge_rows: int, draft_model=None):
        self.config = config
        self.draft_model = draft_model  # pdserve.engine.draft_model.DraftModel, for method draft_model
        self.stale = False  # the target's weights changed since the draft was paired with them
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

    def draft(self, req: Request, batch: int, max_model_len: int, budget: int, version: int = 0) -> list[int]:
        """The tokens req drafts this step ([] for none): at most its adaptive k, the budget's tokens less one,
        and what its max_tokens and the model's context leave after the token the step always emits. With a draft
        model, PENDING placeholders as many as it may draft (fill_drafts draws them); none once the engine's weight
        version is not the draft's."""
        if batch > self.max_batch or not self.eligible(req) or not self._draft_current(version):
            return []
        if self.draft_model is not None and not plain(req):
            return []
        state = self._state.setdefault(req.request_id, DraftState(self.config.num_speculative_tokens))
        room = min(state.k, budget - 1, req.params.max_tokens - req.num_output_tokens - 1,
                   max_model_len - req.num_tokens - 1)
        if room <= 0:
            return []
        if self.draft_model is not None:
            return [PENDING] * room
        return propose(state.tokens.view(req.token_ids), room, self.config.prompt_lookup_min,
                       self.config.prompt_lookup_max)

    def _draft_current(self, version: int) -> bool:
        """Whether the draft (if any) still drafts for the weights served: after an update it does not, and its
        KV is given back."""
        if self.draft_model is None or version == self.draft_model.version:
            return True
        if not self.stale:
            self.stale = True
            self.draft_model.free_all()
            log.warning("weight version %d is not the one the draft model was paired with (%d): requests decode "
                        "without speculation from now on (a draft is not updated with the target)", version,
                        self.draft_model.version)
        return False

    def fill_drafts(self, drafts: dict[Request, list[int]], kv) -> dict[Request, torch.Tensor]:
        """A draft model's drafts in place of the step's placeholders (drafts changed in place: a request the draft
        could not draft for, or preempted since it was given room, is left with none, its extra slots given back);
        the distributions q of the sampled requests' drafts."""
        if self.draft_model is None or not drafts:
            return {}
        running = [r for r in drafts if r.status is RequestStatus.RUNNING]  # others were preempted after drafting
        got = self.draft_model.propose([(r, len(drafts[r])) for r in running])
        probs = {}
        for req in drafts:
            tokens, q = got.get(req, ([], None))
            drafts[req] = tokens
            if not tokens and req.status is RequestStatus.RUNNING:
                trim(kv, req)
            if q is not None:
                probs[req] = q
        return probs

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
        """The request ended: its draft state and draft KV go."""
        self._state.pop(req.request_id, None)
        self.drop_kv(req)

    def drop_kv(self, req: Request) -> None:
        """The request lost its KV (preempted, recomputed) or ended: its draft model KV goes too (computed again at
        its next draft)."""
        if self.draft_model is not None:
            self.draft_model.free(req.request_id)

    def stats(self) -> dict:
        out = {"method": self.config.method, "drafted": self.drafted, "accepted": self.accepted,
               "verifications": self.verifications, "acceptance_lengths": dict(self.acceptance_lengths)}
        if self.draft_model is not None:
            out["draft_stale"] = self.stale
            out["draft_kv_blocks_used"] = self.draft_model.pool.num_used_blocks
        return out


def trim(kv, req: Request) -> None:
    """Give back the request's blocks past those its tokens and the next one's KV need (blocks allocated for
    drafted slots that were rejected). They were never offered to the prefix cache: only computed full blocks
    are."""
    keep = kv.blocks_needed(req.num_tokens)
    extra: Sequence[int] = req.block_ids[keep:]
    if extra:
        kv.pool.free(list(extra)[::-1])
        del req.block_ids[keep:]


def speculation_for(config, role: Role, runner, pipelined: bool, simulated: bool, info=None) -> Speculation | None:
    """An engine's speculation (config: its EngineConfig), where configured: decode and colocated engines that are
    not pipelined (a pipelined step would need its emitted count before the next is built) and run a model
    (a simulated engine's tokens are not the model's). Without disable_by_batch_size, the batch it stops at
    comes from the device's ridge point (pdserve.engine.speculative.free_rows): its peaks as configured, from
    the GPU table, or measured here. Method draft_model loads the draft beside the target (info: the target's
    ModelInfo, which the draft must match)."""
    spec = config.speculative
    if spec is None or role is Role.PREFILL or pipelined or simulated:
        if spec is not None and role is not Role.PREFILL and pipelined:
            log.warning("speculative decoding is off on this %s engine: pipelined decode was asked for "
                        "(--pipelined-decode); without it the engine speculates", role.value)
        return None
    rows = 1
    if spec.disable_by_batch_size is None:
        peaks = device_peaks(runner.device, config.peak_flops, config.peak_bytes_per_second)
        model = getattr(runner, "model", None)
        weight_bytes = next(model.parameters()).element_size() if model is not None else 2
        rows = free_rows(peaks.flops_per_second, peaks.bytes_per_second, weight_bytes)
    draft = None
    if spec.method == "draft_model":
        from pdserve.engine.draft_model import DraftModel

        draft = DraftModel.load(config, info, runner.num_blocks)
    return Speculation(spec, rows, draft)


def pipelined(config, role: Role) -> bool:
    """Whether an engine (config: its EngineConfig) pipelines its decode steps: where asked
    (`pipelined_decode`); by default on CUDA for decode and colocated engines of one rank, unless the engine is
    configured to speculate: a pipelined step would need its emitted count before the next is built, and the
    speculation asked for by name wins over the default."""
    on = config.pipelined_decode
    if on is None:
        on = torch.device(config.device).type == "cuda" and config.speculative is None
    return on and role is not Role.PREFILL and config.tensor_parallel_size == 1


def graph_rows(config, role: Role) -> int:
    """The rows of an engine's largest CUDA-graph bucket (pdserve.engine.cuda_graphs): max_num_seqs, or, where
    the engine speculates, the most rows a verification step carries: each speculating request's k + 1."""
    seqs = config.scheduler.max_num_seqs
    spec = config.speculative
    if spec is None or role is Role.PREFILL or pipelined(config, role):
        return seqs
    return max(seqs, min(seqs, spec.disable_by_batch_size or seqs) * (spec.num_speculative_tokens + 1))


def plain(req: Request) -> bool:
    """Whether the sampler draws the request's next token from its raw logits (no penalties, min_tokens reached,
    no structured output): a draft model's q is processed as such a request's p is."""
    p = req.params
    return not p.penalized and req.num_output_tokens >= p.min_tokens and p.structured is None


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
                eos_token_ids: tuple[int, ...], probs: dict[Request, torch.Tensor] | None = None) -> list[Chunk]:
    """A step's chunks (pdserve.engine.scheduler_types.chunk_of); a drafting request's is its last token and its
    drafts (Chunk.draft), with a mask per position under structured output (grammar_masks) and the draft model's
    distributions where it drew them (Chunk.draft_probs); one whose draft came back empty (fill_drafts) computes
    its one token."""
    probs = probs or {}
    return [chunk_of(r, n, eos_token_ids) if r not in drafts else chunk_of(r, 1, eos_token_ids) if not drafts[r] else
            draft_chunk(r, drafts[r], eos_token_ids)._replace(draft_probs=probs.get(r))
            for r, n in scheduled]


def draft_chunk(req: Request, draft: list[int], eos_token_ids: tuple[int, ...]) -> Chunk:
    """A drafting request's chunk: chunk_of's one-token chunk (its history, banned ids, first mask), its tokens
    the last known one and the drafts, and under structured output a mask per position."""
    chunk = chunk_of(req, 1, eos_token_ids)._replace(token_ids=[req.token_ids[-1], *draft], draft=tuple(draft))
    if req.grammar is not None:
        chunk = chunk._replace(mask=grammar_masks(req, chunk.mask, draft, eos_token_ids))
    return chunk
