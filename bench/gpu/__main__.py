"""pdserve on one GPU: decode vs the bandwidth floor, GPU busy fraction, prefill MFU, offline vs HF.

    python -m bench.gpu                       # on a CUDA machine: bf16, Llama-3-8B shape (dummy weights)
    .venv/bin/python -m bench.gpu --device cpu --small   # smoke test of every section, tiny shapes
    python -m bench.gpu --sections peaks,decode  # a subset

On the GPU machine (no Ray/gguf there; see ../shared/tools/device-wheels), one call runs everything:
    python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl \
      && export PYTHONPATH=$PWD/.site:$PWD; python3 -m bench.gpu 2>&1 | tee $OUT/log.txt
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
import json
import os
import platform
import sys
from pathlib import Path

import torch

from bench.gpu.checksum import bench_checksum
from bench.gpu.cluster import bench_cluster
from bench.gpu.decode import bench_decode, bench_hf_decode
from bench.gpu.experiments import experiments
from bench.gpu.offline import bench_offline
from bench.gpu.peaks import measure_peaks
from bench.gpu.prefill import bench_prefill
from bench.gpu.table import table
from bench.gpu.timing import GiB, RESULTS, free_memory


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
