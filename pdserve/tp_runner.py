"""A tensor-parallel engine's runner: rank 0 (this process) schedules, every rank runs the forward.

A worker of TP n is n processes, one per device (gloo on CPU, NCCL on CUDA: the same code). Rank 0 holds
the engine (scheduler, block pool, sampling) and its share of the model; ranks 1..n-1 hold only their
shares and caches. Each step rank 0 broadcasts the step's chunks (their tokens, positions and block
tables: the block tables rank 0's scheduler decided, identical on every rank) on the worker's own
process group, and every rank runs the forward; the row-parallel layers all-reduce over the same group
(pdserve.model.all_reduce). Every rank computes the (replicated) LM head; rank 0 alone samples.
Every wait is bounded by the group's timeout: a rank that dies or hangs fails rank 0's next step.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.config import EngineConfig
from pdserve.kv_transfer import backend_for, new_process_group
from pdserve.runner import ModelRunner

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 120.0


def _new_group(device: torch.device, store: dist.Store, rank: int, world: int) -> dist.ProcessGroup:
    # NCCL on CUDA has never run here: one GPU cannot host two ranks.
    return new_process_group(dist.PrefixStore("tp", store), rank, world, timedelta(seconds=GROUP_TIMEOUT_S),
                             backend_for(device))


def _broadcast(group: dist.ProcessGroup, chunks) -> None:
    payload = pickle.dumps(chunks) if chunks is not None else b""
    size = torch.tensor([len(payload) if chunks is not None else -1], dtype=torch.int64)
    group.broadcast(size, 0).wait()
    if chunks is not None:
        group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0).wait()


def _receive(group: dist.ProcessGroup):
    size = torch.empty(1, dtype=torch.int64)
    group.broadcast(size, 0).wait()
    if int(size) < 0:
        return None
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(payload, 0).wait()
    return pickle.loads(payload.numpy().tobytes())


def _follower(config: EngineConfig, tp: int, rank: int, host: str, port: int, num_blocks: int, threads: int) -> None:
    """Rank > 0: its share of the model and its cache; runs every step rank 0 broadcasts, until told to stop."""
    from pdserve.loader import load_shard

    torch.set_num_threads(threads)
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    device = torch.device(config.device)
    group = _new_group(device, store, rank, tp)
    loaded = load_shard(config, tp, rank)
    loaded.model.set_tensor_parallel(group)
    runner = ModelRunner(loaded.model, num_blocks, config.cache.block_size)
    group.barrier().wait()  # ready
    while (chunks := _receive(group)) is not None:
        runner.execute(chunks)


class TPRunner:
    """Rank 0's runner: broadcasts each step, then runs its own share (every ModelRunner attribute is
    rank 0's: its cache holds its KV heads)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, tp: int):
        self.runner, self.tp = runner, tp
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        threads = max(1, (os.cpu_count() or 1) // tp)
        if runner.device.type == "cpu":
            torch.set_num_threads(threads)  # this process is rank 0: the cores are split between the ranks
        ctx = mp.get_context("spawn")
        self._ranks = [ctx.Process(target=_follower, args=(config, tp, r, "127.0.0.1", self._store.port,
                                                           runner.num_blocks, threads),
                                   name=f"tp-rank-{r}", daemon=True) for r in range(1, tp)]
        for p in self._ranks:
            p.start()
        self.group = _new_group(runner.device, self._store, 0, tp)
        runner.model.set_tensor_parallel(self.group)
        self.group.barrier().wait()  # every rank has loaded its share
        self._closed = False

    def execute(self, chunks, layer_done=None, previous=None):
        assert previous is None, "a tensor-parallel engine does not pipeline its decode"
        _broadcast(self.group, chunks)
        return self.runner.execute(chunks, layer_done)

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            _broadcast(self.group, None)
        except Exception as e:  # noqa: BLE001 - a rank already gone: the others still end below
            log.warning("tensor-parallel shutdown: %s", e)
        for p in self._ranks:
            p.join(30)
            if p.is_alive():
                p.kill()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)
