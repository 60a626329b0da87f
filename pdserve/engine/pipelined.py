"""Pipelined decode, the scheduler's half that runs one step ahead of the host (pdserve.engine.scheduler).

A step is launched (its forward and sampling queued on the device) before the step before it has
resolved (its sampled tokens read back to the host): `launch` accounts a step whose sampled tokens are
still on the device, appending each as PENDING; `resolve` puts the tokens in, in launch order, and applies
the token-level stops; `abandon_launched` drops the launched steps when a step failed. A request's blocks
stay in use while a launched step holds it (`_in_flight`): a request that ends meanwhile is freed when
that step resolves.

PipelinedDecode is a base of Scheduler, which owns the state named below (set in Scheduler.__init__).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.grammar import advance
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import PENDING, Request, length_stop, token_stop_reason
from pdserve.engine.runner import StepResult, samples_of
from pdserve.engine.routed_experts import note_step
from pdserve.engine.scheduler_types import Role, SampledToken, ScheduledStep, take_prompt_logprobs, take_routed


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are launched and whose sampled tokens are still on the device
    (pipelined decode): each sampled row's request and the index of its PENDING token."""

    step: ScheduledStep
    result: StepResult
    rows: list[tuple[Request, int]]
    members: set[int]  # id() of every request in the step: its blocks are in use until it resolves
    forks: list[tuple[Request, int, int]] = field(default_factory=list)  # (group, its row, sample index)


class PipelinedDecode:
    """launch, resolve and abandon_launched of Scheduler: its steps whose sampled tokens are still on the
    device."""

    # The scheduler's state this half reads and writes (Scheduler.__init__ sets it).
    role: Role
    kv: KVCacheManager
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    running: list[Request]
    launched: list[LaunchedStep]
    ending: list[Request]
    _free_after: list[Request]

    def launch(self, step: ScheduledStep, result: StepResult) -> LaunchedStep:
        """Pipelined decode: account a step whose sampled tokens are still on the device. Its tokens count
        as computed and each sampled token is appended as PENDING, so the next step can be scheduled (and
        launched, taking that token from the device) before this one resolves. A request whose PENDING
        token is its last by length leaves the batch now; one that a token rule ends (EOS, a stop id)
        is known only at resolve: it rides the next step, whose output for it is dropped, and its
        blocks are freed once that step resolves too."""
        assert self.role is not Role.PREFILL, "a prefill worker hands its requests off: it does not pipeline"
        for req, chunk in zip(step.requests, step.chunks):
            req.num_computed_tokens += len(chunk.token_ids)
        self.note_prompt_logprobs(step, result)
        note_step(step.requests, step.chunks, result.routed_experts)
        rows, forks = [], []
        for row, (i, j) in enumerate(zip(result.sampling_chunks, samples_of(result.sampling_chunks))):
            req = step.requests[i]
            if j:  # a group's sample: forked when its token is known (resolve)
                forks.append((req, row, j))
                continue
            req.fanout = 1
            req.token_ids.append(PENDING)
            req.unresolved += 1
            req.pending_row = row
            rows.append((req, req.num_tokens - 1))
            if length_stop(req, self.max_model_len) is not None and req in self.running:
                self.running.remove(req)
                self.ending.append(req)
        launched = LaunchedStep(step, result, rows, {id(r) for r in step.requests}, forks)
        self.launched.append(launched)
        return launched

    @property
    def must_resolve(self) -> bool:
        """A launched step holds a request under structured output. Its next mask needs the token that step
        sampled on the host, so the step loop resolves that step before it schedules the next one (a step of no
        chunks: EngineCore.run_pipelined): while such a request runs, the host's work for a step no longer overlaps
        the step before it, for every row of the batch, free text included; tokens are the same either way."""
        return any(r.grammar is not None and not r.finished for s in self.launched for r in s.step.requests)

    def resolve(self, launched: LaunchedStep) -> list[SampledToken]:
        """Pipelined decode: a launched step's sampled tokens, now on the host (this waits for them), in
        place of its PENDING tokens; token-level stops; the blocks of requests that ended meanwhile."""
        assert self.launched and self.launched[0] is launched, "steps resolve in launch order"
        tokens = launched.result.tokens()
        logprobs = self.token_logprobs(launched.step, launched.result, tokens)
        self.launched.pop(0)
        # A group's samples first: they share its blocks, which its own first token may end and free.
        out = [self.sample(group, j, tokens[row], logprobs[row]) for group, row, j in launched.forks]
        group_rows = {row for _, row, _ in launched.forks}
        tokens, logprobs = ([v for row, v in enumerate(col) if row not in group_rows] for col in (tokens, logprobs))
        for (req, idx), token, lp in zip(launched.rows, tokens, logprobs):
            if req.finished:
                continue  # ended meanwhile (cancelled, a stop string, a stop in the step before): dropped
            req.token_ids[idx] = token
            req.unresolved -= 1
            advance(req, token)
            reason = token_stop_reason(req, self.eos_token_ids, self.max_model_len, end=idx + 1)
            if reason is not None:
                del req.token_ids[idx + 1:]  # what was launched after its last token
                req.unresolved = 0
            out.append(SampledToken(req, token, reason, idx + 1 - req.num_prompt_tokens, lp,
                                    take_prompt_logprobs(req), version=self.kv.version,
                                    routed_experts=take_routed(req, idx)))
            if reason is not None:
                self.finish(req, reason)
        for req in launched.step.requests:
            if not req.finished and PENDING not in req.token_ids[max(req.num_computed_tokens - 2, 0):req.num_computed_tokens]:
                self.kv.cache_computed_blocks(req)
        for req in [r for r in self._free_after if not self._in_flight(r)]:
            self._free_after.remove(req)
            self.kv.free(req)
        return out

    @staticmethod
    def note_prompt_logprobs(step: ScheduledStep, result: StepResult) -> None:
        """Keep the prompt logprobs a step computed on their requests, by position (a prompt computed
        again after a preemption overwrites its own)."""
        for i, logprobs in result.prompt_logprobs.items():
            req = step.requests[i]
            if req.prompt_logprobs is not None:
                start = step.chunks[i].start
                del req.prompt_logprobs[start:]
                req.prompt_logprobs += logprobs

    @staticmethod
    def token_logprobs(step: ScheduledStep, result: StepResult, tokens: list[int]) -> list:
        """Per sampled row, its token's TokenLogprob if its request asked (this waits for the device)."""
        if result.logprobs is None:
            return [None] * len(tokens)
        return result.logprobs.rows(tokens, [step.requests[i].params.logprobs for i in result.sampling_chunks])

    def _in_flight(self, req: Request) -> bool:
        """Whether a launched step (pipelined decode) still uses req's blocks."""
        return any(id(req) in step.members for step in self.launched)

    def abandon_launched(self) -> None:
        """A step failed: the launched steps will not resolve (their requests are being failed)."""
        self.launched.clear()
        for req in self._free_after:
            self.kv.free(req)
        self._free_after.clear()
