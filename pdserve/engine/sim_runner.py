"""The simulated engine's runner (`load_format="sim"`): every part of a worker but the forward.

The scheduler, block pool, KV hand-off, tiers, metrics and failure paths around it are the real ones; the
forward is a clock. A step sleeps (never spins: dozens of simulated workers share a few cores) the time the
cost model gives for exactly its chunks: `RooflineCosts.step_time` of the GPU named by `sim_gpu`
(pdserve.perf.hardware.roofline) on the real model's shape, times `sim_time_scale`. Single-token chunks
count as decodes (reading their context), longer ones as prompt chunks, as ModelRunner batches them and as
`pdserve profile` measures them. When the host's own work of a step takes longer than that (by more than
PACE_S, a wake-up's slack), the step is late: counted (`late_steps`, the worker's metric
pdserve_worker_late_steps), never hidden.

The KV cache is real tensors (the hand-off moves them over gloo), sized down: each layer's K and V hold
ceil(num_kv_heads * head_dim / sim_kv_scale) elements a token instead of num_kv_heads * head_dim, in one
head. The number of blocks is CacheConfig.num_blocks when given, else the real GPU's (its KV budget next
to the weights, pdserve.perf.hardware.kv_budget_bytes) capped by what CacheConfig.memory_bytes holds of
the held bytes. Block counts and the router's view of room are therefore those of the real worker; bytes
moved are the held ones (so are the parts of a layer-wise push: pdserve.transfer.protocol.num_parts_for).
With layer-wise pushes, layer i is written and announced once i + 1 layers' share of the step has passed.

Tokens. A written slot holds, in every element of its layer, ((token * 131 + position * 31 + layer * 7)
mod 251) + 1 (exact in 16 bits). The token sampled for a chunk is a hash (pdserve.engine.sampling.token_seed)
of the request's seed (0 for greedy requests: like a real model's, their tokens follow from the context
alone), the output index, and what the cache holds at position 0 of the first layer and at the
second-to-last position of the last layer. So a token depends on KV that came over the hand-off: a block
moved wrong changes the tokens, and a cluster's tokens equal the offline engine's only if every transfer
was right. Ids are drawn uniformly from [0, V), V the smaller of the shape's and the tokenizer's
vocabularies, leaving out end-of-sequence and the tokenizer's special ids: a request ends by max_tokens (or
a stop id or string it asked for), never by EOS. Logits are not made: StepResult.logits is [rows, 0].
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.chunk import Chunk
from pdserve.engine.kv_cache import zeroed_cache
from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.runner import StepResult, samples_of
from pdserve.engine.sampling import SampledLogprobs, sample_seed, token_seed
from pdserve.engine.utilization import step_bytes, step_flops
from pdserve.model.loader import ModelInfo, load_info
from pdserve.perf.costs import RooflineCosts, attention_pairs
from pdserve.perf.hardware import (
    DECODE_MBU,
    GB,
    MEMORY_UTILIZATION,
    PREFILL_MFU,
    STEP_OVERHEAD_S,
    Gpu,
    gpu,
    kv_budget_bytes,
    roofline,
)

log = logging.getLogger(__name__)

_MOD = 251  # a slot's value is in [1, 251]: exact in bfloat16 and float16
# A step with layer-wise pushes sleeps at most once per this much simulated time: each sleep waits for a core
# to wake on, and dozens of workers share a few.
PACE_S = 0.005


@dataclass(frozen=True)
class SimPlan:
    """What a simulated worker stands for (a GPU running a model) and what it holds instead."""

    gpu: Gpu
    model: str  # the shape's name or path
    shape: ModelConfig  # the real model's
    costs: RooflineCosts
    dtype: torch.dtype
    time_scale: float
    kv_scale: int  # as asked
    kv_width: int  # elements of K (and of V) held per layer and token
    block_size: int
    gpu_blocks: int  # blocks the GPU's KV budget holds
    num_blocks: int  # blocks held
    capped_by: str | None  # None, "num_blocks" or "memory_bytes"

    @property
    def real_kv_bytes_per_token(self) -> int:
        return self.costs.kv_bytes_per_token

    @property
    def held_kv_bytes_per_token(self) -> int:
        return 2 * self.shape.num_layers * self.kv_width * self.dtype.itemsize

    @property
    def held_bytes(self) -> int:
        return self.held_kv_bytes_per_token * self.block_size * self.num_blocks

    def step_time(self, chunks: list[Chunk]) -> float:
        """Seconds the step takes: the cost model's for its chunks, times the time scale."""
        work = [0, 0, 0, 0, 0]  # prefill tokens, pairs, seqs; decode seqs, context (pdserve.perf.costs)
        for c in chunks:
            n = len(c.token_ids)
            if n == 1:
                work[3] += 1
                work[4] += c.start + 1
            else:
                work[0] += n
                work[1] += attention_pairs(c.start, n)
                work[2] += c.sample is not None
        return self.costs.step_time(*work) * self.time_scale

    def describe(self) -> str:
        g, m = self.gpu, self.shape
        name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(self.dtype, str(self.dtype))
        cap = {None: "", "num_blocks": ", capped by num_blocks",
               "memory_bytes": f", capped by the KV memory budget (the GPU holds {self.gpu_blocks})"}[self.capped_by]
        return (f"simulated engine: an {g.name} ({g.flops / 1e12:.0f} TFLOP/s, {g.bytes_per_s / 1e12:.2f} TB/s, "
                f"{g.memory_bytes / GB:.0f} GB) running {self.model} ({m.num_layers} layers, hidden {m.hidden_size}, "
                f"{m.num_heads}/{m.num_kv_heads} heads, vocabulary {m.vocab_size}, "
                f"{self.costs.resident_weight_bytes / GB:.1f} GB of weights) in {name}; step times from its roofline "
                f"(prefill MFU {PREFILL_MFU}, decode MBU {DECODE_MBU}, {STEP_OVERHEAD_S * 1e3:g} ms a step) "
                f"x{self.time_scale:g}; KV {self.real_kv_bytes_per_token} B a token real, "
                f"{self.held_kv_bytes_per_token} B held (scale {self.kv_scale}: {self.kv_width} of "
                f"{m.kv_size} elements of each layer's K and V); {self.num_blocks} blocks of {self.block_size} tokens "
                f"(its KV budget at {MEMORY_UTILIZATION:.0%} of memory{cap}), {self.held_bytes / 2**20:.1f} MiB held")


