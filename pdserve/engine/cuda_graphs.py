"""CUDA graphs for decode-only steps: fixed batch buckets, static input buffers, capture and replay.

A decode step launches hundreds of small kernels; where the GPU runs them faster than the host issues
them, the GPU waits (a bubble). A CUDA graph replays them all with one launch. A graph fixes every shape
and address,
so a decode step of n requests runs in the smallest bucket of at least n rows (``batch_buckets``),
its inputs written in place into that bucket's static buffers, the rows past n filled with padding:

- a padding row's token is 0 at position 0; it writes its K/V to slot 0 of a scratch block that no
  request ever owns, and attends to a context of length 1 (that slot alone);
- a real row's block table is padded with the scratch block up to ``max_blocks`` entries;
- the padding rows' logits are computed and dropped.

So padding rows read and write only the scratch block, and a real row's output is what the unpadded
step gives it. Every decode row sits in one attention group of ``max_blocks`` entries. A kernel that
walks each row's table up to its context length (the CPU one, the Triton one) reads no more than the
unpadded step; the torch attention path (pdserve.model.attention) gathers and masks all ``max_blocks`` blocks
of every row, every step, so there ``max_blocks`` bounds the bytes moved as well as the longest context
a graph serves.

A speculative verification step (pdserve.engine.speculative: each request's last token and its k drafts) runs
in the same graphs: each of a chunk's k + 1 tokens is a decode row of its own, at its position, writing its own
slot and attending to the context up to itself through the request's block table. Every layer writes the whole
step's K/V before it attends, so row j of a request sees the drafts before it, as a causal prefill chunk does,
and the step's logits are those of every row, the k + 1 positions the verification reads. The buckets count
rows, so a verification of r requests with k_i drafts each takes the bucket of sum(k_i + 1) rows: adaptive k
needs no graph of its own (the runner's largest bucket covers the speculating batch's full drafts,
ModelRunner's graph_rows).

Steps a graph cannot serve run eagerly, as the runner runs them today: any chunk that is neither a sampled
single-token decode nor a verification (a prefill chunk, a chunk that asks for prompt logprobs or routed
experts), more rows than the largest bucket, a context longer than ``max_blocks`` blocks, or a per-layer
callback (a graph cannot call back into Python mid-replay).

``DecodeGraphs.run`` replays a captured graph on CUDA and, where none is captured (CPU, or before
``capture``), runs the same padded computation eagerly on the same buffers: the padding is exercised
and tested on CPU (tests/engine/test_cuda_graphs.py). Capture (``torch.cuda.graph`` with a shared memory pool, warm-up on a
side stream) ran on an H200: replays equal eager steps, padded and unpadded (the gpu-marked tests), and a
Llama-3-8B-shaped decode step at batch 64 went from 15.8 ms eager to 6.5 ms (docs/benchmarks.md).
"""
from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.chunk import Chunk
from pdserve.engine.sampling import to_device
from pdserve.model.attention import AttentionMetadata, DecodeGroup

if TYPE_CHECKING:
    from pdserve.model.llama import LlamaModel

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16  # past the small buckets: every multiple of 16


def batch_buckets(max_rows: int) -> list[int]:
    """Step sizes in rows to capture: 1, 2, 4, 8, then every multiple of 16 below max_rows, and max_rows
    itself (max_num_seqs for plain decode: a step never holds more running requests; more where requests
    verify drafts, each k + 1 rows)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    small = [b for b in SMALL_BUCKETS if b < max_rows]
    return small + list(range(BUCKET_STEP, max_rows, BUCKET_STEP)) + [max_rows]


def select_bucket(buckets: Sequence[int], num_rows: int) -> int | None:
    """The smallest bucket (ascending list) that holds num_rows rows; None if none does."""
    i = bisect.bisect_left(buckets, num_rows)
    return buckets[i] if i < len(buckets) else None


def is_decode_only(chunks: Sequence[Chunk]) -> bool:
    """Every chunk is one token whose next token is sampled (no prefill chunk, not even a 1-token one), or a
    speculative verification (its last token and its drafts, each position sampled); none asks for prompt
    logprobs or routed experts, which read the hidden states the graph does not keep."""
    return all(c.sample is not None and c.prompt_logprobs is None and not c.routed_experts and c.fanout == 1
               and len(c.token_ids) == 1 + len(c.draft) for c in chunks)


def num_rows(chunks: Sequence[Chunk]) -> int:
    """The step's decode rows: one per token (a verification's k + 1)."""
    return sum(len(c.token_ids) for c in chunks)


def inputs_size(bucket: int, max_blocks: int) -> int:
    """int64 elements of one bucket's packed inputs."""
    return bucket * (4 + max_blocks)


