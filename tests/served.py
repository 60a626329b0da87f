"""A real local Ray cluster behind the real gRPC router, greedy streams through it from a real client,
and the offline engine's answers to check them against: what the cluster tests share."""
from __future__ import annotations

import asyncio
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import ray
import torch

from pdserve.client import AsyncClient
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.serving.messages import CancelRecord, WorkerStats
from router.cluster import Cluster
from router.compose import build_router
from router.config import RouterConfig

from conftest import wait_for


def tiny_1p1d(path, batched_tokens: int = 256, num_blocks: int = 256, **cluster) -> ClusterConfig:
    """The tiny checkpoint at `path` on one prefill and one decode worker of a quarter CPU each (4-token blocks),
    with ClusterConfig's other settings as given."""
    engine = EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=batched_tokens))
    return ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.25), decode=PoolConfig(1, num_cpus=0.25),
                         **cluster)


class Routers:
    """Routers over one started cluster, each with its RouterConfig settings (port 0), all stopped at close();
    routes: HTTP control routes (path: handler, POST) added before a router starts."""

    def __init__(self, aloop, cluster: Cluster):
        self.aloop, self.cluster, self.started = aloop, cluster, []

    def start(self, routes=None, **settings):
        r = build_router(self.cluster, RouterConfig(port=0, **settings))
        for path, fn in (routes or {}).items():
            r.http_control.add_api_route(path, fn, methods=["POST"])
        self.aloop.run(r.start())
        self.started.append(r)
        return r

    def close(self) -> None:
        for r in self.started:
            self.aloop.run(r.stop(grace=2))


