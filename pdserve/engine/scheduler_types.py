"""The scheduler's vocabulary: a worker's role, a scheduled step and what it samples, a request's next chunk.

Role picks the scheduler's policy (pdserve.engine.scheduler); ScheduledStep is what one `schedule()` hands
the runner (requests, their chunks, and on a decode worker the requests whose KV blocks it reserved);
SampledToken is what accounting a step hands back, one per sampled token; chunk_of cuts a request's next
uncomputed tokens into a Chunk.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.engine.chunk import Chunk
from pdserve.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.engine.request import PENDING, FinishReason, Request
from pdserve.engine.routed_experts import RoutedExperts


class Role(str, enum.Enum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class ScheduledStep:
    requests: list[Request]
    chunks: list[Chunk]
    # Decode role: requests that got their KV blocks this step (now WAITING_FOR_KV); their prefill
    # workers are to be told that the destination is ready.
    reserved: list[Request] = field(default_factory=list)


@dataclass
class SampledToken:
    request: Request
    token: int
    finish_reason: FinishReason | None  # set when a token-level rule ended the request
    num_output_tokens: int = 0  # the request's output with this token (pipelined: more may be in flight)
    logprobs: TokenLogprob | None = None  # if the request asked for them
    prompt_logprobs: PromptLogprobs | None = None  # with the request's first sampled token, if it asked
    # A group's first tokens on a prefill worker (which forks nothing): sample sample_index's, request
    # being the group's. Elsewhere each sample is a request of its own and this is 0.
    sample_index: int = 0
    version: int = 0  # the weight version that sampled it (pdserve.weights)
    # The routed experts of the positions computed since the request's last token, up to the one that sampled
    # this token (pdserve.engine.routed_experts), if it asked.
    routed_experts: RoutedExperts | None = None


def take_prompt_logprobs(req: Request) -> PromptLogprobs | None:
    """The request's prompt logprobs, once all are computed (None before, and after they were taken)."""
    got = req.prompt_logprobs
    if got is None or len(got) < req.num_prompt_tokens - 1:
        return None
    req.prompt_logprobs = None
    return (None, *got[:req.num_prompt_tokens - 1])


def take_routed(req: Request, upto: int) -> RoutedExperts | None:
    """The request's routed experts not sent yet of the positions before `upto` (its token at index upto was
    sampled from position upto - 1); None if it did not ask or none are new."""
    return None if req.routed is None else req.routed.take(upto)


def chunk_of(req: Request, n: int, eos_token_ids: tuple[int, ...] = ()) -> Chunk:
    """The next n uncomputed tokens of a request; it samples if they reach its last known token. A
    PENDING last token (pipelined decode) is read on the device from the launched step's row. Below
    min_tokens, eos_token_ids (unless EOS is ignored) and the stop ids are banned from sampling. A request under
    structured output samples from its matcher's mask (filled here: its last token must be on the host), the
    banned ids taken out of the mask (pdserve.engine.grammar.Matcher.mask)."""
    start = req.num_computed_tokens
    end = start + n
    pending = req.unresolved > 0 and end == req.num_tokens and req.token_ids[-1] == PENDING
    params = req.params
    samples = end == req.num_tokens
    banned: tuple[int, ...] = ()
    if samples and req.num_output_tokens < params.min_tokens:
        banned = (*(() if params.ignore_eos else eos_token_ids), *params.stop_token_ids)
    mask = None
    if samples and req.grammar is not None:
        assert not pending, "a structured output's matcher needs its last token on the host"
        mask, banned = req.grammar.mask(banned), ()
    prompt_logprobs = None
    last_prompt = req.num_prompt_tokens - 1  # the last position whose next token is a prompt token
    if req.prompt_logprobs is not None and start < last_prompt:
        prompt_logprobs = (params.prompt_logprobs, req.token_ids[start + 1:min(end, last_prompt) + 1])
    return Chunk(
        token_ids=req.token_ids[start:end],
        start=start,
        block_ids=req.block_ids,
        sample=params if samples else None,
        seed=req.seed,
        output_index=req.num_output_tokens,
        pending_row=req.pending_row if pending else None,
        history=req.token_ids if samples and params.penalized else None,
        banned=banned,
        prompt_logprobs=prompt_logprobs,
        fanout=req.fanout if samples else 1,
        mask=mask,
        routed_experts=req.routed is not None,
    )
