"""Where pdserve's CPU linear kernel beats F.linear: one matmul x [rows, in] @ W.T at SmolLM2-135M's MLP shapes,
fp32, bf16 and int8 weights, over 1..512 rows (decode batches to prefill chunks), median of --repeat.

    .venv/bin/python -m bench.engine.linear_rows [--repeat 30] [--engine] [--out-of-cache]

The kernel (pdserve/kernels/csrc/linear.cpp) streams the weight once for up to 4 rows of x at a time: at a
decode step's few rows it reads the weight at close to the memory bandwidth, where F.linear's blocked GEMM
pays its set-up; over many rows the GEMM's cache blocking wins. An int8 weight goes to F.linear dequantized
(the whole weight to the activations' dtype, each call). pdserve.model.linear.KERNEL_MAX_ROWS is set from this.

--engine: then the offline engine on the default model (SmolLM2-135M), fp32 and bf16, with KERNEL_MAX_ROWS as
set and with the kernel at every row count (as before it was set), alternating, best of 3 each: prefill tok/s
(4 prompts of 512 tokens, one output token) and decode output tok/s (16 prompts of 16 tokens, 64 out each).

--out-of-cache: instead, the kernel alone over rows 1..8 with the weights out of cache, as a decode step reads
them: fp32 weights of SmolLM2's MLP and attention shapes, ~640 MB of them (more than any cache), walked once per
pass, the best of --repeat passes per row count (the row counts taking turns pass by pass). It shows what a
verification's extra rows (k + 1 of them, bench/speculative.py) cost against a plain step's one.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import Table, parser
from pdserve.kernels import cpu_kernels
from pdserve.model.linear import Linear

ROWS = (1, 2, 3, 4, 8, 16, 24, 32, 64, 256, 512)


def median_s(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--engine", action="store_true", help="also the offline engine end to end (below)")
    ap.add_argument("--out-of-cache", action="store_true", help="the kernel per row count, weights from memory")
    args = ap.parse_args()
    assert cpu_kernels.applies(torch.zeros(1)), "the CPU kernels are not built or are forced off"
    torch.manual_seed(0)
    if args.out_of_cache:
        out_of_cache(min(args.repeat, 10))
        return
    t = Table(("weight", 8, "s"), ("shape", 11, "s"), ("rows", 5, "d"), ("kernel us", 10, ".1f"),
              ("F.linear us", 11, ".1f"), ("F.linear / kernel", 17, ".2f"))
    print(t.header())
    for kind in ("float32", "bfloat16", "int8"):
        for out_f, in_f in ((3072, 576), (576, 1536)):
            layer = Linear(in_f, out_f)
            torch.nn.init.normal_(layer.weight, std=0.02)
            act = torch.float32 if kind != "bfloat16" else torch.bfloat16
            if kind == "int8":
                layer.quantize_int8()
            else:
                layer.weight.data = layer.weight.data.to(act)
            w, scale = layer.weight, layer.scale
            for n in ROWS:
                x = torch.randn(n, in_f, dtype=act)
                ours = median_s(lambda: torch.ops.pdserve.linear(x, w, scale, None), args.repeat)
                theirs = median_s(lambda: F.linear(x, layer.dequantized(act)), args.repeat)
                print(t.row(kind, f"{out_f}x{in_f}", n, 1e6 * ours, 1e6 * theirs, theirs / ours))
    if args.engine:
        engine_runs()


OUT_OF_CACHE_BYTES = 640 << 20
OUT_OF_CACHE_ROWS = (1, 2, 3, 4, 5, 6, 8)


def out_of_cache(repeat: int) -> None:
    shapes = ((3072, 576), (576, 1536), (576, 576))  # SmolLM2-135M: gate/up, down, q/o
    weights: list[torch.Tensor] = []
    while sum(w.numel() * 4 for w in weights) < OUT_OF_CACHE_BYTES:
        weights += [torch.randn(out_f, in_f) * 0.02 for out_f, in_f in shapes]
    total = sum(w.numel() * 4 for w in weights)
    xs = {n: {in_f: torch.randn(n, in_f) for _, in_f in shapes} for n in OUT_OF_CACHE_ROWS}
    best = {n: float("inf") for n in OUT_OF_CACHE_ROWS}
    for _ in range(repeat):
        for n in OUT_OF_CACHE_ROWS:
            t0 = time.perf_counter()
            for w in weights:
                torch.ops.pdserve.linear(xs[n][w.shape[1]], w, None, None)
            best[n] = min(best[n], time.perf_counter() - t0)
    print(f"fp32 weights out of cache: {total / 1e6:.0f} MB a pass, best of {repeat}")
    t = Table(("rows", 5, "d"), ("ms a pass", 10, ".1f"), ("GB/s", 6, ".1f"), ("vs 1 row", 9, ".2f"))
    print(t.header())
    for n in OUT_OF_CACHE_ROWS:
        print(t.row(n, 1e3 * best[n], total / best[n] / 1e9, best[n] / best[1]))


def engine_runs() -> None:
    from pdserve.config import EngineConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from pdserve.model import linear

    as_set = dict(linear.KERNEL_MAX_ROWS)
    everywhere = {k: 1 << 30 for k in as_set}
    g = torch.Generator().manual_seed(0)
    long = [torch.randint(10, 40000, (512,), generator=g).tolist() for _ in range(4)]
    short = [torch.randint(10, 40000, (16,), generator=g).tolist() for _ in range(16)]
    t = Table(("dtype", 9, "s"), ("kernel rows", 11, "s"), ("prefill tok/s", 13, ",.0f"), ("decode tok/s", 12, ",.0f"))
    print(t.header())
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(dtype=dtype))
        best: dict[str, list[float]] = {"as set": [0.0, 0.0], "all": [0.0, 0.0]}
        for _ in range(3):
            for name, rows in (("as set", as_set), ("all", everywhere)):
                linear.KERNEL_MAX_ROWS.clear()
                linear.KERNEL_MAX_ROWS.update(rows)
                t0 = time.perf_counter()
                engine.generate(long, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                prefill = 4 * 512 / (time.perf_counter() - t0)
                t0 = time.perf_counter()
                engine.generate(short, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
                decode = 16 * 64 / (time.perf_counter() - t0)
                best[name] = [max(best[name][0], prefill), max(best[name][1], decode)]
        for name in best:
            print(t.row(dtype, name, *best[name]))
        linear.KERNEL_MAX_ROWS.clear()
        linear.KERNEL_MAX_ROWS.update(as_set)


if __name__ == "__main__":
    main()
