"""The continuous-batching scheduler every engine runs; the worker's role is a policy over request states.

Each step spends a token budget: first one token for every running request that is decoding (and the
next chunk of any running prefill), then prompt chunks of waiting requests in (service tier, arrival)
order (pdserve.tiers). When the pool cannot hold a running request's next token, a request is preempted:
the lowest tier's most recently admitted one. Its blocks are freed and it goes back to the queue, at its
place, to be recomputed (prompt + output so far), so nothing is dropped and the tokens already produced
are kept.

Tiers (decode and colocated roles): a waiting request of a higher tier than flex that finds every slot
(max_num_seqs) taken preempts the most recently admitted running flex request, as long as flex keeps its
floor (flex_min_share of the slots). That flex request keeps its KV in its blocks and resumes without
recomputing when its turn comes again; if a higher tier needs its blocks (a reservation that does not
fit), they are freed and it is recomputed instead. Both outcomes are counted (`preemptions`).

Roles (see pdserve.engine.request.RequestStatus for the states):
- COLOCATED (offline engine, colocated workers): both phases here.
- PREFILL: a prompt is admitted only when blocks for all of it can be allocated, so a partly ingested
  prompt never waits for room (and is never preempted). Once its last chunk has run and the first
  token is sampled, it leaves the batch as HELD: its KV stays in its blocks until the owner releases
  it (sent to the decode worker, or the request ended). Held KV fills the pool, which stops admission:
  backpressure, not failure.
- DECODE: a request whose KV is computed elsewhere (remote_kv) waits for room; the scheduler then
  reserves blocks for its KV and next token and reports it in `ScheduledStep.reserved` (WAITING_FOR_KV).
  When the KV has landed (`kv_arrived`, with the token the prefill worker sampled), it joins the
  running batch at the next step. Requests preempted here are recomputed here.

The step's records and the role are in pdserve.engine.scheduler_types; pipelined decode (launch, resolve)
is in pdserve.engine.pipelined, a base of Scheduler.
"""
from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Callable, Iterator, Sequence

from pdserve.config import SchedulerConfig
from pdserve.engine.grammar import GrammarError, Grammars, advance
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.pipelined import LaunchedStep, PipelinedDecode
from pdserve.engine.request import (
    FinishReason,
    Request,
    RequestStatus,
    first_token_stop,
    sample_id,
    token_stop_reason,
)
from pdserve.engine.routed_experts import note_step
from pdserve.engine.runner import StepResult, samples_of
from pdserve.engine.sampling import sample_seed
from pdserve.engine.scheduler_spec import Speculation, step_chunks, trim, usable
from pdserve.engine.scheduler_types import (
    Role,
    SampledToken,
    ScheduledStep,
    chunk_of,
    take_prompt_logprobs,
    take_routed,
)
from pdserve.tiers import ServiceTier, flex_floor

FLEX = ServiceTier.FLEX.rank


class WaitingQueue:
    """Waiting requests in (tier, queue_seq) order: the head is the next to go, whatever the tier it came in."""

    def __init__(self) -> None:
        self._items: list[Request] = []

    def append(self, req: Request) -> None:
        bisect.insort(self._items, req, key=_queue_key)

    def popleft(self) -> Request:
        return self._items.pop(0)

    def pop(self, i: int) -> Request:
        return self._items.pop(i)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __getitem__(self, i: int) -> Request:
        return self._items[i]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _queue_key(req: Request) -> tuple[int, int]:
    return req.tier, req.queue_seq


def _shares_computing(kv: KVCacheManager, req: Request, computing: set[bytes]) -> bool:
    """Whether the first block of req's prompt that its cache hits leave to compute is one a prompt admitted
    in this step computes: a burst of prompts with one uncached prefix (a shared system prompt) computes it
    once, the rest taking it from the cache a step later."""
    i = len(req.block_ids)  # the blocks the cache gave it
    return kv.pool.enable_prefix_caching and i < len(req.block_hashes) and req.block_hashes[i] in computing


