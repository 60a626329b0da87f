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

from dataclasses import dataclass


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
