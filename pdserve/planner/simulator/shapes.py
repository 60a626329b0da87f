"""What the simulator is given: a cluster's shape, its pools (how many workers, how each batches) and the
router's admission limits and latencies."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.perf.speculation import SpeculationModel


@dataclass(frozen=True)
class PoolShape:
    """One pool: how many workers and how each batches (pdserve.config.SchedulerConfig's knobs)."""

    workers: int
    kv_blocks: int  # KV cache per worker, in blocks
    block_size: int = 16
    max_num_seqs: int = 64
    token_budget: int = 2048  # tokens a step computes (max_num_batched_tokens)
    headroom_blocks: int = 1  # decode: free blocks a reservation leaves per running request
    # Speculative decoding on the pool's decode steps (pdserve.perf.speculation: its tokens per step and
    # verification cost); None: none. A prefill pool ignores it.
    speculation: SpeculationModel | None = None

    def __post_init__(self) -> None:
        if min(self.workers, self.kv_blocks, self.block_size, self.max_num_seqs, self.token_budget) < 1:
            raise ValueError(f"every pool setting must be >= 1: {self}")


@dataclass(frozen=True)
class ClusterShape:
    """A deployment to simulate: disaggregated (prefill + decode pools, and the fast lane's decode workers
    when `fast` is given) or colocated (one pool)."""

    mode: str
    prefill: PoolShape | None = None
    decode: PoolShape | None = None
    colocated: PoolShape | None = None
    max_running: int = 256  # router admission (pdserve serve --max-running)
    max_queued: int = 1024  # router queue (--max-queued)
    first_token_latency_s: float = 0.0  # worker -> router -> client, for the first token
    token_latency_s: float = 0.0  # the same for a decode step's tokens
    fast: PoolShape | None = None  # the fast lane: priority only, max_num_seqs its running cap

    def __post_init__(self) -> None:
        pools = (self.prefill, self.decode) if self.mode == "disaggregated" else (self.colocated,)
        if self.mode not in ("disaggregated", "colocated") or any(p is None for p in pools):
            raise ValueError(f"a {self.mode} cluster needs its pools: {self}")
        if self.fast is not None and self.mode != "disaggregated":
            raise ValueError("the fast lane is a set of decode workers: it needs a disaggregated cluster")

    @property
    def workers(self) -> int:
        if self.mode == "colocated":
            return self.colocated.workers
        return self.prefill.workers + self.decode.workers + (self.fast.workers if self.fast else 0)

    @property
    def label(self) -> str:
        if self.mode == "colocated":
            return f"colocated x{self.colocated.workers}"
        return f"{self.prefill.workers}P{self.decode.workers}D" + (f"+{self.fast.workers}F" if self.fast else "")
