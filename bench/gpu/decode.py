"""Decode: pdserve's step at each batch against its weight+KV read floor, its GPU busy fraction by what hides
the host's work (eager, CUDA graphs, graphs with pipelined decode; and the layer ops in torch), and
transformers' decode step on the same shape (hf_decode)."""
from __future__ import annotations

import os
import random
import time
import traceback

import torch

from bench.gpu.core import add_requests, make_core, run_prefill_until_decoding, set_mode
from bench.gpu.timing import RESULTS, free_memory, kernel_stats, section, sync


@section("decode")
def bench_decode(args, device: torch.device, peaks: dict | None) -> dict:
    from pdserve.config import kv_bytes_per_token
    from pdserve.engine.utilization import weight_bytes

    core = make_core(args, device, max_batched=args.prefill_tokens, prefix_caching=False)
    args._core = core  # reused by the prefill section
    cfg = core.model_config
    dbytes = torch.empty((), dtype=core.config.torch_dtype).element_size()
    wbytes = weight_bytes(cfg, dbytes)
    kv_tok = kv_bytes_per_token(cfg, core.config.torch_dtype)
    bw = peaks["copy_bw_read_plus_write"] if peaks else float("nan")
    rng = random.Random(0)
    rows = []
    for b in args.batches:
        try:
            rows.append(decode_row(core, device, args, b, rng, wbytes, kv_tok, bw))
        finally:
            core.cancel_all()
    return dict(model=args.model, dtype=args.dtype, weight_bytes=wbytes, kv_bytes_per_token=kv_tok,
                copy_bw=bw, rows=rows)


def decode_row(core, device, args, b: int, rng: random.Random, wbytes: int, kv_tok: int, bw: float) -> dict:
    # max_tokens far beyond the steps run: requests prefilled early keep decoding while later ones
    # prefill, and none may finish inside the timed or profiled steps. They are cancelled afterwards.
    reqs = add_requests(core, b, args.context, 4000, rng)
    run_prefill_until_decoding(core, reqs)
    for _ in range(args.warmup):
        core.step()
    assert all(r.num_computed_tokens == r.num_tokens - 1 for r in reqs), "not all decoding"
    ctx_tokens_mid = sum(r.num_tokens for r in reqs) + b * (args.steps // 2)  # K/V read per step, mid-run
    bytes0 = core.runner.bytes_total
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = core.step()
        assert len(out) == b, (len(out), b)
    sync(device)
    step_s = (time.perf_counter() - t0) / args.steps
    counted = (core.runner.bytes_total - bytes0) / args.steps
    kv_read = ctx_tokens_mid * kv_tok
    floor_s = (wbytes + kv_read) / bw
    row = dict(batch=b, context_mid=ctx_tokens_mid // b, step_s=step_s, weight_bytes=wbytes, kv_bytes=kv_read,
               pdserve_counted_bytes=counted, floor_s=floor_s, floor_over_step=floor_s / step_s,
               tokens_per_s=b / step_s)
    # Host-side preparation alone: schedule() (idempotent while no step runs) + the runner's _prepare.
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        st = core.scheduler.schedule()
        core.runner._prepare(sorted(st.chunks, key=lambda c: c.start))
    sync(device)
    row["host_prep_s"] = (time.perf_counter() - t0) / args.steps
    if b == args.busy_batch or not args.small:
        row["busy"] = profile_decode(core, device, args.profile_steps, step_s, b)
    row["modes"] = busy_modes(core, device, args, b, profile=b == args.busy_batch)
    if b == args.busy_batch and device.type == "cuda" and core.runner.graphs is not None:
        row["modes"][TORCH_OPS_MODE] = torch_ops_mode(core, device, args, b)
    print(f"batch {b:3d} ctx~{row['context_mid']}: step {step_s * 1e3:8.2f} ms  floor {floor_s * 1e3:7.2f} ms  "
          f"({floor_s / step_s:5.1%} of floor)  {b / step_s:9.1f} tok/s  host prep "
          f"{row['host_prep_s'] * 1e3:.2f} ms", flush=True)
    return row


# The GPU busy fraction of decode by what hides the host's work: neither, CUDA graphs only, and graphs
# with pipelined decode (the default on CUDA).
BUSY_MODES = (("eager", False, False), ("graphs", True, False), ("graphs+pipelined", True, True))
# At the busy batch, the default mode again with the layer ops in torch (PDSERVE_GPU_KERNELS=torch, the
# graphs captured again): what the fused Triton layer ops (pdserve.kernels.triton_layer_ops) buy.
TORCH_OPS_MODE = "graphs+pipelined, torch layer ops"


def mode_step(core, device: torch.device, steps: int, name: str, batch: int) -> float:
    """Seconds a decode step of the mode the core is in, over `steps` after 3 untimed ones (printed)."""
    for _ in range(3):
        core.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync(device)
    step_s = (time.perf_counter() - t0) / steps
    print(f"[{name}] batch {batch}: step {step_s * 1e3:.2f} ms", flush=True)
    return step_s


def busy_modes(core, device: torch.device, args, batch: int, profile: bool) -> dict:
    """Step time of the same decode batch in each of BUSY_MODES, and (profile) its GPU busy fraction.
    A mode that fails is recorded and the next one runs."""
    graphs, pipelined = core.runner.graphs, core.pipelined
    out = {}
    try:
        for name, use_graphs, pipe in BUSY_MODES:
            if use_graphs and graphs is None:
                out[name] = {"skipped": "no CUDA graphs on this device"}
                continue
            try:
                set_mode(core, graphs, use_graphs, pipe)
                step_s = mode_step(core, device, args.steps, name, batch)
                out[name] = dict(step_s=step_s)
                if profile:
                    out[name].update(profile_decode(core, device, args.profile_steps, step_s, batch))
            except Exception as e:  # noqa: BLE001 - the next mode still runs
                print(traceback.format_exc(), flush=True)
                out[name] = {"error": f"{type(e).__name__}: {e}"}
                RESULTS["errors"][f"decode batch {batch} {name}"] = out[name]["error"]
    finally:
        set_mode(core, graphs, graphs is not None, pipelined)
    return out


def torch_ops_mode(core, device: torch.device, args, batch: int) -> dict:
    """The default mode's step with the layer ops in torch: graphs captured again under
    PDSERVE_GPU_KERNELS=torch, timed and profiled, then captured again with the kernels."""
    graphs = core.runner.graphs
    try:
        set_mode(core, graphs, True, True)
        os.environ["PDSERVE_GPU_KERNELS"] = "torch"
        graphs.capture()
        step_s = mode_step(core, device, args.steps, TORCH_OPS_MODE, batch)
        return dict(step_s=step_s, **profile_decode(core, device, args.profile_steps, step_s, batch))
    except Exception as e:  # noqa: BLE001
        print(traceback.format_exc(), flush=True)
        RESULTS["errors"][f"decode batch {batch} {TORCH_OPS_MODE}"] = f"{type(e).__name__}: {e}"
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        os.environ.pop("PDSERVE_GPU_KERNELS", None)
        set_mode(core, graphs, True, core.pipelined)
        graphs.capture()


def profile_decode(core, device: torch.device, steps: int, unprofiled_step_s: float, batch: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(2):
        core.step()
    sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            assert len(core.step()) == batch, "a request finished inside the profiled steps"
        sync(device)
        wall = time.perf_counter() - t0
    ks = kernel_stats(prof)
    cpu_top = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()),
                     key=lambda t: -t[1])[:8]
    res = dict(steps=steps, profiled_wall_s=wall, kernel_sum_s=ks["sum_s"], kernel_union_s=ks["union_s"],
               num_gpu_events=ks["num_events"], busy_profiled=ks["union_s"] / wall,
               gpu_s_per_step=ks["union_s"] / steps,
               busy_vs_unprofiled=ks["union_s"] / steps / unprofiled_step_s, top_kernels=ks["top"],
               top_cpu_ops=[(k, us / 1e6 / steps, n / steps) for k, us, n in cpu_top])
    print(f"busy: profiled wall {wall / steps * 1e3:.2f} ms/step, GPU kernels (union) "
          f"{ks['union_s'] / steps * 1e3:.2f} ms/step ({ks['num_events'] / steps:.0f} GPU ops/step) -> "
          f"{res['busy_profiled']:.1%} busy under the profiler, {res['busy_vs_unprofiled']:.1%} of the unprofiled step",
          flush=True)
    for n, s in ks["top"]:
        print(f"   {s / steps * 1e3:8.3f} ms/step  {n}")
    print("   host (profiled, self CPU time per step, calls per step):")
    for k, s, n in res["top_cpu_ops"]:
        print(f"   {s * 1e3:8.3f} ms/step {n:7.0f} calls  {k}")
    return res


