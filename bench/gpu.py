"""pdserve on one GPU: decode vs the bandwidth floor, GPU busy fraction, prefill MFU, offline vs HF.

    python bench/gpu.py                       # on a CUDA machine: bf16, Llama-3-8B shape (dummy weights)
    .venv/bin/python bench/gpu.py --device cpu --small   # smoke test of every section, tiny shapes
    python bench/gpu.py --sections peaks,decode  # a subset

On the GPU machine (no Ray/gguf there; see ../shared/tools/device-wheels), one call runs everything:
    python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl \
      && export PYTHONPATH=$PWD/.site:$PWD; python3 bench/gpu.py 2>&1 | tee $OUT/log.txt
The cluster sections need Ray; every other section needs only torch and transformers.

Sections (each runs even if an earlier one failed; failures are printed with their traceback):

peaks    Two ceilings measured in this run: copy bandwidth of a large device-to-device copy
         (bytes read + bytes written) / time, and bf16 matmul FLOP/s of 8192^3 on random data. Both
         timed with CUDA events, median of several repetitions after warm-up.
decode   EngineCore (scheduler + ModelRunner + sampler, i.e. pdserve's own step) on the dummy-weight
         Llama-3-8B shape, bf16. For batch B in 1, 8, 64: B random prompts of --context tokens are
         prefilled (not timed), then --warmup decode steps, then --steps timed decode steps
         (synchronize before and after; every step ends with the sampled tokens copied to the host).
         floor = (matmul weight bytes + K/V bytes of every sequence's context) / copy bandwidth, with
         the context at the middle of the timed steps. Also the analytic bytes pdserve counts.
busy     At batch 64: the same decode loop under torch.profiler. GPU busy = union of the GPU
         kernel/memcpy intervals / wall time of the profiled steps (the profiler adds host overhead,
         so a second figure divides the per-step kernel time by the unprofiled step time).
prefill  One 4096-token prompt, SchedulerConfig(max_num_batched_tokens=4096), prefix caching off,
         one step per prompt (fresh random prompts), median of --prefill-reps steps.
         MFU = step_flops (pdserve.engine.utilization) / step time / measured bf16 matmul FLOP/s.
offline  pdserve LLMEngine vs transformers generate() on the same GPU, bf16, same random HF
         checkpoint of SmolLM2-135M's shape made here by transformers (random weights, seeded).
         64 prompts of 128-512 tokens, 128 output tokens each, greedy, EOS ignored (the checkpoint has
         no EOS). Then greedy token equality on a few prompts (pdserve batched vs HF batch 1, no
         padding), in bf16 and in fp32.

experiments  What fixes would give, by monkeypatching in this process only (pdserve's files untouched):
         x1 the decode forward (model only) eager vs replayed from a CUDA graph, at each decode batch;
         x2 the chunked-prefill attention (second chunk: 3904 queries over 8000 keys, one layer) with
         torch's causal_lower_right bias instead of the dense boolean mask, timed and compared.
cluster  The one-GPU 1P1D check (needs Ray). Both workers share the GPU (num_gpus 0.4 each), so their
         KV pair channel stages through host memory over gloo (pdserve.transfer.channel, NCCL refuses two
         ranks on one GPU). (1) Tiny random checkpoint, fp32, 4 prompts (5-100 tokens, greedy and
         seeded sampling, 12 tokens): colocated, then disaggregated; tokens compared with the offline
         engine; for disaggregated also the decode worker's hand-off histogram (WorkerStats.handoff:
         first token sampled on the prefill worker -> KV usable on the decode worker), mean = sum/count.
         (2) Disaggregated, random HF checkpoint of SmolLM2-135M's shape, bf16 (fp32 on CPU): for
         each of --handoff-lengths, one warm-up request and then --handoff-reps requests of fresh
         random prompts, one at a time, max_tokens 8; per request the hand-off (delta of the decode
         worker's histogram sum) and the prefill step (delta of the prefill worker's busy_seconds).

Prints one table at the end; writes $OUT/gpu_bench.json (or --json) when OUT is set. Exit status 1 if
any section failed (its traceback is printed where it happened).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

GiB = 1 << 30
RESULTS: dict = {"sections": {}, "errors": {}}


# --- timing helpers ---------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def event_time(fn, device: torch.device, reps: int, warmup: int = 2) -> list[float]:
    """Seconds per call, one value per repetition (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def section(name: str):
    def wrap(fn):
        def run(*a, **kw):
            print(f"\n=== {name} ===", flush=True)
            t = time.perf_counter()
            try:
                res = fn(*a, **kw)
                RESULTS["sections"][name] = res
                return res
            except Exception as e:  # noqa: BLE001 - report and go on with the next section
                tb = traceback.format_exc()
                print(tb, flush=True)
                RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
                RESULTS.setdefault("tracebacks", {})[name] = tb
                return None
            finally:
                print(f"[{name}: {time.perf_counter() - t:.1f} s]", flush=True)
        return run
    return wrap


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- sections ---------------------------------------------------------------------------------------

@section("peaks")
def measure_peaks(device: torch.device, small: bool) -> dict:
    n = (64 << 20) if small else (2 * GiB)  # bytes of the copy's source
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = event_time(lambda: dst.copy_(src), device, reps=5 if small else 20, warmup=3)
    copy_s = statistics.median(t)
    bw = 2 * src.nbytes / copy_s  # read + write
    src = dst = None  # free before the matmul
    m = 1024 if small else 8192
    dt = torch.float32 if (small and device.type == "cpu") else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    mats = [torch.randn(m, m, dtype=dt, device=device, generator=g) for _ in range(4)]
    c = torch.empty(m, m, dtype=dt, device=device)
    i = [0]

    def mm():  # rotate inputs so repeated products do not reuse one pair
        torch.mm(mats[i[0] % 4], mats[(i[0] + 1) % 4], out=c)
        i[0] += 1
    t = event_time(mm, device, reps=3 if small else 20, warmup=1 if small else 5)
    mm_s = statistics.median(t)
    flops = 2 * m ** 3 / mm_s
    mats = c = None
    free_memory()
    res = dict(copy_bytes=2 * (n // 2) * 2, copy_s=copy_s, copy_bw_read_plus_write=bw,
               matmul_n=m, matmul_dtype=str(dt), matmul_s=mm_s, matmul_flops=flops)
    print(f"copy {n / GiB:.2f} GiB src: {copy_s * 1e3:.3f} ms -> {bw / 1e12:.3f} TB/s (read+write);  "
          f"{m}^3 {dt} matmul {mm_s * 1e3:.3f} ms -> {flops / 1e12:.1f} TFLOP/s", flush=True)
    return res


def make_core(args, device: torch.device, max_batched: int, prefix_caching: bool):
    """The engine core on the dummy-weight shape, with the device's default fast path. Where building it
    fails (CUDA-graph capture is the step most likely to), the failure is recorded and a core without
    graphs is built instead, so the eager figures still come."""
    from dataclasses import replace

    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import EngineCore

    cfg = EngineConfig(model=args.model, load_format="dummy", dtype=args.dtype, device=str(device),
                       cache=CacheConfig(memory_bytes=int(args.kv_gib * GiB), enable_prefix_caching=prefix_caching),
                       scheduler=SchedulerConfig(max_num_seqs=max(64, max(args.batches)),
                                                 max_num_batched_tokens=max_batched))
    t = time.perf_counter()
    try:
        core = EngineCore(cfg)
    except Exception as e:  # noqa: BLE001 - reported, then the eager core
        print(traceback.format_exc(), flush=True)
        RESULTS["errors"]["engine_with_graphs"] = f"{type(e).__name__}: {e}"
        free_memory()
        core = EngineCore(replace(cfg, cuda_graphs=False))
    sync(device)
    graphs = core.runner.graphs
    RESULTS.setdefault("env", {})["graph_buckets_captured"] = graphs.captured if graphs is not None else None
    print(f"CUDA graphs captured for buckets {graphs.captured if graphs is not None else None} "
          f"({time.perf_counter() - t:.1f} s with the load)", flush=True)
    print(f"EngineCore({args.model}, {args.dtype}, {device}): {time.perf_counter() - t:.1f} s, "
          f"{core.pool.num_blocks} KV blocks", flush=True)
    return core


def add_requests(core, n: int, length: int, max_tokens: int, rng: random.Random) -> list:
    from pdserve.engine.request import Request
    from pdserve.engine.sampling import SamplingParams

    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = []
    for _ in range(n):
        req = Request(f"r{rng.getrandbits(48)}", [rng.randrange(3, vocab) for _ in range(length)], params, 0)
        core.scheduler.add(req)
        reqs.append(req)
    return reqs


def run_prefill_until_decoding(core, reqs) -> None:
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in reqs):
        core.step()


def kernel_stats(prof, top: int = 8) -> dict:
    """GPU kernel/memcpy events of a profile: summed time, union of intervals, top kernels by time."""
    from torch.autograd import DeviceType

    ivs, by_name = [], {}
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        s, t = e.time_range.start, e.time_range.end
        ivs.append((s, t))
        by_name[e.name] = by_name.get(e.name, 0.0) + (t - s)
    ivs.sort()
    union, cur_s, cur_e = 0.0, None, None
    for s, t in ivs:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                union += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    if cur_e is not None:
        union += cur_e - cur_s
    tops = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return dict(num_events=len(ivs), sum_s=sum(t - s for s, t in ivs) / 1e6, union_s=union / 1e6,
                top=[(n[:90], us / 1e6) for n, us in tops])


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


def set_mode(core, graphs, use_graphs: bool, pipelined: bool) -> None:
    """Switch a core's decode step between modes (the launched steps resolved first)."""
    while core.scheduler.launched:
        core.scheduler.resolve(core.scheduler.launched[0])
    core.runner.graphs = graphs if use_graphs else None
    core.pipelined = pipelined


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
                for _ in range(3):
                    core.step()
                sync(device)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    core.step()
                sync(device)
                step_s = (time.perf_counter() - t0) / args.steps
                print(f"[{name}] batch {batch}: step {step_s * 1e3:.2f} ms", flush=True)
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
        for _ in range(3):
            core.step()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        sync(device)
        step_s = (time.perf_counter() - t0) / args.steps
        print(f"[{TORCH_OPS_MODE}] batch {batch}: step {step_s * 1e3:.2f} ms", flush=True)
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


def build_hf_checkpoint(directory: Path, small: bool, initializer_range: float) -> dict:
    import transformers

    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    if small:
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    cfg = transformers.LlamaConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   initializer_range=initializer_range,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return shape


def load_hf(directory: Path, dtype: torch.dtype, device: torch.device):
    import warnings

    import transformers
    from transformers.utils import logging

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).to(device).eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> list[list[int]]:
    from bench.common import hf_generate as batched_generate

    return batched_generate(model, prompts, new_tokens, device, exact=False)[:, max(map(len, prompts)):].tolist()


