"""How a model's attention heads are laid out over the ranks of a tensor-parallel worker, and how KV moves
between a prefill worker of TP A and a decode worker of TP B.

Megatron-style sharding splits the query heads evenly over the ranks: rank r of TP t holds query heads
[r * h/t, (r + 1) * h/t). Its KV heads are those its query heads attend to (GQA: query head q reads
KV head q // (h / kv)):

- TP divides the KV heads (t <= kv): each rank holds kv/t KV heads of its own;
- TP exceeds them (t > kv, t a multiple of kv): each KV head is replicated on t/kv consecutive ranks, and
  each rank holds exactly one.

Anything else cannot be laid out: a clear error at start-up. Each rank's paged KV cache holds its own
KV heads, in the order `kv_heads` lists them; block tables are the same on every rank.

The hand-off (`handoff_plan`): every decode rank receives exactly the KV heads it holds, each from one
prefill rank that holds it, directly (nothing goes through rank 0). Where the prefill side replicates a
head, the sources are spread over its replicas; where the decode side replicates one, it is sent once to
each decode rank that holds it.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from pdserve.config import ModelConfig


@dataclass(frozen=True)
class TPLayout:
    num_heads: int
    num_kv_heads: int
    tp: int

    def __post_init__(self) -> None:
        h, kv, t = self.num_heads, self.num_kv_heads, self.tp
        if t < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {t}")
        if h % t:
            raise ValueError(f"tensor-parallel size {t} does not divide the model's {h} attention heads")
        if kv % t and t % kv:
            raise ValueError(f"tensor-parallel size {t} neither divides the model's {kv} KV heads nor is a "
                             f"multiple of them: its ranks' KV heads cannot be laid out")

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return max(self.num_kv_heads // self.tp, 1)

    @property
    def replication(self) -> int:
        """How many ranks hold each KV head (1: split, no copies)."""
        return max(self.tp // self.num_kv_heads, 1)

    def q_heads(self, rank: int) -> range:
        n = self.heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def kv_heads(self, rank: int) -> list[int]:
        """The global KV heads rank holds, in its cache's order."""
        self._check(rank)
        group = self.num_heads // self.num_kv_heads  # query heads per KV head
        return sorted({q // group for q in self.q_heads(rank)})

    def holders(self, kv_head: int) -> list[int]:
        """The ranks that hold a KV head."""
        return [r for r in range(self.tp) if kv_head in self.kv_heads(r)]

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} of a TP {self.tp} worker")


@dataclass(frozen=True)
class HeadTransfer:
    """KV heads one prefill rank sends to one decode rank: global ids, and where they sit in each cache."""

    src_rank: int
    dst_rank: int
    kv_heads: tuple[int, ...]
    src_index: tuple[int, ...]  # positions in the prefill rank's cache (its kv_heads order)
    dst_index: tuple[int, ...]  # positions in the decode rank's cache


def handoff_plan(prefill: TPLayout, decode: TPLayout) -> list[HeadTransfer]:
    """The transfers of one hand-off from a TP prefill.tp worker to a TP decode.tp one, by (dst, src)."""
    if (prefill.num_heads, prefill.num_kv_heads) != (decode.num_heads, decode.num_kv_heads):
        raise ValueError("the prefill and decode workers must serve the same model")
    by_pair: dict[tuple[int, int], list[int]] = {}
    for dst in range(decode.tp):
        for head in decode.kv_heads(dst):
            holders = prefill.holders(head)
            src = holders[dst % len(holders)]  # replicas on the prefill side share the sending
            by_pair.setdefault((dst, src), []).append(head)
    out = []
    for (dst, src), heads in sorted(by_pair.items()):
        src_heads, dst_heads = prefill.kv_heads(src), decode.kv_heads(dst)
        out.append(HeadTransfer(src, dst, tuple(heads), tuple(src_heads.index(h) for h in heads),
                                tuple(dst_heads.index(h) for h in heads)))
    return out


def pair_plan(cfg: ModelConfig, prefill_tp: int, decode_tp: int) -> list[HeadTransfer | None]:
    """The channels of a pair of workers (pdserve.transfer.shares): [None], one channel of every head, when
    both are TP 1; else handoff_plan's head transfers."""
    if prefill_tp == decode_tp == 1:
        return [None]
    return list(handoff_plan(TPLayout(cfg.num_heads, cfg.num_kv_heads, prefill_tp),
                             TPLayout(cfg.num_heads, cfg.num_kv_heads, decode_tp)))


def shares_by_rank(plan: list[HeadTransfer | None], sender: bool) -> dict[int, list[HeadTransfer | None]]:
    """A pair's channels by the rank of one side that holds them (the source rank on the prefill side, the
    destination rank on the decode side); rank 0 always holds one (the (0, 0) channel)."""
    out: dict[int, list[HeadTransfer | None]] = {}
    for t in plan:
        out.setdefault(0 if t is None else t.src_rank if sender else t.dst_rank, []).append(t)
    return out


# --- a rank's share of the model ----------------------------------------------------------------------

def vocab_rows(vocab_size: int, tp: int) -> int:
    """Rows of the embedding and LM head each rank holds (vocab-parallel; the last rank's are padded)."""
    return -(-vocab_size // tp)


def rank_config(cfg: ModelConfig, tp: int, ep: int = 1) -> ModelConfig:
    """The shape of one rank's share: its attention heads, its KV heads, its slice of the MLP and of the
    vocabulary (vocab_size is its rows of the embedding and LM head); the hidden size and everything else
    unchanged. A mixture of experts' experts are sliced like the MLP (ep 1) or split whole over the ranks
    (ep = tp: experts_per_rank of them each; pdserve.model.moe)."""
    layout = TPLayout(cfg.num_heads, cfg.num_kv_heads, tp)
    if ep != 1 and ep != tp:
        raise ValueError(f"expert-parallel size {ep} must be 1 or the worker's rank count ({tp}): the experts are "
                         f"split over the same ranks as the attention heads")
    if ep > 1 and not cfg.is_moe:
        raise ValueError(f"expert parallelism needs a mixture-of-experts model; {cfg.architecture} is dense")
    dense = len(cfg.moe_layers) < cfg.num_layers
    if dense and cfg.intermediate_size % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the model's MLP size {cfg.intermediate_size}")
    moe = {}
    if cfg.is_moe and ep > 1:
        if cfg.num_experts % ep:
            raise ValueError(f"expert-parallel size {ep} does not divide the model's {cfg.num_experts} experts")
        moe = dict(experts_per_rank=cfg.num_experts // ep)
    elif cfg.is_moe:
        if cfg.moe_intermediate_size % tp or cfg.shared_expert_intermediate_size % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the experts' MLP size "
                             f"{cfg.moe_intermediate_size} (or the shared expert's, "
                             f"{cfg.shared_expert_intermediate_size}): split the experts instead (expert parallelism)")
        moe = dict(moe_intermediate_size=cfg.moe_intermediate_size // tp,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp)
    return replace(cfg, num_heads=layout.heads_per_rank, num_kv_heads=layout.kv_heads_per_rank,
                   intermediate_size=max(cfg.intermediate_size // tp, 1), vocab_size=vocab_rows(cfg.vocab_size, tp),
                   **moe)


def shard_weights(weights: Iterable[tuple[str, Any]], cfg: ModelConfig, tp: int,
                  rank: int, ep: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face-named weights cut to one rank's share (Megatron-style), one tensor at a time, so a
    rank never holds the whole model: q/k/v and gate/up by output rows (column-parallel), o_proj and
    down_proj by input columns (row-parallel: their outputs are partial sums, all-reduced); embedding and
    LM head by vocabulary rows (vocab-parallel, the last rank's padded with zeros); norms whole.

    Each weight is a tensor or a lazy slice of a file (safetensors' get_slice): every cut is one
    contiguous range (a rank's heads, MLP columns and vocabulary rows are consecutive), so from a file
    a rank reads its share's bytes only.

    Experts (pdserve.model.moe): at ep 1 each expert is cut like the MLP, by its own intermediate size; at
    ep = tp a rank gets its experts whole, renumbered from 0, and none of the others'."""
    layout = TPLayout(cfg.num_heads, cfg.num_kv_heads, tp)
    d, inter = cfg.head_dim, cfg.intermediate_size // tp
    q = layout.q_heads(rank)
    kv = layout.kv_heads(rank)  # consecutive
    mlp = (rank * inter, (rank + 1) * inter)
    cut = {"q_proj": (0, (q.start * d, q.stop * d)), "k_proj": (0, (kv[0] * d, (kv[-1] + 1) * d)),
           "v_proj": (0, (kv[0] * d, (kv[-1] + 1) * d)), "o_proj": (1, (q.start * d, q.stop * d)),
           "gate_proj": (0, mlp), "up_proj": (0, mlp), "down_proj": (1, mlp)}
    rows = vocab_rows(cfg.vocab_size, tp)
    shared = cfg.shared_expert_intermediate_size // tp
    for name, weight in weights:
        if ".shared_expert." in name:  # Qwen2-MoE's: sliced like an MLP (ep 1), whole on every rank (ep = tp)
            parts = name.split(".")
            if ep > 1 or parts[-2] not in ("gate_proj", "up_proj", "down_proj"):
                yield name, _read(weight)
            else:
                yield name, _read(weight, 1 if parts[-2] == "down_proj" else 0, rank * shared, (rank + 1) * shared)
            continue
        if ".experts." in name:
            share = _expert_share(name, weight, cfg, tp, rank, ep)
            if share is not None:
                yield share
            continue
        parts = name.split(".")
        kind = parts[-2] if len(parts) >= 2 else ""
        if kind in ("embed_tokens", "lm_head"):
            start = min(rank * rows, cfg.vocab_size)
            tensor = _read(weight, 0, start, min(start + rows, cfg.vocab_size))
            if tensor.shape[0] < rows:
                tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
        elif kind in cut:
            dim, (start, stop) = cut[kind]
            if len(_shape(weight)) == 1 and dim == 1:  # a row-parallel layer's bias: added once, on rank 0
                tensor = _read(weight)
                tensor = tensor if rank == 0 else torch.zeros_like(tensor)
            else:
                tensor = _read(weight, dim if len(_shape(weight)) > 1 else 0, start, stop)
        else:
            tensor = _read(weight)
        yield name, tensor


# A per-expert tensor's kind -> the dimension its intermediate size is on (gate/up rows, down columns).
_EXPERT_CUT = {"gate_proj": 0, "up_proj": 0, "w1": 0, "w3": 0, "down_proj": 1, "w2": 1}


def _expert_share(name: str, weight, cfg: ModelConfig, tp: int, rank: int,
                  ep: int) -> tuple[str, torch.Tensor] | None:
    """One rank's share of an expert tensor: one expert's (...experts.E.<proj>.weight) or all experts' packed
    (...experts.gate_up_proj [experts, 2 * inter, hidden], ...experts.down_proj [experts, hidden, inter]);
    None for an expert another rank holds."""
    parts = name.split(".")
    at = parts.index("experts")
    if ep > 1:
        per = cfg.num_experts // ep
        first = rank * per
        if parts[at + 1].isdigit():  # one expert's tensor: this rank's, renumbered, or none
            e = int(parts[at + 1])
            if not first <= e < first + per:
                return None
            return ".".join(parts[: at + 1] + [str(e - first)] + parts[at + 2:]), _read(weight)
        return name, _read(weight, 0, first, first + per)
    if tp == 1:
        return name, _read(weight)
    inter = cfg.moe_intermediate_size // tp
    lo, hi = rank * inter, (rank + 1) * inter
    if parts[at + 1].isdigit():
        return name, _read(weight, _EXPERT_CUT[parts[at + 2]], lo, hi)
    if parts[-1] == "down_proj":
        return name, _read(weight, 2, lo, hi)
    full = cfg.moe_intermediate_size  # gate_up_proj: this rank's gate rows and its up rows
    return name, torch.cat([_read(weight, 1, lo, hi), _read(weight, 1, full + lo, full + hi)], dim=1)


def _shape(weight) -> tuple[int, ...]:
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) else tuple(weight.get_shape())


def _read(weight, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
    """weight[start:stop] along dim (all of it without a range), as a contiguous tensor; from a lazy
    file slice, only those bytes are read."""
    if start is None:
        return weight if isinstance(weight, torch.Tensor) else weight[:]
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, start, stop - start).contiguous()
    return weight[(slice(None),) * dim + (slice(start, stop),)].contiguous()
