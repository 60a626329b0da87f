"""An agentic multi-turn workload through the OpenAI API (the openai SDK), against `pdserve serve` on this machine.

Sessions of several turns, a few at a time: each turn sends the whole conversation so far (a system prompt
every session shares, the earlier turns, the model's own replies) plus a new tool output, and asks for a
short reply (greedy). Printed: median TTFT by turn; the prompt tokens the workers computed against those
requested and against those new to the cluster (what no earlier turn or reply held); the KV bytes the
hand-offs moved against the new tokens' KV; prefix-cache hits by pool; local prefills and the KV blocks they
kept from moving; with --check, every reply against
the offline engine's for the same conversation.

    python -m bench.cluster.agentic                               # this checkout, 2P2D SmolLM2
    python -m bench.cluster.agentic --root ../wt-old --label old  # another checkout's pdserve, the same load
    python -m bench.cluster.agentic --serve-args "--local-prefill-max-tokens 0"
"""
from __future__ import annotations

import asyncio
import json
import random
import shlex
import statistics
import time
from pathlib import Path

from bench.common import ROOT, Server, parser, pool_sums, run_header, write_json

WORDS = ("the system reads a value from the store and returns it to the caller with a status code that says "
         "whether the request succeeded or failed because of a timeout a missing key an invalid argument or a "
         "server error which the agent then uses to decide what to do next in its plan").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Workload:
    """The sessions' conversations, and what of each request was new to the cluster."""

    def __init__(self, args, tokenizer):
        rng = random.Random(args.seed)
        self.args, self.tok = args, tokenizer
        self.system = words(rng, args.system_words)
        self.first = [f"Task {i}: plan the next steps with the tools. " + words(rng, 20) for i in range(args.sessions)]
        self.tools = [[f"Tool output {t}: " + words(rng, args.tool_words) for t in range(args.turns)]
                      for _ in range(args.sessions)]
        self.seen: list[list[int]] = []  # every prompt and prompt + reply the cluster has had
        self.new_tokens = 0
        self.requested = 0

    def messages(self, s: int, replies: list[str]) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}, {"role": "user", "content": self.first[s]}]
        for t, reply in enumerate(replies):
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": self.tools[s][t]}]
        return msgs

    def think(self, s: int, t: int) -> float:
        """Seconds session s waits after turn t (its tool call): --think, or uniform up to --think-max, the same
        in every run of a seed."""
        hi = max(self.args.think, self.args.think_max or 0.0)
        return random.Random(f"{self.args.seed}/{s}/{t}").uniform(self.args.think, hi)

    def count(self, msgs: list[dict], reply_ids: list[int]) -> list[int]:
        ids = self.tok.apply_chat_template(msgs)
        self.new_tokens += len(ids) - max((common_prefix(ids, x) for x in self.seen), default=0)
        self.requested += len(ids)
        self.seen += [ids, ids + reply_ids]
        return ids


async def session(client, work: Workload, s: int, model: str, ttft: dict[int, list[float]],
                  transcripts: list) -> None:
    replies: list[str] = []
    for t in range(work.args.turns):
        msgs = work.messages(s, replies)
        t0 = time.perf_counter()
        first, text = None, []
        stream = await client.chat.completions.create(model=model, messages=msgs, max_tokens=work.args.max_tokens,
                                                      temperature=0.0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - t0
                text.append(chunk.choices[0].delta.content)
        reply = "".join(text)
        ttft[t].append(first if first is not None else time.perf_counter() - t0)
        work.count(msgs, work.tok.encode(reply))
        transcripts.append((msgs, reply))
        replies.append(reply)
        await asyncio.sleep(work.think(s, t))


async def drive(args, server: Server, work: Workload) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0)
    model = (await client.models.list()).data[0].id
    ttft: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    transcripts: list = []
    gate = asyncio.Semaphore(args.concurrency)

    async def one(s: int) -> None:
        async with gate:
            await session(client, work, s, model, ttft, transcripts)

    before = server.metrics_page()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(s) for s in range(args.sessions)))
    wall = time.perf_counter() - t0
    after = server.metrics_page()

    def delta(name: str) -> dict[str, float]:
        a, b = pool_sums(after, name), pool_sums(before, name)
        return {k: a[k] - b.get(k, 0.0) for k in a}
    returning = [x for t, v in ttft.items() if t > 0 for x in v]
    return dict(wall_s=wall, ttft_by_turn={t: statistics.median(v) for t, v in ttft.items()},
                ttft_returning=statistics.median(returning) if returning else None,
                computed=delta("pdserve_worker_prompt_tokens_computed"), kv_bytes=delta("pdserve_kv_transfer_bytes"),
                hits=delta("pdserve_worker_prefix_cache_hit_blocks"),
                queries=delta("pdserve_worker_prefix_cache_query_blocks"),
                local_prefills=delta("pdserve_worker_local_prefills"),
                handoff_blocks=delta("pdserve_kv_handoff_blocks"),
                avoided_blocks=delta("pdserve_kv_handoff_avoided_blocks"), transcripts=transcripts)