@section("hf_decode")
def bench_hf_decode(args, device: torch.device, peaks: dict | None) -> dict:
    """transformers' decode step on the same shape (random weights, bf16, its default SDPA attention and
    DynamicCache), at each decode batch: B prompts of --context tokens, generate() with max_new_tokens n1
    and n2 (greedy, no EOS), per step = (t(n2) - t(n1)) / (n2 - n1), the prefill and set-up cancelling out."""
    import transformers
    from pdserve.config import ModelConfig, kv_bytes_per_token
    from pdserve.engine.utilization import weight_bytes
    from pdserve.model.loader import DUMMY_PRESETS

    shape = {k: v for k, v in DUMMY_PRESETS[args.model].items() if k not in ("model_type", "eos_token_id")}
    cfg = transformers.LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    dtype = torch.bfloat16
    default = torch.get_default_dtype()
    t = time.perf_counter()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    sync(device)
    print(f"transformers LlamaForCausalLM({args.model}) on {device}: {time.perf_counter() - t:.1f} s, "
          f"attention {model.config._attn_implementation}", flush=True)
    mcfg = ModelConfig.from_hf(DUMMY_PRESETS[args.model])
    wbytes = weight_bytes(mcfg, 2)
    kv_tok = kv_bytes_per_token(mcfg, dtype)
    bw = peaks["copy_bw_read_plus_write"] if peaks else float("nan")
    n1, n2 = args.hf_new_tokens
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in args.batches:
        ids = torch.randint(3, cfg.vocab_size, (b, args.context), generator=g).to(device)
        mask = torch.ones_like(ids)

        def gen(n: int) -> float:
            sync(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     pad_token_id=0)
            sync(device)
            assert out.shape == (b, args.context + n), out.shape
            return time.perf_counter() - t0
        gen(2)  # warm-up
        t1, t2 = gen(n1), gen(n2)
        step_s = (t2 - t1) / (n2 - n1)
        ctx_mid = args.context + (n1 + n2) // 2
        floor_s = (wbytes + b * ctx_mid * kv_tok) / bw
        rows.append(dict(batch=b, step_s=step_s, floor_s=floor_s, tokens_per_s=b / step_s, t_n1=t1, t_n2=t2))
        print(f"transformers batch {b:3d}: step {step_s * 1e3:8.2f} ms  floor {floor_s * 1e3:7.2f} ms  "
              f"{b / step_s:9.1f} tok/s", flush=True)
        free_memory()
    del model
    free_memory()
    return dict(model=args.model, dtype="bfloat16", new_tokens=(n1, n2), context=args.context, rows=rows,
                transformers=transformers.__version__)
