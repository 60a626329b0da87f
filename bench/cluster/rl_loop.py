"""An RL loop against a running cluster, the example and the benchmark: a trainer (this process, torch on CPU)
trains a tiny Llama by policy gradient on rollouts that pdserve samples, pushing its weights after every step;
synchronous and asynchronous (bounded staleness) in one run, same seed, same steps.

    .venv/bin/python -m bench.cluster.rl_loop [--steps 12] [--prompts 8] [--n 4] [--max-tokens 16] [--lr 0.01]
                                              [--modes sync,async-1,async-2] [--seed 0] [--json out.json]

The model is a seeded random tiny Llama (vocab 320, hidden 128, 4 layers) saved to a temporary directory;
a 1P1D cluster serves it on a local Ray cluster, with the gRPC router in this process (each worker and the
trainer on one torch thread: all share this machine's cores). The reward is a TOY, verifiable from token
ids: the fraction of a completion's tokens in GOOD_TOKENS (ids 10 to 19: a few % under the near-uniform
initial model). Each step: B prompts x n seeded samples at temperature 1 (one request of n per prompt, all
at once), group-normalised advantages, the loss -advantage x the sampled tokens' log-probs under the
trainer's current model (teacher-forced on prompt + completion), each token's weighted by the truncated
importance ratio against the logprob pdserve sampled it with; an Adam step; WeightSync.push as the next version.

Modes (each from the initial weights, pushed again as a new version; Adam anew):
- sync: the rollouts of step t are sampled by version t; train, push t + 1, the next rollouts.
- async-K: the rollouts of step t start as soon as version t - K is served, in the background; those of
  steps t + 1 .. t + K are in flight while the trainer trains on step t's, and every token of step t is
  sampled by a version in [t - K, t]. Pushes are "rolling" (each worker switches as soon as it has the
  update: the rollouts in flight wait for no cluster-wide pause) and requests ask version_policy
  "recompute" (a request that meets the new version recomputes its KV with it, so each token is sampled by
  exactly the version it reports, and its logprob is that version's). sync pushes in "pause" mode, with
  nothing in flight.

Per mode: wall seconds (first rollout to last push), output tokens/s over that wall, the cluster's idle
fraction (share of the wall with no rollout request in flight, from this process's request start and end
times), the trainer's idle fraction (waiting for rollouts), seconds in training steps and in pushes, the
staleness seen (the trained version minus each token's weight version), the mean |trainer logprob - pdserve
logprob| over the tokens sampled by the version trained (fp32: ~1e-7 here), and the reward curve (mean
reward per step).
Asserted: every token's version within the mode's bound of the trained version (sync: equal), the pushed
versions strictly increasing.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common import Table, local_cluster, local_router, parser, write_json

GOOD_TOKENS = frozenset(range(10, 20))  # the toy reward's tokens
PROMPT_TOKENS = (20, 320)  # prompts draw from these ids: none of them is good
IS_CAP = 2.0  # the importance ratio's truncation
MODEL = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.02, rms_norm_eps=1e-6,
             tie_word_embeddings=False)


@dataclass(frozen=True)
class Settings:
    steps: int = 12
    prompts: int = 8  # B
    n: int = 4  # samples per prompt
    max_tokens: int = 16
    prompt_len: int = 8
    lr: float = 1e-2
    seed: int = 0


def parse_mode(mode: str) -> int:
    """A mode's staleness bound: sync 0, async-K K."""
    if mode == "sync":
        return 0
    if mode.startswith("async-") and mode[6:].isdigit() and int(mode[6:]) >= 1:
        return int(mode[6:])
    raise ValueError(f"mode must be sync or async-K (K >= 1), got {mode!r}")