@torch.inference_mode()
def pdserve_last_logits(eng, prompt: list[int]) -> torch.Tensor:
    """fp32 logits of a prompt's last position, through pdserve's own scheduler and runner."""
    from pdserve.engine.sampling import SamplingParams

    eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while True:
        step = eng.scheduler.schedule()
        res = eng.runner.execute(step.chunks)
        eng.process(eng.core.account(step, res))
        if res.sampling_chunks:
            return res.logits[0].float().cpu()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@section("offline")
def bench_offline(args, device: torch.device) -> dict:
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-hf-"))
    t = time.perf_counter()
    shape = build_hf_checkpoint(tmp, args.small, args.init_range)
    print(f"random HF checkpoint {shape} init_range={args.init_range}: {time.perf_counter() - t:.1f} s", flush=True)
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_prompts)]
    out_len = args.output_len
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    res: dict = dict(checkpoint="random transformers LlamaForCausalLM, SmolLM2-135M shape" if not args.small
                     else "random tiny llama", shape=shape, num_prompts=len(prompts),
                     prompt_tokens=sum(map(len, prompts)), output_len=out_len)

    def engine_for(dtype: str):
        return LLMEngine(EngineConfig(model=str(tmp), load_format="hf", dtype=dtype, device=str(device),
                                      cache=CacheConfig(memory_bytes=int(args.offline_kv_gib * GiB)),
                                      scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096)))

    eng = engine_for("bfloat16")
    hf = load_hf(tmp, torch.bfloat16, device)
    eng.generate([prompts[0][:32]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    hf_generate(hf, [prompts[0][:32]], 4, device)
    sync(device)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    sync(device)
    ours_s = time.perf_counter() - t0
    assert all(len(o.token_ids) == out_len for o in outs)
    t0 = time.perf_counter()
    hf_out = hf_generate(hf, prompts, out_len, device)
    sync(device)
    hf_s = time.perf_counter() - t0
    assert all(len(o) == out_len for o in hf_out)
    n_out = len(prompts) * out_len
    res.update(pdserve_s=ours_s, hf_s=hf_s, pdserve_tok_s=n_out / ours_s, hf_tok_s=n_out / hf_s,
               speedup=hf_s / ours_s)
    print(f"{len(prompts)}x{out_len} tokens: pdserve {ours_s:.2f} s ({n_out / ours_s:.0f} tok/s), transformers "
          f"{hf_s:.2f} s ({n_out / hf_s:.0f} tok/s)", flush=True)

    # Greedy equality: pdserve batched vs HF one prompt at a time (no padding). And, since random
    # weights leave small top-1 margins, the prompt's last-position logits of each side against HF fp32:
    # is pdserve's bf16 error of the same size as transformers' own bf16 error?
    eq, logits = {}, {}
    eq_prompts = prompts[: args.eq_prompts]
    eq_params = SamplingParams(max_tokens=args.eq_tokens, temperature=0.0, ignore_eos=True)
    for dtype_name, tdtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        if dtype_name == "float32":
            del eng, hf
            free_memory()
            eng = engine_for("float32")
            hf = load_hf(tmp, torch.float32, device)
        ours = [o.token_ids for o in eng.generate(eq_prompts, eq_params)]
        ref = [hf_generate(hf, [p], args.eq_tokens, device)[0] for p in eq_prompts]
        same = sum(a == b for x, y in zip(ours, ref) for a, b in zip(x, y))
        total = sum(len(y) for y in ref)
        divs = [first_divergence(x, y) for x, y in zip(ours, ref)]
        eq[dtype_name] = dict(prompts=len(eq_prompts), tokens_each=args.eq_tokens,
                              positional_match=same / total, identical_sequences=sum(d is None for d in divs),
                              first_divergence=divs)
        print(f"greedy equality {dtype_name}: {sum(d is None for d in divs)}/{len(divs)} identical, "
              f"positional match {same / total:.1%}, first divergence per prompt {divs}", flush=True)
        logits[f"pdserve_{dtype_name}"] = [pdserve_last_logits(eng, p) for p in eq_prompts]
        with torch.inference_mode():
            logits[f"hf_{dtype_name}"] = [hf(torch.tensor([p], device=device)).logits[0, -1].float().cpu()
                                          for p in eq_prompts]
    ref_l = logits["hf_float32"]
    acc = {}
    for k in ("pdserve_bfloat16", "hf_bfloat16", "pdserve_float32"):
        errs = [((a - r).norm() / r.norm()).item() for a, r in zip(logits[k], ref_l)]
        agree = sum(int(a.argmax() == r.argmax()) for a, r in zip(logits[k], ref_l))
        acc[k] = dict(median_rel_err=statistics.median(errs), max_rel_err=max(errs), argmax_agree=agree)
    margins = [(lambda t: (t[0] - t[1]).item())(r.topk(2).values) for r in ref_l]
    acc["hf_fp32_top1_margin_median"] = statistics.median(margins)
    acc["hf_fp32_logit_std_median"] = statistics.median(r.std().item() for r in ref_l)
    eq["prefill_logits_vs_hf_fp32"] = acc
    print(f"last-position prefill logits vs HF fp32: {json.dumps(acc)}", flush=True)
    res["equality"] = eq
    del eng, hf
    free_memory()
    return res


def _start_ray(device: torch.device) -> None:
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=1 if device.type == "cuda" else 0, include_dashboard=False,
             _node_ip_address="127.0.0.1", object_store_memory=128 << 20, log_to_driver=True)


async def _generate(cluster, prompt: list[int], params) -> tuple[list[int], str | None]:
    toks, err = [], None
    async for out in cluster.generate(prompt, params):
        toks += out.new_token_ids
        err = out.error or err
    return toks, err


def _by_pool(stats: list, pool: str):
    (s,) = [x for x in stats if x.pool == pool]
    return s


def _hist_count(h: dict) -> int:
    return sum(h.get("counts", ()))


@section("cluster")
def bench_cluster(args, device: torch.device) -> dict:
    """The Ray cluster on ONE GPU: colocated, then disaggregated 1P1D (both workers on the same GPU,
    num_gpus 0.4 each, KV staged through host memory); then hand-off vs prefill on longer prompts."""
    import ray

    res: dict = {}
    _start_ray(device)
    try:
        try:
            res.update(_cluster_tokens(args, device))
        except Exception as e:  # noqa: BLE001 - the hand-off workload still runs
            print(traceback.format_exc(), flush=True)
            res["tokens"] = dict(exception=f"{type(e).__name__}: {e}")
        try:
            res["handoff"] = _cluster_handoff(args, device)
        except Exception as e:  # noqa: BLE001
            print(traceback.format_exc(), flush=True)
            res["handoff"] = dict(exception=f"{type(e).__name__}: {e}")
    finally:
        ray.shutdown()
    bad = [k for k, r in res.items() if isinstance(r, dict) and ("exception" in r or r.get("errors")
                                                                  or not all(r.get("equal", [True])))]
    bad += [f"handoff {r['prompt_tokens']}" for r in res.get("handoff", {}).get("rows", []) if r["errors"]]
    if bad:  # the section ran to its end; its table lines say what failed
        RESULTS["errors"]["cluster"] = f"failed parts: {bad}"
    return res


def _cluster_tokens(args, device: torch.device) -> dict:
    import asyncio

    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from router.cluster import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-tiny-"))
    shape = build_hf_checkpoint(tmp, True, 0.3)
    cache = CacheConfig(block_size=16, num_blocks=256)
    sched = SchedulerConfig(max_num_batched_tokens=64)
    engine = EngineConfig(model=str(tmp), dtype="float32", device=str(device), cache=cache, scheduler=sched)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, shape["vocab_size"], (n,), generator=g).tolist() for n in (5, 40, 100, 17)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)] * 2
    ref = [c.token_ids for c in LLMEngine(engine).generate(prompts, params)]
    gpus = 0.4 if device.type == "cuda" else 0.0
    res = {}

    async def run(mode: str) -> dict:
        pool = PoolConfig(1, num_cpus=0.5, num_gpus=gpus, cache=cache, scheduler=sched)
        pools = dict(colocated=pool) if mode == "colocated" else dict(prefill=pool, decode=pool)
        cfg = ClusterConfig(engine=engine, mode=mode, **pools,
                            transfer_timeout_s=args.transfer_timeout, max_retries=0)
        cluster = Cluster(cfg)
        t = time.perf_counter()
        await asyncio.wait_for(cluster.start(), 180)
        started = time.perf_counter() - t
        try:
            got = await asyncio.wait_for(asyncio.gather(*(_generate(cluster, p, sp) for p, sp in zip(prompts, params))),
                                         4 * args.transfer_timeout + 60)
            stats = await asyncio.wait_for(cluster.stats(), 30)
        finally:
            await asyncio.wait_for(cluster.shutdown(), 60)
        out = dict(start_s=started, equal=[g[0] == r for g, r in zip(got, ref)],
                   errors=[g[1] for g in got if g[1]])
        line = (f"cluster {mode}: start {started:.1f} s, tokens equal to offline {out['equal']}, "
                f"errors {out['errors'][:2]}")
        if mode == "disaggregated":
            d = _by_pool(stats, "decode")
            h, n = d.handoff, _hist_count(d.handoff)
            out.update(handoff_count=n, handoff_sum_s=h.get("sum", 0.0),
                       handoff_mean_s=h["sum"] / n if n else float("nan"), handoff_hist=h,
                       transfer=d.transfer)
            line += (f"; hand-off (decode worker's histogram) count {n}, mean "
                     f"{out['handoff_mean_s'] * 1e3:.2f} ms (sum/count)")
        print(line, flush=True)
        return out

    for mode in ("colocated", "disaggregated"):
        try:
            res[mode] = asyncio.run(run(mode))
        except Exception as e:  # noqa: BLE001
            print(traceback.format_exc(), flush=True)
            res[mode] = dict(exception=f"{type(e).__name__}: {e}")
    return res


