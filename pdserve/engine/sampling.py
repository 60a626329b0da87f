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
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
MAX_LOGPROBS = 20  # the most alternatives a request may ask for at each position
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables
    top_k: int = 0  # 0 disables
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

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the frozen value hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits (then the sampler needs the request's tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


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
    top_k: torch.Tensor  # [rows] int64, 0 = off
    top_p: torch.Tensor  # [rows] float32, 1 = off
    seeds: tuple[int, ...]  # per row; each request carries one (assigned if the client gave none)
    output_index: tuple[int, ...]  # per row: index of the token being sampled in the request's output
    all_greedy: bool
    any_filter: bool

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], output_index: Sequence[int],
              device: torch.device | str = "cpu") -> SamplingBatch:
        return cls(
            temperatures=to_device(torch.tensor([p.temperature for p in params], dtype=torch.float32), device),
            top_k=to_device(torch.tensor([p.top_k for p in params], dtype=torch.int64), device),
            top_p=to_device(torch.tensor([p.top_p for p in params], dtype=torch.float32), device),
            seeds=tuple(seeds),
            output_index=tuple(output_index),
            all_greedy=all(p.greedy for p in params),
            any_filter=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
        )


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on the device without the host waiting for the device: on CUDA a plain copy from
    pageable memory synchronizes the stream (it would stall pipelined decode), so the data goes through
    pinned memory with non_blocking=True (the caching host allocator keeps the pinned block until the
    copy has run). Elsewhere: as is, or a plain copy."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


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
    sorted_logits.masked_fill_(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: [rows, vocab] fp32 -> sampled token ids [rows] int64 (stays on the logits' device)."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    is_greedy = batch.temperatures == 0
    scaled = logits / torch.where(is_greedy, 1.0, batch.temperatures)[:, None]
    if batch.any_filter:
        scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    gen = torch.Generator(device=logits.device)
    for row, (seed, index) in enumerate(zip(batch.seeds, batch.output_index)):
        gen.manual_seed(token_seed(seed, index))
        noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(is_greedy, greedy, sampled)
