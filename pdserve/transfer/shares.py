"""One rank's share of a transfer on one pair channel, and tensor-parallel shares rank to rank.

A pair of a TP A prefill worker and a TP B decode worker (pdserve.parallel.layout) is several channels, one
per (prefill rank, decode rank) of `handoff_plan`, each carrying the KV heads its decode rank holds,
straight from a prefill rank that holds them (`PairLink`, built by `open_shares`). Rank 0 of each side
orders and announces (pdserve.transfer.protocol); the other ranks' shares of each transfer are started by
a call from their rank 0 and run at the same time as its own (`run_shares`). The channel of ranks (0, 0)
carries the trailer's first tokens (`is_lead`). `send_share` and `receive_share` move one share: the KV
of the transfer's blocks, part by part, then the trailer.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pdserve.faults import FaultPoints
from pdserve.parallel.layout import HeadTransfer
from pdserve.transfer.channel import (
    RECEIVER_RANK,
    SENDER_RANK,
    PairChannel,
    TransferStats,
    TransferTimeout,
)
from pdserve.transfer.protocol import KVCorrupted, KVMac, rank_name

log = logging.getLogger(__name__)


@dataclass
class PairLink:
    """One generation of a (prefill worker, decode worker) pair as one rank holds it: its channels, each
    with the heads it carries (None: every head; both workers are TP 1), and, on rank 0, how to start
    the other ranks' shares of a transfer (`others`, returning futures) and make them give this
    generation's channels up (`drop`)."""

    shares: list[tuple[HeadTransfer | None, PairChannel]]
    others: Callable[..., list[concurrent.futures.Future]] | None = None
    drop: Callable[[], None] | None = None

    @property
    def timeout_s(self) -> float:
        return self.shares[0][1].timeout_s

    def record_others(self, results: Sequence[Sequence[tuple[int, float]]]) -> None:
        """Count the other ranks' channels (their shares' (bytes, seconds)) in this worker's statistics."""
        stats = self.shares[0][1].stats
        for per_rank in results:
            for nbytes, seconds in per_rank:
                stats.record(nbytes, seconds)

    def break_(self) -> None:
        for _, channel in self.shares:
            channel.break_()
        if self.drop is not None:
            self.drop()

    def close(self) -> None:
        for _, channel in self.shares:
            channel.close()


def is_lead(transfer: HeadTransfer | None) -> bool:
    """The channel of ranks (0, 0), which carries the trailer's first tokens."""
    return transfer is None or (transfer.src_rank, transfer.dst_rank) == (0, 0)


def share_heads(transfer: HeadTransfer | None, sender: bool, cache: torch.Tensor) -> torch.Tensor | None:
    """Positions in this rank's cache of the heads a share carries (None: all of them, in order)."""
    if transfer is None:
        return None
    index = list(transfer.src_index if sender else transfer.dst_index)
    return None if index == list(range(cache.shape[2])) else torch.tensor(index, dtype=torch.int64, device=cache.device)


def share_numel(cache: torch.Tensor, heads: torch.Tensor | None, num_blocks: int, trailer: int) -> int:
    num_heads = cache.shape[2] if heads is None else heads.numel()
    return cache.shape[0] * 2 * num_heads * num_blocks * cache.shape[4] * cache.shape[5] + trailer


def run_concurrently(fns: Sequence[Callable[[], object]]) -> list[object]:
    """Run each fn in a thread of its own (one inline), wait for all; the first error raises. A rank's
    shares run side by side: one after the other could deadlock across ranks."""
    if len(fns) == 1:
        return [fns[0]()]
    with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result() for f in futures]


def send_share(channel: PairChannel, seq: int, cache: torch.Tensor, index: torch.Tensor, heads: torch.Tensor | None,
               spans: list[tuple[int, int]], wait_layers: Callable[[int], torch.cuda.Event | None],
               trailer: Callable[[], list[int]] | None, num_trailer: int, checksum: KVMac | None,
               faults: FaultPoints | None = None, stream: torch.cuda.Stream | None = None) -> None:
    """One rank's share of transfer seq on one channel: for each span of layers, once wait_layers says it
    is computed, the KV of blocks `index` (heads `heads`); then the trailer (trailer() gives its first
    values; the keyed checksum of the parts ends it, if `checksum` is given)."""
    faults = faults or FaultPoints()
    wait_layers(spans[0][1])  # the receiver's clock starts with the header: send it once the first part can follow

    def parts() -> Iterator[torch.Tensor]:
        total = None
        for i, (start, end) in enumerate(spans):
            event = wait_layers(end)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if event is not None:  # a GPU's: every caller there reads on a stream of its own
                    stream.wait_event(event)
                kv = cache[start:end] if heads is None else cache[start:end].index_select(2, heads)
                part = kv.index_select(3, index)
                if checksum is not None:
                    total = checksum.checksum(part) if total is None else total + checksum.checksum(part)
                if faults.hit("corrupt"):
                    part.view(-1)[:1].view(torch.uint8)[0] ^= 1  # one bit, after the checksum was taken
                yield part
            if i == 0:
                faults.hit("mid_send")
        if num_trailer:
            values = torch.tensor(trailer() if trailer is not None else [], dtype=torch.int64, device=cache.device)
            if total is not None:  # one sync, at the end: the tag is made on the host
                if stream is not None:
                    stream.synchronize()  # the sums were queued on the pusher's own stream
                tag = checksum.tag(channel.prefix, seq, int(total))
                values = torch.cat([values, torch.tensor([tag], dtype=torch.int64, device=values.device)])
            yield values

    channel.send_parts(seq, parts(), share_numel(cache, heads, index.numel(), num_trailer))


