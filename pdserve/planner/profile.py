"""`pdserve profile`: what a step and a KV transfer cost on this device, measured, and a cost model fitted to it.

Measured in this process, on the engine every worker runs (pdserve.engine.llm_engine.EngineCore: scheduling,
the forward, sampling and the step's bookkeeping), with the torch threads one worker gets:
- prefill steps against prompt tokens (16 to 2048 in one chunk), chunked prompts (the attention over
  earlier chunks) and several prompts in one step;
- decode steps against batch size (1 to 64) and context length (64 to 2048 tokens), as far as the KV
  cache holds them;
- KV transfers between two processes over the transport the workers use (pdserve.transfer.channel's
  PairChannel: gloo on CPU, NCCL between GPUs), from one block to a 2048-token prompt's KV: the time
  from the sender's start to the receiver's end, on the machine's one monotonic clock.

On a CPU, the other cores are kept busy meanwhile by neighbour processes running the same engine
(prompts and decode steps), as the cluster's other workers would: workers on one machine share its
memory bandwidth and last-level cache, and a worker timed alone runs 10-25 % faster than one in a
busy local cluster (docs/benchmarks.md). `--neighbours 0` times it alone.

Decode steps run on requests placed directly in the running batch with their blocks allocated (what
a decode worker holds after a hand-off), so that a batch of 64 at 2048 tokens is timed without
first prefilling it. Each point is the median of a few steps after one warm-up. Prefix caching is off.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve import processes
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, kv_bytes_per_token
from pdserve.perf.costs import MeasuredCosts, Transport, attention_pairs, fit_measured, fit_nonnegative
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.utilization import synced_seconds, weight_bytes

PREFILL_TOKENS = (16, 64, 256, 512, 1024, 2048)
CHUNKED = (2048, 512)  # a prompt of 2048 tokens in chunks of 512: chunks attend to earlier ones
MULTI = (4, 128)  # four prompts of 128 tokens in one step
DECODE_BATCHES = (1, 4, 16, 32, 64)
DECODE_CONTEXTS = (64, 512, 2048)
TRANSFER_TOKENS = (16, 256, 2048)
VERSION = 1


def default_threads() -> int:
    """One worker of two on this machine, as `pdserve serve` splits the cores on a local CPU cluster."""
    return max(1, (os.cpu_count() or 1) // 2)


def default_neighbours(device: torch.device, threads: int) -> int:
    """Workers that share this machine with the one measured: on a CPU, as many as fill the other cores
    (a local cluster's workers share the memory bandwidth and the last-level cache, which slows each
    one's steps); on a GPU none (a worker has its device to itself)."""
    if device.type != "cpu":
        return 0
    return max(0, (os.cpu_count() or 1) // threads - 1)


def _neighbour(config: EngineConfig, threads: int, ready: Any, stop: Any) -> None:
    """Load the machine as another worker would while the profile measures: prompts and decode steps."""
    torch.set_num_threads(threads)
    bench = _Bench(config)
    ready.set()
    while not stop.is_set():
        bench.prefill(1, 256, 256, 0)
        for _ in range(4):
            if stop.is_set():
                break
            bench.decode(8, 512, 2)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _timed(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median seconds of fn over reps calls, after one unrecorded call."""
    fn()
    return statistics.median(synced_seconds(fn, device) for _ in range(reps))


class _Bench:
    """Drives one EngineCore through chosen steps."""

    def __init__(self, config: EngineConfig):
        from pdserve.engine.llm_engine import EngineCore

        self.core = EngineCore(config)
        self.config = config
        self.rng = np.random.default_rng(0)
        self.n = 0
        self.vocab = self.core.model_config.vocab_size

    def _request(self, num_tokens: int, max_tokens: int) -> Request:
        self.n += 1
        ids = self.rng.integers(0, self.vocab, size=num_tokens).tolist()
        return Request(f"profile-{self.n}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                 ignore_eos=True), seed=0)

    def _budget(self, tokens: int) -> None:
        from pdserve.engine.scheduler import Scheduler

        old = self.core.scheduler
        cfg = replace(self.config.scheduler, max_num_batched_tokens=tokens, max_num_seqs=max(64, old.config.max_num_seqs))
        self.core.scheduler = Scheduler(cfg, self.core.kv, self.core.eos_token_ids, self.core.max_model_len)

    def prefill(self, prompts: int, tokens: int, budget: int, reps: int) -> list[dict[str, float]]:
        """Rows (tokens, pairs, seqs, seconds) of each step that ingests `prompts` prompts of `tokens`."""
        self._budget(budget)
        rows: dict[int, list[float]] = {}
        shape: dict[int, tuple[int, int, int]] = {}
        for rep in range(reps + 1):
            reqs = [self._request(tokens, 1) for _ in range(prompts)]
            for r in reqs:
                self.core.scheduler.add(r)
            i = 0
            while self.core.scheduler.has_work:
                starts = [(r.num_computed_tokens, r) for r in reqs]
                t = time.perf_counter()
                self.core.step()
                if self.core.runner.device.type == "cuda":
                    torch.cuda.synchronize()
                took = time.perf_counter() - t
                # A finished request's blocks are freed and its count reset: it computed the rest.
                done = [(s, (tokens if r.finished else r.num_computed_tokens) - s) for s, r in starts]
                done = [(s, k) for s, k in done if k > 0]
                shape[i] = (sum(k for _, k in done), sum(attention_pairs(s, k) for s, k in done),
                            sum(s + k == tokens for s, k in done))
                if rep:  # the first pass warms up
                    rows.setdefault(i, []).append(took)
                i += 1
        return [{"tokens": shape[i][0], "pairs": shape[i][1], "seqs": shape[i][2], "seconds": statistics.median(ts)}
                for i, ts in sorted(rows.items())]

    def decode(self, batch: int, context: int, reps: int) -> dict[str, float] | None:
        """One decode step of `batch` requests with `context` tokens of KV each; None if they do not fit."""
        core = self.core
        self._budget(max(batch, 1))
        sched = core.scheduler
        reqs = []
        for _ in range(batch):
            r = self._request(context, 1 << 20)
            sched.requests[r.request_id] = r
            if not core.kv.allocate_slots(r, context + reps + 2):
                for q in (*reqs, r):
                    core.kv.free(q)
                    del sched.requests[q.request_id]
                return None
            # What a decode worker holds once the KV has landed: all but the last token computed.
            r.num_computed_tokens = context - 1
            r.status = RequestStatus.RUNNING
            sched.running.append(r)
            reqs.append(r)
        try:
            seconds = _timed(core.step, core.runner.device, reps)
        finally:
            for r in reqs:
                core.cancel(r.request_id)
        # Step i (0: the unrecorded warm-up) reads context + i tokens per request; the median of the
        # recorded steps reads the middle one's.
        mid = context + (reps + 1) // 2
        return {"seqs": batch, "context": batch * mid, "context_per_seq": context, "seconds": seconds}


def _receiver(port: int, sizes: list[int], reps: int, device: str, conn: Any) -> None:
    """The decode side of the transfer measurement (a child process): receive each payload, report when."""
    from pdserve.transfer.channel import PairChannel

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    with PairChannel("127.0.0.1", port, "profile-p", "profile-d", 1, 60.0, device) as ch:
        tid = 0
        for n in sizes:
            buf = torch.empty(n, device=device)
            for _ in range(reps + 1):
                conn.send("ready")
                ch.recv_into(tid, buf)
                if buf.is_cuda:
                    torch.cuda.synchronize()
                conn.send(time.perf_counter())
                tid += 1
    conn.close()


def measure_transfers(kv_bytes_per_token_: int, block_size: int, device: torch.device, reps: int = 5
                      ) -> list[dict[str, float]]:
    """One-way time of a KV payload of each TRANSFER_TOKENS between two processes over PairChannel."""
    from pdserve.transfer.channel import PairChannel, StoreServer

    sizes = []
    for tokens in TRANSFER_TOKENS:
        whole = -(-tokens // block_size) * block_size
        sizes.append(whole * kv_bytes_per_token_ // 4)  # fp32 elements of that many bytes
    ctx = processes.context()
    parent, child = ctx.Pipe()
    rows = []
    with StoreServer() as store:
        proc = ctx.Process(target=_receiver, args=(store.port, sizes, reps, str(device), child), daemon=True)
        proc.start()
        try:
            with PairChannel("127.0.0.1", store.port, "profile-p", "profile-d", 0, 60.0, device) as ch:
                tid = 0
                for tokens, n in zip(TRANSFER_TOKENS, sizes):
                    data = torch.randn(n, device=device)
                    times = []
                    for rep in range(reps + 1):
                        if not parent.poll(60):
                            raise TimeoutError("the transfer peer did not answer")
                        parent.recv()
                        t = time.perf_counter()
                        ch.send(tid, data)
                        if not parent.poll(60):
                            raise TimeoutError("the transfer peer did not answer")
                        done = parent.recv()
                        if rep:
                            times.append(done - t)
                        tid += 1
                    rows.append({"tokens": tokens, "bytes": n * 4, "seconds": statistics.median(times)})
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return rows


def fit_transport(rows: list[dict[str, float]]) -> Transport:
    x = np.array([[1.0, r["bytes"]] for r in rows])
    t = np.array([r["seconds"] for r in rows])
    latency, per_byte = fit_nonnegative(x, t)
    if per_byte <= 0:  # bandwidth unresolvable from these points: the largest payload's rate
        big = max(rows, key=lambda r: r["bytes"])
        per_byte = big["seconds"] / big["bytes"]
    return Transport(float(latency), float(1.0 / per_byte))


def run_profile(config: EngineConfig, threads: int | None = None, quick: bool = False,
                neighbours: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure, fit and return the profile (a JSON-able dict). neighbours: processes that load the
    machine as the cluster's other workers would while the steps are timed (default_neighbours)."""
    start = time.perf_counter()
    threads = threads or default_threads()
    device = torch.device(config.device)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    neighbours = default_neighbours(device, threads) if neighbours is None else neighbours
    config = replace(config, cache=replace(config.cache, enable_prefix_caching=False),
                     scheduler=SchedulerConfig(max_num_seqs=max(DECODE_BATCHES)))
    ctx = processes.context()
    stop = ctx.Event()
    others = []
    for _ in range(neighbours):
        ready = ctx.Event()
        proc = ctx.Process(target=_neighbour, args=(config, threads, ready, stop), daemon=True)
        proc.start()
        others.append((proc, ready))
    try:
        bench = _Bench(config)
        for proc, ready in others:
            if not ready.wait(300):
                raise TimeoutError("a neighbour process did not load the model in 300 s")
        return _measure(bench, config, threads, neighbours, device, quick, start, log)
    finally:
        stop.set()
        for proc, _ in others:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _measure(bench: _Bench, config: EngineConfig, threads: int, neighbours: int, device: torch.device,
             quick: bool, start: float, log: Callable[[str], None]) -> dict[str, Any]:
    mcfg = bench.core.model_config
    kv_tok = kv_bytes_per_token(mcfg, config.torch_dtype)
    block = config.cache.block_size
    reps = 1 if quick else 3
    prefill_sizes = PREFILL_TOKENS[:3] if quick else PREFILL_TOKENS
    log(f"profiling {bench.core.info.path} ({mcfg.num_params / 1e6:.0f}M parameters, {config.dtype}"
        f"{', ' + config.quantization if config.quantization else ''}) on {device_name(device)}, "
        f"{threads} torch thread(s), {neighbours} neighbour worker(s) loading the machine")
    prefill_rows = []
    for tokens in prefill_sizes:
        prefill_rows += bench.prefill(1, tokens, tokens, reps)
        log(f"  prefill {tokens:5d} tokens: {prefill_rows[-1]['seconds'] * 1e3:8.1f} ms")
    total, chunk = (256, 64) if quick else CHUNKED
    for row in bench.prefill(1, total, chunk, reps):
        prefill_rows.append(row)
        log(f"  prefill chunk of {row['tokens']} ({row['pairs']} attention pairs): {row['seconds'] * 1e3:8.1f} ms")
    k, tokens = MULTI
    prefill_rows += bench.prefill(k, tokens, k * tokens, reps)
    log(f"  prefill {k} x {tokens} tokens in one step: {prefill_rows[-1]['seconds'] * 1e3:8.1f} ms")
    decode_rows = []
    batches = (1, 4, 16) if quick else DECODE_BATCHES
    contexts = DECODE_CONTEXTS[:2] if quick else DECODE_CONTEXTS
    for ctx in contexts:
        for b in batches:
            row = bench.decode(b, ctx, max(reps, 3))
            if row is None:
                log(f"  decode batch {b:3d} x {ctx:5d} tokens: does not fit the KV cache, skipped")
                continue
            decode_rows.append(row)
            log(f"  decode batch {b:3d} x {ctx:5d} tokens: {row['seconds'] * 1e3:8.1f} ms")
    transfer_rows = measure_transfers(kv_tok, block, device, reps=2 if quick else 5)
    for row in transfer_rows:
        log(f"  KV transfer {row['tokens']:5d} tokens ({row['bytes'] / 1e6:.2f} MB): {row['seconds'] * 1e3:8.2f} ms")
    transport = fit_transport(transfer_rows)
    weights = weight_bytes(mcfg, 1 if config.quantization == "int8" else config.torch_dtype.itemsize)
    costs, fit_err = fit_measured(prefill_rows, decode_rows, transport, kv_tok, weights)
    seconds = time.perf_counter() - start
    log(f"fitted: prefill worst error {fit_err['prefill_max_rel_error']:.1%}, decode "
        f"{fit_err['decode_max_rel_error']:.1%}; transfer {transport.latency_s * 1e3:.2f} ms + "
        f"{transport.bytes_per_s / 1e9:.2f} GB/s; {seconds:.0f} s in all")
    info = bench.core.info
    return {
        "version": VERSION,
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": {"type": device.type, "name": device_name(device), "threads": threads, "neighbours": neighbours},
        "model": {"name": os.path.basename(info.path), "path": info.path, "architecture": mcfg.architecture,
                  "num_params": mcfg.num_params, "dtype": config.dtype, "quantization": config.quantization,
                  "max_model_len": info.max_model_len, "vocab_size": mcfg.vocab_size,
                  "eos_token_ids": list(info.eos_token_ids)},
        "block_size": block,
        "kv_cache_bytes": config.cache.memory_bytes,
        "kv_bytes_per_token": kv_tok,
        "weight_bytes": weights,
        "measurements": {"prefill": prefill_rows, "decode": decode_rows, "transfer": transfer_rows},
        "costs": costs.to_dict(),
        "fit": fit_err,
        "seconds": seconds,
    }


def profile_config(model: str | None, load_format: str, dtype: str, quantization: str | None, device: str,
                   kv_cache_mib: int, block_size: int) -> EngineConfig:
    return EngineConfig(model=model, load_format=load_format, dtype=dtype, quantization=quantization, device=device,
                        cache=CacheConfig(block_size=block_size, memory_bytes=kv_cache_mib << 20))


def read_profile(path: str) -> tuple[MeasuredCosts, dict[str, Any], int, int]:
    """A profile written by `pdserve profile`: (costs, model facts, KV cache bytes, block size)."""
    try:
        prof = json.loads(Path(path).read_text())
        if prof.get("version") != 1:
            raise ValueError(f"version {prof.get('version')!r}")
        model = prof["model"]
        for key in ("vocab_size", "eos_token_ids", "max_model_len"):
            model[key]
        return MeasuredCosts.from_dict(prof["costs"]), model, int(prof["kv_cache_bytes"]), int(prof["block_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError: a ValueError
        raise ValueError(f"{path} is not a pdserve profile ({type(e).__name__}: {e})") from None
