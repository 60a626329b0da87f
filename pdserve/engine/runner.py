"""One forward step over a batch of scheduled chunks: tensors in, sampled tokens out.

The runner knows chunks, not requests: a chunk is some consecutive tokens of one sequence, where they
start, the sequence's block table and, if its last token is the sequence's last known one, how to
sample the next. Prefill workers, decode workers and the offline engine share it.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.config import ModelConfig
from pdserve.engine.chunk import Chunk
from pdserve.engine.cuda_graphs import DecodeGraphs, batch_buckets
from pdserve.engine.kv_cache import allocate_kv_cache
from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.routed_experts import RouteCapture
from pdserve.engine.sampling import SampledLogprobs, SamplingBatch, logprobs_of, sample, sample_seed, to_device
from pdserve.engine.speculative import verification_batch, verify
from pdserve.engine.utilization import step_bytes, step_flops
from pdserve.kernels import cpu_attention, cpu_kernels
from pdserve.model.attention import AttentionMetadata, DecodeGroup
from pdserve.model import attention
from pdserve.model.llama import LlamaModel


@dataclass
class StepResult:
    sampled: torch.Tensor  # [sampling chunks] int64, in the order of the chunks that sample (on the device)
    logits: torch.Tensor  # [sampling chunks, vocab] fp32
    sampling_chunks: list[int]  # index into the step's chunks of each sampled row
    logprobs: SampledLogprobs | None = None  # of the sampled tokens, if a row asked
    # Chunk index -> the logprobs of the prompt tokens its positions predict (Chunk.prompt_logprobs).
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    # Chunk index -> the tokens a speculative chunk (Chunk.draft) emits: its accepted drafts, then the
    # target's token at the first rejection or after the last draft, and their logprobs if its request asks
    # (pdserve.engine.speculative.verify).
    verified: dict[int, tuple[list[int], list[TokenLogprob] | None]] = field(default_factory=dict)
    # Chunk index -> the top-k experts of its tokens [chunk tokens, moe layers, k] int32 on the host, for the
    # chunks that ask (Chunk.routed_experts; pdserve.engine.routed_experts).
    routed_experts: dict[int, np.ndarray] = field(default_factory=dict)
    # CUDA: the sampled tokens in pinned host memory, copied as soon as they are sampled, and the event
    # that marks the copy done (start_host_copy). None: tokens() reads them from `sampled`.
    _host: torch.Tensor | None = None
    _ready: torch.cuda.Event | None = None

    def start_host_copy(self) -> None:
        """Queue the copy of the sampled tokens (and logprobs) to the host right behind the sampling, without
        waiting for it. Pipelined decode launches the next step before it reads these tokens: a copy
        queued only when they are read would run after that next step and wait for it, so no step would
        overlap the host's work for the one after it."""
        if not self.sampled.is_cuda:
            return
        self._host = _pinned_copy(self.sampled)
        if self.logprobs is not None:
            self.logprobs = SampledLogprobs(*(_pinned_copy(t) for t in (
                self.logprobs.logprob, self.logprobs.rank, self.logprobs.top_ids, self.logprobs.top_logprobs)))
        self._ready = torch.cuda.Event()
        self._ready.record()

    def tokens(self) -> list[int]:
        """The sampled tokens on the host (this waits for them); the logprobs are on the host after it too."""
        if self._ready is None:
            return self.sampled.tolist()
        self._ready.synchronize()
        return self._host.tolist()


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a CUDA tensor into pinned host memory, queued on the current stream (not waited for)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)

# Prompt logprobs take the logits of every position they cover: computed this many rows at a time, so a
# long prompt chunk never holds [chunk tokens, vocabulary] floats at once.
PROMPT_LOGITS_ROWS = 256