def _cluster_handoff(args, device: torch.device) -> dict:
    """Disaggregated 1P1D on one GPU, longer prompts one at a time: hand-off vs prefill step per request."""
    import asyncio

    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
    from pdserve.engine.sampling import SamplingParams
    from router.cluster import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-hf-"))
    shape = build_hf_checkpoint(tmp, args.small, args.init_range)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    lengths = args.handoff_lengths
    cache = CacheConfig(memory_bytes=int(args.handoff_kv_gib * GiB))
    engine = EngineConfig(model=str(tmp), dtype=dtype, device=str(device), cache=cache)
    gpus = 0.4 if device.type == "cuda" else 0.0
    prefill = PoolConfig(1, num_cpus=0.5, num_gpus=gpus, cache=cache,
                         scheduler=SchedulerConfig(max_num_batched_tokens=max(lengths)))  # a prompt: one step
    decode = PoolConfig(1, num_cpus=0.5, num_gpus=gpus, cache=cache)
    cfg = ClusterConfig(engine=engine, mode="disaggregated", prefill=prefill, decode=decode,
                        transfer_timeout_s=args.transfer_timeout, max_retries=0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rng = random.Random(11)
    res: dict = dict(checkpoint="random SmolLM2-135M shape" if not args.small else "random tiny llama",
                     dtype=dtype, shape=shape, max_tokens=8, rows=[])

    async def run() -> None:
        cluster = Cluster(cfg)
        await asyncio.wait_for(cluster.start(), 180)
        try:
            for n in lengths:
                handoffs, steps, kv_bytes, errors = [], [], [], []
                for rep in range(args.handoff_reps + 1):  # the first is a warm-up
                    prompt = [rng.randrange(3, shape["vocab_size"]) for _ in range(n)]  # no prefix-cache hits
                    before = await asyncio.wait_for(cluster.stats(), 30)
                    toks, err = await asyncio.wait_for(_generate(cluster, prompt, params), 2 * args.transfer_timeout + 60)
                    after = await asyncio.wait_for(cluster.stats(), 30)
                    if err or len(toks) != params.max_tokens:
                        errors.append(err or f"{len(toks)} tokens")
                        continue
                    d0, d1 = _by_pool(before, "decode"), _by_pool(after, "decode")
                    p0, p1 = _by_pool(before, "prefill"), _by_pool(after, "prefill")
                    landed = _hist_count(d1.handoff) - _hist_count(d0.handoff)
                    assert landed == 1, f"{landed} hand-offs observed for one request"
                    if rep:
                        handoffs.append(d1.handoff["sum"] - d0.handoff["sum"])
                        steps.append(p1.busy_seconds - p0.busy_seconds)
                        kv_bytes.append(d1.transfer.get("bytes", 0) - d0.transfer.get("bytes", 0))
                row = dict(prompt_tokens=n, requests=len(handoffs), handoff_s=handoffs, prefill_step_s=steps,
                           kv_bytes=kv_bytes, errors=errors)
                if handoffs:
                    row.update(handoff_mean_s=statistics.mean(handoffs), prefill_step_mean_s=statistics.mean(steps),
                               handoff_over_step=statistics.mean(handoffs) / statistics.mean(steps),
                               kv_bytes_per_request=statistics.mean(kv_bytes))
                    print(f"hand-off {n} tokens: {len(handoffs)} requests, hand-off mean "
                          f"{row['handoff_mean_s'] * 1e3:.2f} ms {[round(x * 1e3, 2) for x in handoffs]}, prefill step "
                          f"mean {row['prefill_step_mean_s'] * 1e3:.2f} ms {[round(x * 1e3, 2) for x in steps]}, "
                          f"hand-off/step {row['handoff_over_step']:.2f}, KV {row['kv_bytes_per_request'] / 2**20:.1f} "
                          f"MiB/request, errors {errors[:2]}", flush=True)
                else:
                    print(f"hand-off {n} tokens: no request completed; errors {errors[:2]}", flush=True)
                res["rows"].append(row)
        finally:
            await asyncio.wait_for(cluster.shutdown(), 60)

    asyncio.run(run())
    return res


# --- experiments: what a fix would give, by monkeypatching in this process only ------------------

def _lower_right_prefill_attention(orig):
    """_prefill_attention with the chunked-prefill mask expressed as torch's causal_lower_right bias
    (flash/cuDNN-eligible) instead of a dense boolean mask."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    def attn(q, k_new, v_new, kv_layer, blocks, ctx_len, scale):
        q_len = q.shape[0]
        if ctx_len == q_len:
            return orig(q, k_new, v_new, kv_layer, blocks, ctx_len, scale)
        kv_heads, _, block_size, head_dim = kv_layer.shape[1:]
        n = -(-ctx_len // block_size)
        k = kv_layer[0].index_select(1, blocks[:n]).view(kv_heads, n * block_size, head_dim)[:, :ctx_len]
        v = kv_layer[1].index_select(1, blocks[:n]).view(kv_heads, n * block_size, head_dim)[:, :ctx_len]
        rep = q.shape[1] // kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # [heads, ctx_len, head_dim]
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=causal_lower_right(q_len, ctx_len), scale=scale)
        return o.squeeze(0).transpose(0, 1)
    return attn


@section("checksum")
def bench_checksum(args, device: torch.device) -> dict:
    """The KV checksum (pdserve.transfer.protocol.kv_checksum, --kv-checksum) against moving the same bytes: a
    transfer computes it on both ends, so the cost is twice one sum. Default off unless this is < 5 %."""
    from pdserve.transfer.protocol import kv_checksum

    layers, kv_heads, head_dim, block = (30, 3, 64, 16) if args.small else (32, 8, 128, 16)
    out = {}
    for tokens in (512, 2048):
        kv = torch.randn(layers, 2, kv_heads, tokens // block, block, head_dim, device=device).to(torch.bfloat16)
        dst = torch.empty_like(kv)
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=device.type == "cuda")
        reps = 5 if args.small else 20
        sum_s = statistics.median(event_time(lambda: kv_checksum(kv), device, reps))
        copy_s = statistics.median(event_time(lambda: dst.copy_(kv), device, reps))
        d2h_s = statistics.median(event_time(lambda: host.copy_(kv, non_blocking=True), device, reps))
        row = dict(mb=kv.nbytes / 1e6, sum_ms=sum_s * 1e3, d2d_copy_ms=copy_s * 1e3, d2h_copy_ms=d2h_s * 1e3,
                   two_sums_over_d2h=2 * sum_s / d2h_s)
        print(f"{tokens:>6} tokens {row['mb']:8.1f} MB: sum {row['sum_ms']:.3f} ms, device copy "
              f"{row['d2d_copy_ms']:.3f} ms, to host {row['d2h_copy_ms']:.3f} ms; two sums / host copy "
              f"{row['two_sums_over_d2h']:.1%}", flush=True)
        out[tokens] = row
    return out


@section("experiments")
def experiments(args, device: torch.device, peaks: dict | None) -> dict:
    import pdserve.model.attention as A

    res: dict = {}
    core = getattr(args, "_core", None) or make_core(args, device, args.prefill_tokens, prefix_caching=False)
    model, kv = core.runner.model, core.runner.kv_cache
    rng = random.Random(7)
    # x1: the decode forward (model only, no scheduling/sampling) eager vs replayed from a CUDA graph.
    rows = []
    for b in args.batches:
        try:
            reqs = add_requests(core, b, args.context, 4000, rng)
            run_prefill_until_decoding(core, reqs)
            core.step()
            st = core.scheduler.schedule()
            input_ids, positions, meta = core.runner._prepare(sorted(st.chunks, key=lambda c: c.start))
            with torch.inference_mode():
                fwd = lambda: model(input_ids, positions, meta, kv)  # noqa: E731 - rewrites the same slots
                eager = statistics.median(event_time(fwd, device, reps=10, warmup=3))
                row = dict(batch=b, eager_forward_s=eager)
                if device.type == "cuda":
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(3):
                            fwd()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        fwd()
                    row["graph_forward_s"] = statistics.median(event_time(graph.replay, device, reps=20, warmup=3))
                    del graph
            rows.append(row)
            print(f"x1 batch {b}: decode forward eager {eager * 1e3:.2f} ms, CUDA graph replay "
                  f"{row.get('graph_forward_s', float('nan')) * 1e3:.2f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            print(traceback.format_exc(), flush=True)
            rows.append(dict(batch=b, error=f"{type(e).__name__}: {e}"))
        finally:
            core.cancel_all()
    res["cuda_graph_decode_forward"] = rows
    # x2: chunked prefill attention with causal_lower_right instead of a boolean mask.
    try:
        orig = A._prefill_attention
        new = _lower_right_prefill_attention(orig)
        cfg = core.model_config
        g = torch.Generator(device=device).manual_seed(0)
        q_len, ctx = (args.prefill_tokens - 192, 2 * args.prefill_tokens - 192)
        bs = core.config.cache.block_size
        nb = -(-ctx // bs)
        layer = torch.randn(2, cfg.num_kv_heads, nb + 3, bs, cfg.head_dim, device=device, generator=g,
                            dtype=core.config.torch_dtype)
        blocks = torch.randperm(nb + 3, device=device, generator=g)[:nb]
        q = torch.randn(q_len, cfg.num_heads, cfg.head_dim, device=device, generator=g, dtype=layer.dtype)
        scale = cfg.head_dim ** -0.5
        a = orig(q, None, None, layer, blocks, ctx, scale).float()
        b_ = new(q, None, None, layer, blocks, ctx, scale).float()
        rel = ((a - b_).norm() / a.norm()).item()
        t_orig = statistics.median(event_time(lambda: orig(q, None, None, layer, blocks, ctx, scale), device, 5))
        t_new = statistics.median(event_time(lambda: new(q, None, None, layer, blocks, ctx, scale), device, 5))
        res["lower_right_prefill_attention"] = dict(q_len=q_len, ctx_len=ctx, rel_err_vs_current=rel,
                                                    current_s_per_layer=t_orig, lower_right_s_per_layer=t_new)
        print(f"x2 chunked prefill attention {q_len} q x {ctx} ctx, one layer: current {t_orig * 1e3:.3f} ms, "
              f"causal_lower_right {t_new * 1e3:.3f} ms, rel diff {rel:.2e}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(traceback.format_exc(), flush=True)
        res["lower_right_prefill_attention"] = dict(error=f"{type(e).__name__}: {e}")
    return res


def table() -> str:
    s, lines = RESULTS["sections"], []
    env = RESULTS.get("env", {})
    lines.append(f"device: {env.get('device_name')}  torch {env.get('torch')}  cuda {env.get('cuda')}  "
                 f"transformers {env.get('transformers')}")
    p = s.get("peaks")
    if p:
        lines.append(f"copy bandwidth (read+write, {p['copy_bytes'] / GiB:.1f} GiB moved): "
                     f"{p['copy_bw_read_plus_write'] / 1e12:.3f} TB/s;  {p['matmul_n']}^3 {p['matmul_dtype']} matmul: "
                     f"{p['matmul_flops'] / 1e12:.1f} TFLOP/s")
    d = s.get("decode")
    if d:
        lines.append(f"(a) decode, {d['model']} {d['dtype']} dummy weights, EngineCore.step(); weights read/step "
                     f"{d['weight_bytes'] / 1e9:.2f} GB, KV {d['kv_bytes_per_token'] / 1024:.0f} KiB/token")
        lines.append(f"    {'batch':>5} {'ctx':>5} {'step ms':>9} {'floor ms':>9} {'floor/step':>10} "
                     f"{'tok/s':>9} {'KV GB/step':>10} {'prep ms':>8} {'GPU ms':>7} {'busy':>6}")
        for r in d["rows"]:
            lines.append(f"    {r['batch']:5d} {r['context_mid']:5d} {r['step_s'] * 1e3:9.2f} {r['floor_s'] * 1e3:9.2f} "
                         f"{r['floor_over_step']:10.1%} {r['tokens_per_s']:9.1f} {r['kv_bytes'] / 1e9:10.3f} "
                         f"{r['host_prep_s'] * 1e3:8.2f} "
                         + (f"{r['busy']['gpu_s_per_step'] * 1e3:7.2f} {r['busy']['busy_vs_unprofiled']:6.1%}"
                            if r.get("busy") else f"{'-':>7} {'-':>6}"))
        lines.append("    prep ms: scheduler.schedule() + ModelRunner._prepare() alone (host). GPU ms: union of GPU "
                     "kernel/memcpy intervals per step (torch.profiler); busy = GPU ms / step ms.")
        for r in d["rows"]:
            b = r.get("busy")
            if b:
                lines.append(f"(b) GPU busy at batch {r['batch']}: kernels {b['gpu_s_per_step'] * 1e3:.2f} ms/step "
                             f"(union of GPU op intervals, torch.profiler) / profiled wall "
                             f"{b['profiled_wall_s'] / b['steps'] * 1e3:.2f} ms/step = {b['busy_profiled']:.1%}; "
                             f"/ unprofiled step {r['step_s'] * 1e3:.2f} ms = {b['busy_vs_unprofiled']:.1%}")
        hf = {r["batch"]: r for r in (s.get("hf_decode") or {}).get("rows", [])}
        lines.append(f"    by mode (step ms; x floor = step / weight+KV read floor): {'batch':>5} "
                     + " ".join(f"{n:>22}" for n, _, _ in BUSY_MODES) + f" {'transformers':>22}")
        for r in d["rows"]:
            cells = []
            for name, _, _ in BUSY_MODES:
                m = (r.get("modes") or {}).get(name, {})
                cells.append(f"{m['step_s'] * 1e3:9.2f} ({m['step_s'] / r['floor_s']:5.2f}x fl)" if "step_s" in m
                             else f"{m.get('skipped', m.get('error', '-'))[:22]:>22}")
            h = hf.get(r["batch"])
            cells.append(f"{h['step_s'] * 1e3:9.2f} ({h['step_s'] / r['floor_s']:5.2f}x fl)" if h else f"{'-':>22}")
            lines.append(f"    {'':58}{r['batch']:5d} " + " ".join(f"{c:>22}" for c in cells))
            m = (r.get("modes") or {}).get(TORCH_OPS_MODE)
            if m and "step_s" in m:
                lines.append(f"    {'':58}{r['batch']:5d} {TORCH_OPS_MODE}: {m['step_s'] * 1e3:.2f} ms "
                             f"({m['step_s'] / r['floor_s']:.2f}x floor)")
            for name, m in (r.get("modes") or {}).items():
                if "busy_vs_unprofiled" in m:
                    lines.append(f"    busy at batch {r['batch']}, {name:17}: GPU {m['gpu_s_per_step'] * 1e3:7.2f} ms/step of "
                                 f"{m['step_s'] * 1e3:7.2f} = {m['busy_vs_unprofiled']:6.1%} "
                                 f"(profiled wall: {m['busy_profiled']:6.1%})")
    pf = s.get("prefill")
    if pf:
        lines.append(f"(c) prefill {pf['tokens']} tokens: {pf['step_s'] * 1e3:.2f} ms, {pf['model_flops'] / 1e12:.2f} "
                     f"TFLOP (step_flops) -> {pf['achieved_flops'] / 1e12:.1f} TFLOP/s = MFU {pf['mfu_vs_matmul']:.1%} "
                     f"of the measured matmul ({pf['matmul_flops'] / 1e12:.1f} TFLOP/s)")
        sc = pf.get("second_chunk")
        if sc:
            lines.append(f"    second chunk of a {sc['start'] + sc['tokens']}-token prompt ({sc['tokens']} tokens after "
                         f"{sc['start']} cached, masked SDPA): {sc['step_s'] * 1e3:.2f} ms -> "
                         f"{sc['achieved_flops'] / 1e12:.1f} TFLOP/s = {sc['mfu_vs_matmul']:.1%}")
    o = s.get("offline")
    if o:
        lines.append(f"(d) offline, {o['checkpoint']}, bf16, {o['num_prompts']} prompts "
                     f"({o['prompt_tokens']} prompt tokens) x {o['output_len']} output tokens, greedy:")
        lines.append(f"    pdserve LLMEngine {o['pdserve_s']:.2f} s = {o['pdserve_tok_s']:.0f} output tok/s;  "
                     f"transformers generate {o['hf_s']:.2f} s = {o['hf_tok_s']:.0f} tok/s;  "
                     f"pdserve/HF {o['speedup']:.2f}x")
        for k, e in o["equality"].items():
            if k == "prefill_logits_vs_hf_fp32":
                lines.append("    last-position prefill logits vs HF fp32 (rel. L2 error median/max, argmax agree): " + "; ".join(
                    f"{n} {v['median_rel_err']:.2e}/{v['max_rel_err']:.2e} {v['argmax_agree']}/{o['equality']['bfloat16']['prompts']}"
                    for n, v in e.items() if isinstance(v, dict))
                    + f"; HF fp32 top-1 margin median {e['hf_fp32_top1_margin_median']:.3f}, logit std "
                      f"{e['hf_fp32_logit_std_median']:.3f}")
                continue
            lines.append(f"    greedy equality {k}: {e['identical_sequences']}/{e['prompts']} sequences identical "
                         f"over {e['tokens_each']} tokens; positional match {e['positional_match']:.1%}; "
                         f"first divergence {e['first_divergence']}")
    x = s.get("experiments")
    if x:
        for r in x.get("cuda_graph_decode_forward", []):
            if "error" in r:
                lines.append(f"(x1) batch {r['batch']}: CUDA graph experiment FAILED {r['error']}")
            else:
                lines.append(f"(x1) decode forward only (model, no scheduler/sampler), batch {r['batch']}: eager "
                             f"{r['eager_forward_s'] * 1e3:.2f} ms, CUDA-graph replay "
                             f"{r.get('graph_forward_s', float('nan')) * 1e3:.2f} ms")
        r = x.get("lower_right_prefill_attention", {})
        if "error" in r:
            lines.append(f"(x2) causal_lower_right prefill attention FAILED {r['error']}")
        elif r:
            lines.append(f"(x2) chunked-prefill attention, one layer, {r['q_len']} q x {r['ctx_len']} ctx: boolean mask "
                         f"{r['current_s_per_layer'] * 1e3:.3f} ms vs causal_lower_right "
                         f"{r['lower_right_s_per_layer'] * 1e3:.3f} ms (rel diff {r['rel_err_vs_current']:.1e})")
    c = s.get("cluster")
    if c:
        for mode in ("colocated", "disaggregated", "tokens"):
            r = c.get(mode)
            if not r:
                continue
            if "exception" in r:
                lines.append(f"(e) cluster {mode} on one GPU: FAILED {r['exception']}")
                continue
            lines.append(f"(e) cluster {mode} on one GPU (tiny fp32, 4 prompts x 12 tokens): start {r['start_s']:.1f} s; "
                         f"tokens equal to offline {sum(r['equal'])}/{len(r['equal'])}; errors: {r['errors'][:2]}")
            if "handoff_count" in r:
                lines.append(f"    hand-off (first token sampled on P -> KV usable on D): count {r['handoff_count']}, "
                             f"mean {r['handoff_mean_s'] * 1e3:.2f} ms (sum/count)")
        h = c.get("handoff")
        if h and "exception" in h:
            lines.append(f"(f) hand-off vs prefill, disaggregated 1P1D on one GPU: FAILED {h['exception']}")
        elif h:
            lines.append(f"(f) hand-off vs prefill, disaggregated 1P1D on one GPU, {h['checkpoint']}, {h['dtype']}, one "
                         f"request at a time, max_tokens {h['max_tokens']}:")
            lines.append(f"    {'prompt':>6} {'reqs':>4} {'hand-off ms':>11} {'prefill step ms':>15} {'hand-off/step':>13} "
                         f"{'KV MiB/req':>10}  errors")
            for r in h["rows"]:
                if "handoff_mean_s" in r:
                    lines.append(f"    {r['prompt_tokens']:6d} {r['requests']:4d} {r['handoff_mean_s'] * 1e3:11.2f} "
                                 f"{r['prefill_step_mean_s'] * 1e3:15.2f} {r['handoff_over_step']:13.2f} "
                                 f"{r['kv_bytes_per_request'] / 2**20:10.1f}  {r['errors'][:2]}")
                else:
                    lines.append(f"    {r['prompt_tokens']:6d} {0:4d} {'-':>11} {'-':>15} {'-':>13} {'-':>10}  {r['errors'][:2]}")
            lines.append("    hand-off: delta of the decode worker's WorkerStats.handoff sum per request (mean over "
                         "requests); prefill step: delta of the prefill worker's busy_seconds per request.")
    for k, v in RESULTS["errors"].items():
        lines.append(f"FAILED {k}: {v}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes: a smoke test of every section")
    ap.add_argument("--sections", default="peaks,decode,prefill,hf_decode,offline,cluster,checksum,experiments")
    ap.add_argument("--json", default=None)
    ap.add_argument("--transfer-timeout", type=float, default=10.0, help="cluster section: KV transfer timeout")
    ap.add_argument("--handoff-lengths", type=int, nargs="+", default=None,
                    help="cluster section: prompt lengths of the hand-off workload (default 512 2048; --small 64 256)")
    ap.add_argument("--handoff-reps", type=int, default=None, help="requests per length after a warm-up (4; --small 2)")
    args = ap.parse_args()
    small = args.small
    args.model = "smollm2-135m" if small else "llama3-8b"
    args.dtype = "bfloat16"
    args.kv_gib = 0.25 if small else 18.0
    args.batches = [1, 8] if small else [1, 8, 64]
    args.busy_batch = 8 if small else 64
    args.context = 64 if small else 512
    args.warmup, args.steps, args.profile_steps = (1, 3, 2) if small else (5, 20, 10)
    args.prefill_tokens = 256 if small else 4096
    args.prefill_reps = 1 if small else 5
    args.hf_new_tokens = (2, 6) if small else (4, 36)
    args.init_range = 0.1
    args.num_prompts = 4 if small else 64
    args.min_len, args.max_len = (16, 48) if small else (128, 512)
    args.output_len = 8 if small else 128
    # transformers one prompt at a time is host-bound (~0.1 s a token on the H200's host): 4 x 32 tokens a dtype.
    args.eq_prompts, args.eq_tokens = (2, 8) if small else (4, 32)
    args.offline_kv_gib = 0.05 if small else 4.0
    args.handoff_lengths = args.handoff_lengths or ([64, 256] if small else [512, 2048])
    args.handoff_reps = args.handoff_reps or (2 if small else 4)
    args.handoff_kv_gib = 0.05 if small else 1.0

    device = torch.device(args.device)
    RESULTS["env"] = env = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                                device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                                small=small)
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    print(json.dumps(env), flush=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the default; stated so fp32 equality means fp32
    else:
        # The CPU smoke run's dummy bf16 weights can drive activations denormal, and a CPU step on
        # denormals was seen 50x slower (1.2 s instead of 25 ms at batch 8); flushed to zero here only.
        torch.set_flush_denormal(True)
    wanted = args.sections.split(",")
    peaks = measure_peaks(device, small) if "peaks" in wanted else None
    if "decode" in wanted:
        bench_decode(args, device, peaks)
    if "prefill" in wanted:
        bench_prefill(args, device, peaks)
    if "experiments" in wanted:
        experiments(args, device, peaks)
    if hasattr(args, "_core"):
        del args._core
        free_memory()
    if "hf_decode" in wanted:
        bench_hf_decode(args, device, peaks)
    if "offline" in wanted:
        bench_offline(args, device)
    if "cluster" in wanted:
        bench_cluster(args, device)
    if "checksum" in wanted:
        bench_checksum(args, device)
    # The CPU kernels must not have been built or loaded by a CUDA run.
    from pdserve.kernels import cpu_kernels
    env["cpu_attention_loaded"] = cpu_kernels._loaded or cpu_kernels._failed
    if device.type == "cuda":
        env["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GiB
    text = table()
    print("\n" + "=" * 100 + "\n" + text + f"\nCPU kernels touched: {env['cpu_attention_loaded']}")
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_bench.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=1, default=str))
    sys.exit(1 if RESULTS["errors"] else 0)


if __name__ == "__main__":
    main()
