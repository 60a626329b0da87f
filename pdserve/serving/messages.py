"""The small dataclasses the router and the workers exchange through Ray actor calls.

Only plain values cross process boundaries: token ids, parameters, ids and counters, never requests
or tensors (KV moves over the transfer channels, not through Ray); routed experts travel as small int32 numpy
arrays (pdserve.engine.routed_experts.RoutedExperts).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.engine.block_pool import KVEvents
from pdserve.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.engine.output import TextOutput, text_options
from pdserve.engine.request import FinishReason, Request
from pdserve.engine.routed_experts import RoutedExperts, RoutedLog
from pdserve.engine.sampling import SamplingParams
from pdserve.model.tokenizer import Tokenizer


class _Task:
    """What a task needs to become a worker's Request: prompt, the output so far, sampling, seed."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    tier: int  # its service tier's rank (pdserve.tiers): every queue orders by it
    text_offset: int  # characters of output text the client already has (a resumed request's)

    def new_request(self, tokenizer: Tokenizer | None = None, vocab_size: int | None = None) -> Request:
        """Its Request on a worker; with the model's tokenizer, the request's text continues here too
        (req.text: the worker that samples its tokens detokenizes them and applies its stop strings).

        Checked again here (ValueError, the caller's error): the router checked it, but the task was unpickled,
        which checks nothing, and what reaches a step must have been checked, or it fails the step of every
        request batched with it. vocab_size: the model's (its token ids must be in [0, vocab_size))."""
        params = self.params.checked()
        if vocab_size is not None:
            bad = [t for t in (*self.prompt_token_ids, *self.output_token_ids) if not 0 <= t < vocab_size]
            if bad or not self.prompt_token_ids:
                raise ValueError(f"token ids must be in [0, {vocab_size}), got {bad[:5] or 'no prompt'}")
        req = Request(self.request_id, list(self.prompt_token_ids), params, self.seed, tier=self.tier)
        req.token_ids.extend(self.output_token_ids)
        if tokenizer is not None:
            req.text = TextOutput.resume(tokenizer, list(self.prompt_token_ids), list(self.output_token_ids),
                                         self.params.stop, self.text_offset, **text_options(params))
        return req


@dataclass(frozen=True)
class PrefillTask(_Task):
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    # Tokens already streamed to the client by an earlier attempt (a resumed request): they are
    # ingested with the prompt, and sampling continues at their count, so nothing repeats or skips.
    output_token_ids: tuple[int, ...] = ()
    # Whether a decode worker will reserve room for this prompt's KV: the reservation names it (kv_ready),
    # before the prompt is computed or after (then the KV is held until it comes). False if nothing follows
    # the first token (max_tokens reached with it): the KV is freed as soon as the token is sampled.
    hand_off: bool = False
    tier: int = 1
    text_offset: int = 0
    # The decode worker holds the first skip_blocks full blocks of the KV already (its prefix cache: a
    # conversation's earlier turns): they are computed here as always, but not pushed (DecodeTask.held_blocks).
    skip_blocks: int = 0


@dataclass(frozen=True)
class FirstToken:
    """The first token of a group's sample 1, 2, ... (SamplingParams.n), drawn from the prompt's logits."""

    token: int
    text: str
    finish_reason: FinishReason | None
    logprobs: TokenLogprob | None = None


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    text: str = ""  # the first token's text (held back while it may begin a stop string)
    finish_reason: FinishReason | None = None  # if the first token ended the request (a stop string included)
    logprobs: TokenLogprob | None = None  # the first token's, if asked
    prompt_logprobs: PromptLogprobs | None = None  # if asked
    others: tuple[FirstToken, ...] = ()  # a group's samples 1..n-1 (first_token and the above are sample 0's)
    version: int = 0  # the weight version that computed the prompt's KV and sampled the first tokens
    # If asked: the experts of every position this worker computed (the prompt, and a resumed request's tokens
    # so far), which the router streams with the first token; the decode worker's start after them.
    routed_experts: RoutedExperts | None = None


