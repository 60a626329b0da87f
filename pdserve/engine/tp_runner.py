"""A tensor-parallel worker's ranks: rank 0 schedules, every rank runs the forward.

A worker of TP n is n processes, one per device (gloo on CPU, NCCL on CUDA: the same code). Rank 0
holds the engine (scheduler, block pool, sampling) and its share of the model; ranks 1..n-1
(`RankShare`) hold only their shares and caches. Each step rank 0 broadcasts the step's chunks (their
tokens, positions and block tables: the block tables rank 0's scheduler decided, identical on every
rank) on the worker's own gloo group, and every rank runs the forward; the row-parallel layers
all-reduce over the same group, and so does the vocab-parallel embedding; the vocab-parallel LM head's
logits are all-gathered (pdserve.model.llama). Rank 0 alone samples. (Splitting the LM head over 2 ranks
took 0.57-0.78x the time of rank 0 computing all of it, gather included: docs/benchmarks.md.)

Where the other ranks live is the launcher's business: processes of their own for the offline engine
(`ProcessRanks`), Ray actors in the worker's placement group for a cluster (pdserve.serving.tp_ranks).

Failure: every wait is bounded by the group's timeout. When the worker is idle, rank 0 broadcasts a
heartbeat every quarter of it, so an idle rank waiting for the next step never times out while rank 0
lives, and does once rank 0 dies or hangs. A step or heartbeat that fails means the ranks can no longer
agree: `on_fatal` is called (a cluster worker exits, taking its ranks with it) and, if it returns,
the step raises `TPGroupError`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from pdserve import processes
from pdserve.config import EngineConfig
from pdserve.engine import tp_wire
from pdserve.engine.runner import ModelRunner
from pdserve.transfer.channel import backend_for, new_process_group
from pdserve.transfer.store import bound_store

log = logging.getLogger(__name__)

_STOP, _PING = -1, -2  # control messages in place of a step's size
# Every rank loads its share at once, then they meet on the store, within this (a large checkpoint on
# slow storage takes minutes); the collectives after that are bounded by the worker's fault timeout.
START_TIMEOUT_S = 1800.0


class TPGroupError(RuntimeError):
    """A collective of the worker's ranks failed or timed out: the worker cannot go on."""


def _loaded(store: dist.Store, rank: int, world: int) -> None:
    """Say this rank has loaded its share; wait (bounded by START_TIMEOUT_S) until every rank has."""
    store.set(f"loaded/{rank}", "1")
    store.wait([f"loaded/{r}" for r in range(world)], timedelta(seconds=START_TIMEOUT_S))