def receive_share(channel: PairChannel, seq: int, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                  heads: torch.Tensor | None, total: int, spans: list[tuple[int, int]], num_trailer: int,
                  checksum: KVMac | None, label: str, stream: torch.cuda.Stream | None = None) -> list[int]:
    """One rank's share of transfer seq from one channel: rows `src` of the transfer's `total` blocks go
    into this cache's blocks `dst` (heads `heads`); returns the trailer's values, the checksum checked
    and taken off."""
    num_heads = cache.shape[2] if heads is None else heads.numel()
    trailer = torch.empty(num_trailer, dtype=torch.int64, device=cache.device)
    # One staging buffer, reused by every part: each is scattered into the blocks before the next arrives.
    staging = torch.empty((max(end - start for start, end in spans), 2, num_heads, total, *cache.shape[4:]),
                          dtype=cache.dtype, device=cache.device)
    buffers = [staging[: end - start] for start, end in spans]  # leading slices: contiguous
    parts = channel.recv_parts(seq, [*buffers, *([trailer] if num_trailer else [])],
                               share_numel(cache, heads, total, num_trailer))
    head_list = heads.tolist() if heads is not None else None
    sums = None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for (start, end), data in zip(spans, parts):
            if checksum is not None:
                sums = checksum.checksum(data) if sums is None else sums + checksum.checksum(data)
            if not dst.numel():
                continue
            if head_list is None:
                cache[start:end].index_copy_(3, dst, data.index_select(3, src))
            else:
                for i, h in enumerate(head_list):
                    cache[start:end, :, h].index_copy_(2, dst, data[:, :, i].index_select(2, src))
        for _ in parts:  # the trailer, and the end of the transfer
            pass
        values = trailer.tolist()
    if stream is not None:  # the writes (and the staging buffer's reads) are done before the KV counts as here
        stream.synchronize()
    if sums is not None and checksum.tag(channel.prefix, seq, int(sums)) != values[-1]:
        channel.stats.record_checksum_failure()
        raise KVCorrupted(f"KV checksum mismatch on transfer {label}")
    return values[:-1] if checksum is not None else values


def open_shares(host: str, port: int, prefill_id: str, decode_id: str, sender: bool,
                transfers: Sequence[HeadTransfer | None], timeout_s: float, device: torch.device, generation: int,
                stats: TransferStats, before_send: Callable[[int], None] | None = None
                ) -> list[tuple[HeadTransfer | None, PairChannel]]:
    """One rank's channels of a generation of a pair, one per head transfer it sends or receives (None:
    the one channel of two TP 1 workers), built side by side: each is a rendezvous with its peer rank."""
    def one(t: HeadTransfer | None) -> tuple[HeadTransfer | None, PairChannel]:
        src, dst = (0, 0) if t is None else (t.src_rank, t.dst_rank)
        return t, PairChannel(host, port, rank_name(prefill_id, src), rank_name(decode_id, dst),
                              SENDER_RANK if sender else RECEIVER_RANK, timeout_s, device, generation=generation,
                              stats=stats, before_send=before_send if is_lead(t) else None)

    return run_concurrently([lambda t=t: one(t) for t in transfers])  # type: ignore[return-value]


def as_link(channel: PairChannel | PairLink) -> PairLink:
    return channel if isinstance(channel, PairLink) else PairLink([(None, channel)])


def run_shares(link: PairLink, others: Sequence[concurrent.futures.Future], shares: Sequence[Callable[[], object]],
               timeout_s: float, what: str) -> list[object]:
    """Rank 0's shares of a transfer, side by side, with the other ranks' (already started: `others`);
    the results of rank 0's. The other ranks' are waited for, bounded, whatever happens: if rank 0's
    fail, the others are ended first (the generation broken, unless all of rank 0's share arrived and
    only its checksum differed), so no block is freed while another rank still reads or writes it, and
    no rank starts the next transfer on a channel still busy with this one. Their traffic is counted
    in this worker's statistics."""
    bound = 2 * timeout_s + 5.0  # another rank's share waits for its layers, then sends or receives
    try:
        results = run_concurrently(shares)
    except BaseException as e:
        if others:
            if not isinstance(e, KVCorrupted):
                link.break_()
            if concurrent.futures.wait(others, bound).not_done:
                log.warning("%s did not end within %g s", what, bound)
        raise
    link.record_others(wait_all(others, bound, what))
    return results


def wait_all(futures: Sequence[concurrent.futures.Future], timeout_s: float, what: str) -> list[object]:
    """The results of futures (another rank's share), bounded: one that has not ended in time is a timeout."""
    done, pending = concurrent.futures.wait(futures, timeout_s)
    if pending:
        raise TransferTimeout(f"{what} did not end within {timeout_s:g} s")
    return [f.result() for f in futures]
