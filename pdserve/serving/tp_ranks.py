"""The ranks 1..n-1 of a tensor-parallel worker in a cluster: Ray actors in the worker's placement group.

The router's pool makes one placement group per TP worker, n bundles packed on one node (one GPU per
rank on CUDA, the pool's CPUs per rank on CPU), and starts rank 0 (the worker actor) in bundle 0. Rank
0 starts the other ranks in the other bundles (`RayRanks`); they are its children, so they die with it.
Each rank (`RankActor`) runs the steps rank 0 broadcasts (pdserve.engine.tp_runner.RankShare) on one thread
and, on others, its share of every KV transfer of the worker: the channels to the ranks of the peer
workers that its heads travel to or from (pdserve.transfer.shares), started by a call from its rank 0 for each
transfer. Rank 0 watches every rank: one that ends (killed, crashed) takes the worker down at once.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.config import EngineConfig
from pdserve.engine.tp_runner import RankShare
from pdserve.parallel.layout import HeadTransfer
from pdserve.transfer.channel import TransferError, TransferStats
from pdserve.transfer.protocol import (KVAnnounce, KVCorrupted, KVMac, block_index, layer_spans, trailer_len,
                                       transfer_rows)
from pdserve.transfer.shares import (
    PairLink,
    is_lead,
    open_shares,
    receive_share,
    run_concurrently,
    send_share,
    share_heads,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPPlacement:
    """Where a TP worker's ranks go: its placement group (bundle r for rank r) and what each rank takes."""

    group: Any  # ray.util.placement_group.PlacementGroup
    num_cpus: float
    num_gpus: float
    resources: dict[str, float] = field(default_factory=dict)

    @classmethod
    def create(cls, name: str, tp: int, num_cpus: float, num_gpus: float,
               resources: dict[str, float]) -> TPPlacement:
        """A new placement group of tp bundles, each what one rank takes, packed on one node."""
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {}), **resources}
        group = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK", name=name)
        return cls(group, num_cpus, num_gpus, dict(resources))

    def options(self, rank: int) -> dict:
        return dict(num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=self.resources, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank))


class RankActor:
    """Rank r > 0 of a TP worker (wrapped with ray.remote by RayRanks; a threaded actor)."""

    def __init__(self, worker_id: str, config: EngineConfig, tp: int, rank: int, host: str, port: int,
                 num_blocks: int, threads: int, timeout_s: float):
        torch.set_num_threads(threads)
        self.worker_id, self.rank = worker_id, rank
        self.share = RankShare(config, tp, rank, host, port, num_blocks, timeout_s)
        self.kv_mac = KVMac(config.kv_checksum_key) if config.kv_checksum_key else None  # the cluster's key
        # On a GPU, its KV is read for sending on a stream of its own, after each layer's event: the sends
        # overlap the forward, as rank 0's pusher's do (the default stream has the whole forward queued).
        device = self.share.kv_cache.device
        self._send_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Lock()
        self._links: dict[str, tuple[int, PairLink]] = {}  # peer worker -> (generation, this rank's channels)
        self._dropped: dict[str, int] = {}  # peer worker -> the newest generation given up
        self._lost: set[str] = set()

    def serve(self) -> None:
        """Runs for the worker's life; ends when rank 0 stops it, raises when the group fails."""
        self.share.serve()

    def pid(self) -> int:
        return os.getpid()

    def open_shares(self, sender: bool, prefill_id: str, decode_id: str, host: str, port: int, generation: int,
                    transfers: list[HeadTransfer], timeout_s: float) -> None:
        """This rank's channels of a new generation of a pair (a rendezvous with the peer's ranks)."""
        peer = decode_id if sender else prefill_id
        if peer in self._lost:
            raise ConnectionError(f"{peer} was lost; no channel to it")
        shares = open_shares(host, port, prefill_id, decode_id, sender, transfers, timeout_s,
                             self.share.kv_cache.device, generation, TransferStats())
        with self._lock:
            old = self._links.get(peer)
            if peer in self._lost or (old is not None and old[0] >= generation) \
                    or self._dropped.get(peer, 0) >= generation:  # given up while its rendezvous ran
                PairLink(shares).close()
                return
            self._links[peer] = (generation, PairLink(shares))
        if old is not None:
            old[1].close()

    def send_share(self, decode_id: str, a: KVAnnounce, block_ids: list[list[int]],
                   step: int) -> list[tuple[int, float]]:
        """This rank's share of a prefill worker's transfer: its heads of the blocks, once its own forward
        of engine step `step` has computed them; (bytes, seconds) of each of its channels."""
        link = self._link(decode_id, a.generation)
        cache = self.share.kv_cache
        index = block_index(block_ids, cache.device)
        spans = layer_spans(cache.shape[0], a.num_parts)
        timeout = link.timeout_s
        return self._run(decode_id, a.generation, link, [
            lambda t=t, c=c: send_share(c, a.seq, cache, index, share_heads(t, True, cache), spans,
                                        lambda end: self.share.wait_computed(step, end, timeout), None,
                                        trailer_len(0, False, a.checksum), self.kv_mac if a.checksum else None,
                                        stream=self._send_stream)
            for t, c in link.shares])

    def recv_share(self, prefill_id: str, a: KVAnnounce, blocks: list[list[int] | None]) -> list[tuple[int, float]]:
        """This rank's share of a decode worker's transfer, into the blocks its rank 0 reserved; (bytes,
        seconds) of each of its channels."""
        link = self._link(prefill_id, a.generation)
        cache = self.share.kv_cache
        src, dst = transfer_rows(a.num_blocks, blocks, cache.device)
        spans = layer_spans(cache.shape[0], a.num_parts)
        label = f"{a.generation}/{a.seq} from {a.prefill_id} (rank {self.rank})"
        assert not any(is_lead(t) for t, _ in link.shares)
        return self._run(prefill_id, a.generation, link, [
            lambda t=t, c=c: receive_share(c, a.seq, cache, src, dst, share_heads(t, False, cache), sum(a.num_blocks),
                                           spans, trailer_len(0, False, a.checksum), self.kv_mac if a.checksum else None,
                                           label)
            for t, c in link.shares])

    def drop(self, peer: str, generation: int) -> None:
        """Rank 0 gave this generation of the pair up: so does this rank (its peers' waits end at once)."""
        with self._lock:
            self._dropped[peer] = max(self._dropped.get(peer, 0), generation)
            held = self._links.get(peer)
            if held is None or held[0] != generation:
                return
            del self._links[peer]
        held[1].break_()

    def peer_lost(self, peer: str) -> None:
        with self._lock:
            self._lost.add(peer)
            held = self._links.pop(peer, None)
        if held is not None:
            held[1].close()

    def _link(self, peer: str, generation: int) -> PairLink:
        with self._lock:
            held = self._links.get(peer)
        if held is None or held[0] != generation:
            raise TransferError(f"rank {self.rank} of {self.worker_id} has no channel of generation {generation} "
                                f"to {peer}")
        return held[1]

    def _run(self, peer: str, generation: int, link: PairLink,
             shares: list[Callable[[], object]]) -> list[tuple[int, float]]:
        # One transfer at a time per link (its rank 0 waits for each): each channel counts this one apart,
        # and the counts go back to rank 0, which reports the worker's.
        counts = [TransferStats() for _ in link.shares]
        for (_, channel), stats in zip(link.shares, counts):
            channel.stats = stats
        try:
            run_concurrently(shares)
        except BaseException as e:
            # A failed transfer breaks its generation on every rank; one that arrived whole with a checksum
            # that differs does not (the order held): its rank 0 decides alike.
            if not isinstance(e, KVCorrupted):
                self.drop(peer, generation)
            raise
        return [(c.bytes, c.seconds) for c in counts]