# Decode steps replayed from CUDA graphs serve contexts up to this many tokens (the graphs' block tables
# are this long); longer ones run eagerly. The torch attention path reads a graph's whole block table
# every step, so without the in-place GPU kernel the graphs' tables are kept short.
GRAPH_MAX_CONTEXT = 16384
GRAPH_MAX_CONTEXT_TORCH_ATTENTION = 2048


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, cuda_graphs: bool = False,
                 max_num_seqs: int = 64, max_model_len: int | None = None, graph_rows: int | None = None):
        """cuda_graphs: decode-only steps of up to graph_rows rows (default max_num_seqs; more where requests
        verify drafts, k + 1 rows each) replay CUDA graphs (pdserve.engine.cuda_graphs); the cache then holds
        one more block than the pool hands out, the graphs' scratch block."""
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_cache = allocate_kv_cache(self.cfg, num_blocks + cuda_graphs, block_size, self.dtype, self.device)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            in_place = self.device.type != "cuda" or attention.gpu_decode_in_place()
            cap = GRAPH_MAX_CONTEXT if in_place else GRAPH_MAX_CONTEXT_TORCH_ATTENTION
            context = min(max_model_len or self.cfg.max_position_embeddings, cap)
            self.graphs = DecodeGraphs(model, self.kv_cache, block_size, scratch_block=num_blocks,
                                       max_blocks=-(-context // block_size),
                                       buckets=batch_buckets(graph_rows or max_num_seqs))
            if self.device.type == "cuda":
                self.graphs.capture()
        self._dtype_bytes = self.kv_cache.element_size()
        self._weight_bytes = model.lm_head.weight.element_size()  # 1 for int8 weights
        if self.device.type == "cpu":
            # Build (first time on a machine, ~30 s) or load the CPU kernels (attention, linear) now, at
            # start-up, rather than inside the first request's step.
            cpu_kernels.available()
        self._routes: RouteCapture | None = None  # the MoE blocks' top-k recorder, made at the first step that asks
        # Analytic work done so far (pdserve.engine.utilization): the numerators of MFU and MBU.
        self.flops_total = 0
        self.bytes_total = 0

    @torch.inference_mode()
    def execute(self, chunks: list[Chunk], layer_done: Callable[[int], None] | None = None,
                previous: torch.Tensor | None = None, sample_tokens: bool = True) -> StepResult:
        """layer_done(i), if given, is called as soon as layer i has written this step's KV (on a GPU:
        once its kernels are queued; the callee orders its own reads after them). previous: the sampled
        tokens of the step before (pipelined decode), which chunks with a pending_row read on the device.
        The sampled tokens are returned on the device: nothing here waits for them."""
        assert chunks, "empty step"
        if self.graphs is not None and self.graphs.bucket_for(chunks, layer_done) is not None:
            return self._execute_graph(chunks, previous)
        # Single-token chunks and verifications take the batched decode path, a row per token; they come first,
        # by context length.
        order = sorted(range(len(chunks)), key=lambda i: (not decode_rows(chunks[i]), chunks[i].start))
        ordered = [chunks[i] for i in order]
        input_ids, positions, meta = self._prepare(ordered)
        pending = [(row, c.pending_row) for row, c in zip(itertools.accumulate(len(c.token_ids) for c in ordered),
                                                          ordered) if c.pending_row is not None]
        if pending:
            assert previous is not None, "a pending token needs the previous step's sampled tokens"
            dst, src = to_device(torch.tensor(list(zip(*pending))), self.device)
            input_ids[dst - 1] = previous[src]
        self._count_work(chunks)
        # Routed experts, where a chunk asks: rank 0 of a tensor-parallel engine records them (every rank routes
        # every token alike); its other ranks, which do not sample, do not.
        capture = None
        if sample_tokens and any(c.routed_experts for c in chunks):
            capture = self._routes = self._routes or RouteCapture(self.model)
        if capture is None:
            hidden = self.model(input_ids, positions, meta, self.kv_cache, layer_done)  # [tokens, hidden]
        else:
            with capture:
                hidden = self.model(input_ids, positions, meta, self.kv_cache, layer_done)
        last_row = [0] * len(chunks)  # row of each chunk's last token in the reordered batch
        row = 0
        for i, c in zip(order, ordered):
            row += len(c.token_ids)
            last_row[i] = row - 1
        routed = {}
        if capture is not None:
            ids = capture.ids()  # [tokens, moe layers, k], the batch's rows
            routed = {i: ids[last_row[i] + 1 - len(c.token_ids):last_row[i] + 1]
                      for i, c in enumerate(chunks) if c.routed_experts}
        # Every rank runs the same LM head calls (with tensor parallelism each is a collective), so the
        # prompt logprobs' logits are computed before the ranks that do not sample return.
        prompt_logprobs = {i: self._prompt_logprobs(hidden, last_row[i] + 1 - len(c.token_ids), *c.prompt_logprobs)
                           for i, c in enumerate(chunks) if c.prompt_logprobs is not None}
        verified = {i: self._verify(self.model.compute_logits(hidden[last_row[i] - len(c.draft):last_row[i] + 1]), c)
                    for i, c in enumerate(chunks) if c.draft}
        # One row per token to sample: a group's first sampling draws its n tokens from one row of logits.
        sampling_chunks = [i for i, c in enumerate(chunks) if c.sample is not None and not c.draft
                           for _ in range(c.fanout)]
        if not sampling_chunks:
            return StepResult(torch.empty(0, dtype=torch.int64), torch.empty(0, self.cfg.vocab_size), [],
                              prompt_logprobs=prompt_logprobs, verified=verified, routed_experts=routed)
        rows = to_device(torch.tensor([last_row[i] for i in sampling_chunks]), self.device)
        logits = self.model.compute_logits(hidden[rows])  # [sampling chunks, vocab]
        if not sample_tokens:
            return StepResult(torch.empty(0, dtype=torch.int64), logits, sampling_chunks)
        sampled, logprobs = sample(logits, self._sampling(chunks, sampling_chunks, previous))
        result = StepResult(sampled, logits, sampling_chunks, logprobs, prompt_logprobs, verified=verified,
                            routed_experts=routed)
        result.start_host_copy()
        return result

    def _verify(self, logits: torch.Tensor, chunk: Chunk) -> tuple[list[int], list[TokenLogprob] | None]:
        """A speculative chunk's emitted tokens (and their logprobs, if asked): the target's logits at its k + 1
        positions ([k + 1, vocab]) checked against its k drafts, each position's logits processed as a plain
        step's would be there (its penalties, min_tokens' banned ids, grammar mask)."""
        logits = logits.float()
        batch = verification_batch(chunk.sample, chunk.seed, chunk.output_index, chunk.draft, chunk.history,
                                   chunk.banned, chunk.mask, self.device)
        return verify(logits, chunk.draft, chunk.sample, chunk.seed, chunk.output_index, batch, chunk.draft_probs)

    def _sampling(self, chunks: list[Chunk], sampling_chunks: list[int],
                  previous: torch.Tensor | None) -> SamplingBatch:
        """The sampling rows' inputs; a chunk's repeated rows (a group's fanout) are its samples 0, 1, ..."""
        chunks = [chunks[i] for i in sampling_chunks]
        seeds = [sample_seed(c.seed, j) for c, j in zip(chunks, samples_of(sampling_chunks))]
        return SamplingBatch.build([c.sample for c in chunks], seeds,
                                   [c.output_index for c in chunks], self.device,
                                   histories=[c.history for c in chunks], banned=[c.banned for c in chunks],
                                   pending=[c.pending_row for c in chunks], previous=previous,
                                   masks=[c.mask for c in chunks])

    def commit_weights(self, staged) -> None:
        """A staged weight update (pdserve.weights.update.StagedUpdate) into the model, in place."""
        staged.commit(self.model)

    can_copy_blocks = True  # copy_blocks below (a tensor-parallel engine's ranks cannot: pdserve.engine.tp_runner)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination), every layer: a forked sample's own copy of the
        prompt's partial last block."""
        if copies:
            src, dst = (to_device(torch.tensor(ids, dtype=torch.int64), self.device) for ids in zip(*copies))
            self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]

    def _prompt_logprobs(self, hidden: torch.Tensor, first: int, k: int, targets: list[int]) -> list[TokenLogprob]:
        """Positions first, first + 1, ... of the batch: the raw logprob of each target (the prompt token that
        follows the position), its rank and the top k."""
        out: list[TokenLogprob] = []
        for a in range(0, len(targets), PROMPT_LOGITS_ROWS):
            want = targets[a:a + PROMPT_LOGITS_ROWS]
            lp = self.model.compute_logits(hidden[first + a:first + a + len(want)]).log_softmax(dim=-1)
            ids = to_device(torch.tensor(want, dtype=torch.int64), self.device)
            out += logprobs_of(lp, ids, k).rows(want, [k] * len(want))
        return out

    def _count_work(self, chunks: list[Chunk]) -> None:
        """The step's analytic FLOPs and bytes (pdserve.engine.utilization), the numerators of MFU and MBU."""
        spans = [(c.start, len(c.token_ids)) for c in chunks]
        self.flops_total += step_flops(self.cfg, spans, sum(c.sample is not None for c in chunks))
        self.bytes_total += step_bytes(self.cfg, spans, self._dtype_bytes, self._weight_bytes)

    def _execute_graph(self, chunks: list[Chunk], previous: torch.Tensor | None) -> StepResult:
        """A decode-only step in its CUDA graph's bucket (padded; eager where no graph is captured): plain decodes
        sample their row, verifications check their k + 1 rows."""
        self._count_work(chunks)
        logits = self.graphs.run(chunks, previous)  # a row per token
        ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))
        verified = {i: self._verify(logits[ends[i] - len(c.token_ids):ends[i]], c)
                    for i, c in enumerate(chunks) if c.draft}
        sampling_chunks = [i for i, c in enumerate(chunks) if not c.draft]
        if not sampling_chunks:
            return StepResult(torch.empty(0, dtype=torch.int64), torch.empty(0, self.cfg.vocab_size), [],
                              verified=verified)
        if verified:
            logits = logits[to_device(torch.tensor([ends[i] - 1 for i in sampling_chunks]), self.device)]
        sampled, logprobs = sample(logits, self._sampling(chunks, sampling_chunks, previous))
        result = StepResult(sampled, logits, sampling_chunks, logprobs, verified=verified)
        result.start_host_copy()
        return result

    def _prepare(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        num_decodes = 0
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        p_q, p_ctx, p_tables = [], [], []
        for c in chunks:
            n = len(c.token_ids)
            end = c.start + n
            assert len(c.block_ids) * bs >= end, "block table too short for the chunk"
            ids.extend(c.token_ids)
            p = torch.arange(c.start, end)
            table = torch.tensor(c.block_ids, dtype=torch.int64)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if decode_rows(c):  # each of a verification's positions a row attending up to itself
                num_decodes += n
                for ctx in range(c.start + 1, end + 1):
                    decode_tables.append(c.block_ids[: -(-ctx // bs)])
                    decode_lens.append(ctx)
            else:
                p_q.append(n)
                p_ctx.append(end)
                p_tables.append(to_device(table, self.device))
        meta = AttentionMetadata(
            slot_mapping=to_device(torch.cat(slots), self.device),
            num_decodes=num_decodes,
            decode_groups=[self._decode_group(decode_tables[a:b], decode_lens[a:b])
                           for a, b in group_by_length([len(t) for t in decode_tables], self._max_padding())],
            prefill_query_lens=p_q,
            prefill_context_lens=p_ctx,
            prefill_block_tables=p_tables,
        )
        input_ids = to_device(torch.tensor(ids, dtype=torch.int64), self.device)
        return input_ids, to_device(torch.cat(pos), self.device), meta

    def _max_padding(self) -> float:
        """Padding the decode groups may carry: the CPU kernel never reads it (one group is fastest);
        the torch path reads all of it (groups of similar length)."""
        kernel = self.device.type == "cpu" and self.dtype in cpu_attention.DTYPES and cpu_attention.enabled() \
            and cpu_attention.available()
        return float("inf") if kernel else 0.25

    def _decode_group(self, tables: list[list[int]], lens: list[int]) -> DecodeGroup:
        # Rows ascend by chunk, a verification's rows after the chunk's start: the last row need not be the longest.
        bt = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int64)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        return DecodeGroup(to_device(bt, self.device), to_device(torch.tensor(lens, dtype=torch.int64), self.device))


def decode_rows(chunk: Chunk) -> bool:
    """Whether a chunk's tokens attend as decode rows, one per token, each up to itself: a single token, or a
    verification (its k + 1 positions; the paged decode kernels read each row's context where the prefill path
    would gather it first: 1.1-1.6x faster per layer at k = 4 on this project's CPU, 256 to 8192 tokens of
    context, `python -m bench.engine.decode_attention` part 3)."""
    return len(chunk.token_ids) == 1 or bool(chunk.draft)


def samples_of(sampling_chunks: list[int]) -> list[int]:
    """Each sampling row's sample index, from the rows' chunk indices: 0, unless a chunk repeats (a group's
    fanout: its rows are its samples 0, 1, ...)."""
    out: list[int] = []
    for row, i in enumerate(sampling_chunks):
        out.append(out[-1] + 1 if row and sampling_chunks[row - 1] == i else 0)
    return out


def group_by_length(num_blocks: list[int], max_padding: float = 0.25) -> list[tuple[int, int]]:
    """Split rows sorted by ascending length into [start, end) groups whose padding to the group's
    longest row stays within max_padding of the real work."""
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(num_blocks):
        if i > start and n * (i - start + 1) > (1 + max_padding) * (total + n):
            groups.append((start, i))
            start, total = i, 0
        total += n
    if num_blocks:
        groups.append((start, len(num_blocks)))
    return groups