def _new_groups(device: torch.device, store: dist.Store, rank: int, world: int,
                timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The worker's groups: one on the device's backend for the model's collectives, and one of gloo for
    the steps' inputs and the heartbeat (host data, as JSON: pdserve.engine.tp_wire; NCCL carries device tensors only). On a CPU
    they are one group. (NCCL on CUDA has never run here: one GPU cannot host two ranks.)"""
    timeout = timedelta(seconds=timeout_s)
    backend = backend_for(device)
    group = new_process_group(dist.PrefixStore("tp", store), rank, world, timeout, backend)
    if backend == "gloo":
        return group, group
    return group, new_process_group(dist.PrefixStore("tp-control", store), rank, world, timeout, "gloo")


def _broadcast(group: dist.ProcessGroup, chunks, control: int = 0) -> None:
    payload = tp_wire.encode(chunks) if not control else b""
    size = torch.tensor([control or len(payload)], dtype=torch.int64)
    group.broadcast(size, 0).wait()
    if not control:
        group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0).wait()


def _all_ok(group: dist.ProcessGroup, ok: int) -> bool:
    """Whether every rank says ok (1): a MIN all-reduce."""
    flag = torch.tensor([ok], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([flag], opts).wait()
    return bool(flag.item())


def _receive(group: dist.ProcessGroup):
    """The next step's chunks, or _STOP / _PING."""
    size = torch.empty(1, dtype=torch.int64)
    group.broadcast(size, 0).wait()
    if int(size) < 0:
        return int(size)
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(payload, 0).wait()
    return tp_wire.decode(payload.numpy().tobytes())


class RankShare:
    """Rank r > 0 of a TP worker: its share of the model and its KV cache (the heads it holds), and the
    steps rank 0 broadcasts. `progress` tells its KV senders how far each step's forward has gone."""

    def __init__(self, config: EngineConfig, tp: int, rank: int, host: str, port: int, num_blocks: int,
                 timeout_s: float):
        from pdserve.model.loader import load_shard

        self.rank, self.timeout_s, self.tp = rank, timeout_s, tp
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
        self.device = torch.device(config.device)
        loaded = load_shard(config, tp, rank)
        self.model_config = loaded.info.config  # the whole model's (a weight update's tensors are whole)
        self._staged = self._spare = None  # a weight update staged here, and the one committed before it
        self._weight_group = None  # this rank's place in a trainer's weight group (pdserve.weights.group)
        self._arena: list[torch.Tensor] = []  # the buffers a trainer's updates arrive in, one per bucket
        _loaded(store, rank, tp)
        self.group, self.control = _new_groups(self.device, store, rank, tp, timeout_s)
        loaded.model.set_tensor_parallel(self.group, rank, config.expert_parallel_size > 1)
        self.runner = ModelRunner(loaded.model, num_blocks, config.cache.block_size)
        self.num_layers = loaded.model.cfg.num_layers
        self._cond = threading.Condition()
        self._step, self._layers = 0, 0  # the step running (or last run), and its layers done
        self._events: dict[int, torch.cuda.Event] = {}
        self.failed: str | None = None
        self.control.barrier().wait()  # every rank is ready to serve

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    def serve(self) -> None:
        """Run every step rank 0 broadcasts, until it says stop; raises if the group fails (rank 0 gone)."""
        try:
            while (chunks := _receive(self.control)) != _STOP:
                if chunks == _PING:
                    continue
                if isinstance(chunks, dict):  # a weight update (TPRunner.stage_weights / commit_weights)
                    self._weights(chunks)
                    continue
                with self._cond:
                    self._step, self._layers, self._events = self._step + 1, 0, {}
                # Every rank computes its slice of the LM head (vocab-parallel); rank 0 alone samples.
                self.runner.execute(chunks, self._layer_done, sample_tokens=False)
                self._layer_done(self.num_layers - 1)
        except BaseException as e:
            with self._cond:
                self.failed = f"{type(e).__name__}: {e}"
                self._cond.notify_all()
            raise

    def _weights(self, command: dict) -> None:
        """A weight command of rank 0's (TPRunner.on_every_rank): join or leave a trainer's weight group, stage
        this rank's share of an update (a checkpoint's, or one received on the group) and say whether it could
        (every rank's answer is reduced: all commit, or none), commit it, or drop it."""
        from pdserve.weights.group import WeightGroup
        from pdserve.weights.update import stage, stage_checkpoint

        model, cfg, tp, rank = self.runner.model, self.model_config, self.tp, self.rank
        if "join" in command:
            address, first_rank, timeout_s = command["join"]
            self._leave_group()
            self._reply(lambda: WeightGroup.join(address, first_rank + rank, timeout_s), "_weight_group")
        elif "leave" in command:
            self._leave_group()
        elif "stage" in command:
            spare, self._spare = self._spare, None
            self._reply(lambda: stage_checkpoint(model, cfg, command["stage"], tp, rank, spare=spare), "_staged")
        elif "receive" in command:  # staged where it lands in the arena, as EngineCore.receive_weights does
            self._spare = None
            metas, bucket_bytes = command["receive"]
            self._reply(lambda: stage(model, cfg, self._group().receive(metas, bucket_bytes, self._arena), tp, rank,
                                      adopt=True), "_staged")
        elif "commit" in command:
            self._staged.commit(self.runner.model)
            self._spare, self._staged = self._staged, None
        else:
            self._staged = None

    def _reply(self, make: Callable[[], object], attr: str) -> None:
        """self.<attr> = make(), or None if it failed; every rank learns whether all could (rank 0 raises)."""
        try:
            setattr(self, attr, make())
            ok = 1
        except Exception as e:  # noqa: BLE001 - rank 0 hears of it through the reduction and raises
            log.warning("rank %d: a weight command failed: %s", self.rank, e)
            setattr(self, attr, None)
            ok = 0
        _all_ok(self.control, ok)

    def _group(self):
        if self._weight_group is None:
            raise RuntimeError(f"rank {self.rank} is in no weight group")
        return self._weight_group

    def _leave_group(self) -> None:
        group, self._weight_group = self._weight_group, None
        if group is not None:
            group.close()

    def _layer_done(self, layer: int) -> None:
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        with self._cond:
            if event is not None:
                self._events[layer] = event
            self._layers = max(self._layers, layer + 1)
            self._cond.notify_all()

    def wait_computed(self, step: int, layers: int, timeout_s: float) -> torch.cuda.Event | None:
        """Wait until step `step` has written the KV of its first `layers` layers here (bounded); on a GPU,
        the event after which it is safe to read them."""
        with self._cond:
            done = lambda: self._step > step or (self._step == step and self._layers >= layers)  # noqa: E731
            if not self._cond.wait_for(lambda: done() or self.failed is not None, timeout_s):
                raise TimeoutError(f"rank {self.rank}: step {step} did not compute layer {layers - 1} "
                                   f"within {timeout_s:g} s")
            if not done():
                raise RuntimeError(f"rank {self.rank} failed: {self.failed}")
            event = self._events.get(layers - 1) if self._step == step else None
        if event is None and self.device.type == "cuda":  # an earlier step's: after all queued so far
            event = torch.cuda.Event()
            event.record(torch.cuda.default_stream(self.device))
        return event


class ProcessRanks:
    """The offline engine's launcher: ranks 1..n-1 in processes of their own (pdserve.processes: forked from a
    server that has imported torch)."""

    def __init__(self) -> None:
        self._procs: list[BaseProcess] = []

    def start(self, config: EngineConfig, tp: int, host: str, port: int, num_blocks: int, threads: int,
              timeout_s: float) -> None:
        ctx = processes.context()
        self._procs = [ctx.Process(target=_process_rank, name=f"tp-rank-{r}", daemon=True,
                                   args=(config, tp, r, host, port, num_blocks, threads, timeout_s))
                       for r in range(1, tp)]
        for p in self._procs:
            p.start()

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Nothing to watch: a rank that dies fails rank 0's next step."""

    def close(self) -> None:
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _process_rank(config: EngineConfig, tp: int, rank: int, host: str, port: int, num_blocks: int, threads: int,
                  timeout_s: float) -> None:
    torch.set_num_threads(threads)
    if torch.device(config.device).type == "cuda":
        torch.cuda.set_device(rank)  # one GPU per rank: rank r of an offline engine takes GPU r
    RankShare(config, tp, rank, host, port, num_blocks, timeout_s).serve()


class TPRunner:
    """Rank 0's runner: broadcasts each step, then runs its own share (every ModelRunner attribute is
    rank 0's: its cache holds its KV heads). `steps` counts the steps broadcast: the other ranks count
    the same, so a KV push names the step that computes it (RankShare.wait_computed)."""

    def __init__(self, config: EngineConfig, tp: int, num_blocks: int, ranks=None,
                 on_fatal: Callable[[str], None] | None = None, threads: int | None = None):
        """Start the other ranks: they load their shares while this process loads rank 0's, then
        `attach` its runner."""
        self.tp = tp
        self.runner: ModelRunner | None = None
        self.timeout_s = config.tensor_parallel_timeout_s
        self.expert_parallel = config.expert_parallel_size > 1
        self.ranks = ranks if ranks is not None else ProcessRanks()
        self._on_fatal = on_fatal
        self.steps = 0
        self.failed: str | None = None
        self._lock = threading.Lock()  # one collective sequence at a time: a step or a heartbeat
        self._closed = threading.Event()
        # The ranks are on this node: the store listens on loopback alone (pdserve.transfer.store).
        self._store = bound_store("127.0.0.1", 0, START_TIMEOUT_S)
        if threads is None:
            threads = max(1, (os.cpu_count() or 1) // tp)
            if torch.device(config.device).type == "cpu":
                torch.set_num_threads(threads)  # this process is rank 0: the cores are split between the ranks
        self.ranks.start(config, tp, "127.0.0.1", self._store.port, num_blocks, threads, self.timeout_s)
        self.ranks.watch(self._fatal)  # a rank that dies while loading fails the start at once

    def attach(self, runner: ModelRunner) -> TPRunner:
        """Rank 0's share is loaded: wait for the others', make the worker's groups, start serving."""
        self.runner = runner
        _loaded(self._store, 0, self.tp)
        self.group, self.control = _new_groups(runner.device, self._store, 0, self.tp, self.timeout_s)
        runner.model.set_tensor_parallel(self.group, 0, self.expert_parallel)
        self.control.barrier().wait()  # every rank is ready to serve
        self._last = time.monotonic()
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()
        return self

    def execute(self, chunks, layer_done=None, previous=None):
        assert previous is None, "a tensor-parallel engine does not pipeline its decode"
        with self._lock:
            self._check()
            try:
                self.steps += 1
                _broadcast(self.control, chunks)
                return self.runner.execute(chunks, layer_done)
            except Exception as e:  # the ranks may now disagree on where they are: the worker is done for
                self._fatal(f"step {self.steps} failed: {type(e).__name__}: {e}")
                raise TPGroupError(self.failed) from e
            finally:
                self._last = time.monotonic()

    def stage_weights(self, path: str, stage_own: Callable[[], object]) -> object:
        """Every rank stages its share of checkpoint `path` (rank 0's: stage_own()), steps waiting meanwhile;
        rank 0's staged update, once every rank has its share. If any rank could not, none keeps its share and
        this raises (WeightError from rank 0's own staging, or ValueError naming the failure elsewhere)."""
        return self.on_every_rank({"stage": path}, stage_own, f"stage {path!r}")

    def receive_weights(self, metas: list, bucket_bytes: int, receive_own: Callable[[], object]) -> object:
        """Every rank receives an update broadcast on the trainer's weight group and stages its share (rank 0's:
        receive_own()), steps waiting meanwhile; as stage_weights."""
        return self.on_every_rank({"receive": (metas, bucket_bytes)}, receive_own, "receive the update")

    def join_weight_group(self, address, first_rank: int, timeout_s: float, join_own: Callable[[], object]) -> object:
        """Rank r joins the trainer's weight group at `address` as rank first_rank + r (rank 0: join_own(), whose
        group is returned). If any rank could not, those that did leave it again and this raises."""
        return self.on_every_rank({"join": (address, first_rank, timeout_s)}, join_own, "join the weight group",
                                  undo={"leave": True}, drop_own=lambda group: group.close())

    def leave_weight_group(self) -> None:
        """The other ranks leave the trainer's weight group (rank 0 closes its own)."""
        self.on_every_rank({"leave": True}, None, "leave the weight group")

    def on_every_rank(self, command: dict, own: Callable[[], object] | None, what: str,
                      undo: dict | None = None, drop_own: Callable[[object], None] | None = None) -> object:
        """Broadcast a weight command (RankShare._weights), run rank 0's part (own(); None: the command needs no
        answer) and return it, steps waiting meanwhile. If any rank fails, every rank is told `undo` (default:
        drop what it staged), rank 0's result is dropped, and this raises: rank 0's own error, or a ValueError."""
        from pdserve.weights.group import WeightGroupError
        from pdserve.weights.update import WeightError

        with self._lock:
            self._check()
            try:
                _broadcast(self.control, command)
                if own is None:
                    return None
                try:
                    mine, error = own(), None
                except Exception as e:  # noqa: BLE001 - the others are told to undo theirs, then it is raised
                    mine, error = None, e
                if not _all_ok(self.control, int(error is None)):
                    _broadcast(self.control, undo or {"drop": True})
                    if mine is not None and drop_own is not None:
                        drop_own(mine)
                    raise error or WeightError(f"another rank could not {what} (its log says why)")
                return mine
            except (WeightError, WeightGroupError, ValueError, FileNotFoundError):
                raise
            except Exception as e:
                self._fatal(f"a weight update failed: {type(e).__name__}: {e}")
                raise TPGroupError(self.failed) from e
            finally:
                self._last = time.monotonic()

    def commit_weights(self, staged) -> None:
        """Every rank commits the share it staged, between two steps."""
        with self._lock:
            self._check()
            try:
                _broadcast(self.control, {"commit": True})
                staged.commit(self.runner.model)
            except Exception as e:  # a rank may hold a mix of two versions: the worker is done for
                self._fatal(f"a weight update's commit failed: {type(e).__name__}: {e}")
                raise TPGroupError(self.failed) from e
            finally:
                self._last = time.monotonic()

    def _check(self) -> None:
        if self.failed is not None:
            raise TPGroupError(self.failed)

    def _heartbeat(self) -> None:
        period = self.timeout_s / 4
        while not self._closed.wait(period / 2):
            if time.monotonic() - self._last < period or not self._lock.acquire(blocking=False):
                continue
            try:
                if self.failed is None and not self._closed.is_set():
                    _broadcast(self.control, None, _PING)
                    self._last = time.monotonic()
            except Exception as e:  # noqa: BLE001 - a rank is gone or stuck
                self._fatal(f"heartbeat failed: {type(e).__name__}: {e}")
            finally:
                self._lock.release()

    def _fatal(self, why: str) -> None:
        if self._closed.is_set():
            return  # the ranks were told to stop: their ending is no fault
        if self.failed is None:
            self.failed = why
            log.error("tensor-parallel worker lost a rank: %s", why)
            if self._on_fatal is not None:
                self._on_fatal(why)

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            try:
                if self.failed is None and self.runner is not None:
                    _broadcast(self.control, None, _STOP)
            except Exception as e:  # noqa: BLE001 - a rank already gone: the others still end below
                log.warning("tensor-parallel shutdown: %s", e)
        self.ranks.close()

    # Only rank 0's cache is here: a forked sample computes the prompt's partial block again instead.
    can_copy_blocks = False

    def __getattr__(self, name: str):
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)
