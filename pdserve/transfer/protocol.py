"""The prefill -> decode hand-off: KV pushed by the prefill worker as it is computed, in an order it announces.

This module holds what both ends of a pair agree on: the announcement (`KVAnnounce`), how a transfer is cut
into parts (`layer_spans`, `num_parts_for`), the order of its blocks (`block_index` on the sender,
`transfer_rows` on the receiver), its trailer (`trailer_len`) and keyed checksum (`KVMac`, `KVCorrupted`),
the channels' names (`rank_name`) and the hand-off's duration histogram (`SecondsHistogram`). The rest:

sender.py    the prefill side: `PushJob`, `KVPusher`
receiver.py  the decode side: `InboundTable`, `KVIntake`
shares.py    one rank's share of a transfer on one channel, and tensor-parallel shares rank to rank (`PairLink`)

Request path (pdserve.engine.request has the states):
1. The router places a request on a prefill worker P and a decode worker D at once. D reserves blocks
   for the prompt's KV (WAITING_FOR_KV) while P computes, and tells P that the destination is ready
   (one `kv_ready` call per D step, for all the requests it reserved for P).
2. P pushes. A request whose prompt completes in a step and whose destination is ready is sent layer
   by layer during that step's forward (layer i travels while layer i+1 computes); one whose
   destination became ready later is sent at once from its HELD blocks. The requests of one step bound
   for the same D travel as one transfer. Nothing waits for another step or a per-request call.
3. Ordering: per (P, D) pair, P's `KVPusher` takes queued transfers by service tier, then queue order,
   numbers each (generation, seq) as its turn comes and announces it (`KVAnnounce`, a small Ray call to
   D) before sending it; D's `KVIntake` receives them strictly in that order, whatever order the
   announcements arrive in. NCCL matches operations by order alone, so the sender orders and the
   receiver follows.
4. Each transfer is: a header, the KV (one part per layer, or one part for all), and a trailer with
   the first token of each request, when it was sampled and, if switched on, a checksum of the KV keyed
   with the cluster's secret (`KVMac`). D writes each part straight into the reserved blocks and, after the trailer
   (a checksum that differs fails the transfer), hands each request to its scheduler (`kv_arrived`).
   The announcement names the requests, their blocks, the parts, each request's number of first
   tokens (`samples`: a group's n) and the weight version that computed each request's KV and first
   tokens (`versions`: P switches versions between two steps, so a push of HELD KV may mix versions);
   D applies the request's version policy when that version differs from the one D serves.
5. Tensor parallelism (pdserve.parallel.layout): a pair of a TP A prefill worker and a TP B decode
   worker is several channels, one per (prefill rank, decode rank) of `handoff_plan`, each carrying
   the KV heads its decode rank holds, straight from a prefill rank that holds them (`PairLink`). Rank
   0 of each side orders and announces as above; the other ranks' shares of each transfer are started
   by a call from their rank 0 and run at the same time as its own. The channel of ranks (0, 0) carries
   the trailer's first tokens.
6. Failure: every wait is bounded. A transfer that fails breaks its pair channel; every transfer of
   that generation fails on both sides (P releases the KV, D frees the reservations and reports the
   requests failed, and the router retries them once elsewhere); the next transfer rebuilds the
   channel under the next generation. A request cancelled while its KV is being written into its
   blocks keeps those blocks until the write has finished (`InboundTable`), so a late write can never
   land in blocks that another request owns.
"""
from __future__ import annotations

import bisect
import hashlib
import hmac
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.transfer.channel import TransferError

# --- control message and layout --------------------------------------------------------------------

@dataclass(frozen=True)
class KVAnnounce:
    """What transfer (generation, seq) of a pair carries: the requests' KV, in this order."""

    prefill_id: str
    generation: int
    seq: int
    request_ids: tuple[str, ...]
    num_blocks: tuple[int, ...]  # per request: blocks of KV sent
    num_parts: int  # KV parts, each a run of whole layers (layer_spans): 1 sends all layers at once
    checksum: bool = False  # the trailer ends with kv_checksum of the parts
    # Per request: first tokens carried in the trailer (a group of n samples has n); empty: one each.
    samples: tuple[int, ...] = ()
    # Per request: the weight version (pdserve.weights) that computed its KV and first tokens; empty: all 0.
    versions: tuple[int, ...] = ()

    @property
    def tokens_per_request(self) -> tuple[int, ...]:
        return self.samples or (1,) * len(self.request_ids)

    def version_of(self, i: int) -> int:
        """The weight version of request i's KV."""
        return self.versions[i] if self.versions else 0

    @property
    def order(self) -> tuple[int, int]:
        return self.generation, self.seq


# A part of a layer-wise push carries at least this much KV (whole layers): small parts cost more in
# per-message latency than sending them early saves.
MIN_PART_BYTES = 1 << 20


