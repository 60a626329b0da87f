"""The decode side of the hand-off (pdserve.transfer.protocol has the overview): reservations and the intake.

The decode worker reserves blocks for a prompt's KV while the prefill worker computes it (`InboundTable`).
Per (prefill, decode) pair, the `KVIntake` receives transfers strictly in the order the sender announced
them, whatever order the announcements arrive in, writes each part straight into the reserved blocks and,
after the trailer (a checksum that differs fails the transfer), hands each request over. A transfer that
fails fails every transfer of its generation. A request cancelled while its KV is being written into its
blocks keeps those blocks until the write has finished, so a late write can never land in blocks that
another request owns.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from pdserve.parallel.layout import HeadTransfer
from pdserve.transfer.channel import PairChannel
from pdserve.transfer.protocol import KVAnnounce, KVCorrupted, KVMac, layer_spans, trailer_len, transfer_rows
from pdserve.transfer.shares import PairLink, as_link, is_lead, receive_share, run_shares, share_heads

log = logging.getLogger(__name__)


class InboundTable:
    """Reserved blocks awaiting KV, shared by a decode worker's step thread and its intake threads.

    A request is RESERVED when published, RECEIVING once an intake has claimed its blocks. Cancelling a
    RECEIVING request does not free its blocks at once: the write into them has to finish first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[str, list[int]] = {}
        self._receiving: set[str] = set()
        self._cancelled: set[str] = set()

    def publish(self, request_id: str, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._blocks[request_id] = list(block_ids)

    def claim(self, request_id: str) -> list[int] | None:
        """The blocks to write a request's KV into, or None if it is no longer expected (cancelled)."""
        with self._lock:
            blocks = self._blocks.get(request_id)
            if blocks is not None:
                self._receiving.add(request_id)
            return blocks

    def settle(self, request_id: str) -> bool:
        """The write into a claimed request's blocks is over; whether it was cancelled meanwhile."""
        with self._lock:
            self._blocks.pop(request_id, None)
            self._receiving.discard(request_id)
            if request_id in self._cancelled:
                self._cancelled.discard(request_id)
                return True
            return False

    def withdraw(self, request_id: str) -> bool:
        """Stop expecting a request's KV. True: its blocks may be freed now; False: a write is under way,
        and its intake will report it (settle() then says it was cancelled)."""
        with self._lock:
            if request_id in self._receiving:
                self._cancelled.add(request_id)
                return False
            self._blocks.pop(request_id, None)
            return True

    def receiving(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._receiving

    def expire(self, request_id: str) -> bool:
        """Its KV will not come (the sender says so). True: it may be failed and freed now; False: an
        intake is writing it, and reports the outcome itself."""
        with self._lock:
            if request_id in self._receiving:
                return False
            self._blocks.pop(request_id, None)
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)


class KVIntake:
    """The receiving end of one (prefill, decode) pair: takes transfers in the order the sender announced.

    For every request of every announced transfer that was still expected when its turn came, exactly
    one of these is called, from this intake's thread: landed(request_id, tokens, sampled_at, version)
    (its KV is in its blocks; tokens: its first tokens, a group's n; version: the weight version that
    computed them, from the announce), failed(request_id, error), or cancelled(request_id) (withdrawn
    while its KV was being written: its blocks may be freed now).
    """

    def __init__(self, prefill_id: str, decode_id: str, kv_cache: torch.Tensor, table: InboundTable,
                 timeout_s: float, landed: Callable[[str, tuple[int, ...], float, int], None],
                 failed: Callable[[str, str], None], cancelled: Callable[[str], None], checksum: KVMac | None = None):
        """checksum: the cluster's keyed checksum (--kv-checksum), for the transfers announced with one."""
        self.checksum = checksum
        self.prefill_id, self.decode_id = prefill_id, decode_id
        self.kv_cache, self.table, self.timeout_s = kv_cache, table, timeout_s
        self._landed, self._failed, self._cancelled = landed, failed, cancelled
        self._cond = threading.Condition()
        self._announced: dict[tuple[int, int], KVAnnounce] = {}
        self._channel: PairLink | None = None
        self._generation = 0  # of the channel installed last
        self._next_seq = 0  # within that generation
        self._dead_generation = 0  # transfers of this generation and older are void
        self._stopped = False
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._thread = threading.Thread(target=self._run, name=f"kv-intake-{prefill_id}->{decode_id}", daemon=True)
        self._thread.start()

    def announce(self, a: KVAnnounce) -> None:
        with self._cond:
            self._announced[a.order] = a
            self._cond.notify_all()

    def install(self, channel: PairChannel | PairLink, generation: int) -> None:
        """A new channel with the sender (after a rendezvous it started); older transfers are void."""
        channel = as_link(channel)
        with self._cond:
            if generation < self._generation or generation <= self._dead_generation:
                channel.close()  # a rendezvous that finished too late: the sender has moved on
                return
            if self._channel is not None:
                self._channel.close()
            self._channel, self._generation, self._next_seq = channel, generation, 0
            self._dead_generation = max(self._dead_generation, generation - 1)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            if self._channel is not None:
                self._channel.close()
            self._cond.notify_all()

    def _next(self) -> tuple[KVAnnounce, PairLink | None, str | None] | None:
        """The next transfer to take, with its channel; or one that is void, with why (None: drop it
        silently, its sender announces it again or reports it failed)."""
        with self._cond:
            deadline = None
            while not self._stopped:
                stale = [o for o in self._announced if o[0] <= self._dead_generation]
                if stale:
                    return self._announced.pop(min(stale)), None, None
                nxt = self._announced.pop((self._generation, self._next_seq), None)
                if nxt is not None and self._channel is not None:
                    self._next_seq += 1
                    return nxt, self._channel, None
                if nxt is not None:
                    self._announced[nxt.order] = nxt
                # Something announced cannot be taken yet (its channel or an earlier transfer is
                # missing): wait, bounded, then fail it.
                if self._announced:
                    deadline = deadline or time.monotonic() + self.timeout_s
                    if time.monotonic() >= deadline:
                        # The whole generation is given up on both sides (breaking the channel fails the
                        # sender's pending send), so the sender's order and this one cannot drift apart.
                        first = min(self._announced)
                        self._dead_generation = max(self._dead_generation, first[0])
                        if self._channel is not None and self._generation <= first[0]:
                            self._channel.break_()
                        return self._announced.pop(first), None, (
                            f"transfer {first[1]} of generation {first[0]} could not start within "
                            f"{self.timeout_s:g} s (no channel, or an earlier transfer never announced)")
                    self._cond.wait(max(deadline - time.monotonic(), 0.01))
                else:
                    deadline = None
                    self._cond.wait()
            return None

    def _run(self) -> None:
        while (item := self._next()) is not None:
            a, channel, error = item
            if channel is None and error is None:
                continue
            blocks = [self.table.claim(rid) for rid in a.request_ids]
            tokens: list[tuple[int, ...]] = []
            sampled_at = 0.0
            if channel is not None:
                try:
                    tokens, sampled_at = self._receive(a, channel, blocks)
                except Exception as e:  # noqa: BLE001 - every request of the transfer fails
                    log.warning("KV transfer %s/%s from %s failed: %s", a.generation, a.seq, self.prefill_id, e)
                    error = str(e) or type(e).__name__
                    if not isinstance(e, KVCorrupted):  # (all of a corrupted transfer arrived: the order holds)
                        channel.break_()  # the sender must not wait out its timeout on a receive never posted
                        with self._cond:
                            self._dead_generation = max(self._dead_generation, a.generation)
            for i, rid in enumerate(a.request_ids):
                if blocks[i] is None:
                    continue  # withdrawn before its turn: its owner already freed it
                if self.table.settle(rid):
                    self._cancelled(rid)
                elif error is not None:
                    self._failed(rid, error)
                else:
                    self._landed(rid, tokens[i], sampled_at, a.version_of(i))

    def _receive(self, a: KVAnnounce, link: PairLink,
                 blocks: list[list[int] | None]) -> tuple[list[tuple[int, ...]], float]:
        """Receive a transfer's KV into its blocks; each request's first tokens (a group's n) and when they
        were sampled."""
        cache = self.kv_cache
        src, dst = transfer_rows(a.num_blocks, blocks, cache.device)
        spans = layer_spans(cache.shape[0], a.num_parts)
        others = link.others(a, blocks) if link.others is not None else []  # the other TP ranks' shares
        label = f"{a.generation}/{a.seq} from {a.prefill_id}"
        if a.checksum and self.checksum is None:
            raise KVCorrupted(f"transfer {label} carries a KV checksum and this decode worker has no key to check it")

        def share(transfer: HeadTransfer | None, channel: PairChannel) -> list[int]:
            lead = is_lead(transfer)
            trailer = trailer_len(sum(a.tokens_per_request), lead, a.checksum)
            return receive_share(channel, a.seq, cache, src, dst, share_heads(transfer, False, cache), sum(a.num_blocks),
                                 spans, trailer, self.checksum if a.checksum else None, label,
                                 self._stream)

        results = run_shares(link, others, [lambda t=t, c=c: share(t, c) for t, c in link.shares], self.timeout_s,
                             f"the other ranks' shares of transfer {label}")
        values = next(v for (t, _), v in zip(link.shares, results) if is_lead(t))
        ends = list(itertools.accumulate(a.tokens_per_request))
        return [tuple(values[e - n:e]) for n, e in zip(a.tokens_per_request, ends)], values[ends[-1]] / 1e6
