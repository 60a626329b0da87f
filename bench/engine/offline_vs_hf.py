"""Offline engine vs Hugging Face transformers generate(), same checkpoint, same machine, one run.

    .venv/bin/python -m bench.engine.offline_vs_hf [--model PATH] [--num-prompts 32] [--min-len 16]
                                                   [--max-len 512] [--output-len 128]

Prompts are seeded random token ids of uniformly drawn lengths; every request produces exactly
--output-len tokens (EOS ignored) so both sides do the same work. transformers runs all prompts as
one left-padded batch (its best throughput). Batch-1 decode step time is (t(1 + n tokens) - t(1 token)) / n
for both. Prints one table and the ratios.
"""
from __future__ import annotations

import os
import random
import time

import torch

from bench.common import Table, add_prompt_args, hf_generate, load_hf, parser


def main() -> None:
    ap = parser(__doc__)
    add_prompt_args(ap, max_len=512, output_len=128)
    ap.add_argument("--decode-steps", type=int, default=64, help="tokens timed for the batch-1 step time")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from pdserve.config import EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from pdserve.model.loader import resolve_format

    path, fmt = resolve_format(args.model, "auto")
    engine = LLMEngine(EngineConfig(model=path, scheduler=SchedulerConfig(max_num_seqs=max(64, args.num_prompts))))
    hf, hf_name = load_hf(path, fmt), os.path.basename(path)

    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    special = set(engine.eos_token_ids) | {0, 1, 2}
    prompts = [[t for t in (rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len)))]
               for _ in range(args.num_prompts)]
    prompts = [[t if t not in special else 100 for t in p] for p in prompts]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    # Warm both up once (first-call allocations, thread pools).
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    hf_generate(hf, [prompts[0][:16]], 2)

    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    ours_s = time.perf_counter() - t0
    assert all(len(o.token_ids) == args.output_len for o in outs)
    t0 = time.perf_counter()
    hf_generate(hf, prompts, args.output_len)
    hf_s = time.perf_counter() - t0

    n = args.decode_steps
    p1 = prompts[0][:128]
    ours_step = (timed(lambda: engine.generate([p1], SamplingParams(max_tokens=1 + n, temperature=0.0, ignore_eos=True)))
                 - timed(lambda: engine.generate([p1], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))) / n
    hf_step = (timed(lambda: hf_generate(hf, [p1], 1 + n)) - timed(lambda: hf_generate(hf, [p1], 1))) / n

    out_tokens = args.num_prompts * args.output_len
    in_tokens = sum(map(len, prompts))
    print(f"model: {hf_name}  fp32  threads={torch.get_num_threads()}  prompts={args.num_prompts} "
          f"(lengths {args.min_len}-{args.max_len}, {in_tokens} prompt tokens)  output_len={args.output_len}")
    t = Table(("", 28, "<"), ("pdserve", 12, ".1f"), ("transformers", 14, ".1f"), ("ratio", 8, ".2f"), sep="")
    print(t.header())
    print(t.row("batch wall time (s)", f"{ours_s:.2f}", f"{hf_s:.2f}", hf_s / ours_s))
    print(t.row("output tokens/s", out_tokens / ours_s, out_tokens / hf_s, hf_s / ours_s))
    print(t.row("batch-1 decode step (ms)", ours_step * 1e3, hf_step * 1e3, hf_step / ours_step))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