def sim_plan(config: EngineConfig, info: ModelInfo) -> SimPlan:
    """The GPU, its roofline on the shape, and the cache a simulated worker holds for it."""
    shape, device = info.config, gpu(config.sim_gpu)
    dtype = config.torch_dtype
    costs = roofline(shape, device, dtype.itemsize)
    bs = config.cache.block_size
    gpu_blocks = kv_budget_bytes(device, costs.resident_weight_bytes) // (costs.kv_bytes_per_token * bs)
    width = -(-shape.kv_size // config.sim_kv_scale)
    held_block = 2 * shape.num_layers * width * dtype.itemsize * bs
    if config.cache.num_blocks is not None:
        blocks, capped = config.cache.num_blocks, "num_blocks"
    else:
        blocks = min(gpu_blocks, config.cache.memory_bytes // held_block)
        capped = "memory_bytes" if blocks < gpu_blocks else None
        if blocks < 1:
            raise ValueError(f"KV cache budget {config.cache.memory_bytes} B holds no block of {held_block} B")
    return SimPlan(device, info.path, shape, costs, dtype, config.sim_time_scale, config.sim_kv_scale, width, bs,
                   gpu_blocks, blocks, capped)


class SimRunner:
    """ModelRunner's interface (execute, kv_cache, device, work counters) over a clock instead of a model."""

    def __init__(self, config: EngineConfig):
        self.info = load_info(config)
        self.plan = sim_plan(config, self.info)
        self.cfg = self.plan.shape
        self.device = torch.device("cpu")
        self.dtype = self.plan.dtype
        self.block_size = self.plan.block_size
        self.num_blocks = self.plan.num_blocks
        layers, width = self.cfg.num_layers, self.plan.kv_width
        # [layers, 2, kv_heads, blocks, block_size, head_dim] as pdserve.transfer moves it: one head, width wide.
        self.kv_cache = zeroed_cache((layers, 2, 1, self.num_blocks, self.block_size, width), self.dtype, self.device)
        self._slots = self.kv_cache.view(layers, 2, 1, self.num_blocks * self.block_size, width)  # [.., slots, w]
        self._layer_salt = (torch.arange(layers, dtype=torch.int64) * 7)[:, None]  # [layers, 1]
        tok = self.info.tokenizer
        self.vocab = min(self.cfg.vocab_size, tok.vocab_size) if tok is not None else self.cfg.vocab_size
        special = set(tok.special_tokens) if tok else set()
        self._skipped = sorted(i for i in {*self.info.eos_token_ids, *special} if i < self.vocab)
        self._dtype_bytes = self.dtype.itemsize
        self.flops_total = 0
        self.bytes_total = 0
        self.late_steps = 0  # steps whose host work took longer than the simulated time
        log.info("%s; generated ids in [0, %d) but %d end-of-sequence or special ones%s", self.plan.describe(),
                 self.vocab, len(self._skipped), "" if tok is not None else "; no tokenizer: token-id prompts only")

    def execute(self, chunks: list[Chunk], layer_done: Callable[[int], None] | None = None,
                previous: torch.Tensor | None = None, sample_tokens: bool = True) -> StepResult:
        """As ModelRunner.execute; the step returns when the simulated time since its call has passed."""
        t0 = time.perf_counter()
        assert chunks, "empty step"
        duration = self.plan.step_time(chunks)
        slots, values = self._slot_values(chunks, previous)
        if layer_done is None:
            self._write(slots, values, slice(None))
        else:  # layer i's KV is there once i + 1 layers' share of the step has passed (PACE_S early at most)
            layers, woke = self.cfg.num_layers, t0
            for i in range(layers):
                due = t0 + duration * (i + 1) / layers
                if due - woke >= PACE_S:  # a sleep costs a wake-up: on a crowded host, a wait in the run queue
                    _sleep_until(due)
                    woke = due
                self._write(slots, values, slice(i, i + 1))
                layer_done(i)
        self._count_work(chunks)
        sampling = [i for i, c in enumerate(chunks) if c.sample is not None for _ in range(c.fanout)]
        rows = [chunks[i]._replace(seed=sample_seed(chunks[i].seed, j)) for i, j in zip(sampling, samples_of(sampling))]
        sampled = torch.tensor(self._tokens(rows) if sample_tokens else [], dtype=torch.int64)
        if time.perf_counter() - t0 > duration + PACE_S:  # a layer-wise step sleeps to its end, then writes one layer
            self.late_steps += 1
            if self.late_steps == 1:
                log.warning("a simulated step took %.1f ms of host work, more than its %.1f ms: steps run late "
                            "when the host cannot keep up (raise sim_time_scale, or run fewer workers a core)",
                            (time.perf_counter() - t0) * 1e3, duration * 1e3)
        _sleep_until(t0 + duration)
        logprobs, prompt_logprobs = _certain_logprobs(chunks, sampling, sampled)
        return StepResult(sampled, torch.empty(len(sampling), 0), sampling, logprobs, prompt_logprobs)

    def _slot_values(self, chunks: list[Chunk], previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every computed token's cache slot and its value before the layer salt: [tokens] each. Lists built
        at C speed and a few tensor ops for the whole step, whatever its batch: a tensor op per chunk would
        cost more host time than a decode step of a large batch simulates."""
        bs, chain = self.block_size, itertools.chain.from_iterable
        ends = [c.start + len(c.token_ids) for c in chunks]
        spans = [c.block_ids[c.start // bs: -(-e // bs)] for c, e in zip(chunks, ends)]  # the blocks each chunk writes
        assert all(len(c.block_ids) * bs >= e for c, e in zip(chunks, ends)), "block table too short for the chunk"
        tables = torch.tensor(list(chain(spans)), dtype=torch.int64)
        # Per token: where its chunk's span starts in `tables`, less the chunk's first block (pos // bs is absolute).
        shift = [b - c.start // bs for c, b in zip(chunks, itertools.accumulate((len(t) for t in spans), initial=0))]
        pos = torch.tensor(list(chain(range(c.start, e) for c, e in zip(chunks, ends))), dtype=torch.int64)
        at = torch.tensor(list(chain(itertools.repeat(k, len(c.token_ids)) for c, k in zip(chunks, shift))))
        ids = torch.tensor(list(chain(c.token_ids for c in chunks)), dtype=torch.int64)
        ends_in_step = itertools.accumulate(len(c.token_ids) for c in chunks)
        pending = [(end - 1, c.pending_row) for end, c in zip(ends_in_step, chunks) if c.pending_row is not None]
        if pending:  # pipelined decode: those chunks' last token is the previous step's sample, still unread
            assert previous is not None, "a pending token needs the previous step's sampled tokens"
            rows, src = zip(*pending)
            ids[list(rows)] = previous[list(src)]
        return tables[at + pos // bs] * bs + pos % bs, ids * 131 + pos * 31

    def _write(self, slots: torch.Tensor, values: torch.Tensor, layers: slice) -> None:
        v = ((values[None, :] + self._layer_salt[layers]) % _MOD + 1).to(self.dtype)  # [layers, tokens]
        src = v[:, None, None, :, None].expand(v.shape[0], 2, 1, v.shape[1], self.plan.kv_width)
        self._slots[layers].index_copy_(3, slots, src)

    can_copy_blocks = True

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """As ModelRunner.copy_blocks: a forked sample's copy of the prompt's partial last block."""
        for src, dst in copies:
            self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]

    def _tokens(self, chunks: list[Chunk]) -> list[int]:
        """Each sampling chunk's token, from its seed, output index and the KV it reads."""
        if not chunks:
            return []
        bs, last = self.block_size, self.cfg.num_layers - 1
        first = torch.tensor([c.block_ids[0] * bs for c in chunks])
        before = [max(c.start + len(c.token_ids) - 2, 0) for c in chunks]
        near = torch.tensor([c.block_ids[p // bs] * bs + p % bs for c, p in zip(chunks, before)])
        a = self._slots[0, 0, 0, first, 0].tolist()
        b = self._slots[last, 1, 0, near, 0].tolist()
        out = []
        for c, x, y in zip(chunks, a, b):
            seed = 0 if c.sample.greedy else c.seed
            h = token_seed(token_seed(seed, int(x) * 256 + int(y)), c.output_index)
            out.append(self._vocab_id(h % (self.vocab - len(self._skipped))))
        return out

    def _vocab_id(self, k: int) -> int:
        """The k-th id of [0, vocab) that is not skipped."""
        for s in self._skipped:
            if s > k:
                break
            k += 1
        return k

    def _count_work(self, chunks: list[Chunk]) -> None:
        """The real model's analytic FLOPs and bytes (pdserve.engine.utilization), as ModelRunner counts them."""
        spans = [(c.start, len(c.token_ids)) for c in chunks]
        self.flops_total += step_flops(self.cfg, spans, sum(c.sample is not None for c in chunks))
        self.bytes_total += step_bytes(self.cfg, spans, self._dtype_bytes, self._dtype_bytes)


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _certain_logprobs(chunks: list[Chunk], sampling: list[int],
                      sampled: torch.Tensor) -> tuple[SampledLogprobs | None, dict[int, list[TokenLogprob]]]:
    """Logprobs for the requests that ask: a simulated engine's tokens are certain (logprob 0, rank 1,
    the token itself the only alternative it reports)."""
    asks = [chunks[i].sample.logprobs is not None for i in sampling]
    logprobs = None
    if any(asks) and len(sampled):
        n = len(sampled)
        ones = torch.ones(n, dtype=torch.int64)
        logprobs = SampledLogprobs(torch.zeros(n), ones, sampled[:, None], torch.zeros(n, 1))
    prompt = {}
    for i, c in enumerate(chunks):
        if c.prompt_logprobs is not None:
            k, targets = c.prompt_logprobs
            prompt[i] = [TokenLogprob(t, 0.0, 1, ((t, 0.0),)[:k]) for t in targets]
    return logprobs, prompt