def check(transcripts: list, model: str | None, max_tokens: int) -> int:
    """Replies that differ from the offline engine's for the same conversation."""
    from pdserve.config import EngineConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(model=model))
    tok = eng.core.tokenizer
    bad = 0
    for msgs, reply in transcripts:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        out = eng.generate([tok.apply_chat_template(msgs)], params)[0]
        bad += out.text != reply
    return bad


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--tool-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--think", type=float, default=0.0, help="seconds between a reply and the next turn (a tool)")
    ap.add_argument("--think-max", type=float, default=None,
                    help="think times drawn uniformly from --think to this (seeded: the same in every run)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--serve-args", default="--prefill-workers 2 --decode-workers 2")
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose pdserve serves (side by side runs)")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--check", action="store_true", help="every reply against the offline engine's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    head = run_header()
    from pdserve.config import EngineConfig
    from pdserve.model.loader import load_info

    info = load_info(EngineConfig(model=args.model))
    kv_per_token = info.config.num_layers * 2 * info.config.num_kv_heads * info.config.head_dim * 4  # fp32 KV
    work = Workload(args, info.tokenizer)
    serve = shlex.split(args.serve_args) + (["--model", args.model] if args.model else [])
    log = Path(f"/tmp/agentic-{args.label.replace(' ', '_')}.log")
    server = Server(serve, log, http=True, root=Path(args.root))
    try:
        server.wait_ready(workers=4, timeout=600)
        res = asyncio.run(drive(args, server, work))
    finally:
        server.stop()
    computed = sum(res["computed"].values())
    moved = sum(res["kv_bytes"].values())
    print(f"\n{args.label}: {args.sessions} sessions x {args.turns} turns, {args.concurrency} at a time, "
          f"{args.max_tokens} tokens a reply; serve {args.serve_args}; {res['wall_s']:.1f} s")
    print("median TTFT by turn: " + ", ".join(f"{v * 1e3:.0f}" for v in res["ttft_by_turn"].values()) + " ms"
          + (f"; returning turns {res['ttft_returning'] * 1e3:.0f} ms" if res["ttft_returning"] is not None else ""))
    print(f"prompt tokens computed {computed:.0f} of {work.requested} requested ({computed / work.requested:.2f}); "
          f"{computed / work.new_tokens:.2f}x the {work.new_tokens} tokens new to the cluster")
    print(f"KV moved {moved / 1e6:.1f} MB: {moved / (work.new_tokens * kv_per_token):.2f}x the new tokens' KV "
          f"({kv_per_token / 1e3:.1f} KB a token)")
    print("prefix-cache hits by pool: " + ", ".join(f"{p} {res['hits'].get(p, 0):.0f}/{q:.0f} blocks"
                                                   for p, q in res["queries"].items()))
    if res["local_prefills"]:  # a checkout whose decode workers count them
        print(f"local prefills {sum(res['local_prefills'].values()):.0f}; KV blocks handed off "
              f"{sum(res['handoff_blocks'].values()):.0f}, not moved {sum(res['avoided_blocks'].values()):.0f}")
    if args.check:
        bad = check(res["transcripts"], args.model, args.max_tokens)
        print(f"replies equal to the offline engine's: {len(res['transcripts']) - bad} of {len(res['transcripts'])}")
        res["replies_differing"] = bad
    res.update(head, new_tokens=work.new_tokens, requested=work.requested, kv_bytes_per_token=kv_per_token)
    res.pop("transcripts")
    if args.json:
        write_json(args.json, res)
    print(json.dumps({k: v for k, v in res.items() if k in ("ttft_by_turn", "ttft_returning")}))


if __name__ == "__main__":
    main()