@dataclass(frozen=True)
class DecodeTask(_Task):
    """A request whose KV a prefill worker computes: the decode worker reserves room for it at once (or, `local`,
    one whose prompt the decode worker computes itself)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # tokens streamed before this attempt; the prefill worker samples the next
    params: SamplingParams
    seed: int
    prefill_worker: str  # id of the prefill worker that computes and pushes the KV ("" when local)
    tier: int = 1
    text_offset: int = 0  # before the prefill worker's first token (this worker adds that token's text unsent)
    # The decode worker computes the prompt itself (it holds most of it: a conversation's earlier turns), with
    # its prefix cache, and samples the first token too: no prefill worker, no hand-off (router.dispatch).
    local: bool = False
    # A partial hand-off: this worker's prefix cache holds the first held_blocks full blocks of the prompt (as
    # the router's index said, at weight version held_version): it takes them from its cache and reserves, and
    # receives, only the rest. If it no longer holds them all, the reservation fails (PREFIX_MISSED).
    held_blocks: int = 0
    held_version: int = 0

    def new_request(self, tokenizer: Tokenizer | None = None, vocab_size: int | None = None) -> Request:
        req = super().new_request(tokenizer, vocab_size)
        if not self.local:
            req.remote_kv = True
            req.prompt_logprobs = None  # the prefill worker's to compute
            if req.routed is not None:  # so are the experts of every position whose KV it sends
                req.routed = RoutedLog(req.num_tokens)
        return req


class FailureReason(str, enum.Enum):
    """Why an attempt of a request failed; the router's retry policy is keyed on it."""

    TRANSFER_FAILED = "transfer_failed"  # its KV did not reach the decode worker
    STEP_FAILED = "step_failed"  # a worker's step raised: the batch it was in was failed
    REJECTED = "rejected"  # a worker refused it (e.g. an id already in use there)
    BAD_REQUEST = "bad_request"  # its own data failed a step (its neighbours went on): the client's error, not retried
    PREFILL_LOST = "prefill_lost"  # its prefill worker died or hung
    DECODE_LOST = "decode_lost"  # its decode worker died or hung: the streamed tokens survive at the router
    COLOCATED_LOST = "colocated_lost"
    NO_WORKER = "no_worker"  # a pool stayed empty past pool_wait_timeout_s
    # A partial hand-off's decode worker no longer held the prefix the router counted on (evicted, or of another
    # weight version): no worker's fault; tried again at once as a full hand-off.
    PREFIX_MISSED = "prefix_missed"

    @property
    def loses_the_stream(self) -> bool:
        """The worker that was generating the request's tokens is gone (a resume, or UNAVAILABLE)."""
        return self in (FailureReason.DECODE_LOST, FailureReason.COLOCATED_LOST)


@dataclass(frozen=True)
class Failure:
    request_id: str  # the worker-side id of the attempt
    reason: FailureReason
    detail: str


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token: int
    finish_reason: FinishReason | None  # STOP for a completed stop string too (the worker ended the request)
    text: str = ""  # the token's text, detokenized on the worker (pdserve.engine.output.TextOutput)
    logprobs: TokenLogprob | None = None  # if the request asked
    prompt_logprobs: PromptLogprobs | None = None  # with a colocated request's first token, if it asked
    version: int = 0  # the weight version that sampled the token (pdserve.weights)
    # Prompt tokens the prefix cache served, where this worker computed the prompt (colocated, or a decode
    # worker's local prefill); None where the KV came from a prefill worker (its PrefillResult says).
    cached_tokens: int | None = None
    # If asked: the experts of the positions computed since the request's last event, up to the one that
    # sampled this token (pdserve.engine.routed_experts).
    routed_experts: RoutedExperts | None = None


