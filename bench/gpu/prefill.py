"""Prefill: one prompt of --prefill-tokens in one step, its MFU against the measured matmul, and a second
chunk over the cached first (the masked attention path); their kernels under the profiler on CUDA."""
from __future__ import annotations

import random
import statistics
import time

import torch

from bench.gpu.core import add_requests, make_core, set_mode
from bench.gpu.timing import kernel_stats, section, sync


@section("prefill")
def bench_prefill(args, device: torch.device, peaks: dict | None) -> dict:
    from pdserve.engine.utilization import step_flops

    core = getattr(args, "_core", None) or make_core(args, device, args.prefill_tokens, prefix_caching=False)
    cfg = core.model_config
    n = args.prefill_tokens
    rng = random.Random(1)
    core.cancel_all()
    # One step is timed: with pipelined decode a step's tokens come back with the next step's call.
    set_mode(core, core.runner.graphs, core.runner.graphs is not None, pipelined=False)
    times = []
    for i in range(args.prefill_reps + 1):  # the first is a warm-up
        reqs = add_requests(core, 1, n, 1, rng)
        sync(device)
        t0 = time.perf_counter()
        out = core.step()
        sync(device)
        dt = time.perf_counter() - t0
        assert len(out) == 1 and reqs[0].finished, "the prompt did not prefill in one step"
        if i:
            times.append(dt)
    step_s = statistics.median(times)
    flops = step_flops(cfg, [(0, n)], 1)
    achieved = flops / step_s
    mm = peaks["matmul_flops"] if peaks else float("nan")
    res = dict(tokens=n, step_s=step_s, all_step_s=times, model_flops=flops, achieved_flops=achieved,
               matmul_flops=mm, mfu_vs_matmul=achieved / mm)
    print(f"prefill {n} tokens: {step_s * 1e3:.2f} ms, {flops / 1e12:.2f} TFLOP -> {achieved / 1e12:.1f} TFLOP/s "
          f"= {achieved / mm:.1%} of the measured matmul", flush=True)
    # A second chunk (attends to the cached first chunk: the masked SDPA path), 2n - 192 tokens in all.
    total = 2 * n - 192 if not args.small else 2 * n - 16
    second = []
    for i in range(3):
        reqs = add_requests(core, 1, total, 1, rng)
        core.step()  # first chunk: n tokens
        sync(device)
        t0 = time.perf_counter()
        out = core.step()
        sync(device)
        assert len(out) == 1 and reqs[0].finished
        if i:
            second.append(time.perf_counter() - t0)
    f2 = step_flops(cfg, [(n, total - n)], 1)
    res["second_chunk"] = dict(start=n, tokens=total - n, step_s=statistics.median(second), model_flops=f2,
                               achieved_flops=f2 / statistics.median(second),
                               mfu_vs_matmul=f2 / statistics.median(second) / mm)
    print(f"second chunk {total - n} tokens after {n} cached: {statistics.median(second) * 1e3:.2f} ms -> "
          f"{res['second_chunk']['achieved_flops'] / 1e12:.1f} TFLOP/s = {res['second_chunk']['mfu_vs_matmul']:.1%}",
          flush=True)
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        reqs = add_requests(core, 1, total, 1, rng)
        core.step()
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            core.step()
            sync(device)
        ks = kernel_stats(prof)
        res["second_chunk"]["profile"] = dict(kernel_union_s=ks["union_s"], top_kernels=ks["top"])
        print("   second chunk kernels:")
        for name, s in ks["top"]:
            print(f"   {s * 1e3:8.3f} ms  {name}")
        add_requests(core, 1, n, 1, rng)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            core.step()
            sync(device)
        ks = kernel_stats(prof)
        res["profile"] = dict(kernel_union_s=ks["union_s"], top_kernels=ks["top"])
        print(f"   {n}-token prefill kernels (GPU busy {ks['union_s'] * 1e3:.2f} ms):")
        for name, s in ks["top"]:
            print(f"   {s * 1e3:8.3f} ms  {name}")
    return res
