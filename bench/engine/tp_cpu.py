"""Tensor parallelism on this CPU: TP 1 against TP 2, and what one decode step's all-reduces cost over gloo.

    .venv/bin/python -m bench.engine.tp_cpu [--model PATH] [--prompt-len 512] [--batch 8] [--steps 20]

In one run, with the same model and the same seeded prompts (default: a random checkpoint of
SmolLM2-135M's size, fp32, with 8 attention heads over 2 KV heads instead of its 9 over 3, which TP 2
cannot split; made here with transformers):
- TP 1 (one process, all cores) and TP 2 (two processes, half the cores each, gloo): the time of one
  prefill step of --prompt-len tokens and of a decode step at --batch requests (median of --steps);
- gloo's all-reduce of one decode step's activations ([batch, hidden] fp32) between two processes,
  timed alone, times the 2 per layer and 1 for the embedding a step makes;
- the LM head two ways, rank 0 holding the whole logits at the end: replicated (rank 0 alone computes
  [batch, hidden] x [hidden, vocab]; the other ranks skip it) against vocab-parallel (each of 2 ranks
  computes half the vocabulary, then the halves are all-gathered over gloo).
A 2-core machine can show the protocol's cost, not a speed-up: TP 2 splits the same two cores that TP 1
already uses, and adds the all-reduces.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from bench.common import Table, parser, smollm2_sized_checkpoint


def time_engine(model: str | None, tp: int, prompt_len: int, batch: int, steps: int) -> dict:
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import EngineCore
    from pdserve.engine.request import Request
    from pdserve.engine.sampling import SamplingParams

    if tp == 1:
        torch.set_num_threads(os.cpu_count() or 1)
    cfg = EngineConfig(model=model, tensor_parallel_size=tp, cache=CacheConfig(num_blocks=512, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_batched_tokens=prompt_len, max_num_seqs=batch))
    core = EngineCore(cfg)
    try:
        g = torch.Generator().manual_seed(0)
        vocab = core.model_config.vocab_size
        params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True)
        prefill = []
        for i in range(batch):
            core.scheduler.add(Request(f"r{i}", torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params, 0))
            t0 = time.perf_counter()
            core.step()  # one prompt per step (the budget is one prompt)
            prefill.append(time.perf_counter() - t0)
        decode = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = core.step()
            decode.append(time.perf_counter() - t0)
            assert len(out) == batch
        return dict(tp=tp, prefill_s=statistics.median(prefill[1:]), decode_s=statistics.median(decode[2:]),
                    layers=core.model_config.num_layers, hidden=core.model_config.hidden_size, vocab=vocab)
    finally:
        core.close()


def _allreduce_peer(port: int, numel: int, reps: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=60))
    x = torch.ones(numel)
    for _ in range(reps):
        group.allreduce([x]).wait()


def time_allreduce(numel: int, reps: int = 200) -> float:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    peer = mp.get_context("spawn").Process(target=_allreduce_peer, args=(store.port, numel, reps + 20))
    peer.start()
    group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
    x = torch.ones(numel)
    times = []
    for i in range(reps + 20):
        t0 = time.perf_counter()
        group.allreduce([x]).wait()
        if i >= 20:
            times.append(time.perf_counter() - t0)
    peer.join(60)
    return statistics.median(times)


def _lm_head_peer(port: int, batch: int, hidden: int, vocab: int, reps: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=60))
    x, w = torch.randn(batch, hidden), torch.randn(vocab // 2, hidden)
    for _ in range(reps):
        mine = x @ w.T
        group.allgather([[torch.empty_like(mine), torch.empty_like(mine)]], [mine]).wait()


def time_lm_head(batch: int, hidden: int, vocab: int, reps: int = 50) -> tuple[float, float]:
    """(replicated, vocab-parallel): seconds until rank 0 holds the [batch, vocab] logits."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    x, w = torch.randn(batch, hidden), torch.randn(vocab, hidden)
    replicated = []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        x @ w.T
        if i >= 5:
            replicated.append(time.perf_counter() - t0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    peer = mp.get_context("spawn").Process(target=_lm_head_peer, args=(store.port, batch, hidden, vocab, reps + 5))
    peer.start()
    group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
    half = w[: vocab // 2].contiguous()
    split = []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        mine = x @ half.T
        parts = [torch.empty_like(mine), torch.empty_like(mine)]
        group.allgather([parts], [mine]).wait()
        torch.cat(parts, dim=1)
        if i >= 5:
            split.append(time.perf_counter() - t0)
    peer.join(60)
    torch.set_num_threads(os.cpu_count() or 1)
    return statistics.median(replicated), statistics.median(split)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default=None, help="a checkpoint whose heads TP 2 can split (default: made here)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores; prompt {args.prompt_len} tokens, decode batch {args.batch}", flush=True)
    model = args.model or str(smollm2_sized_checkpoint(Path(tempfile.mkdtemp(prefix="pdserve-tp-"))))
    rows = [time_engine(model, tp, args.prompt_len, args.batch, args.steps) for tp in (1, 2)]
    layers, hidden = rows[0]["layers"], rows[0]["hidden"]
    one = time_allreduce(args.batch * hidden)
    per_step = (2 * layers + 1) * one  # o_proj and down_proj in each layer, and the vocab-parallel embedding
    t = Table(("TP", 3, ""), ("prefill ms", 11, ".1f"), ("decode step ms", 15, ".2f"))
    print("\n" + t.header())
    for r in rows:
        print(t.row(r["tp"], r["prefill_s"] * 1e3, r["decode_s"] * 1e3))
    print(f"TP 2 / TP 1: prefill {rows[1]['prefill_s'] / rows[0]['prefill_s']:.2f}x, decode "
          f"{rows[1]['decode_s'] / rows[0]['decode_s']:.2f}x")
    print(f"gloo all-reduce of [{args.batch}, {hidden}] fp32 between 2 processes: {one * 1e6:.0f} us; x {2 * layers + 1} "
          f"per step = {per_step * 1e3:.2f} ms ({per_step / rows[1]['decode_s']:.0%} of the TP 2 decode step), "
          f"and one all-gather of the logits (below)")
    vocab = rows[0]["vocab"]
    for n in sorted({1, args.batch, 64}):  # rows that sample: one per request
        rep, split = time_lm_head(n, hidden, vocab)
        print(f"LM head [{n}, {hidden}] x [{hidden}, {vocab}], 1 thread per rank: replicated on rank 0 {rep * 1e3:.2f} ms, "
              f"vocab-parallel over 2 ranks + all-gather {split * 1e3:.2f} ms ({split / rep:.2f}x)")


if __name__ == "__main__":
    main()