# The hops of a request's path that compute prompt tokens, by the pool whose workers run them: a prefill
# worker's prompt; a decode worker's local prefill (it holds most of the prompt: router.dispatch) or its
# recompute (KV computed again after a preemption or a weight update); a colocated worker's prompt.
HOPS = {"prefill": ("prefill",), "decode": ("local_prefill", "recompute"), "fast": ("local_prefill", "recompute"),
        "colocated": ("colocated",)}


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    pool: str  # "prefill", "decode" or "colocated"
    waiting: int  # requests queued (prefill: prompts; decode: KV not yet received)
    waiting_tokens: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int = 0
    tokens_processed: int = 0
    busy_seconds: float = 0.0  # wall time spent in model steps
    uptime_seconds: float = 0.0
    flops: int = 0  # model FLOPs executed (pdserve.engine.utilization)
    bytes_read: int = 0  # weight and KV bytes read by steps
    peak_flops: float = 0.0  # the device's, and where the figure comes from
    peak_bytes_per_second: float = 0.0
    peak_source: str = ""
    prefix_hit_blocks: int = 0
    prefix_query_blocks: int = 0
    # Speculative decoding (pdserve.engine.scheduler_spec.Speculation.stats), cumulative: drafted and accepted
    # tokens, verifications, and verifications by accepted length {length: count}; empty where it is off.
    speculation: dict = field(default_factory=dict)
    transfer: dict = field(default_factory=dict)  # TransferStats snapshot
    # SecondsHistogram snapshots (decode workers): first token sampled -> KV usable here, and time a
    # request waited for room to reserve.
    handoff: dict = field(default_factory=dict)
    reservation_wait: dict = field(default_factory=dict)
    pid: int = 0  # the worker's process (operators and fault tests signal it)
    preemptions: int = 0  # running requests sent back to the queue for lack of KV blocks (recomputed)
    late_steps: int = 0  # simulated engine: steps whose host work outlasted their simulated time
    kv_peers: int = 0  # workers of the other pool this one holds a KV pusher or intake for
    # Service tiers (pdserve.tiers), cumulative: step seconds attributed to each tier (a step's time is
    # shared by its requests in proportion to the tokens each computed in it), and preemptions by
    # "TIER/kept" or "TIER/recomputed".
    tier_seconds: dict = field(default_factory=dict)
    tier_preemptions: dict = field(default_factory=dict)
    cancelled: int = 0  # requests a cancel ended here (their records: WorkerActor.recent_cancels)
    # Prompt tokens of the requests taken here to compute, and those computed (pdserve.engine.llm_engine.EngineCore).
    prompt_tokens_requested: int = 0
    prompt_tokens_computed: int = 0
    # Weights (pdserve.weights): the version served, whether generation is paused here, the updates applied
    # (their seconds and bytes, cumulative) and failed, and requests holding older KV at an update by
    # what their version policy did ("recomputed", "kept", "aborted").
    weight_version: int = 0
    paused: bool = False
    weight_updates: int = 0
    weight_update_seconds: float = 0.0
    weight_update_bytes: int = 0
    weight_update_failures: int = 0
    version_outcomes: dict = field(default_factory=dict)
    # A mixture of experts: tokens routed to each expert, summed over its layers (load balance); () if dense.
    expert_tokens: tuple[int, ...] = ()
    # Sessions and the prefix cache, cumulative. Prompt tokens by the hop that computed them here (HOPS: the
    # pool's hops) and by how: "HOP/cached" (served by the prefix cache when the prompt was admitted) or
    # "HOP/computed". Decode workers: the prompts they computed themselves (local prefills, taken instead of a
    # prefill worker's hand-off), the KV blocks hand-offs brought here, and the blocks local prefills kept from
    # moving (each one's prompt, which a hand-off would have moved).
    hop_tokens: dict = field(default_factory=dict)
    local_prefills: int = 0
    handoff_blocks: int = 0
    handoff_avoided_blocks: int = 0
    # KV tiers beneath the cache (pdserve.engine.kv_offload.TierStats.as_dict): blocks and bytes written and
    # loaded and blocks hit, by tier, and load seconds; {} without tiers.
    kv_offload: dict = field(default_factory=dict)

    @property
    def busy_fraction(self) -> float:
        return self.busy_seconds / self.uptime_seconds if self.uptime_seconds > 0 else 0.0


@dataclass(frozen=True)
class WeightUpdateReport:
    """What one worker's update did: the version it now serves, seconds to stage (read, convert; the worker
    serving meanwhile) and to commit (between two steps), and the bytes staged."""

    worker_id: str
    version: int
    stage_seconds: float
    commit_seconds: float
    num_bytes: int


@dataclass(frozen=True)
class CancelRecord:
    """What a cancel did on a worker that had the request: when it left, and what it had produced."""

    request_id: str  # the worker-side id of the attempt
    step: int  # the worker's step count when it left: no step after that one computed it
    output_tokens: int  # its output tokens then (those streamed by earlier attempts included)
    # Where it stood: a pdserve.engine.request.RequestStatus value (waiting, running, held, waiting_for_kv), or
    # "pushing" (a prefill worker whose push of its KV was under way, the request itself gone).
    status: str


@dataclass(frozen=True)
class StepOutput:
    """Everything one decode step produced, for all of the worker's running requests at once, and the
    answers to the router's calls that completed meanwhile (pdserve.serving.link)."""

    worker_id: str
    events: tuple[TokenEvent, ...]
    failed: tuple[Failure, ...] = ()  # requests the worker had to drop
    stats: WorkerStats | None = None
    replies: tuple[Reply, ...] = ()
    kv: KVEvents | None = None  # what the worker's prefix cache stored and evicted since its last output


@dataclass(frozen=True)
class Reply:
    """The answer to a call the router made on a worker's link: its value, or why it failed. `error` is
    None on success; otherwise `invalid` says the request itself was refused (the caller's error, a
    ValueError at the router) rather than the worker failing it."""

    call_id: int
    value: object = None
    error: str | None = None
    invalid: bool = False