def _givable(waiting: WaitingQueue, kv: KVCacheManager, but: Request | None) -> Request | None:
    """The waiting request (but `but`) whose blocks Scheduler._drop_kept frees for `but`, or None: the last that kept
    its KV, else the last holding blocks it has not run with (a finished load's, prefix-cache hits), else the last
    partial hand-off holding its pinned prefix."""
    others = [r for r in waiting if r is not but][::-1]
    return next((r for r in others if r.kept_kv), None) \
        or next((r for r in others if r.block_ids and not r.remote_kv and kv.loaded(r)), None) \
        or next((r for r in others if r.block_ids and r.remote_kv), None)


class Scheduler(PipelinedDecode):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: tuple[int, ...],
                 max_model_len: int, role: Role = Role.COLOCATED):
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.role = role
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # in admission order
        self.held: dict[str, Request] = {}  # prefill: KV kept for the decode worker
        self.waiting_for_kv: dict[str, Request] = {}  # decode: blocks reserved, KV in flight
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_preemptions = 0
        self.prompt_tokens_requested = 0  # prompts taken here to compute (not those whose KV comes from elsewhere)
        # Preemptions by (tier name, "kept" | "recomputed"), counted when the preempted request resumes
        # with its KV (kept) or loses it (recomputed).
        self.preemptions: collections.Counter[tuple[str, str]] = collections.Counter()
        self._seq = itertools.count()
        # Pipelined decode: steps launched and not yet resolved (at most two), requests out of the batch
        # whose last token is in flight, and finished requests whose blocks a launched step still uses.
        self.launched: list[LaunchedStep] = []
        self.ending: list[Request] = []
        self._free_after: list[Request] = []
        self._flex_floor = flex_floor(config.flex_min_share, config.max_num_seqs)
        # Partial hand-offs ended because their pinned prefix was given back (_drop_kept): the decode worker takes
        # them (and empties the list) after each schedule, to fail them as PREFIX_MISSED.
        self.unpinned: list[Request] = []
        # Groups (SamplingParams.n): the block copies forks asked for, whether the runner can make them
        # (EngineCore says), and who gives a forked sample what the scheduler does not know (its text).
        self.block_copies: list[tuple[int, int]] = []
        self.can_copy_blocks = False
        self.on_fork: Callable[[Request, Request], None] | None = None
        # Structured output: the worker's compiler (EngineCore sets it where the model has a tokenizer).
        self.grammars: Grammars | None = None
        # Speculative decoding (pdserve.engine.scheduler_spec): set by EngineCore on a decode or colocated
        # engine that is not pipelined, when configured.
        self.speculation: Speculation | None = None

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.remote_kv and self.role is not Role.DECODE:
            raise ValueError("only a decode worker takes requests whose KV is computed elsewhere")
        # Room for every token and one more (the next one's KV), or it could never run (a group's samples
        # can run one after another: they are preempted like any request when the cache is short).
        if self.kv.blocks_needed(req.num_tokens + 1) > self.kv.pool.num_blocks:
            raise ValueError(
                f"request {req.request_id} needs more KV blocks than the cache has "
                f"({req.num_tokens} tokens, {self.kv.pool.num_blocks} blocks of {self.kv.block_size})"
            )
        self.structure(req)
        req.status = RequestStatus.WAITING
        req.queue_seq = next(self._seq)
        self.waiting.append(req)
        self.requests[req.request_id] = req
        if not req.remote_kv:
            self.prompt_tokens_requested += req.num_prompt_tokens

    def structure(self, req: Request) -> None:
        """A request under structured output gets its matcher (unless it has one), its tokens so far (a resumed
        attempt's) replayed into it: GrammarError if the spec does not compile or the grammar rejects one. Touches
        only req: a worker calls it on the thread that takes the request in, so that the step thread neither
        compiles nor replays."""
        if req.params.structured is None or req.grammar is not None:
            return
        if self.grammars is None:
            raise ValueError("structured output is not served here: it needs the model's tokenizer and a real "
                             "engine (not a simulated one)")
        req.grammar = self.grammars.matcher(req.params.structured, req.output_token_ids)

    @property
    def has_work(self) -> bool:
        """Whether a step would compute something (HELD and WAITING_FOR_KV requests need no step)."""
        return bool(self.running) or any(not r.remote_kv for r in self.waiting) or self._can_reserve()

    @property
    def num_active(self) -> int:
        """Requests that hold or will soon hold a batch slot (running, or their KV on the way)."""
        return len(self.running) + len(self.waiting_for_kv)

    def schedule(self) -> ScheduledStep:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        drafts: dict[Request, list[int]] = {}
        reserved: list[Request] = []
        preempted = 0
        self.kv.reap()
        if self.role is not Role.PREFILL:
            self._preempt_for_tiers()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n == 1 and self.speculation is not None and (draft := self._draft(req, budget)):
                drafts[req] = draft
                n += len(draft)
            while not self._allocate(req, n):
                assert self.role is not Role.PREFILL, "a prefill worker allocates whole prompts at admission"
                # The lowest tier's most recently admitted request gives its blocks back.
                v = max(range(len(self.running)), key=lambda j: (self.running[j].tier, j))
                victim = self.running.pop(v)
                self._preempt(victim)
                preempted += 1
                if v < i:  # already in this step: take it out again
                    k = next(k for k, (r, _) in enumerate(scheduled) if r is victim)
                    budget += scheduled.pop(k)[1]
                    i -= 1
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
        # Admitting while preempting would only thrash: the freed room belongs to the running batch.
        if not preempted:
            self._admit(budget, scheduled, reserved)
        self.num_preemptions += preempted
        probs = self.speculation.fill_drafts(drafts, self.kv) if drafts else {}
        return ScheduledStep([r for r, _ in scheduled], step_chunks(scheduled, drafts, self.eos_token_ids, probs),
                             reserved)

    def _admit(self, budget: int, scheduled: list[tuple[Request, int]], reserved: list[Request]) -> None:
        """Waiting requests into the step, in queue order, while budget, slots and room last (schedule's second
        half): prompts join `scheduled`, incoming KV is given blocks (`reserved`). A request whose prefix is loading
        from a KV tier keeps its place and is passed over until the load is over."""
        computing: set[bytes] = set()  # full blocks the prompts admitted in this step compute
        j = 0  # the first waiting request not waiting for its prefix to load from a KV tier
        while j < len(self.waiting) and self.num_active < self.config.max_num_seqs:
            req = self.waiting[j]
            if not self.kv.loaded(req):
                j += 1  # its prefix is still loading: it keeps its place, those behind it go on
                continue
            if req.unresolved:
                break  # preempted with a token in flight: it goes once that token is known
            if req.remote_kv:
                if not self._reserve(req):
                    break  # backpressure: it waits, in order, for room
                self.waiting.pop(j)
                req.status = RequestStatus.WAITING_FOR_KV
                self.waiting_for_kv[req.request_id] = req
                reserved.append(req)
                continue
            if budget <= 0:
                break
            kept, req.kept_kv = req.kept_kv, False  # preempted for another tier, its KV still here
            if not req.block_ids:
                self.kv.start(req)  # computed by this worker's weights
                if req.prompt_logprobs is None and req.routed is None:  # these need every position computed
                    self.kv.admit_cached_prefix(req)
                    if req.tier_load is not None:
                        j += 1  # the rest of its prefix is loading: it runs once that is over
                        continue
                    if _shares_computing(self.kv, req, computing):
                        self.kv.free(req)  # one step later its prefix is in the cache: it waits for that
                        break
            n = req.num_tokens - req.num_computed_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                req.kept_kv = kept
                break
            # A prefill worker allocates the whole prompt now, so a chunked prompt never waits for room.
            need = n if self.role is Role.PREFILL else min(n, budget)
            n = min(n, budget)
            if not self._allocate(req, need):
                if kept:
                    req.kept_kv = True
                else:
                    self.kv.free(req)  # drop the prefix references taken above; retry next step
                break
            if kept:  # resumes without recomputing
                self.preemptions[(ServiceTier.of_rank(req.tier).value, "kept")] += 1
            self.waiting.pop(j)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
            bs = self.kv.block_size
            computing.update(req.block_hashes[req.num_computed_tokens // bs:(req.num_computed_tokens + n) // bs])

    def _draft(self, req: Request, budget: int) -> list[int]:
        """The tokens req drafts this step, if their slots can be had without taking anyone's blocks."""
        draft = self.speculation.draft(req, len(self.running), self.max_model_len, budget, self.kv.version)
        if self.speculation.draft_model is None:  # a draft model's are placeholders until fill_drafts
            draft = usable(req, draft, self.eos_token_ids)
        return draft if draft and self.kv.allocate_slots(req, 1 + len(draft)) else []

    def update(self, step: ScheduledStep, result: StepResult) -> list[SampledToken]:
        """Account a finished step: computed tokens, newly full blocks, sampled tokens, token-level stops.

        Prefill role: a request that sampled its first token is HELD, whatever the token; the
        SampledToken still says whether that token ended it, and the owner releases it.
        """
        for req, chunk in zip(step.requests, step.chunks):
            if not chunk.draft:
                req.num_computed_tokens += len(chunk.token_ids)
                self.kv.cache_computed_blocks(req)
        self.note_prompt_logprobs(step, result)
        note_step(step.requests, step.chunks, result.routed_experts)
        out = [t for i, (emitted, logprobs) in result.verified.items()
               for t in self._take_verified(step.requests[i], len(step.chunks[i].draft), emitted, logprobs)]
        tokens = result.tokens()
        logprobs = self.token_logprobs(step, result, tokens)
        rows = list(zip(result.sampling_chunks, tokens, logprobs, samples_of(result.sampling_chunks)))
        # A group's samples 1.. first: they share its blocks, which its own first token may end and free.
        samples = {(i, j): self.sample(step.requests[i], j, token, lp) for i, token, lp, j in rows if j}
        for i, token, lp, j in rows:
            if j:
                out.append(samples[i, j])
                continue
            req = step.requests[i]
            req.fanout = 1
            req.token_ids.append(token)
            advance(req, token)
            reason = token_stop_reason(req, self.eos_token_ids, self.max_model_len)
            if self.role is Role.PREFILL:
                self.running.remove(req)
                req.status = RequestStatus.HELD
                self.held[req.request_id] = req
            elif reason is not None:
                self.finish(req, reason)
            out.append(SampledToken(req, token, reason, req.num_output_tokens, lp, take_prompt_logprobs(req),
                                    version=self.kv.version, routed_experts=take_routed(req, req.num_tokens - 1)))
        return out

    def _take_verified(self, req: Request, drafted: int, emitted: list[int],
                       logprobs: list[TokenLogprob] | None) -> list[SampledToken]:
        """A verification's tokens (and their logprobs, if asked) into req, one by one, each checked by the
        token-level stop rules: the first that ends it is its last. The accepted drafts' KV (and the last known
        token's) count as computed."""
        self.speculation.note(req, drafted, len(emitted) - 1)
        out = []
        for i, token in enumerate(emitted):
            req.token_ids.append(token)
            advance(req, token)
            req.num_computed_tokens = req.num_tokens - 1
            reason = token_stop_reason(req, self.eos_token_ids, self.max_model_len)
            out.append(SampledToken(req, token, reason, req.num_output_tokens,
                                    logprobs[i] if logprobs is not None else None, version=self.kv.version))
            if reason is not None:
                self.finish(req, reason)
                return out
        self.kv.cache_computed_blocks(req)
        trim(self.kv, req)
        return out

    def sample(self, group: Request, index: int, token: int, logprobs: TokenLogprob | None) -> SampledToken:
        """Sample `index` > 0 of a group whose prompt was just computed, its first token drawn: a prefill
        worker reports it on the group (it forks nothing: the decode worker does, once the KV has come);
        elsewhere it is forked into a request of its own (fork)."""
        if self.role is Role.PREFILL:
            reason = first_token_stop(group.params, token, self.eos_token_ids, group.num_prompt_tokens,
                                      self.max_model_len)
            return SampledToken(group, token, reason, 1, logprobs, sample_index=index, version=self.kv.version)
        child = self.fork(group, index, token)
        reason = token_stop_reason(child, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.finish(child, reason)
        return SampledToken(child, token, reason, 1, logprobs, version=child.kv_version)

    def fork(self, group: Request, index: int, token: int) -> Request:
        """A running request for sample `index` of a group, its first token `token`: the prompt's full
        blocks shared with the group (referenced once more), its own copy of the prompt's partial last block
        (copied before the next step: block_copies), or where copies cannot be made (or no block is free)
        that part computed again by its next step."""
        # The group's own first token may already follow its prompt (pipelined: forks happen at resolve).
        child = Request(sample_id(group.request_id, index), group.prompt_token_ids, group.params,
                        sample_seed(group.seed, index), tier=group.tier)
        child.sample_index, child.fanout, child.prompt_logprobs = index, 1, None
        child.kv_version = group.kv_version
        child.token_ids.append(token)
        if group.grammar is not None:  # the group's matcher has not taken its own first token yet
            child.grammar = group.grammar.fork()
            advance(child, token)
        bs = self.kv.block_size
        full = group.num_prompt_tokens // bs
        child.block_ids = self.kv.share(group.block_ids[:full])
        child.block_hashes = group.block_hashes[:full]
        child.num_registered_blocks = min(group.num_registered_blocks, full)
        child.num_computed_tokens = full * bs
        if group.num_prompt_tokens % bs and self.can_copy_blocks:
            copy = self.kv.allocate_blocks(1)
            if copy:
                child.block_ids += copy
                self.block_copies.append((group.block_ids[full], copy[0]))
                child.num_computed_tokens = group.num_prompt_tokens
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        child.status = RequestStatus.RUNNING
        child.queue_seq = next(self._seq)
        self.running.append(child)
        self.requests[child.request_id] = child
        if self.on_fork is not None:
            self.on_fork(group, child)
        return child

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The block copies forks asked for, to run before the next step (the runner's copy_blocks)."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def kv_arrived(self, request_id: str, tokens: Sequence[int], version: int = 0) -> list[SampledToken]:
        """The KV of a WAITING_FOR_KV request has landed in its blocks, with the token sampled after it (a
        group's n first tokens: its samples 1.. are forked here), both computed by weight version `version`.

        It runs from the next step on. Returns the tokens as sampled (finish_reason set where a token
        ended its sample: it is then finished here), none if the request is not waiting for KV. Under structured
        output each token is replayed into the sample's matcher: GrammarError, before anything changes, if the
        grammar rejects one (the caller fails the request).
        """
        req = self.waiting_for_kv.get(request_id)
        if req is None:
            return []
        if req.grammar is not None:
            for j, t in enumerate(tokens):
                if not req.grammar.fork().accept(t):
                    raise GrammarError(f"request {request_id}: the first token of sample {j} (id {t}) handed over "
                                       "does not follow its structured output grammar")
        del self.waiting_for_kv[request_id]
        token, *others = tokens
        req.fanout = 1
        req.kv_version, req.block_hashes = version, []
        samples = [self.sample(req, j, t, None) for j, t in enumerate(others, 1)]
        req.token_ids.append(token)
        advance(req, token)
        req.num_computed_tokens = req.num_tokens - 1  # all but the new token, whose KV the next step computes
        self.kv.cache_computed_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        reason = token_stop_reason(req, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.finish(req, reason)
        return [SampledToken(req, token, reason, req.num_output_tokens, version=version), *samples]

    def kv_blocks(self, req: Request) -> list[int]:
        """The blocks that hold (prefill: HELD) or will hold (decode: WAITING_FOR_KV) the hand-off's KV."""
        num_tokens = req.num_computed_tokens if req.status is RequestStatus.HELD else req.num_tokens
        return req.block_ids[: self.kv.blocks_needed(num_tokens)]

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request wherever it is and release its blocks."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            if req in self.ending:
                self.ending.remove(req)
            else:
                self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.HELD:
            del self.held[req.request_id]
        else:
            assert req.status is RequestStatus.WAITING_FOR_KV, req.status
            del self.waiting_for_kv[req.request_id]
        del self.requests[req.request_id]
        if self.speculation is not None:
            self.speculation.forget(req)
        if self._in_flight(req):
            self._free_after.append(req)  # a launched step still writes its KV: freed when it resolves
        else:
            self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def _reserve(self, req: Request) -> bool:
        """Blocks for a remote request's KV and its next token, if that leaves the configured headroom
        per running request (so that taking it in does not force a preemption at the very next step)."""
        while not self._room_for(req):
            if not self._drop_kept(but=req):
                return False
        return self.kv.allocate_slots(req, req.num_tokens + 1)

    def _can_reserve(self) -> bool:
        """Whether the head of the queue is incoming KV that a step would reserve room for (there is room, or blocks
        that requests behind it hold give way to it)."""
        return bool(self.waiting) and self.waiting[0].remote_kv and self.num_active < self.config.max_num_seqs \
            and (self._room_for(self.waiting[0]) or _givable(self.waiting, self.kv, self.waiting[0]) is not None)

    def blocks_for(self, req: Request) -> int:
        """Blocks a request needs to take its next token: its tokens' and the next one's; a group's samples
        each their copy of the prompt's partial last block and a block for their next token."""
        need = self.kv.blocks_needed(req.num_tokens + 1)
        if req.fanout > 1:
            need += (req.fanout - 1) * (1 + (req.num_prompt_tokens % self.kv.block_size > 0))
        return need

    def _room_for(self, req: Request) -> bool:
        need = self.blocks_for(req) - (len(req.block_ids) if req.remote_kv else 0)  # a partial hand-off's own prefix
        return self.kv.pool.num_free_blocks - need >= len(self.running) * self.config.reservation_headroom_blocks

    def recompute(self, req: Request) -> None:
        """Free a running (or KV-keeping waiting) request's KV: it is computed again, prompt and tokens so far,
        when it next runs (a weight update's "recompute")."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            req.status = RequestStatus.WAITING
            req.remote_kv = False  # recomputed here
            self.waiting.append(req)
        req.kept_kv = False
        self.kv.free(req)
        if self.speculation is not None:
            self.speculation.drop_kv(req)

    def _preempt(self, req: Request, keep_kv: bool = False) -> None:
        """Back to the queue at its place: its KV freed (recomputed when it runs again) or kept (a draft model's
        KV goes either way: it is computed again at the request's next draft)."""
        if self.speculation is not None:
            self.speculation.drop_kv(req)
        if keep_kv:
            req.kept_kv = True
        else:
            self.kv.free(req)
            self.preemptions[(ServiceTier.of_rank(req.tier).value, "recomputed")] += 1
        req.status = RequestStatus.WAITING
        req.remote_kv = False  # its KV is here (kept) or recomputed here
        self.waiting.append(req)

    def _allocate(self, req: Request, n: int) -> bool:
        """Slots for n more tokens of req; KV kept by preempted requests is given up for them if needed."""
        while not self.kv.allocate_slots(req, n):
            if not self._drop_kept(but=req):
                return False
        return True

    def _drop_kept(self, but: Request | None = None) -> bool:
        """Free the KV of the last waiting request (but `but`, the one that needs the room) that kept it (it will be
        recomputed), or else that holds blocks it has not run with yet: a prefix a KV tier load brought back, or
        prefix-cache hits taken at admission (they stay in the prefix cache, and a tier keeps what is then
        evicted), or else, last, a partial hand-off's prefix pinned while it waits for its reservation: that
        request ends here, its prefix given back (`self.unpinned`: the decode worker fails it as PREFIX_MISSED, and the
        router tries it again at once as a full hand-off, which pins nothing). A request ahead of it in the queue,
        or a running one, never waits for room that a request the queue does not reach holds, so no block waits
        for a request that waits for that block. (A load still under way is not taken: its end wakes the step
        thread.) False if none did."""
        victim = _givable(self.waiting, self.kv, but)
        if victim is None:
            return False
        if victim.kept_kv:
            victim.kept_kv = False
            self.preemptions[(ServiceTier.of_rank(victim.tier).value, "recomputed")] += 1
        if victim.remote_kv:
            self.finish(victim, FinishReason.ABORT)
            self.unpinned.append(victim)
        else:
            self.kv.free(victim)
        return True

    def _preempt_for_tiers(self) -> None:
        """Running flex requests above flex's floor make way for a waiting request of a higher tier that
        has no slot (they keep their KV) or, for incoming KV, no room (their KV is freed: flex requests
        preempted earlier and still waiting with their KV give theirs first)."""
        while self.waiting and self.waiting[0].tier < FLEX:
            head = self.waiting[0]
            no_slot = self.num_active >= self.config.max_num_seqs
            no_room = head.remote_kv and not self._room_for(head)
            if not (no_slot or no_room):
                return
            if no_room and not no_slot and self._drop_kept(but=head):
                continue
            flex = [j for j, r in enumerate(self.running) if r.tier == FLEX]
            if len(flex) <= self._flex_floor:
                return
            victim = self.running.pop(flex[-1])
            self._preempt(victim, keep_kv=not no_room)
            self.num_preemptions += 1
