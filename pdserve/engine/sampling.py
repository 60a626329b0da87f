"""Sampling parameters and the batched sampler.

Randomness is stateless per token: the noise for output token ``n`` of a request is drawn from a
generator seeded with ``mix(seed, n)``. A request therefore samples the same tokens whatever batch it
runs in, after a preemption, and across the prefill -> decode hand-off, with no generator state to move.
Sampling is an exponential race (argmax of probs / Exp(1) noise), equivalent to drawing from probs,
with no host synchronisation inside the step.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.structured import StructuredOutput

_MASK64 = (1 << 64) - 1
MAX_LOGPROBS = 20  # the most alternatives a request may ask for at each position
LOGPROBS_MODES = ("raw", "processed")
MAX_N = 128  # samples of one prompt a request may ask for
# What a request may ask of the step thread that every request on its worker shares (#47). Every value
# below goes into the step's tensors (int64) or its per-token work, so each is bounded here, where every
# request is built, and again on the worker (the router's checks can be bypassed by an object built past
# them: unpickling a frozen dataclass runs no __post_init__).
# - int32 fields of the gRPC API (top_k, max_tokens, min_tokens, token ids): INT32_MAX, the wire's own bound.
# - stop strings: each generated token's text is searched for every stop string over a window as long as
#   the longest (pdserve.engine.output.TextOutput), so count x length is the characters scanned per token:
#   16 x 256 = 4 Ki, a few microseconds (100,000 strings made a token cost 20 ms of the step thread).
#   OpenAI's API takes 4.
# - stop_token_ids: looked up for each token, and banned from sampling under min_tokens (a row of the
#   sampler's mask each): 256.
INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1
MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 256
# What a request holding KV of older weights does when its worker's weights change (pdserve.weights):
# "recompute" its KV with the new weights (prompt and tokens so far), "keep" decoding over the old KV (up to
# max_staleness versions old; older is recomputed), or "abort" (it ends, FinishReason.ABORT, with its tokens).
VERSION_POLICIES = ("recompute", "keep", "abort")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables
    top_k: int = 0  # 0 disables (so does -1, made 0 here)
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: generation ends once the text contains one; not returned
    stop_token_ids: tuple[int, ...] = ()  # returned as the last token, not as text
    ignore_eos: bool = False
    # Log-probabilities (pdserve.engine.logprobs): None is off; k in [0, MAX_LOGPROBS] returns the logprob of
    # each sampled token (prompt_logprobs: of each prompt token given its prefix) and the k most likely.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Which distribution sampled tokens' logprobs are read from: "raw" (log_softmax of the model's logits)
    # or "processed" (of the logits the sampler drew from: after the penalties, the temperature and the
    # top-k / top-p masks; tokens masked out have -inf). Prompt logprobs are always raw.
    logprobs_mode: str = "raw"
    # Penalties on the logits before temperature: presence and frequency as OpenAI defines them (over the
    # output's tokens), repetition as transformers and vLLM do (over the prompt's and the output's tokens).
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from every token the output holds
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0; 1 is off: seen tokens' positive logits / p, negative * p
    min_tokens: int = 0  # EOS and stop_token_ids are held back until the output has this many tokens
    # Samples of the prompt: its KV computed once, shared by n sequences; sample i draws from the stream of
    # seed sample_seed(seed, i), so it equals the n=1 request with that seed.
    n: int = 1
    # A weight update in flight (VERSION_POLICIES); max_staleness bounds "keep" (None: unbounded).
    version_policy: str = "recompute"
    max_staleness: int | None = None
    # What the output must match (pdserve.engine.structured): a token mask each step; None: free text.
    structured: StructuredOutput | None = None
    # min_p in [0, 1]: after the temperature, tokens less likely than min_p x the most likely one are masked
    # out (0 is off); before the top-k / top-p masks.
    min_p: float = 0.0
    # The text (pdserve.engine.output.TextOutput): a stop string that ends the output is part of its text
    # (and so is the stop token's own text, unless it is a special token that is skipped); special tokens
    # are left out of the text unless skip_special_tokens is False.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Routed experts (pdserve.engine.routed_experts): every token's top-k expert ids in each mixture-of-experts
    # layer, returned with the tokens. One sample a request (n == 1).
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the frozen value hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= INT32_MAX:
            raise ValueError(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == -1 and isinstance(self.top_k, int):  # off, as 0 is (clients send either)
            object.__setattr__(self, "top_k", 0)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be an integer in [0, {INT32_MAX}] (0 or -1 disables), got {self.top_k!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        self._check_stops()
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.return_routed_experts and self.n > 1:
            raise ValueError(f"return_routed_experts is supported for one sample a request (n=1), got n={self.n}")
        if self.version_policy not in VERSION_POLICIES:
            raise ValueError(f"version_policy must be one of {', '.join(VERSION_POLICIES)}, "
                             f"got {self.version_policy!r}")
        m = self.max_staleness
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= INT64_MAX):
            raise ValueError(f"max_staleness must be an integer in [0, 2**63), got {m!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
            StructuredOutput(self.structured.kind, self.structured.spec)  # checked again: it may come unpickled

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP:
            raise ValueError(f"stop has {len(self.stop)} strings; the most is {MAX_STOP}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {_short(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop has a string of {max(len(s) for s in self.stop)} characters; the most is "
                             f"{MAX_STOP_CHARS}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids; the most is {MAX_STOP_TOKEN_IDS}")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {INT32_MAX}], got {_short(self.stop_token_ids)}")

    def checked(self) -> SamplingParams:
        """These parameters checked again (a copy, which runs __post_init__): an object that reached a worker
        over the wire, whose unpickling checked nothing."""
        return replace(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits (then the sampler needs the request's tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _short(values: tuple) -> str:
    """A field's values for an error message, cut short (a request may send thousands)."""
    return repr(values[:5])[:-1] + ", ...)" if len(values) > 5 else repr(values)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (n > 1): the n=1 request with this seed
    samples the same tokens."""
    return (seed + index) % (1 << 63)


def token_seed(seed: int, index: int) -> int:
    """A 63-bit seed for output token `index` of a request seeded with `seed` (splitmix64 finaliser)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling inputs of one step."""

    temperatures: torch.Tensor  # [rows] float32, 0 for greedy rows
    top_k: torch.Tensor  # [rows] int64, 0 = off (off on greedy rows)
    top_p: torch.Tensor  # [rows] float32, 1 = off (off on greedy rows)
    seeds: tuple[int, ...]  # per row; each request carries one (assigned if the client gave none)
    output_index: tuple[int, ...]  # per row: index of the token being sampled in the request's output
    all_greedy: bool
    any_filter: bool
    penalties: Penalties | None = None  # the rows with penalties, if any
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) the sampler may not draw
    # Logprobs: per row, k (None: not asked), and which rows read the processed distribution.
    logprobs: tuple[int | None, ...] = ()
    processed: torch.Tensor | None = None  # [rows] bool
    # Structured output: (rows, their token bitmasks [rows with one, words] int32), the tokens each may draw.
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    min_p: torch.Tensor | None = None  # [rows] float32, 0 = off; None: no sampling row has it

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], output_index: Sequence[int],
              device: torch.device | str = "cpu", histories: Sequence[list[int] | None] = (),
              banned: Sequence[tuple[int, ...]] = (), pending: Sequence[int | None] = (),
              previous: torch.Tensor | None = None, masks: Sequence[torch.Tensor | None] = ()) -> SamplingBatch:
        """histories, banned, pending, masks (per row, optional): a penalized row's tokens so far (prompt then
        output; PENDING ones are read from previous[pending row]), the ids a row may not draw, the bitmask of
        the ids a row under structured output may draw (pdserve.engine.grammar)."""
        penalties = Penalties.build(params, histories, output_index, pending, previous, device) \
            if any(h is not None for h in histories) else None
        ban = None
        if any(banned):
            rows = [r for r, ids in enumerate(banned) for _ in ids]
            ids = [t for row_ids in banned for t in row_ids]
            ban = (to_device(torch.tensor(rows), device), to_device(torch.tensor(ids), device))
        logprobs = tuple(p.logprobs for p in params)
        processed = None
        if any(p.logprobs is not None and p.logprobs_mode == "processed" for p in params):
            processed = to_device(torch.tensor([p.logprobs_mode == "processed" for p in params]), device)
        allowed = None
        if any(m is not None for m in masks):
            rows = [r for r, m in enumerate(masks) if m is not None]
            allowed = (to_device(torch.tensor(rows), device), to_device(torch.stack([masks[r] for r in rows]), device))
        return cls(
            temperatures=to_device(torch.tensor([p.temperature for p in params], dtype=torch.float32), device),
            top_k=to_device(torch.tensor([0 if p.greedy else p.top_k for p in params], dtype=torch.int64), device),
            top_p=to_device(torch.tensor([1.0 if p.greedy else p.top_p for p in params], dtype=torch.float32), device),
            seeds=tuple(seeds),
            output_index=tuple(output_index),
            all_greedy=all(p.greedy for p in params),
            any_filter=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
            penalties=penalties,
            banned=ban,
            logprobs=logprobs,
            processed=processed,
            allowed=allowed,
            min_p=to_device(torch.tensor([0.0 if p.greedy else p.min_p for p in params], dtype=torch.float32), device)
            if any(p.min_p > 0 and not p.greedy for p in params) else None,
        )

    @property
    def max_logprobs(self) -> int:
        """The most alternatives a row asks for; -1 if no row asks for logprobs."""
        return max((k for k in self.logprobs if k is not None), default=-1)


@dataclass(frozen=True)
class Penalties:
    """The penalized rows of a step: which rows, their tokens as flat (penalized row, token id) pairs, and
    their penalties, on the device. Counting happens in `apply`, where the vocabulary is known."""

    rows: torch.Tensor  # [P] int64: which rows of the batch
    output: tuple[torch.Tensor, torch.Tensor]  # (index into rows, token id) for every output token known
    prompt: tuple[torch.Tensor, torch.Tensor]  # the same for the prompt's tokens
    pending: tuple[torch.Tensor, torch.Tensor] | None  # (index into rows, row of previous) of PENDING tokens
    previous: torch.Tensor | None
    presence: torch.Tensor  # [P, 1] float32
    frequency: torch.Tensor  # [P, 1]
    repetition: torch.Tensor  # [P, 1]

    @classmethod
    def build(cls, params: Sequence[SamplingParams], histories: Sequence[list[int] | None],
              output_index: Sequence[int], pending: Sequence[int | None], previous: torch.Tensor | None,
              device: torch.device | str) -> Penalties:
        rows = [r for r, h in enumerate(histories) if h is not None]
        out_at, out_ids, prompt_at, prompt_ids, pend_at, pend_src = [], [], [], [], [], []
        for i, r in enumerate(rows):
            history = histories[r]
            split = len(history) - output_index[r]  # the prompt's length (a resumed request's included)
            prompt_ids += history[:split]
            prompt_at += [i] * split
            known = [t for t in history[split:] if t >= 0]  # PENDING tokens (-1) are on the device
            out_ids += known
            out_at += [i] * len(known)
            if len(known) < output_index[r]:  # its last token is still on the device (pipelined decode)
                assert pending and pending[r] is not None and previous is not None, "a PENDING token without its row"
                pend_at.append(i)
                pend_src.append(pending[r])

        def pair(at: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            return (to_device(torch.tensor(at, dtype=torch.int64), device),
                    to_device(torch.tensor(ids, dtype=torch.int64), device))

        def column(name: str) -> torch.Tensor:
            return to_device(torch.tensor([[getattr(params[r], name)] for r in rows], dtype=torch.float32), device)

        return cls(to_device(torch.tensor(rows, dtype=torch.int64), device), pair(out_at, out_ids),
                   pair(prompt_at, prompt_ids), pair(pend_at, pend_src) if pend_at else None, previous,
                   column("presence_penalty"), column("frequency_penalty"), column("repetition_penalty"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with the penalties applied to the penalized rows (a new tensor): repetition first
        (seen tokens' positive logits divided by it, negative ones multiplied), then frequency and presence
        (logit -= frequency * count + presence * (count > 0), over the output)."""
        sub = logits[self.rows]
        counts = torch.zeros_like(sub)
        ones = torch.ones_like(self.output[1], dtype=sub.dtype)
        counts.index_put_(self.output, ones, accumulate=True)
        if self.pending is not None:
            at, src = self.pending
            counts.index_put_((at, self.previous[src]), torch.ones_like(at, dtype=sub.dtype), accumulate=True)
        seen = counts > 0
        seen[self.prompt] = True
        sub = torch.where(seen, torch.where(sub > 0, sub / self.repetition, sub * self.repetition), sub)
        sub = sub - self.frequency * counts - self.presence * (counts > 0).to(sub.dtype)
        out = logits.clone()
        out[self.rows] = sub
        return out


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on the device without the host waiting for the device: on CUDA a plain copy from
    pageable memory synchronizes the stream (it would stall pipelined decode), so the data goes through
    pinned memory with non_blocking=True (the caching host allocator keeps the pinned block until the
    copy has run). Elsewhere: as is, or a plain copy."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The logits (a new tensor) with -inf on `rows` wherever their bitmask ([len(rows), words] int32, bit i
    of word w for token 32 w + i) does not allow the token; ids past the bitmask are not allowed. On the
    logits' device, with no host synchronisation."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made there: no copy from the host
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    allowed = bits.view(bitmask.shape[0], -1).bool()  # [rows, 32 * words]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))
    return out


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every logit outside each row's top-k, then outside its top-p nucleus."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [rows, vocab]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)
    sorted_logits.masked_fill_(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches p; the top token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p 1 (off) keep every token: their float32 mass can reach 1 before the tail ends.
    sorted_logits.masked_fill_((mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every logit whose probability is below its row's min_p x the row's most likely token's:
    p < min_p * p_max is logit < max_logit + log(min_p) (rows with min_p 0 keep everything)."""
    floor = logits.max(dim=-1, keepdim=True).values + min_p[:, None].log()  # [rows, 1]; -inf where off
    return logits.masked_fill(logits < floor, float("-inf"))


@dataclass(frozen=True)
class SampledLogprobs:
    """The logprobs of a step's sampled tokens, on the device: [rows] and [rows, k] for the largest k asked."""

    logprob: torch.Tensor  # [rows] float32
    rank: torch.Tensor  # [rows] int64
    top_ids: torch.Tensor  # [rows, k] int64
    top_logprobs: torch.Tensor  # [rows, k] float32

    def rows(self, sampled: Sequence[int], ks: Sequence[int | None]) -> list[TokenLogprob | None]:
        """On the host (this waits for the device): one TokenLogprob per row that asked, None elsewhere."""
        lp, rank, ids, top = (t.tolist() for t in (self.logprob, self.rank, self.top_ids, self.top_logprobs))
        return [None if k is None else TokenLogprob(tok, lp[r], rank[r], tuple(zip(ids[r][:k], top[r][:k])))
                for r, (tok, k) in enumerate(zip(sampled, ks))]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, SampledLogprobs | None]:
    """logits: [rows, vocab] fp32 -> sampled token ids [rows] int64 and, if a row asks, their logprobs
    (both stay on the logits' device).

    The logits the sampler draws from ("processed"): penalties, banned tokens (min_tokens), the structured
    output's mask (process_logits), then on sampling rows the temperature, the min-p mask and the top-k / top-p
    masks (scale_logits); greedy rows take the argmax of the penalized and masked logits."""
    raw = logits
    logits = process_logits(logits, batch)
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy, _logprobs(raw, logits, greedy, batch)
    is_greedy = batch.temperatures == 0
    scaled = scale_logits(logits, batch)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    gen = torch.Generator(device=logits.device)
    for row, (seed, index) in enumerate(zip(batch.seeds, batch.output_index)):
        gen.manual_seed(token_seed(seed, index))
        noise[row].exponential_(generator=gen)
    sampled = torch.where(is_greedy, greedy, (probs / noise).argmax(dim=-1))
    return sampled, _logprobs(raw, scaled, sampled, batch)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits after what every row gets before its temperature: the penalties, the banned tokens
    (min_tokens) and the structured output's mask (the logits themselves where a batch has none of these)."""
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.allowed is not None:
        logits = apply_token_bitmask(logits, *batch.allowed)
    return logits


def scale_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Processed logits (process_logits) as a sampling row draws from them: divided by its temperature, then
    its min-p and top-k / top-p masks; greedy rows are left as they are (temperature 1, no mask)."""
    is_greedy = batch.temperatures == 0
    scaled = logits / torch.where(is_greedy, 1.0, batch.temperatures)[:, None]
    if batch.min_p is not None:
        scaled = apply_min_p(scaled, batch.min_p)
    if batch.any_filter:
        scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    return scaled


def _logprobs(raw: torch.Tensor, processed: torch.Tensor, sampled: torch.Tensor,
              batch: SamplingBatch) -> SampledLogprobs | None:
    """The sampled tokens' logprobs under each row's distribution (raw or processed), ranks and top k."""
    k = batch.max_logprobs
    if k < 0:
        return None
    source = raw if batch.processed is None else torch.where(batch.processed[:, None], processed, raw)
    return logprobs_of(source.log_softmax(dim=-1), sampled, k)


def logprobs_of(lp: torch.Tensor, tokens: torch.Tensor, k: int) -> SampledLogprobs:
    """lp: [rows, vocab] log-probabilities, tokens: [rows]: each token's logprob, its rank (1 + the tokens
    strictly more likely) and the k most likely, on lp's device."""
    chosen = lp.gather(-1, tokens[:, None])
    top_logprobs, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], tokens[:, None][:, :0])
    return SampledLogprobs(chosen[:, 0], (lp > chosen).sum(dim=-1) + 1, top_ids, top_logprobs)
