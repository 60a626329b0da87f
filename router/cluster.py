"""The cluster: starts the worker pools on Ray and carries each request through them.

Disaggregated path: the request's prompt goes to a prefill worker, whose first token comes straight
back (TTFT does not wait for the KV); if the request goes on, a decode worker is told to pull the KV
from that prefill worker and its per-step outputs arrive on the decode worker's stream, which one
task here fans out to the requests. Colocated path: one worker does both phases and streams all tokens.
Text (detokenization, stop strings) is produced here, once, for both paths.
"""
from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from decode_worker.actor import DecodeActor
from decode_worker.colocated import ColocatedActor
from pdserve.block_pool import hash_prompt_blocks
from pdserve.config import ClusterConfig, PoolConfig
from pdserve.loader import ModelInfo, load_info
from pdserve.messages import DecodeTask, PrefillTask, StepOutput, TokenEvent, WorkerStats
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
    requests: set[str] = field(default_factory=set)  # routed here and not finished
    queued_tokens: int = 0  # prefill: prompt tokens sent and not yet ingested
    stats: WorkerStats | None = None
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(0))  # prefill workers only


@dataclass(frozen=True)
class _Failed:
    reason: str


class Cluster:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.info: ModelInfo | None = None
        self.prefill: list[_Worker] = []
        self.decode: list[_Worker] = []
        self.colocated: list[_Worker] = []
        self._streams: dict[str, asyncio.Queue[TokenEvent | _Failed]] = {}
        self._consumers: list[asyncio.Task] = []
        self._seed_rng = random.Random(config.engine.seed)
        self.block_size = config.prefill.cache.block_size

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        # Also builds the model's local caches (dequantized weights, tokenizer) once, before the workers.
        self.info = await asyncio.to_thread(load_info, c.engine)
        if c.mode == "colocated":
            self.colocated = [self._spawn(ColocatedActor, c.colocated, f"colocated-{i}")
                              for i in range(c.colocated.num_workers)]
        else:
            self.prefill = [self._spawn(PrefillActor, c.prefill, f"prefill-{i}", c.transfer_timeout_s)
                            for i in range(c.prefill.num_workers)]
            blocks = c.prefill.cache.resolve_num_blocks(self.info.config, c.engine.torch_dtype)
            for w in self.prefill:
                w.prefix = PrefixIndex(blocks)
            self.decode = [self._spawn(DecodeActor, c.decode, f"decode-{i}", c.transfer_timeout_s,
                                       bind_host=c.bind_host) for i in range(c.decode.num_workers)]
        await asyncio.gather(*(w.handle.ready.remote() for w in self.workers))
        await self._poll_stats()
        self._consumers = [asyncio.create_task(self._consume(w)) for w in (*self.decode, *self.colocated)]
        self._consumers.append(asyncio.create_task(self._heartbeat()))

    def _spawn(self, cls: type, pool: PoolConfig, worker_id: str, *args: Any, **kwargs: Any) -> _Worker:
        actor = ray.remote(cls).options(num_cpus=pool.num_cpus, num_gpus=pool.num_gpus, resources=pool.resources,
                                        name=None, max_restarts=0)
        handle = actor.remote(worker_id, self.config.engine_for(pool), *args,
                              torch_threads=pool.torch_threads, **kwargs)
        return _Worker(worker_id, handle)

    @property
    def workers(self) -> list[_Worker]:
        return [*self.prefill, *self.decode, *self.colocated]

    async def shutdown(self) -> None:
        for t in self._consumers:
            t.cancel()
        await asyncio.gather(*self._consumers, return_exceptions=True)
        await asyncio.gather(*(w.handle.shutdown.remote() for w in self.workers), return_exceptions=True)
        for w in self.workers:
            ray.kill(w.handle)
        self.prefill, self.decode, self.colocated = [], [], []

    async def stats(self) -> list[WorkerStats]:
        """Fresh stats from every worker (one call each)."""
        return list(await asyncio.gather(*(w.handle.stats.remote() for w in self.workers)))

    def worker_stats(self) -> list[WorkerStats]:
        """The latest stats each worker reported (step outputs and the heartbeat); no call is made."""
        return [w.stats for w in self.workers if w.stats is not None]

    async def _poll_stats(self) -> None:
        results = await asyncio.gather(*(w.handle.stats.remote() for w in self.workers), return_exceptions=True)
        for w, r in zip(self.workers, results):
            if isinstance(r, WorkerStats):
                w.stats = r

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await self._poll_stats()

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
        events: asyncio.Queue[TokenEvent | _Failed] = asyncio.Queue()
        self._streams[rid] = events
        task = PrefillTask(rid, tuple(prompt), params, seed)
        placed: list[_Worker] = []
        finished = False
        try:
            if self.colocated:
                w = self.colocated[pick_decode([self._decode_load(x) for x in self.colocated])]
                placed.append(w)
                w.requests.add(rid)
                await w.handle.generate.remote(task)
                streamer = w
            else:
                hashes = hash_prompt_blocks(prompt, self.block_size)
                p = self.prefill[pick_prefill([PrefillLoad(x.queued_tokens, x.prefix.match(hashes) * self.block_size)
                                               for x in self.prefill])]
                p.prefix.add(hashes)
                d = self.decode[pick_decode([self._decode_load(x) for x in self.decode])]
                placed += [p, d]
                p.queued_tokens += len(prompt)
                try:
                    result = await p.handle.prefill.remote(task)
                finally:
                    p.queued_tokens -= len(prompt)
                req.token_ids.append(result.first_token)
                req.num_cached_tokens = result.num_cached_tokens
                out = token_output(req, text, result.first_token,
                                   token_stop_reason(req, info.eos_token_ids, info.max_model_len))
                finished = out.finished
                if finished:
                    p.handle.release.remote(rid)
                else:
                    d.requests.add(rid)
                    await d.handle.decode.remote(
                        DecodeTask(rid, tuple(prompt), result.first_token, params, seed, p.worker_id), p.handle)
                yield self._annotate(out, req, placed if finished else [])
                streamer = d
            while not finished:
                ev = await events.get()
                if isinstance(ev, _Failed):
                    finished = True
                    yield RequestOutput(rid, [], "", FinishReason.ERROR, req.num_prompt_tokens, req.num_output_tokens,
                                        error=ev.reason)
                    break
                req.token_ids.append(ev.token)
                out = token_output(req, text, ev.token, ev.finish_reason)
                finished = out.finished
                if finished and ev.finish_reason is None:
                    streamer.handle.cancel.remote(rid)  # a stop string ended it; the worker would go on
                yield self._annotate(out, req, placed if finished else [])
        finally:
            del self._streams[rid]
            for w in placed:
                w.requests.discard(rid)
                if not finished:
                    w.handle.cancel.remote(rid)  # client went away or an error: free its KV everywhere

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
                    q = self._streams.get(ev.request_id)
                    if q is not None:
                        q.put_nowait(ev)
                for rid, reason in out.failed:
                    q = self._streams.get(rid)
                    if q is not None:
                        q.put_nowait(_Failed(reason))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the worker is gone: no request of its may hang
            log.error("stream of %s ended: %s", w.worker_id, e)
            for rid in list(w.requests):
                q = self._streams.get(rid)
                if q is not None:
                    q.put_nowait(_Failed(f"worker {w.worker_id} failed: {e}"))