def layer_spans(num_layers: int, num_parts: int) -> list[tuple[int, int]]:
    """[start, end) layers of each part of a transfer: num_parts contiguous runs of near-equal length."""
    assert 1 <= num_parts <= num_layers, (num_parts, num_layers)
    bounds = [num_layers * i // num_parts for i in range(num_parts + 1)]
    return list(zip(bounds, bounds[1:]))


def num_parts_for(num_layers: int, layer_bytes: int, min_part_bytes: int = MIN_PART_BYTES) -> int:
    """How many parts a layer-wise push of layers of layer_bytes each is cut into."""
    per_part = max(1, -(-min_part_bytes // max(layer_bytes, 1)))  # layers
    return max(1, num_layers // per_part)


class KVMac:
    """The KV checksum keyed with the cluster's secret (--kv-checksum): a transfer's parts cannot be altered,
    swapped or replayed by anyone without the key, on the wire or between the workers.

    Each part's 64-bit words are multiplied by weights derived from the key (odd, one per word position of a
    row and one per (layer, k/v, head, block) row) and summed, on the part's device, with no host sync
    (`checksum`): a linear hash keyed by the secret weights, wrapping the same way on both ends. The sum of a
    transfer's parts is then tagged with HMAC-SHA256 under the key, bound to the channel and the transfer
    (`tag`): the value sent reveals nothing of the weights, and a tag of one transfer fits no other. (The
    weights are odd, so a single changed word always changes the sum; a change of several that cancels needs
    the weights. Reading int64 words runs at memory speed; widening int32 ones is 25x slower on a CPU.)"""

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError("the KV checksum's key must have at least 16 bytes")
        self._key = key
        seed = hmac.new(key, b"pdserve kv-checksum weights", hashlib.sha256).digest()
        self._seed = int.from_bytes(seed[:8], "little") & ((1 << 63) - 1)
        self._weights: dict[tuple[str, int, int], torch.Tensor] = {}  # (device, which, count) -> odd int64
        self._lock = threading.Lock()  # pushers and intakes of several pairs share one

    def _odd(self, which: int, n: int, device: torch.device) -> torch.Tensor:
        k = (str(device), which, n)
        with self._lock:
            w = self._weights.get(k)
            if w is None:
                g = torch.Generator().manual_seed(self._seed + which)
                w = (torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, dtype=torch.int64) * 2 + 1).to(device)
                self._weights[k] = w
        return w

    def checksum(self, part: torch.Tensor) -> torch.Tensor:
        """The keyed sum of a KV part [layers, 2, kv_heads, blocks, block_size, head_dim], as a 0-dim int64
        tensor on its device (no host sync)."""
        rows = part.reshape(-1, part[0, 0, 0, 0].numel())
        row_bytes = rows.shape[1] * rows.element_size()
        words = rows.view(torch.int64) if row_bytes % 8 == 0 else rows.view(torch.uint8).to(torch.int64)
        w = self._odd(0, words.shape[1], words.device)
        # A CPU's int64 matrix-vector product reads the words once (as fast as the unkeyed sum: 8 ms for 94 MB);
        # CUDA has none for int64, and its temporary costs little there.
        sums = torch.mv(words, w) if words.device.type == "cpu" else (words * w).sum(dim=1)
        return (sums * self._odd(1, sums.numel(), sums.device)).sum()

    def tag(self, channel: str, seq: int, total: int) -> int:
        """What the trailer carries for a transfer whose parts' keyed sums add up to `total`: an int64."""
        msg = f"{channel}|{seq}|{total & ((1 << 64) - 1)}".encode()
        return int.from_bytes(hmac.new(self._key, msg, hashlib.sha256).digest()[:8], "little", signed=True)


def block_index(block_ids: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """The blocks of a push's requests, in order, as one index tensor."""
    return torch.tensor([b for ids in block_ids for b in ids], dtype=torch.int64, device=device)


# --- statistics ------------------------------------------------------------------------------------

HANDOFF_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class SecondsHistogram:
    """A thread-safe histogram of durations, shipped to the router as a snapshot (router.metrics)."""

    buckets: tuple[float, ...] = HANDOFF_SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket and +Inf, not cumulative
    total: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self.total += seconds

    def snapshot(self) -> dict:
        with self._lock:
            return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total}


# --- channels, trailer, rows ----------------------------------------------------------------------

def rank_name(worker_id: str, rank: int) -> str:
    """A pair channel's name for one rank of a worker (rank 0 is the worker itself)."""
    return worker_id if rank == 0 else f"{worker_id}#{rank}"


def trailer_len(num_tokens: int, lead: bool, checksum: bool) -> int:
    """The lead channel's trailer: each request's first token (a group's n, in order: num_tokens in all),
    when they were sampled, [checksum]; another channel's: [checksum]."""
    return (num_tokens + 1 if lead else 0) + checksum


def transfer_rows(num_blocks: Sequence[int], blocks: Sequence[Sequence[int] | None],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a transfer's blocks go where: (rows of the transfer, blocks of the cache), for the
    requests still expected (blocks None: withdrawn; their KV arrives and goes nowhere)."""
    for n, blk in zip(num_blocks, blocks):
        if blk is not None and len(blk) != n:
            raise TransferError(f"{n} blocks announced for a request that reserved {len(blk)}")
    offsets = [0, *itertools.accumulate(num_blocks)]
    keep = [(off, blk) for off, blk in zip(offsets, blocks) if blk is not None]
    src = torch.tensor([o + j for o, blk in keep for j in range(len(blk))], dtype=torch.int64, device=device)
    dst = torch.tensor([b for _, blk in keep for b in blk], dtype=torch.int64, device=device)
    return src, dst


class KVCorrupted(TransferError):
    """The KV received differs from the KV sent (its checksum): the transfer failed."""
