"""The cluster: starts the worker pools on Ray and carries each request through them.

Disaggregated path: the request is placed on a prefill worker and, if a token will follow the first,
a decode worker, both at once: the decode worker reserves room for the prompt's KV while the prefill
worker computes it, and the prefill worker pushes the KV there as it is computed (pdserve.handoff).
The first token comes straight back from the prefill worker (TTFT does not wait for the KV); the
decode worker's per-step outputs arrive on its stream, which one task here fans out to the requests.
Colocated path: one worker does both phases and streams all tokens. Text (detokenization, stop
strings) is produced here, once, for both paths.

Faults: a worker that dies is noticed at once (its calls and its stream raise); one that hangs is
noticed when the heartbeat's stats call times out, and is killed. Either way it leaves its pool, its
requests are tried again elsewhere, and a replacement (a new incarnation, under a new id) joins the
pool once it is ready. A request that lost its prefill worker or its KV transfer simply runs again;
one that lost its decode worker resumes (prompt + tokens already streamed are prefilled again, and
the stream continues without repeating or skipping a token) or fails with UNAVAILABLE, by policy.
Each attempt runs under its own worker-side id, so nothing from an abandoned attempt can touch the next.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from decode_worker.actor import DecodeActor
from pdserve.block_pool import hash_prompt_blocks
from pdserve.colocated import ColocatedActor
from pdserve.config import ClusterConfig, PoolConfig
from pdserve.loader import ModelInfo, load_info
from pdserve.messages import DecodeTask, Failure, FailureReason, PrefillTask, StepOutput, TokenEvent, WorkerStats
from pdserve.output import RequestOutput, TextOutput, token_output
from pdserve.request import FinishReason, Request, token_stop_reason, validate_prompt
from pdserve.sampling import SamplingParams
from prefill_worker.actor import PrefillActor
from router.placement import DecodeLoad, PrefillLoad, PrefixIndex, pick_decode, pick_prefill

log = logging.getLogger(__name__)


def init_local_ray(num_cpus: int | None = None, object_store_bytes: int = 128 << 20) -> None:
    """A single-machine Ray cluster on loopback, with a small object store (KV never goes through it)."""
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=object_store_bytes, log_to_driver=False)


@dataclass
class _Worker:
    worker_id: str
    handle: Any
    pool: str
    slot: int  # position in its pool; replacements take the same slot under a new id
    requests: set[str] = field(default_factory=set)  # worker-side ids routed here and not finished
    queued_tokens: int = 0  # prefill: prompt tokens sent and not yet ingested
    stats: WorkerStats | None = None
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(0))  # prefill workers only
    alive: bool = True


class _Retry(Exception):
    def __init__(self, reason: FailureReason, detail: str, workers: Sequence[str] = ()):
        super().__init__(detail)
        self.reason = reason
        self.workers = tuple(workers)  # the attempt's workers: the next attempt avoids them if it can


class Cluster:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.info: ModelInfo | None = None
        self.pools: dict[str, list[_Worker]] = {"prefill": [], "decode": [], "colocated": []}
        self._streams: dict[str, asyncio.Queue[TokenEvent | Failure]] = {}
        self._owner: dict[str, str] = {}  # worker-side id of a live attempt -> its request
        self._tasks: list[asyncio.Task] = []
        self._seed_rng = random.Random(config.engine.seed)
        self.block_size = config.prefill.cache.block_size
        self._incarnations = itertools.count(1)
        self._pool_changed = asyncio.Event()
        # Fault counters, exported as metrics.
        self.restarts: collections.Counter[str] = collections.Counter()  # by pool
        self.retries: collections.Counter[str] = collections.Counter()  # by FailureReason value
        self._closing = False

    @property
    def prefill(self) -> list[_Worker]:
        return self.pools["prefill"]

    @property
    def decode(self) -> list[_Worker]:
        return self.pools["decode"]

    @property
    def colocated(self) -> list[_Worker]:
        return self.pools["colocated"]

    @property
    def workers(self) -> list[_Worker]:
        return [*self.prefill, *self.decode, *self.colocated]

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        # Also builds the model's local caches (dequantized weights, tokenizer) once, before the workers.
        self.info = await asyncio.to_thread(load_info, c.engine)
        sizes = {"colocated": c.colocated.num_workers} if c.mode == "colocated" else \
            {"prefill": c.prefill.num_workers, "decode": c.decode.num_workers}
        starting = [self._spawn(pool, slot, f"{pool}-{slot}") for pool, n in sizes.items() for slot in range(n)]
        await asyncio.gather(*(w.handle.ready.remote() for w in starting))
        for w in starting:
            self.pools[w.pool].append(w)
        await self._poll_stats()
        for w in starting:
            self._watch(w)
        self._tasks.append(asyncio.create_task(self._heartbeat()))

    def _spawn(self, pool: str, slot: int, worker_id: str) -> _Worker:
        c = self.config
        pc: PoolConfig = getattr(c, pool)
        cls, extra = {"prefill": (PrefillActor, dict(transfer_timeout_s=c.transfer_timeout_s)),
                      "decode": (DecodeActor, dict(transfer_timeout_s=c.transfer_timeout_s, bind_host=c.bind_host)),
                      "colocated": (ColocatedActor, {})}[pool]
        actor = ray.remote(cls).options(num_cpus=pc.num_cpus, num_gpus=pc.num_gpus, resources=pc.resources,
                                        max_restarts=0)
        handle = actor.remote(worker_id, c.engine_for(pc), torch_threads=pc.torch_threads, **extra)
        w = _Worker(worker_id, handle, pool, slot)
        if pool == "prefill":
            w.prefix = PrefixIndex(pc.cache.resolve_num_blocks(self.info.config, c.engine.torch_dtype))
        return w

    def _watch(self, w: _Worker) -> None:
        if w.pool in ("decode", "colocated"):
            self._tasks.append(asyncio.create_task(self._consume(w)))

    async def shutdown(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.handle.shutdown.remote() for w in self.workers), return_exceptions=True)
        for w in self.workers:
            ray.kill(w.handle)
        self.pools = {p: [] for p in self.pools}

    async def stats(self) -> list[WorkerStats]:
        """Fresh stats from every worker (one call each)."""
        return list(await asyncio.gather(*(w.handle.stats.remote() for w in self.workers)))

    def worker_stats(self) -> list[WorkerStats]:
        """The latest stats each worker reported (step outputs and the heartbeat); no call is made."""
        return [w.stats for w in self.workers if w.stats is not None]

    async def _poll_stats(self) -> None:
        """The heartbeat: every worker must answer within worker_timeout_s, or it is declared stuck."""
        workers = self.workers
        results = await asyncio.gather(
            *(asyncio.wait_for(w.handle.stats.remote(), self.config.worker_timeout_s) for w in workers),
            return_exceptions=True)
        for w, r in zip(workers, results):
            if isinstance(r, WorkerStats):
                w.stats = r
            elif isinstance(r, (asyncio.TimeoutError, ray.exceptions.RayError)):
                self._lose(w, "stuck: no heartbeat" if isinstance(r, asyncio.TimeoutError) else f"dead: {r}")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await self._poll_stats()

    def _lose(self, w: _Worker, why: str) -> None:
        """Take a dead or stuck worker out of its pool, fail its requests over, start its replacement."""
        if not w.alive or self._closing:
            return
        w.alive = False
        log.warning("worker %s lost (%s); replacing it", w.worker_id, why)
        self.pools[w.pool].remove(w)
        ray.kill(w.handle, no_restart=True)  # a stuck actor must not come back and act on stale requests
        for rid in list(w.requests):
            q = self._streams.get(self._owner.get(rid, ""))
            if q is not None:
                q.put_nowait(Failure(rid, _LOST[w.pool], f"worker {w.worker_id} {why}"))
        self.restarts[w.pool] += 1
        self._tasks.append(asyncio.create_task(self._replace(w)))

    async def _replace(self, lost: _Worker) -> None:
        while not self._closing:
            w = self._spawn(lost.pool, lost.slot, f"{lost.pool}-{lost.slot}.{next(self._incarnations)}")
            try:
                await asyncio.wait_for(w.handle.ready.remote(), self.config.worker_start_timeout_s)
            except Exception as e:  # noqa: BLE001 - try again with a fresh actor
                log.error("replacement %s failed to start: %s", w.worker_id, e)
                ray.kill(w.handle)
                await asyncio.sleep(1.0)
                continue
            self.pools[w.pool].append(w)  # routable only now that it is ready
            self._watch(w)
            self._pool_changed.set()
            self._pool_changed = asyncio.Event()
            log.info("worker %s replaces %s", w.worker_id, lost.worker_id)
            return

    async def _alive(self, pool: str) -> list[_Worker]:
        """The pool's live workers, waiting (bounded) for a replacement if none is left."""
        deadline = asyncio.get_running_loop().time() + self.config.worker_start_timeout_s
        while not self.pools[pool]:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise _Retry(FailureReason.NO_WORKER, f"no {pool} worker is available")
            try:
                await asyncio.wait_for(self._pool_changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return self.pools[pool]

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early cancels it on every worker."""
        info = self.info
        assert info is not None, "start() the cluster first"
        prompt = list(prompt_token_ids)
        validate_prompt(prompt, info.config.vocab_size, info.max_model_len)
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(rid, prompt, params, seed)  # the router's view: tokens streamed so far
        text = TextOutput(info.tokenizer, prompt, params.stop)
        self._streams[rid] = asyncio.Queue()
        failures: collections.Counter[FailureReason] = collections.Counter()
        avoid: tuple[str, ...] = ()
        try:
            for attempt in itertools.count():
                try:
                    # Each attempt has a worker-side id of its own: nothing of an abandoned attempt
                    # can touch the next.
                    async for out in self._attempt(req, text, f"{rid}#{attempt}", avoid):
                        yield out
                    return
                except _Retry as e:
                    failures[e.reason] += 1
                    avoid = e.workers
                    # A failed KV transfer is tried once more; other losses up to max_retries times.
                    limit = 1 if e.reason is FailureReason.TRANSFER_FAILED else self.config.max_retries
                    give_up = failures[e.reason] > limit or (e.reason.loses_the_stream
                                                             and self.config.on_decode_failure == "fail")
                    log.warning("request %s attempt %d failed (%s): %s%s", rid, attempt, e.reason.value, e,
                                "; giving up" if give_up else "; trying again")
                    if give_up:
                        yield RequestOutput(rid, [], "", FinishReason.ERROR, req.num_prompt_tokens,
                                            req.num_output_tokens, error=f"{e} (attempt {attempt + 1})")
                        return
                    self.retries[e.reason.value] += 1
        finally:
            del self._streams[rid]

    async def _attempt(self, req: Request, text: TextOutput, wrid: str,
                       avoid: tuple[str, ...]) -> AsyncIterator[RequestOutput]:
        """One placement of the request, continuing from the tokens already streamed."""
        info = self.info
        q = self._streams[req.request_id]
        while not q.empty():  # failures meant for an earlier attempt
            q.get_nowait()
        self._owner[wrid] = req.request_id  # until the attempt ends: later events of it go nowhere
        task = PrefillTask(wrid, tuple(req.prompt_token_ids), req.params, req.seed, tuple(req.output_token_ids))
        placed: list[_Worker] = []
        finished = False
        try:
            if self.config.mode == "colocated":
                pool = _prefer(await self._alive("colocated"), avoid)
                streamer = pool[pick_decode([self._decode_load(x) for x in pool])]
                placed.append(streamer)
                streamer.requests.add(wrid)
                await self._call(streamer, streamer.handle.generate.remote(task))
            else:
                prefill = _prefer(await self._alive("prefill"), avoid)
                hashes = hash_prompt_blocks(req.token_ids, self.block_size)
                p = prefill[pick_prefill([PrefillLoad(x.queued_tokens, x.prefix.match(hashes) * self.block_size)
                                          for x in prefill])]
                # A decode worker only if a token follows the one the prefill worker samples.
                follows = req.params.max_tokens - req.num_output_tokens > 1 and req.num_tokens + 1 < info.max_model_len
                streamer = None
                if follows:
                    decode = _prefer(await self._alive("decode"), avoid)
                    streamer = decode[pick_decode([self._decode_load(x) for x in decode])]
                placed += [p] + ([streamer] if streamer else [])
                p.prefix.add(hashes)
                p.queued_tokens += req.num_tokens
                p.requests.add(wrid)  # until its KV has reached the decode worker (the first decode token)
                # Both at once: the decode worker reserves room while the prefill worker computes.
                reserved = None
                if streamer is not None:
                    streamer.requests.add(wrid)
                    reserved = streamer.handle.reserve.remote(
                        DecodeTask(wrid, tuple(req.prompt_token_ids), tuple(req.output_token_ids), req.params,
                                   req.seed, p.worker_id), p.handle)
                task = replace(task, kv_destination=streamer.worker_id if streamer else None)
                try:
                    prefilled = p.handle.prefill.remote(task, streamer.handle if streamer else None)
                    if reserved is not None:
                        await self._call(streamer, reserved)
                    result = await self._call(p, prefilled)
                finally:
                    p.queued_tokens -= req.num_tokens
                req.token_ids.append(result.first_token)
                if req.num_output_tokens == 1:
                    req.num_cached_tokens = result.num_cached_tokens
                out = token_output(req, text, result.first_token,
                                   token_stop_reason(req, info.eos_token_ids, info.max_model_len))
                finished = out.finished
                if finished:
                    p.requests.discard(wrid)
                    if streamer is not None:  # e.g. a stop string in the first token: release both sides
                        streamer.requests.discard(wrid)
                        streamer.handle.cancel.remote(wrid)
                        p.handle.cancel.remote(wrid)
                else:
                    assert streamer is not None, "a request with no decode worker ends with its first token"
                yield self._annotate(out, req, placed if finished else [])
            first_decode = True
            while not finished:
                ev = await q.get()
                if isinstance(ev, Failure):
                    if ev.request_id == wrid:
                        raise _Retry(ev.reason, ev.detail, [w.worker_id for w in placed])
                    continue
                if ev.request_id != wrid:
                    continue
                if first_decode and self.config.mode != "colocated":
                    placed[0].requests.discard(wrid)  # the KV has landed: the prefill worker's part is over
                first_decode = False
                req.token_ids.append(ev.token)
                out = token_output(req, text, ev.token, ev.finish_reason)
                finished = out.finished
                if finished and ev.finish_reason is None:
                    streamer.handle.cancel.remote(wrid)  # a stop string ended it; the worker would go on
                yield self._annotate(out, req, placed if finished else [])
        finally:
            self._owner.pop(wrid, None)
            for w in placed:
                w.requests.discard(wrid)
                if not finished and w.alive:
                    w.handle.cancel.remote(wrid)  # a retry, the client went away, or an error: free its KV

    async def _call(self, w: _Worker, ref: Any) -> Any:
        """Await a worker call; a dead worker makes the attempt retry (and the worker be replaced)."""
        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            self._lose(w, f"dead: {type(e).__name__}")
            raise _Retry(_LOST[w.pool], f"worker {w.worker_id} died", [w.worker_id]) from e

    @staticmethod
    def _annotate(out: RequestOutput, req: Request, placed: list[_Worker]) -> RequestOutput:
        out.num_cached_tokens = req.num_cached_tokens
        out.placement = tuple(w.worker_id for w in placed)
        return out

    def _decode_load(self, w: _Worker) -> DecodeLoad:
        s = w.stats
        free = s.kv_blocks_total - s.kv_blocks_used if s else 0
        return DecodeLoad(len(w.requests), free, s.kv_blocks_total if s else 0)

    async def _consume(self, w: _Worker) -> None:
        """Fan one worker's step outputs out to its requests' queues."""
        try:
            async for ref in w.handle.stream.remote():
                out: StepOutput = await ref
                w.stats = out.stats
                for ev in out.events:
                    q = self._streams.get(self._owner.get(ev.request_id, ""))
                    if q is not None:
                        q.put_nowait(ev)
                for f in out.failed:
                    q = self._streams.get(self._owner.get(f.request_id, ""))
                    if q is not None:
                        q.put_nowait(f)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the worker is gone: no request of its may hang
            self._lose(w, f"stream ended: {type(e).__name__}")


_LOST = {"prefill": FailureReason.PREFILL_LOST, "decode": FailureReason.DECODE_LOST,
         "colocated": FailureReason.COLOCATED_LOST}


def _prefer(pool: list[_Worker], avoid: Sequence[str]) -> list[_Worker]:
    """The pool without the workers to avoid, unless that leaves nobody."""
    return [w for w in pool if w.worker_id not in avoid] or pool


