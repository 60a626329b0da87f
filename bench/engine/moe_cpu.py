"""A mixture-of-experts decode step against its memory-read floor and against transformers, same checkpoint,
same machine, one run; and prefill tokens/s.

    .venv/bin/python -m bench.engine.moe_cpu [--experts 32] [--top-k 4] [--hidden 512] [--moe-intermediate 512]
                                             [--layers 4] [--batches 1 32] [--steps 16] [--prefill-len 512]

The checkpoint is a seeded random Qwen3-MoE of the given shape (transformers' own config class, saved to a
temporary directory), fp32. The floor of a decode step is the bytes it must read, over this machine's memory
bandwidth measured in the same run (the best of 5 sums over a 1 GiB fp32 tensor): attention and norms of
every layer, the LM head, each layer's router, and the experts the batch's tokens touched in that step
(counted from pdserve's routing, per layer), each read once. A step's time is the median of --steps
decode-only steps of pdserve's engine (continuous batching, paged cache) with --batch requests running;
transformers' is the median of as many single-token forwards of the same batch with its KV cache. Last, one
expert's matmul over 1..128 rows through the CPU kernel and through F.linear (where the experts switch).
"""
from __future__ import annotations

import inspect
import statistics
import tempfile
import time

import torch

from bench.common import Table, parser, read_bandwidth


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=512)
    args = ap.parse_args()

    import transformers

    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from pdserve.model.moe import MoE

    torch.set_num_threads(torch.get_num_threads())
    tmp = tempfile.mkdtemp(prefix="pdserve-moe-bench-")
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True,
        max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp)
    engine = LLMEngine(EngineConfig(model=tmp, cache=CacheConfig(block_size=16, num_blocks=1024),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=256)))
    cfg = engine.model_config
    bw = read_bandwidth()
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    dense_bytes = (cfg.num_params - cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size
                   * cfg.moe_intermediate_size - cfg.vocab_size * cfg.hidden_size) * 4  # all but experts, embedding
    print(f"Qwen3-MoE shape: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts of "
          f"{cfg.moe_intermediate_size}, top {cfg.num_experts_per_tok}; {cfg.num_params / 1e6:.0f}M parameters "
          f"({cfg.num_active_params / 1e6:.0f}M active a token), fp32; memory bandwidth {bw / 1e9:.1f} GB/s "
          f"({torch.get_num_threads()} threads)")

    touched: list[int] = []
    forward = MoE.forward

    def counting(self, x):  # the experts each MoE layer's tokens chose, this step
        touched.append(int(torch.unique(self.route(x)[1]).numel()))
        return forward(self, x)

    g = torch.Generator().manual_seed(1)

    def decode(prompts: list[list[int]], count: bool) -> tuple[list[float], list[float]]:
        """Decode-only steps of the prompts running together: each step's seconds, and (count) the mean over
        layers of the experts its tokens touched (counting routes again: those steps are not the timed ones)."""
        MoE.forward = counting if count else forward
        params = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # the prefills
        times, per_step = [], []
        while engine.has_unfinished and len(times) < args.steps:
            touched.clear()
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            per_step.append(sum(touched) / max(len(touched), 1))
        while engine.has_unfinished:
            engine.step()
        MoE.forward = forward
        return times, per_step

    t = Table(("batch", 5, "d"), ("experts touched", 15, ".1f"), ("floor ms", 8, ".2f"), ("pdserve ms", 10, ".2f"),
              ("of floor", 8, ".2f"), ("transformers ms", 15, ".2f"), ("hf / ours", 9, ".2f"))
    print(t.header())
    for batch in args.batches:
        prompts = [torch.randint(0, cfg.vocab_size, (16,), generator=g).tolist() for _ in range(batch)]
        times, _ = decode(prompts, count=False)
        _, per_step = decode([p[::-1] for p in prompts], count=True)
        mean_touched = statistics.mean(per_step)
        floor = (dense_bytes + cfg.num_layers * mean_touched * expert_bytes) / bw
        ours = statistics.median(times)
        # transformers: the same batch, one token a forward with its KV cache.
        ids = torch.tensor(prompts)
        hf_times = []
        # The cache's keyword: `cache` since transformers 5.x renamed it, `past_key_values` before.
        kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        with torch.no_grad():
            out = hf(ids, use_cache=True)
            past, nxt = getattr(out, kw), out.logits[:, -1:].argmax(-1)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                out = hf(nxt, use_cache=True, **{kw: past})
                hf_times.append(time.perf_counter() - t0)
                past, nxt = getattr(out, kw), out.logits[:, -1:].argmax(-1)
        theirs = statistics.median(hf_times)
        print(t.row(batch, mean_touched, 1e3 * floor, 1e3 * ours, ours / floor, 1e3 * theirs, theirs / ours))

    prompt = torch.randint(0, cfg.vocab_size, (args.prefill_len,), generator=g).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=1))  # warm
    t0 = time.perf_counter()
    engine.generate([prompt[::-1]], SamplingParams(max_tokens=1))
    ours = time.perf_counter() - t0
    with torch.no_grad():
        hf(torch.tensor([prompt]))
        t0 = time.perf_counter()
        hf(torch.tensor([prompt[::-1]]))
        theirs = time.perf_counter() - t0
    print(f"prefill of {args.prefill_len} tokens: pdserve {args.prefill_len / ours:.0f} tok/s, transformers "
          f"{args.prefill_len / theirs:.0f} tok/s ({theirs / ours:.2f}x)")
    expert_matmul_rows(cfg.hidden_size, cfg.moe_intermediate_size)


def expert_matmul_rows(hidden: int, inter: int) -> None:
    """One expert's gate/up matmul over n rows: the CPU kernel (pdserve.model.linear.linear) against F.linear,
    median of 200 (bench.engine.linear_rows measures the dense shapes that pdserve.model.linear.KERNEL_MAX_ROWS
    is set from)."""
    import torch.nn.functional as F

    from pdserve.model.linear import linear

    w = torch.randn(2 * inter, hidden)
    t = Table(("rows", 5, "d"), ("kernel us", 9, ".1f"), ("F.linear us", 11, ".1f"), ("F.linear / kernel", 17, ".2f"))
    print(t.header())
    for n in (1, 4, 8, 16, 32, 64, 128):
        x = torch.randn(n, hidden)
        times = []
        for fn in (lambda: linear(x, w), lambda: F.linear(x, w)):
            for _ in range(20):
                fn()
            samples = []
            for _ in range(200):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            times.append(statistics.median(samples) * 1e6)
        print(t.row(n, times[0], times[1], times[1] / times[0]))


if __name__ == "__main__":
    main()