class RayRanks:
    """Rank 0's launcher in a cluster (pdserve.engine.tp_runner.TPRunner): the other ranks as RankActors in the
    worker's placement group; `watch` calls on_lost the moment one of them ends."""

    def __init__(self, worker_id: str, placement: TPPlacement):
        self.worker_id, self.placement = worker_id, placement
        self.handles: list[Any] = []  # rank r is handles[r - 1]
        self._closing = threading.Event()

    def start(self, config: EngineConfig, tp: int, host: str, port: int, num_blocks: int, threads: int,
              timeout_s: float) -> None:
        # One node (the placement group packs it): the ranks meet on loopback.
        self.handles = [ray.remote(RankActor).options(max_concurrency=32, **self.placement.options(r)).remote(
            self.worker_id, config, tp, r, host, port, num_blocks, threads, timeout_s) for r in range(1, tp)]

    def watch(self, on_lost: Callable[[str], None]) -> None:
        refs = {h.serve.remote(): r for r, h in enumerate(self.handles, start=1)}

        def run() -> None:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=None)
            if self._closing.is_set():
                return
            try:
                ray.get(ready[0])
                why = "it stopped"
            except Exception as e:  # noqa: BLE001 - how it ended is the report
                why = f"{type(e).__name__}: {e}"
            on_lost(f"rank {refs[ready[0]]} of {self.worker_id} ended: {why}")

        threading.Thread(target=run, name=f"tp-watch-{self.worker_id}", daemon=True).start()

    def link(self, shares: list, peer: str, generation: int, ranks: list[int], method: str) -> PairLink:
        """Rank 0's channels of a generation of the pair with `peer`; the other ranks holding channels
        (`ranks`) take their shares of each transfer through RankActor.`method` (send_share or
        recv_share, called with the peer, the transfer's announcement and what follows it)."""
        handles = [self.handles[r - 1] for r in ranks]
        return PairLink(shares, others=lambda a, *rest: [getattr(h, method).remote(peer, a, *rest).future()
                                                         for h in handles],
                        drop=lambda: self.drop(ranks, peer, generation))

    def drop(self, ranks: list[int], peer: str, generation: int) -> None:
        """These ranks give a generation of the pair with `peer` up (not waiting)."""
        for r in ranks:
            self.handles[r - 1].drop.remote(peer, generation)

    def pids(self) -> list[int]:
        return ray.get([h.pid.remote() for h in self.handles], timeout=30)

    def call(self, method: str, *args) -> None:
        """Tell every other rank something, not waiting (peer_lost)."""
        for h in self.handles:
            getattr(h, method).remote(*args)

    def close(self) -> None:
        self._closing.set()
        for h in self.handles:
            ray.kill(h, no_restart=True)
