"""Offline: pdserve's LLMEngine against transformers' generate() on the same random checkpoint, and their
greedy tokens and last-position logits compared in bf16 and fp32."""
from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import hf_generate as batched_generate
from bench.common import load_hf
from bench.gpu.core import build_hf_checkpoint
from bench.gpu.timing import GiB, free_memory, section, sync


def hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> list[list[int]]:
    """transformers' greedy tokens of each prompt, up to new_tokens (its EOS may end one early)."""
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
    hf = load_hf(tmp, dtype=torch.bfloat16, device=device)
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
            hf = load_hf(tmp, dtype=torch.float32, device=device)
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