class Served:
    """A cluster behind a gRPC router, with the offline engine's answers for its prompts."""

    def __init__(self, aloop, config: ClusterConfig, router: RouterConfig | None = None):
        self.aloop = aloop
        self.cluster = Cluster(config)
        aloop.run(self.cluster.start(), timeout=600)
        self.router = build_router(self.cluster, router or RouterConfig(port=0))
        aloop.run(self.router.start())
        self.target = f"127.0.0.1:{self.router.port}"
        self.sizes = {name: pool.num_workers for name, pool in config.pools.items()}
        self.offline = LLMEngine(config.engine)

    def reference(self, batch, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [c.token_ids for c in self.offline.generate(batch, params)]

    def worker(self, pool: str, index: int = 0):
        return self.cluster.pools[pool][index]

    def stats(self):
        return self.aloop.run(self.cluster.stats())

    @staticmethod
    def stats_of(worker) -> WorkerStats:
        """One worker's stats (those of the others are not waited for: one may be held at a fault point)."""
        return ray.get(worker.handle.stats.remote(), timeout=30)

    def pid(self, worker) -> int:
        return self.stats_of(worker).pid

    def settle(self) -> None:
        """Pools back to size, no KV block used anywhere, no KV channel kept to a worker that is gone."""
        wait_for(lambda: all(len(self.cluster.pools[p]) == n for p, n in self.sizes.items()), timeout=120,
                 what="the pools to be back to their configured size")
        wait_for(lambda: sum(s.kv_blocks_used for s in self.stats()) == 0, timeout=60,
                 what="zero used KV blocks on every worker")
        wait_for(lambda: all(s.kv_peers <= len(self.cluster.pools["decode" if s.pool == "prefill" else "prefill"])
                             for s in self.stats()), timeout=30, what="no KV channel kept to a lost worker")

    def close(self) -> None:
        self.aloop.run(self.router.stop(grace=5))
        self.aloop.run(self.cluster.shutdown())


def prompts(n, seed=21):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (int(torch.randint(4, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@dataclass
class Outcome:
    tokens: list[int]
    code: grpc.StatusCode
    details: str


class Streams:
    """Greedy streams through the gRPC router, started at once; progress is readable while they run."""

    def __init__(self, served: Served, batch, max_tokens: int):
        self.served, self.batch, self.max_tokens = served, batch, max_tokens
        self.progress = [0] * len(batch)
        self.future = asyncio.run_coroutine_threadsafe(self._run(), served.aloop.loop)

    async def _run(self) -> list[Outcome]:
        async with AsyncClient(self.served.target) as c:
            return await asyncio.gather(*(self._one(c, i, p) for i, p in enumerate(self.batch)))

    async def _one(self, c: AsyncClient, i: int, prompt) -> Outcome:
        tokens: list[int] = []
        try:
            async for r in c.generate(token_ids=prompt, max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True,
                                      timeout=300):
                tokens += r.token_ids
                self.progress[i] = len(tokens)
        except grpc.aio.AioRpcError as e:
            return Outcome(tokens, e.code(), e.details())
        return Outcome(tokens, grpc.StatusCode.OK, "")

    def wait_progress(self, at_least: int, timeout: float = 60) -> None:
        wait_for(lambda: min(self.progress) >= at_least or self.future.done(), timeout,
                 what=f"every stream to have {at_least} tokens")
        assert not self.future.done(), "the streams ended before the fault"

    def result(self, bound_s: float, since: float, what: str = "") -> list[Outcome]:
        """Every stream's outcome; the last must have ended within bound_s of `since` (a fault, say)."""
        out = self.future.result(bound_s + 30)
        elapsed = time.monotonic() - since
        assert elapsed < bound_s, f"{what}: the last stream ended {elapsed:.1f} s after {since:.1f}"
        return out


@contextmanager
def streams_in_flight(served: Served, batch, max_tokens: int, pool: str = "decode"):
    """Streams started with the pool's first worker held at its first step: inside the block they are
    surely in flight (each has its first token and none has ended, however slow this machine is); the
    worker goes on when the block ends."""
    worker = served.worker(pool)
    ray.get(worker.handle.inject_fault.remote("step", math.inf, 1, 0))
    try:
        streams = Streams(served, batch, max_tokens)
        assert ray.get(worker.handle.fault_reached.remote("step", 60)), f"the {pool} worker took no step"
        streams.wait_progress(1)
        yield streams
    finally:
        ray.get(worker.handle.release_fault.remote("step"))
        ray.get(worker.handle.disarm_fault.remote("step"))


def assert_exact(outcomes: list[Outcome], reference: list[list[int]]) -> None:
    assert [(o.code, o.details) for o in outcomes] == [(grpc.StatusCode.OK, "")] * len(outcomes)
    assert [o.tokens for o in outcomes] == reference  # nothing lost, repeated or skipped


# How many steps a worker may take between a client's cancel and the request leaving its batch, while the
# router hears of the cancel and calls the worker (measured here: 0 to 2 steps, both models): about 0.1 s of
# the tiny model's steps (~5 ms each on 2 cores), 0.1 to 0.25 s of SmolLM2's (30 to 60 ms).
CANCEL_WITHIN_STEPS = 24
CANCEL_WITHIN_STEPS_SMOL = 4


class CancelWatch:
    """Whether a client's cancel reached a worker, and when, from the worker's own record of what the cancel
    did (WorkerActor.recent_cancels): not from the client's status, nor from KV freed within a wait that
    the request's own end would fit in. Its methods are coroutines (any loop); make it before the client
    cancels."""

    def __init__(self, worker, cancelled: int, seen: set[str]):
        self.worker, self.cancelled, self.seen = worker, cancelled, seen
        self.step_at_cancel: int | None = None

    @classmethod
    async def of(cls, worker) -> CancelWatch:
        """worker: a router.pools.Worker."""
        stats, recent = await asyncio.gather(worker.handle.stats.remote(), worker.handle.recent_cancels.remote())
        return cls(worker, stats.cancelled, {r.request_id for r in recent})

    async def client_cancelled(self) -> None:
        """Read the worker's step count: call it right after the client's cancel."""
        self.step_at_cancel = (await self.worker.handle.stats.remote()).steps

    async def arrived(self, max_tokens: int, request_id: str | None = None, within_steps: int = CANCEL_WITHIN_STEPS,
                      timeout: float = 30.0) -> CancelRecord:
        """The record of the cancel that ended a request here (the attempt `request_id`, worker-side, if given;
        else the one new record), asserting that the worker counted it, that the request left its batch
        within `within_steps` steps of the client's cancel, and that it had produced well under the
        `max_tokens` it asked for (so it did not simply run to its end)."""
        deadline = time.monotonic() + timeout
        while True:
            new = [r for r in await self.worker.handle.recent_cancels.remote()
                   if r.request_id not in self.seen and (request_id is None or r.request_id == request_id)]
            if new:
                break
            assert time.monotonic() < deadline, \
                f"{self.worker.worker_id} recorded no cancel of {request_id or 'a request'} in {timeout:g} s"
            await asyncio.sleep(0.05)
        assert len(new) == 1, new
        record = new[0]
        assert (await self.worker.handle.stats.remote()).cancelled > self.cancelled
        assert record.output_tokens < max_tokens // 4, f"{record}: it was not cancelled, it ran ({max_tokens} asked)"
        assert self.step_at_cancel is not None, "client_cancelled() was not called"
        late = record.step - self.step_at_cancel
        assert late <= within_steps, f"{record}: left {late} steps after the client's cancel (at {self.step_at_cancel})"
        return record


def mixed_params(n, max_tokens):
    """Half greedy, half seeded sampling."""
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i, ignore_eos=True)
            for i in range(n)]


def logprob_params(n, max_tokens):
    """Requests that ask for logprobs in every way, with penalties: greedy raw with the top 5 and the
    prompt's; seeded sampling in processed mode under top-k and penalties; greedy with only the sampled
    token's, min_tokens and a repetition penalty; and one that asks for none."""
    kinds = [
        dict(temperature=0.0, logprobs=5, prompt_logprobs=2),
        dict(temperature=0.8, top_k=20, seed=7, logprobs=3, logprobs_mode="processed", repetition_penalty=1.3,
             presence_penalty=0.4, frequency_penalty=0.3),
        dict(temperature=0.0, logprobs=0, min_tokens=max_tokens, repetition_penalty=1.2),
        dict(temperature=0.7, seed=3, presence_penalty=-0.5),
    ]
    return [SamplingParams(max_tokens=max_tokens, **kinds[i % len(kinds)]) for i in range(n)]


async def collect_logprobs(cluster: Cluster, prompt, params):
    """(tokens, logprobs, prompt logprobs) of a request streamed through the cluster."""
    tokens, logprobs, prompt_logprobs = [], [], None
    async for out in cluster.generate(prompt, params):
        assert out.error is None, out.error
        tokens += out.new_token_ids
        if out.logprobs is not None:
            assert len(out.logprobs) == len(out.new_token_ids)
            logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            assert prompt_logprobs is None, "prompt logprobs came twice"
            prompt_logprobs = out.prompt_logprobs
    return tokens, logprobs if params.logprobs is not None else None, prompt_logprobs


async def collect_group(cluster: Cluster, prompt, params):
    """Per sample of a request of n samples: (tokens, logprobs, text, finish reason), by index."""
    samples = [([], [], [], None) for _ in range(params.n)]
    async for out in cluster.generate(prompt, params):
        assert out.error is None, out.error
        tokens, logprobs, text, _ = samples[out.index]
        assert samples[out.index][3] is None, "a sample streamed after its end"
        tokens += out.new_token_ids
        logprobs += out.logprobs or []
        text.append(out.new_text)
        assert out.num_output_tokens == len(tokens)
        samples[out.index] = (tokens, logprobs, text, out.finish_reason)
    return [(t, lp, "".join(x), r) for t, lp, x, r in samples]


def assert_same_logprobs(got, want, tol=1e-4):
    """Two lists of TokenLogprob (None entries allowed) agree: tokens, ranks and top ids exactly (unless
    two alternatives are within tol of each other), values within tol."""
    assert (got is None) == (want is None)
    if want is None:
        return
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is None:
            continue
        assert g.token_id == w.token_id
        assert abs(g.logprob - w.logprob) <= tol or g.logprob == w.logprob, (g, w)
        assert len(g.top) == len(w.top)
        for (gi, gv), (wi, wv) in zip(g.top, w.top):
            assert abs(gv - wv) <= tol or gv == wv, (g, w)
            assert gi == wi or any(abs(v - wv) <= tol for i, v in w.top if i == gi), (g, w)


async def collect(cluster: Cluster, prompt, params, request_id=None):
    tokens, text, last = [], [], None
    async for out in cluster.generate(prompt, params, request_id):
        tokens += out.new_token_ids
        text.append(out.new_text)
        last = out
    assert last.error is None, last.error
    return tokens, "".join(text), last.finish_reason


async def collect_all(cluster, prompts, params):
    return await asyncio.gather(*(collect(cluster, p, sp) for p, sp in zip(prompts, params)))


async def tokens_of(cluster: Cluster, prompt, params) -> list[int]:
    """A request's output tokens, every output of it checked for an error."""
    tokens = []
    async for out in cluster.generate(prompt, params):
        assert out.error is None, out.error
        tokens += out.new_token_ids
    return tokens


def tier_stats(aloop, cluster: Cluster) -> dict[str, dict]:
    """Each worker's KV tier counters (WorkerStats.kv_offload), by worker id."""
    return {s.worker_id: s.kv_offload for s in aloop.run(cluster.stats())}


def a_turn_pushed_out(aloop, cluster: Cluster, offline, params, seed: int,
                      fillers: int) -> tuple[list[int], list[int], object]:
    """A 40-token conversation's first turn, then `fillers` prompts of 60 tokens through the same worker, so that
    the conversation's blocks leave its cache (for its KV tiers); every reply equal to the offline engine's.
    Returns the conversation, its reply and the generator that drew them, for the next turn's tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    conversation = torch.randint(0, 320, (40,), generator=g).tolist()
    reply = aloop.run(tokens_of(cluster, conversation, params))
    assert reply == offline.generate([conversation], params)[0].token_ids
    for _ in range(fillers):
        filler = torch.randint(0, 320, (60,), generator=g).tolist()
        assert aloop.run(tokens_of(cluster, filler, params)) == offline.generate([filler], params)[0].token_ids
    return conversation, reply, g