def build_policy(directory: str | Path, seed: int = 0):
    """The seeded random tiny Llama, saved as a Hugging Face checkpoint in directory; the model (fp32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def cluster_config(directory: str | Path, max_concurrent_seqs: int = 128):
    """1P1D serving the checkpoint in directory, one torch thread per worker."""
    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig

    engine = EngineConfig(model=str(directory), cache=CacheConfig(block_size=16, num_blocks=1024),
                          scheduler=SchedulerConfig(max_num_seqs=max_concurrent_seqs))
    pool = PoolConfig(1, num_cpus=0.5, torch_threads=1)
    return ClusterConfig(engine=engine, mode="disaggregated", prefill=pool, decode=pool)


def reward(tokens: list[int]) -> float:
    """The toy reward: the fraction of tokens in GOOD_TOKENS."""
    return sum(t in GOOD_TOKENS for t in tokens) / max(len(tokens), 1)


@dataclass
class Request:
    prompt: list[int]
    seed: int
    samples: list | None = None  # pdserve.client Samples, by index
    start: float = 0.0
    end: float = 0.0


def draws(s: Settings) -> list[list[tuple[list[int], int]]]:
    """Per step, per prompt: (prompt, seed); the same for every mode."""
    g = torch.Generator().manual_seed(s.seed)
    return [[(torch.randint(*PROMPT_TOKENS, (s.prompt_len,), generator=g).tolist(),
              int(torch.randint(0, 1 << 40, (1,), generator=g))) for _ in range(s.prompts)] for _ in range(s.steps)]


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end] intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def run_mode(client, sync, model, initial: dict, s: Settings, mode: str, base: int) -> dict:
    """One mode from the initial weights, pushed as version `base` (trainer step t <-> version base + t)."""
    k = parse_mode(mode)
    push_mode = "pause" if k == 0 else "rolling"
    model.load_state_dict(initial)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=s.lr)
    pushed = [sync.push(initial, base, mode="pause").version]
    plan = draws(s)

    def one(req: Request) -> Request:
        req.start = time.perf_counter()
        out = client.complete(token_ids=req.prompt, n=s.n, max_tokens=s.max_tokens, temperature=1.0, seed=req.seed,
                              logprobs=0, ignore_eos=True, version_policy="recompute", timeout=300)
        req.end = time.perf_counter()
        req.samples = out.choices
        return req

    pool = ThreadPoolExecutor(max_workers=(k + 1) * s.prompts, thread_name_prefix="rollout")
    batches: list[list[Future]] = []  # by step

    def launch(served: int) -> None:
        """Start every batch whose gate is open: batch b once trainer version b - k is served."""
        while len(batches) < min(served + k + 1, s.steps):
            batches.append([pool.submit(one, Request(p, seed)) for p, seed in plan[len(batches)]])

    rows, requests = [], []
    t0 = time.perf_counter()
    try:
        launch(0)
        for t in range(s.steps):
            version = base + t
            w0 = time.perf_counter()
            batch = [f.result() for f in batches[t]]
            w1 = time.perf_counter()
            requests += batch
            row = train_step(model, opt, batch, s, version, k)
            w2 = time.perf_counter()
            pushed.append(sync.push(model.state_dict(), version + 1, mode=push_mode).version)
            w3 = time.perf_counter()
            launch(t + 1)
            rows.append(dict(step=t, version=version, **row, wait_s=w1 - w0, train_s=w2 - w1, push_s=w3 - w2))
        wall = time.perf_counter() - t0
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    assert all(a < b for a, b in zip(pushed, pushed[1:])), f"versions not strictly increasing: {pushed}"
    tokens = sum(len(x.token_ids) for r in requests for x in r.samples)
    busy = union_seconds([(max(r.start, t0), r.end) for r in requests])
    stale = torch.tensor([x for r in rows for x in r.pop("staleness")])
    on_version = sum(r["on_version_tokens"] for r in rows)
    gap = sum(r["logprob_gap"] * r["on_version_tokens"] for r in rows) / on_version if on_version else float("nan")
    return dict(mode=mode, staleness_bound=k, push_mode=push_mode, version_policy="recompute", wall_s=wall,
                output_tokens=tokens, output_tokens_per_s=tokens / wall, cluster_idle=1 - busy / wall,
                trainer_idle=sum(r["wait_s"] for r in rows) / wall, train_s=sum(r["train_s"] for r in rows),
                push_s=sum(r["push_s"] for r in rows),
                staleness_max=int(stale.max()), staleness_mean=float(stale.float().mean()),
                staleness_counts={int(v): int((stale == v).sum()) for v in stale.unique()},
                logprob_gap=gap, on_version_tokens=on_version, rewards=[r["reward"] for r in rows],
                versions=pushed, steps=rows)


def train_step(model, opt, batch: list[Request], s: Settings, version: int, k: int) -> dict:
    """One policy-gradient step on a batch trained at `version`; its reward, staleness and logprob figures."""
    samples = [(r.prompt, x) for r in batch for x in r.samples]
    for _, x in samples:
        assert len(x.token_ids) == len(x.weight_versions) == len(x.logprobs) == s.max_tokens, x
        assert all(version - k <= v <= version for v in x.weight_versions), \
            f"a token of versions {x.weight_versions} is trained at version {version}, bound {k}"
    rewards = torch.tensor([reward(x.token_ids) for _, x in samples]).view(len(batch), s.n)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, correction=0, keepdim=True) + 1e-6)).view(-1)
    ids = torch.tensor([p + x.token_ids for p, x in samples])
    completion = ids[:, s.prompt_len:]
    behaviour = torch.tensor([[lp.logprob for lp in x.logprobs] for _, x in samples])
    versions = torch.tensor([x.weight_versions for _, x in samples])
    logits = model(ids).logits[:, s.prompt_len - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, completion[..., None]).squeeze(-1)
    ratio = torch.exp(logp.detach() - behaviour).clamp(max=IS_CAP)
    loss = -(adv[:, None] * ratio * logp).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    current = versions == version
    gap = (logp.detach() - behaviour).abs()[current]
    return dict(reward=float(rewards.mean()), loss=float(loss.detach()),
                staleness=(version - versions).view(-1).tolist(),
                on_version_tokens=int(current.sum()), logprob_gap=float(gap.mean()) if gap.numel() else 0.0,
                mean_ratio=float(ratio.mean()))


def run(target: str, model, s: Settings, modes: list[str]) -> dict:
    """Every mode against the router at target, one after the other, the trainer's model reset to its initial
    weights for each (it ends with the last mode's); first a warm-up (one rollout and one push). Per mode, its
    results (run_mode)."""
    from pdserve.client import Client
    from pdserve.weights.trainer import WeightSync

    for m in modes:
        parse_mode(m)
    initial = {name: t.detach().clone() for name, t in model.state_dict().items()}
    with Client(target) as client, WeightSync(target) as sync:
        version = client.weight_versions(timeout=60).version + 1
        client.complete(token_ids=draws(s)[0][0][0], n=s.n, max_tokens=s.max_tokens, seed=1, logprobs=0,
                        ignore_eos=True, timeout=300)
        sync.push(initial, version)
        results = {}
        for m in modes:
            r = results[m] = run_mode(client, sync, model, initial, s, m, base=version + 1)
            version = r["versions"][-1]
            assert {w.version for w in client.weight_versions(timeout=60).workers} == {version}
    return results


def main() -> None:
    ap = parser(__doc__)
    d = Settings()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--prompts", type=int, default=d.prompts)
    ap.add_argument("--n", type=int, default=d.n)
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--modes", default="sync,async-1,async-2")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        parse_mode(m)
    s = Settings(args.steps, args.prompts, args.n, args.max_tokens, lr=args.lr, seed=args.seed)

    from router.pools import init_local_ray

    torch.set_num_threads(1)  # the trainer's: the two workers take one thread each
    init_local_ray(num_cpus=2)
    with tempfile.TemporaryDirectory(prefix="pdserve-rl-") as tmp:
        model = build_policy(tmp, s.seed)
        concurrent = (max(map(parse_mode, modes)) + 1) * s.prompts * s.n

        async def serve_and_train() -> dict:
            async with local_cluster(cluster_config(tmp, max(128, concurrent))) as cluster, \
                    local_router(cluster) as router:
                return await asyncio.to_thread(run, f"127.0.0.1:{router.port}", model, s, modes)

        results = asyncio.run(serve_and_train())

    print(f"toy reward: the fraction of completion tokens in ids 10..19; {s.steps} steps of {s.prompts} prompts x "
          f"{s.n} samples x {s.max_tokens} tokens, Adam lr {s.lr:g}, seed {s.seed}")
    t = Table(("mode", 8, "<"), ("push", 7, "<"), ("wall s", 7, ".1f"), ("out tok/s", 9, ".1f"),
              ("cluster idle", 12, ".0%"), ("trainer idle", 12, ".0%"), ("train s", 7, ".2f"), ("push s", 7, ".2f"),
              ("stale max", 9, "d"), ("mean", 5, ".2f"), ("lp gap", 8, ".1e"), ("reward 1st", 10, ".3f"),
              ("last", 6, ".3f"))
    print(t.header())
    for r in results.values():
        print(t.row(r["mode"], r["push_mode"], r["wall_s"], r["output_tokens_per_s"], r["cluster_idle"],
                    r["trainer_idle"], r["train_s"], r["push_s"], r["staleness_max"], r["staleness_mean"],
                    r["logprob_gap"], r["rewards"][0], r["rewards"][-1]))
    print("lp gap: mean |trainer logprob - pdserve logprob| over the tokens sampled by the version trained; "
          "version_policy recompute")
    print("reward per step (toy):")
    for r in results.values():
        print(f"  {r['mode']:<8} " + " ".join(f"{x:.3f}" for x in r["rewards"]))
    print("staleness seen (tokens per versions behind):")
    for r in results.values():
        print(f"  {r['mode']:<8} " + ", ".join(f"{v}: {c}" for v, c in sorted(r["staleness_counts"].items())))
    if args.json:
        write_json(args.json, dict(settings=asdict(s), model=MODEL, good_tokens=sorted(GOOD_TOKENS), results=results))


if __name__ == "__main__":
    main()