def split_inputs(flat: torch.Tensor, bucket: int, max_blocks: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a bucket's packed inputs, each contiguous: input ids [b], positions [b], slot mapping [b],
    context lengths [b], block tables [b, max_blocks]. One packed tensor is one host-to-device copy."""
    ids, pos, slots, ctx, tables = flat.split([bucket] * 4 + [bucket * max_blocks])
    return ids, pos, slots, ctx, tables.view(bucket, max_blocks)


def pad_inputs(chunks: Sequence[Chunk], bucket: int, max_blocks: int, block_size: int, scratch_block: int
               ) -> torch.Tensor:
    """The packed inputs (layout of split_inputs) of decode chunks, in their order, padded to bucket rows.

    Real row (a chunk's token j): its token at position p = start + j, written to its slot, attending to
    p + 1 tokens through the blocks that hold them, the rest of its table the scratch block. Padding row:
    token 0 at position 0, written to slot 0 of the scratch block, attending to that one token.
    """
    n = num_rows(chunks)
    assert n <= bucket, f"{n} rows do not fit a bucket of {bucket}"
    bs, pad = block_size, bucket - n
    ids, pos, slots, ctx, tables = [], [], [], [], []
    for c in chunks:
        for j, token in enumerate(c.token_ids):
            p = c.start + j
            used = p // bs + 1  # blocks holding positions 0..p
            assert used <= max_blocks, f"a context of {p + 1} tokens needs more than {max_blocks} blocks"
            ids.append(token)
            pos.append(p)
            slots.append(c.block_ids[p // bs] * bs + p % bs)
            ctx.append(p + 1)
            tables += c.block_ids[:used]
            tables += [scratch_block] * (max_blocks - used)
    tables += [scratch_block] * (pad * max_blocks)
    return torch.tensor(ids + [0] * pad + pos + [0] * pad + slots + [scratch_block * bs] * pad
                        + ctx + [1] * pad + tables, dtype=torch.int64)


@dataclass
class DecodeBuffers:
    """One bucket's static inputs on the device (views of one packed tensor) and the attention metadata
    over them: the addresses a captured graph reads, rewritten in place before each replay."""

    bucket: int
    flat: torch.Tensor  # [bucket * (4 + max_blocks)] int64
    input_ids: torch.Tensor  # [bucket]
    positions: torch.Tensor  # [bucket]
    slot_mapping: torch.Tensor  # [bucket]
    context_lens: torch.Tensor  # [bucket]
    block_tables: torch.Tensor  # [bucket, max_blocks]
    meta: AttentionMetadata  # every row a decode, one group

    @classmethod
    def allocate(cls, bucket: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        flat = torch.zeros(inputs_size(bucket, max_blocks), dtype=torch.int64, device=device)
        ids, pos, slots, ctx, tables = split_inputs(flat, bucket, max_blocks)
        meta = AttentionMetadata(slot_mapping=slots, num_decodes=bucket, decode_groups=[DecodeGroup(tables, ctx)],
                                 prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[])
        return cls(bucket, flat, ids, pos, slots, ctx, tables, meta)


class DecodeGraphs:
    """Decode-only steps padded to fixed buckets: replayed from CUDA graphs once captured, eager otherwise.

    kv_cache is the runner's cache tensor, which must keep its storage for as long as the graphs live
    (they hold its address); scratch_block is a block of it that no request is ever given.
    """

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, scratch_block: int,
                 max_blocks: int, buckets: Sequence[int]):
        assert list(buckets) == sorted(set(buckets)) and buckets[0] >= 1, "buckets: ascending, distinct, >= 1"
        assert 0 <= scratch_block < kv_cache.shape[3], "the scratch block must be a block of the cache"
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_blocks = max_blocks
        self.buckets = list(buckets)
        self.device = kv_cache.device
        self.buffers = {b: DecodeBuffers.allocate(b, max_blocks, self.device) for b in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # each captured graph's output, [bucket, vocab] fp32
        self.steps: collections.Counter[str] = collections.Counter()  # steps run here: decode, verify

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def bucket_for(self, chunks: Sequence[Chunk], layer_done: Callable[[int], None] | None = None) -> int | None:
        """The bucket this step runs in, or None: the step runs eagerly, unpadded (the runner's own path)."""
        if layer_done is not None or not chunks or not is_decode_only(chunks):
            return None
        if max(c.start + len(c.token_ids) for c in chunks) > self.max_blocks * self.block_size:
            return None
        return select_bucket(self.buckets, num_rows(chunks))

    def prepare(self, chunks: Sequence[Chunk], previous: torch.Tensor | None = None) -> DecodeBuffers:
        """Write the step's padded inputs into its bucket's buffers (one copy, not waited for) and return
        them. previous: the sampled tokens of the step before, read on the device by pending rows."""
        bucket = self.bucket_for(chunks)
        assert bucket is not None, "not a step for a decode graph (see bucket_for)"
        buf = self.buffers[bucket]
        buf.flat.copy_(self._staged(pad_inputs(chunks, bucket, self.max_blocks, self.block_size,
                                               self.scratch_block)), non_blocking=True)
        # A pending token is a plain decode's one row (a pipelined engine does not speculate).
        first_rows = itertools.accumulate((len(c.token_ids) for c in chunks), initial=0)
        pending = [(row, c.pending_row) for row, c in zip(first_rows, chunks) if c.pending_row is not None]
        if pending:
            assert previous is not None, "a pending token needs the previous step's sampled tokens"
            rows, src = to_device(torch.tensor(list(zip(*pending))), self.device)
            buf.input_ids[rows] = previous[src]
        return buf

    def _staged(self, host: torch.Tensor) -> torch.Tensor:
        """host, in pinned memory on CUDA: copied with non_blocking=True, the host does not wait for the
        stream (a plain copy from pageable memory synchronizes it), and the caching host allocator keeps
        the pinned block until the copy has run."""
        return host.pin_memory() if self.device.type == "cuda" else host

    def forward(self, buf: DecodeBuffers) -> torch.Tensor:
        """The padded step on the bucket's buffers: fp32 logits of every row, [bucket, vocab]. What a graph
        captures, and what runs when there is none."""
        hidden = self.model(buf.input_ids, buf.positions, buf.meta, self.kv_cache)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run(self, chunks: Sequence[Chunk], previous: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, vocab] of a decode-only step, one row per token (num_rows), in the chunks' order.
        From a graph this is a view of the graph's output, overwritten by the next replay of the same bucket."""
        buf = self.prepare(chunks, previous)
        rows = num_rows(chunks)
        self.steps["verify" if rows > len(chunks) else "decode"] += 1
        graph = self._graphs.get(buf.bucket)
        if graph is None:
            return self.forward(buf)[:rows]
        graph.replay()
        return self._logits[buf.bucket][:rows]

    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> None:
        """Capture one graph per bucket, largest first, all in one memory pool (they never run at once).

        Each bucket's buffers are filled with padding rows only, so warm-up writes nothing but the scratch
        block; warm-up runs on a side stream (cuBLAS and the allocator settle outside the capture). Call
        once the model's weights and the cache are in place.
        """
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device; this cache is on {self.device}")
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            buf = self.prepare_padding(bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.forward(buf)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(buf)
            self._graphs[bucket] = graph
            self._logits[bucket] = logits
        torch.cuda.synchronize()

    def prepare_padding(self, bucket: int) -> DecodeBuffers:
        """Fill a bucket's buffers with padding rows only (as for capture)."""
        buf = self.buffers[bucket]
        buf.flat.copy_(pad_inputs([], bucket, self.max_blocks, self.block_size, self.scratch_block))
        return buf
