"""A draft model for speculative decoding: a smaller checkpoint of the target's vocabulary, loaded beside the
target on a decode or colocated worker, that drafts k tokens autoregressively from a paged KV cache of its own.

Each drafting request has a block table here (DraftSeq) apart from its target blocks, and the tokens whose KV
those blocks hold. At each draft the ones still the request's (the longest common prefix with its tokens: drafts
the target rejected are not) are kept and the rest computed again, in the draft's first forward. So a request
whose KV came from a prefill worker computes the draft's KV for its prompt and first token there, on the decode
worker, before its first draft; a resumed attempt after a fault re-drafts from its tokens the same way. The
draft's prompt KV is computed where it is used: the draft is small next to the target, so computing it costs
less than handing it over beside the target's.

A step's drafting requests draft together: k forwards of the draft over all of them (the first computing what
each lacks, the others one token each). A greedy request drafts the draft's argmax; a sampled one draws from the
draft's distribution q, processed as the target's is (pdserve.engine.speculative.processed), and its verification
uses q in the rejection rule (accept_sampled).

A weight update changes the target, never the draft: the draft is paired with the weight version its engine
started on (DraftModel.version), and pdserve.engine.scheduler_spec stops drafting with it after an update.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_pool import BlockPool, OutOfBlocks
from pdserve.engine.chunk import Chunk
from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import SamplingBatch, scale_logits, token_seed
from pdserve.model.loader import ModelInfo, load, load_info

# Drafts are drawn with a generator of their own, seeded apart from the verification's (token_seed of the same
# seed and index): the acceptance test's uniform draws must not be the ones that chose the drafts.
DRAFT_SEED_SALT = 0x5DEECE66D


@dataclass
class DraftSeq:
    """A request's KV in the draft's cache: its blocks, and the tokens at positions 0, 1, ... whose KV they hold."""

    block_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def check_pair(target: ModelInfo, draft: ModelInfo) -> None:
    """ValueError unless the draft can draft for the target: the same vocabulary (size, and the same tokens where
    both checkpoints carry a tokenizer), since a draft's token ids are the target's."""
    where = f"the draft model {draft.path!r}"
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"{where} has a vocabulary of {draft.config.vocab_size} tokens, the target "
                         f"{target.path!r} {target.config.vocab_size}: a draft must share the target's tokenizer")
    if target.tokenizer is not None and draft.tokenizer is not None and \
            target.tokenizer.hf_tokenizer.get_vocab() != draft.tokenizer.hf_tokenizer.get_vocab():
        raise ValueError(f"{where} has another tokenizer than the target {target.path!r}: a draft must share it")


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The draft's engine configuration: the target's device, dtype and quantization, its own checkpoint, one rank."""
    return dataclasses.replace(config, model=config.speculative.model, load_format="auto", speculative=None,
                               tensor_parallel_size=1, expert_parallel_size=1, weight_version=0, max_model_len=None)


def draft_info(config: EngineConfig, target: ModelInfo) -> ModelInfo:
    """The draft's ModelInfo, checked against the target's (check_pair): what a router checks before it starts
    workers, so that a bad draft is refused at start with the reason."""
    info = load_info(draft_engine_config(config))
    check_pair(target, info)
    return info


class DraftModel:
    """The draft's model, runner and block pool, and the drafting requests' DraftSeqs."""

    def __init__(self, runner: ModelRunner, max_model_len: int, version: int):
        self.runner = runner
        self.pool = BlockPool(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.max_model_len = max_model_len
        self.version = version  # the target's weight version the draft is paired with
        self._seqs: dict[str, DraftSeq] = {}

    @classmethod
    def load(cls, config: EngineConfig, target: ModelInfo, num_blocks: int) -> DraftModel:
        """The draft of config.speculative (method draft_model) loaded and checked against the target; its cache as
        many blocks of the target's size as the target's (a draft holds fewer tokens per request than the target,
        so it runs short only where the target would)."""
        info = draft_info(config, target)
        loaded = load(draft_engine_config(config))
        runner = ModelRunner(loaded.model, num_blocks, config.cache.block_size)
        return cls(runner, info.max_model_len, config.weight_version)

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    def free(self, request_id: str) -> None:
        """A request's draft KV back to the pool (it finished, was cancelled or preempted)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None and seq.block_ids:
            self.pool.free(seq.block_ids[::-1])

    def free_all(self) -> None:
        for rid in list(self._seqs):
            self.free(rid)

    @torch.inference_mode()
    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[Request, tuple[list[int], torch.Tensor | None]]:
        """Up to k drafted tokens for each (request, k), and for a sampled request the distributions q they were
        drawn from [drafts, vocab] (None for a greedy one). A request the draft's context or cache has no room
        for gets none (it is absent)."""
        active: list[tuple[Request, DraftSeq, int, torch.Generator | None, SamplingBatch | None]] = []
        chunks: list[Chunk] = []
        for req, k in wanted:
            tokens = req.token_ids
            k = min(k, self.max_model_len - len(tokens) + 1)  # the last draft fed is at position len + k - 2
            seq = self._seqs.setdefault(req.request_id, DraftSeq())
            if k <= 0 or not self._room(seq, len(tokens) + k - 1):
                continue
            keep = min(_common_prefix(seq.tokens, tokens), len(tokens) - 1)
            seq.tokens = list(tokens)
            chunks.append(Chunk(list(tokens[keep:]), keep, seq.block_ids, req.params))
            gen = scaling = None
            if not req.params.greedy:
                gen = torch.Generator(device=self.runner.device)
                gen.manual_seed(token_seed(req.seed ^ DRAFT_SEED_SALT, req.num_output_tokens))
                # q: the raw logits as the sampler scales them for a plain request (temperature, min-p, top-k/p)
                scaling = SamplingBatch.build([req.params], [0], [0], self.runner.device)
            active.append((req, seq, k, gen, scaling))
        out: dict[Request, tuple[list[int], list[torch.Tensor]]] = {req: ([], []) for req, *_ in active}
        while active:
            logits = self.runner.execute(chunks, sample_tokens=False).logits.float()  # [len(active), vocab]
            still, chunks = [], []
            for row, (req, seq, k, gen, scaling) in enumerate(active):
                drafts, qs = out[req]
                if gen is None:
                    token = int(logits[row].argmax())
                else:
                    q = scale_logits(logits[row:row + 1], scaling).softmax(dim=-1)[0]  # [vocab]
                    token = int(torch.multinomial(q, 1, generator=gen))
                    qs.append(q)
                drafts.append(token)
                if len(drafts) < k:  # its KV is needed for the next draft
                    chunks.append(Chunk([token], len(seq.tokens), seq.block_ids, req.params))
                    seq.tokens.append(token)
                    still.append((req, seq, k, gen, scaling))
            active = still
        return {req: (drafts, torch.stack(qs) if qs else None) for req, (drafts, qs) in out.items()}

    def _room(self, seq: DraftSeq, num_tokens: int) -> bool:
        """Blocks for num_tokens positions (those beyond given back); False if the pool is short."""
        need = -(-num_tokens // self.pool.block_size)
        if len(seq.block_ids) > need:
            self.pool.free(seq.block_ids[need:][::-1])
            del seq.block_ids[need:]
            return True
        try:
            seq.block_ids.extend(self.pool.allocate(need - len(seq.block_ids)))
        except OutOfBlocks:
            return False
        return True


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
