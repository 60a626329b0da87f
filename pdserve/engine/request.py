"""A request's state as the schedulers see it, and the token-level stop rules."""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.routed_experts import RoutedLog
from pdserve.engine.sampling import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    CANCELLED = "cancelled"
    ERROR = "error"
    ABORT = "abort"  # ended by a weight update under the "abort" version policy, with its tokens so far


class RequestStatus(enum.Enum):
    """Where a request stands in one worker's scheduler.

    WAITING -> RUNNING -> FINISHED on every worker. The role adds one state on each side of the hand-off:
    a prefill worker moves a request whose prompt is computed to HELD (its KV kept until it has been sent
    to the decode worker); a decode worker reserves blocks for a request whose KV is computed elsewhere
    and keeps it WAITING_FOR_KV until the KV has landed, when it joins the running batch.
    """

    WAITING = "waiting"  # queued: for compute, or (remote KV) for room to reserve
    RUNNING = "running"
    HELD = "held"  # prefill: prompt computed, first token sampled, KV kept for its decode worker
    WAITING_FOR_KV = "waiting_for_kv"  # decode: blocks reserved, KV arriving from a prefill worker
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the client's seed, or one assigned on arrival: every request samples reproducibly
    arrival_time: float = field(default_factory=time.monotonic)
    # Prompt then output tokens, one list: prefill, recompute after preemption and block hashing all
    # walk it without concatenating.
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0  # tokens whose K/V are in this worker's cache
    num_cached_tokens: int = 0  # of those, tokens served by the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)  # append-only while the request holds blocks
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks of token_ids, in order
    num_registered_blocks: int = 0  # leading blocks of block_ids offered to the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Decode side of a hand-off: the KV of token_ids comes from a prefill worker, with the next token.
    remote_kv: bool = False
    # A partial hand-off: the leading blocks of that KV this worker's prefix cache held (pinned at reservation,
    # KVCacheManager.pin_prefix); only the rest comes from the prefill worker.
    held_blocks: int = 0
    # Its service tier's rank (pdserve.tiers: 0 priority, 1 default, 2 flex): every queue orders by
    # (tier, queue_seq), queue_seq being the order the scheduler took it in.
    tier: int = 1
    queue_seq: int = 0
    # Preempted for another tier with its KV kept in its blocks: it resumes without recomputing.
    kept_kv: bool = False
    # Its prefix's blocks on their way back from a KV tier (pdserve.engine.kv_offload.TierLoad): it stays queued
    # until the load is over (KVCacheManager.loaded).
    tier_load: object | None = None
    # The weight version that computed the oldest KV it holds (pdserve.weights): its prefix-cache hashes are
    # rooted in it, and a weight update compares it with the new version (the request's version policy).
    kv_version: int = 0
    # Pipelined decode (pdserve.engine.scheduler.Scheduler.launch): tokens appended as PENDING whose values are
    # still on the device, and the row of the launched step's sampled tensor that holds the last one.
    unresolved: int = 0
    pending_row: int = -1
    # The worker's pdserve.engine.output.TextOutput, where this worker streams the request's tokens (their
    # text and stop strings are made where they are sampled); None elsewhere.
    text: object | None = None
    # Prompt logprobs still to be delivered (params.prompt_logprobs): entry p is the logprob of prompt token
    # p + 1, filled as the prompt's chunks are computed; None once delivered, or where they are not wanted
    # (asked not, or computed elsewhere).
    prompt_logprobs: list | None = field(init=False)
    # A group (params.n > 1): samples still to be drawn from the prompt's logits (n until its first
    # sampling, then 1); a sample forked from it has its index (pdserve.engine.scheduler.Scheduler.fork).
    fanout: int = field(init=False)
    sample_index: int = 0
    # Structured output (params.structured): this sample's pdserve.engine.grammar.Matcher, which has accepted
    # every output token known on the host; set when a scheduler takes the request in (or forks it).
    grammar: object | None = None
    # Routed experts (params.return_routed_experts): the log (pdserve.engine.routed_experts) of the entries
    # computed here and not yet sent; None where they are not wanted.
    routed: RoutedLog | None = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.routed = RoutedLog() if self.params.return_routed_experts else None
        self.prompt_logprobs = [] if self.params.prompt_logprobs is not None else None
        self.fanout = self.params.n

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


PENDING = -1  # a sampled token whose value has not reached the host yet (pipelined decode)
NO_TOKEN = -2  # an end with no token (a request a weight update aborted: FinishReason.ABORT)
SAMPLE_SEP = "~"  # sample i > 0 of a group runs under the id "<the group's id>~i"


def sample_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}{SAMPLE_SEP}{index}"


def group_of(request_id: str) -> tuple[str, int]:
    """(the group's id, the sample's index) of a request id (index 0 for a request of one sample)."""
    group, sep, index = request_id.rpartition(SAMPLE_SEP)
    return (group, int(index)) if sep and index.isdigit() else (request_id, 0)


def token_stop_reason(req: Request, eos_token_ids: tuple[int, ...], max_model_len: int,
                      end: int | None = None) -> FinishReason | None:
    """Whether the request must stop after its token at index end - 1 (default: its last appended
    token); stop strings are checked on text. A structured output ends when its grammar has (an EOS token
    completed it), ignore_eos or not."""
    end = req.num_tokens if end is None else end
    last = req.token_ids[end - 1]
    if (not req.params.ignore_eos and last in eos_token_ids) or last in req.params.stop_token_ids:
        return FinishReason.STOP
    if req.grammar is not None and req.grammar.terminated:
        return FinishReason.STOP
    return length_stop(req, max_model_len, end)


def first_token_stop(params: SamplingParams, token: int, eos_token_ids: tuple[int, ...], num_prompt_tokens: int,
                     max_model_len: int) -> FinishReason | None:
    """token_stop_reason for a first output token, without a request holding it (a group's sample on
    the prefill worker)."""
    if (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids:
        return FinishReason.STOP
    if params.max_tokens <= 1 or num_prompt_tokens + 1 >= max_model_len:
        return FinishReason.LENGTH
    return None


def length_stop(req: Request, max_model_len: int, end: int | None = None) -> FinishReason | None:
    """LENGTH if the request has no room for a token after its first `end` tokens (whatever their values)."""
    end = req.num_tokens if end is None else end
    if end - req.num_prompt_tokens >= req.params.max_tokens or end >= max_model_len:
        return FinishReason.LENGTH
    return None


def validate_prompt(prompt: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError saying what is wrong with a prompt of token ids."""
    if not prompt:
        raise ValueError("prompt is empty")
    bad = [t for t in prompt if not (0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(prompt) >= max_model_len:
        raise ValueError(f"prompt has {len(prompt)} tokens; the model's context is {max_model_len}, "
                         "which must also hold at least one generated token")
