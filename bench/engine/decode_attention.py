"""CPU decode attention: the torch path vs the C++ kernel (pdserve.kernels.cpu_attention), per layer and per step.

    .venv/bin/python -m bench.engine.decode_attention [--reps 300] [--steps 24] [--seed 0] [--skip-engine]

Part 1, one layer's decode attention for SmolLM2-135M shapes (9 heads, 3 KV heads, head_dim 64, fp32,
16-token blocks) at batch 1, 8 and 32, context lengths uniform in [100, 600], block ids shuffled.
Rows are sorted and split into padded groups exactly as the runner does (group_by_length), and one
timed call is what paged_attention runs for one layer: every group through _decode_attention. The
cache has 30 layers and successive calls walk through them, so K/V come from memory as in a real step,
not from the last call's L3. Columns: torch path and kernel with the runner's groups; the same with
one group padded to the longest row (what group_by_length saves each of them). Median microseconds
over --reps calls, the paths interleaved call by call.

Part 3 (#51), a verification's k + 1 = 5 positions of one sequence, contexts 256 to 8192 tokens: as decode rows,
each attending up to itself (what the runner does, pdserve.engine.runner.decode_rows), against the prefill path
(_prefill_attention: the context gathered, then SDPA over the 5 queries). Median microseconds per layer, the
two interleaved call by call, walking the layers.

Part 2, whole engine decode steps: LLMEngine with the default EngineConfig() (the default model), batch
1 and 32, prompts of random lengths in [16, 512]. Prefill runs first (not timed); then --steps decode
steps (schedule + forward + sampling + bookkeeping), alternating kernel and torch path step by step
(PDSERVE_CPU_ATTENTION is read at every call), so both see the same contexts. Median milliseconds.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from bench.common import Table
from pdserve.engine.runner import group_by_length
from pdserve.kernels import cpu_attention, cpu_kernels
from pdserve.model.attention import _decode_attention, _prefill_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16  # SmolLM2-135M
SCALE = HEAD_DIM ** -0.5


def use_kernel(on: bool) -> None:
    os.environ[cpu_attention.ENV_VAR] = "auto" if on else "torch"


def make_batch(batch: int, rng: random.Random):
    lens = sorted(rng.randint(100, 600) for _ in range(batch))
    used = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(used)
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables, start = [], 0
    for n in used:
        tables.append(perm[start:start + n])
        start += n
    cache = torch.randn(LAYERS, 2, KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
    q = torch.randn(batch, HEADS, HEAD_DIM)

    def groups(spans):
        out = []
        for a, b in spans:
            bt = torch.zeros(b - a, used[b - 1], dtype=torch.int64)
            for i in range(a, b):
                bt[i - a, : used[i]] = torch.tensor(tables[i])
            out.append((a, b, bt, torch.tensor(lens[a:b])))
        return out

    return q, cache, groups(group_by_length(used)), groups([(0, batch)]), lens


def time_layer(q, cache, groups, layer: int) -> float:
    out = torch.empty_like(q)
    t = time.perf_counter()
    for a, b, bt, cl in groups:
        _decode_attention(q[a:b], cache[layer], bt, cl, SCALE, out=out[a:b])
    return time.perf_counter() - t


def bench_layers(reps: int, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    print(f"## Part 1: one layer of decode attention (SmolLM2 shapes, contexts uniform 100-600, "
          f"{torch.get_num_threads()} threads), median us over {reps} calls")
    table = Table(("batch", 5, ""), ("groups", 6, ""), ("torch", 9, ".1f"), ("kernel", 9, ".1f"), ("speedup", 7, ""),
                  ("|", 1, ""), ("torch 1grp", 10, ".1f"), ("kernel 1grp", 11, ".1f"), ("max|diff|", 9, ".1e"))
    print(table.header())
    for batch in (1, 8, 32):
        q, cache, grouped, single, _ = make_batch(batch, rng)
        variants = {("torch", "g"): grouped, ("kernel", "g"): grouped,
                    ("torch", "1"): single, ("kernel", "1"): single}
        times = {k: [] for k in variants}
        for k, groups in variants.items():  # warm up (and build the kernel) outside the timing
            use_kernel(k[0] == "kernel")
            time_layer(q, cache, groups, 0)
        layer = 0
        for _ in range(reps):
            for k, groups in variants.items():
                use_kernel(k[0] == "kernel")
                times[k].append(time_layer(q, cache, groups, layer))
                layer = (layer + 1) % LAYERS
        out = {}
        for path in ("torch", "kernel"):
            use_kernel(path == "kernel")
            o = torch.empty_like(q)
            for a, b, bt, cl in grouped:
                _decode_attention(q[a:b], cache[0], bt, cl, SCALE, out=o[a:b])
            out[path] = o
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        diff = (out["torch"] - out["kernel"]).abs().max().item()
        speedup = f"{med['torch', 'g'] / med['kernel', 'g']:>6.2f}x"
        print(table.row(batch, len(grouped), med["torch", "g"], med["kernel", "g"], speedup, "|", med["torch", "1"],
                        med["kernel", "1"], diff))


def bench_verification(reps: int, rows: int = 5) -> None:
    print(f"\n## Part 3: a verification's {rows} positions of one sequence, one layer (SmolLM2 shapes, "
          f"{torch.get_num_threads()} threads), median us over {reps} calls")
    table = Table(("context", 7, ""), ("decode rows", 11, ".0f"), ("prefill path", 12, ".0f"), ("ratio", 7, ""),
                  ("max|diff|", 9, ".1e"))
    print(table.header())
    for ctx in (256, 1024, 4096, 8192):
        blocks = -(-ctx // BLOCK_SIZE)
        cache = torch.randn(LAYERS, 2, KV_HEADS, blocks, BLOCK_SIZE, HEAD_DIM)
        table_ids = torch.randperm(blocks)
        q = torch.randn(rows, HEADS, HEAD_DIM)
        tables, lens = table_ids.repeat(rows, 1), torch.arange(ctx - rows + 1, ctx + 1)
        # The new keys and values are in the cache already (the runner writes them before attending).
        slots = table_ids[(lens - 1) // BLOCK_SIZE] * BLOCK_SIZE + (lens - 1) % BLOCK_SIZE
        k_new = cache[:, 0].flatten(2, 3)[:, :, slots].transpose(1, 2)  # [layers, rows, kv_heads, head_dim]
        v_new = cache[:, 1].flatten(2, 3)[:, :, slots].transpose(1, 2)
        paths = {"decode": lambda i: _decode_attention(q, cache[i], tables, lens, SCALE),
                 "prefill": lambda i: _prefill_attention(q, k_new[i], v_new[i], cache[i], table_ids, ctx, SCALE)}
        times = {k: [] for k in paths}
        for i in range(reps):
            for name, f in paths.items():
                t = time.perf_counter()
                f(i % LAYERS)
                times[name].append(time.perf_counter() - t)
        diff = (paths["decode"](0) - paths["prefill"](0)).abs().max().item()
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        print(table.row(ctx, med["decode"], med["prefill"], f"{med['prefill'] / med['decode']:>6.2f}x", diff))


def bench_engine(steps: int, seed: int) -> None:
    from pdserve.config import EngineConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig())
    vocab = engine.model_config.vocab_size
    print(f"\n## Part 2: engine decode step, default model, {torch.get_num_threads()} threads, "
          f"median ms over {steps} steps per path")
    table = Table(("batch", 5, ""), ("mean ctx", 8, ".0f"), ("groups", 6, ""), ("torch ms", 9, ".1f"),
                  ("kernel ms", 9, ".1f"), ("speedup", 7, ""))
    print(table.header())
    rng = random.Random(seed)
    for batch in (1, 32):
        params = SamplingParams(max_tokens=2 * steps + 8, temperature=0.0, ignore_eos=True)
        rids = [engine.add_request([rng.randrange(vocab) for _ in range(rng.randint(16, 512))], params)
                for _ in range(batch)]
        timed = {True: [], False: []}
        groups = 0
        warm = 2  # decode steps per path before timing
        i = 0
        while engine.has_unfinished and min(len(v) for v in timed.values()) < steps:
            step = engine.scheduler.schedule()
            decode = len(step.chunks) == batch and all(len(c.token_ids) == 1 for c in step.chunks)
            on = i % 2 == 0
            use_kernel(on)
            t = time.perf_counter()
            result = engine.runner.execute(step.chunks)
            engine.process(engine.core.account(step, result))
            dt = time.perf_counter() - t
            if decode:
                i += 1
                if i > 2 * warm:
                    timed[on].append(dt)
                ctx = statistics.mean(c.start + 1 for c in step.chunks)
                groups = len(group_by_length(sorted(-(-(c.start + 1) // BLOCK_SIZE) for c in step.chunks)))
        for rid in rids:
            engine.abort(rid)
        t_torch, t_kernel = (statistics.median(timed[k]) * 1e3 for k in (False, True))
        print(table.row(batch, ctx, groups, t_torch, t_kernel, f"{t_torch / t_kernel:>6.2f}x"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    t = time.perf_counter()
    if not cpu_attention.available():
        raise SystemExit("the CPU attention kernel did not build; see the warning above")
    print(f"kernel ready in {time.perf_counter() - t:.1f} s (build or load), cache {cpu_kernels.build_directory()}")
    bench_layers(args.reps, args.seed)
    bench_verification(min(args.reps, 100))
    if not args.skip_engine:
        bench_engine(args.steps, args.seed)


if __name__ == "__main__":
    main()
