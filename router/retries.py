"""A request through its attempts: the retry policy, and the samples of a group that go on alone.

Each attempt (router.attempt) runs under its own worker-side id (`<tag><id>#<n>`) and continues from the
tokens, and the characters of text, the request already streamed. A failed attempt raises Retry with its
FailureReason; the policy is keyed on it: a failed KV transfer is tried once more, a lost worker up to
max_retries times, an empty pool not again (its wait was already bounded), a request whose own data failed a
step never (ValueError: the client's error); a lost decode worker's stream resumes elsewhere unless
on_decode_failure is "fail".
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from pdserve.config import ClusterConfig
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import SAMPLE_SEP, FinishReason, Request
from pdserve.engine.sampling import sample_seed
from pdserve.serving.messages import FailureReason
from router.attempt import Attempt, Parts, Retry
from router.streams import Aborted

log = logging.getLogger(__name__)


def _own_fault(e: Retry) -> None:
    """A request whose own data failed a worker's step (its neighbours went on) is the client's error, never
    tried again: the next worker's step would fail on it the same way."""
    if e.reason is FailureReason.BAD_REQUEST:
        raise ValueError(str(e)) from None


class Runs:
    """Requests run through their attempts over `parts`; `on_output(out, tier)` sees every output (the
    demand windows count the finished ones); `retries` counts the attempts tried again, by FailureReason
    value."""

    def __init__(self, config: ClusterConfig, parts: Parts, on_output: Callable[[RequestOutput, object], None],
                 retries: collections.Counter[str]):
        self.config = config
        self.parts = parts
        self._on_output = on_output
        self.retries = retries

    async def run(self, req: Request, tier, tag: str, sent: int = 0, attempts: int = 0,
                  session: str | None = None) -> AsyncIterator[RequestOutput]:
        """A request through its attempts, from the tokens (and the `sent` characters of text) it already
        has: each attempt continues where the last one stopped."""
        rid, streams = req.request_id, self.parts.streams
        streams.open(rid)
        failures: collections.Counter[FailureReason] = collections.Counter()
        avoid: tuple[str, ...] = ()
        full = False  # every attempt after a PREFIX_MISSED hands all of the KV off
        try:
            for attempt in itertools.count(attempts):
                try:
                    # Closed explicitly (not left to the garbage collector): its cleanup cancels the attempt on
                    # its workers the moment the client goes away.
                    outs = Attempt(self.parts, req, sent, f"{tag}{rid}#{attempt}", avoid, session, full).outputs()
                    async with contextlib.aclosing(outs):
                        async for out in outs:
                            sent += len(out.new_text)
                            self._on_output(out, tier)
                            yield out
                    return
                except Retry as e:
                    _own_fault(e)
                    if e.reason is FailureReason.PREFIX_MISSED and not full:
                        # Its decode worker lost the prefix it was to keep: no worker's fault, again at once, whole.
                        full = True
                        self.retries[e.reason.value] += 1
                        continue
                    failures[e.reason] += 1
                    avoid = e.workers
                    if self.give_up(e, failures, rid, attempt):
                        yield RequestOutput(rid, [], "", FinishReason.ERROR, req.num_prompt_tokens,
                                            req.num_output_tokens, error=f"{e} (attempt {attempt + 1})")
                        return
                    self.retries[e.reason.value] += 1
        except Aborted:
            yield RequestOutput(rid, [], "", FinishReason.ABORT, req.num_prompt_tokens, req.num_output_tokens)
        finally:
            streams.close(rid)

    def give_up(self, e: Retry, failures: collections.Counter[FailureReason], rid: str, attempt: int) -> bool:
        """Whether a failed attempt is the request's last. A failed KV transfer is tried once more; other
        losses up to max_retries times; an empty pool was already waited for (pool_wait_timeout_s)."""
        limit = {FailureReason.TRANSFER_FAILED: 1, FailureReason.NO_WORKER: 0}.get(e.reason, self.config.max_retries)
        give_up = failures[e.reason] > limit or (e.reason.loses_the_stream and self.config.on_decode_failure == "fail")
        log.warning("request %s attempt %d failed (%s): %s%s", rid, attempt, e.reason.value, e,
                    "; giving up" if give_up else "; trying again")
        return give_up

    async def run_group(self, group: Request, tier, tag: str, session: str | None = None
                        ) -> AsyncIterator[RequestOutput]:
        """A request of n > 1 samples: one attempt for the group (its prompt computed once, its KV moved once,
        the samples forked where they decode). If that attempt fails, each unfinished sample goes on as a
        request of its own (sample i is the n=1 request seeded sample_seed(seed, i)) from the tokens it has,
        through its own attempts; their outputs are merged, each with its index."""
        rid, n = group.request_id, group.params.n
        tokens: list[list[int]] = [[] for _ in range(n)]
        sent = [0] * n
        done = [False] * n
        self.parts.streams.open(rid)
        try:
            outs = Attempt(self.parts, group, 0, f"{tag}{rid}#0", (), session).outputs()
            async with contextlib.aclosing(outs):
                async for out in outs:
                    tokens[out.index] += out.new_token_ids
                    sent[out.index] += len(out.new_text)
                    done[out.index] = out.finished
                    self._on_output(out, tier)
                    yield out
            return
        except Aborted:
            for i in range(n):
                if not done[i]:
                    yield RequestOutput(rid, [], "", FinishReason.ABORT, group.num_prompt_tokens, len(tokens[i]),
                                        index=i)
            return
        except Retry as e:
            _own_fault(e)
            if self.give_up(e, collections.Counter([e.reason]), rid, 0) and e.reason.loses_the_stream:
                yield RequestOutput(rid, [], "", FinishReason.ERROR, group.num_prompt_tokens, 0,
                                    error=f"{e} (attempt 1)")
                return
            self.retries[e.reason.value] += 1
        finally:
            self.parts.streams.close(rid)
        async for out in self._samples_alone(group, tier, tag, tokens, sent, done):
            yield out

    async def _samples_alone(self, group: Request, tier, tag: str, tokens: list[list[int]], sent: list[int],
                             done: list[bool]) -> AsyncIterator[RequestOutput]:
        """Each unfinished sample of a group whose attempt failed, on its own from its tokens (a request id of
        its own, router-side; its seed), their outputs merged under the group's id, each with its index."""
        rid = group.request_id
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def sample(i: int) -> None:
            seed = sample_seed(group.seed, i)
            req = Request(f"{rid}{SAMPLE_SEP}{i}", group.prompt_token_ids, replace(group.params, n=1, seed=seed),
                          seed, tier=group.tier)
            req.token_ids += tokens[i]
            try:
                outs = self.run(req, tier, tag, sent[i], attempts=1)
                async with contextlib.aclosing(outs):
                    async for out in outs:
                        await merged.put((i, out))
                await merged.put((i, None))
            except BaseException as e:  # noqa: BLE001 - handed to the merging loop
                await merged.put((i, e))

        tasks = [asyncio.ensure_future(sample(i)) for i in range(len(done)) if not done[i]]
        try:
            left = len(tasks)
            while left:
                i, item = await merged.get()
                if item is None:
                    left -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                item.request_id, item.index = rid, i
                yield item
                if item.finish_reason is FinishReason.ERROR:
                    return  # one sample failed for good: the request has
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
