"""Speculative decoding: its configuration, the prompt lookup (n-gram) proposer, the acceptance rule.

A decode step at small batch is bound by reading the weights, so a forward over k + 1 tokens of one
sequence costs about what one token costs. Prompt lookup guesses the next k tokens without a second model:
the longest suffix of the request's tokens (prompt and output) that occurred earlier, between
prompt_lookup_max and prompt_lookup_min tokens long, and the k tokens that followed that earlier
occurrence. Replies that copy from their context (an agent editing a file it was given, a summary quoting
its source) repeat such spans, and each accepted draft token is a step saved.

The target model checks the k drafted tokens, with the request's last token, in one forward; each of the
k + 1 positions gives the target's distribution for the token after it. Acceptance (accept_greedy,
accept_sampled) keeps the output exactly the target's: greedy output is token-identical with speculation
on and off, and sampled output is distributed as the target's (the standard rejection rule: a draft token d
drawn from the draft's distribution q is kept with probability min(1, p(d) / q(d)), a rejected one replaced by a
draw from max(0, p - q) renormalised; prompt lookup's q puts all its mass on its one token).

A draft model (pdserve.engine.draft_model) is the other proposer: a smaller checkpoint of the same vocabulary
that drafts k tokens autoregressively, its q real.

The configuration is spelled as vLLM's `--speculative-config` spells it: a JSON object with `method`
"ngram" (`num_speculative_tokens` (k), `prompt_lookup_min`, `prompt_lookup_max`) or "draft_model" (`model`, the
draft's path, and `num_speculative_tokens`), and optionally `disable_by_batch_size` (no request speculates in a
step of more running requests than this). As in vLLM, `model` without `method` names the method: "ngram" is
prompt lookup, any other path a draft model. Other methods (EAGLE, ...) are refused at start-up: they are not
supported yet.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.sampling import (
    SamplingBatch,
    SamplingParams,
    logprobs_of,
    process_logits,
    scale_logits,
    token_seed,
)
from pdserve.perf.speculation import tokens_per_step

SUPPORTED_METHODS = ("ngram", "draft_model")
# Methods of the field that a later change may add; named in the refusal so that the message says
# "not yet" rather than "unknown".
KNOWN_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
MAX_SPECULATIVE_TOKENS = 16  # k: a verification chunk is k + 1 tokens; more is never free
MAX_LOOKUP = 64  # the longest n-gram searched for


@dataclass(frozen=True)
class SpeculativeConfig:
    """A worker's speculation (decode and colocated roles; a prefill worker samples one token per prompt).

    disable_by_batch_size: no request speculates while more than this many requests run (None: the rule of
    free_rows, from the cost model; see max_speculating_batch)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1  # a one-token match drafts too: at batch 1 a wrong draft costs ~3 % of a step
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's checkpoint (a Hugging Face directory or a .gguf file)

    def __post_init__(self) -> None:
        self._check_method(self.method)
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError('speculative config: method "draft_model" needs "model", the draft checkpoint\'s path')
            if not os.path.exists(self.model):
                raise ValueError(f"speculative config: the draft model path {self.model!r} does not exist")
        elif self.model is not None:
            raise ValueError(f'speculative config: "model" is the draft of method "draft_model", '
                             f'not of {self.method!r}')
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_LOOKUP)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_LOOKUP)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)

    @staticmethod
    def _check_method(method: object) -> None:
        if method not in SUPPORTED_METHODS:
            if method in KNOWN_METHODS:
                raise ValueError(f"speculative method {method!r} is not supported yet: only "
                                 f"{' and '.join(SUPPORTED_METHODS)} are")
            raise ValueError(f"unknown speculative method {method!r}: the supported ones are "
                             f"{' and '.join(SUPPORTED_METHODS)}")

    @classmethod
    def parse(cls, text: str | dict | None) -> SpeculativeConfig | None:
        """The configuration from the flag's JSON (or a dict: a YAML config file's); None for none.
        ValueError names what is wrong, so a worker refuses to start rather than serve without it."""
        if text is None or text == "":
            return None
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(text, dict):
            raise ValueError("--speculative-config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        text = _with_method(text)
        cls._check_method(text["method"])
        fields = set(cls.__dataclass_fields__)
        unknown = sorted(set(text) - fields)
        if unknown:
            raise ValueError(f"--speculative-config has unsupported keys {unknown}; the keys are {sorted(fields)}")
        return cls(**text)


def _with_method(text: dict) -> dict:
    """The configuration with its method named, as vLLM names it when only `model` is given: "ngram" (or
    "[ngram]") is prompt lookup, a name that says eagle, medusa or mlp_speculator is that method (refused: not
    supported yet), any other path a draft model."""
    if text.get("method") is not None:
        return text
    model = text.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError('--speculative-config needs a method ("ngram" or "draft_model") or a draft "model"')
    if model in ("ngram", "[ngram]"):
        return {**{k: v for k, v in text.items() if k != "model"}, "method": "ngram"}
    name = os.path.basename(model.rstrip("/")).lower()
    method = next((m for m in ("eagle3", "eagle", "medusa", "mlp_speculator") if m.replace("_", "-") in name
                   or m in name), "draft_model")
    return {**text, "method": method}


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"speculative config: {name} must be an integer in [{lo}, {hi}], got {value!r}")


def propose(tokens: Sequence[int] | np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of `tokens` between
    lookup_max and lookup_min tokens long (the latest with k tokens after it, else the one with the most);
    [] when no such suffix occurred before. The earlier occurrence may overlap the suffix (a run of one
    repeated token proposes more of it).

    The search runs in numpy (a request's TokenBuffer gives the tokens as an array without a copy): each length
    is a few passes over the context in C: ~0.05 ms a step at 32k tokens, where a loop in Python took ~3.8 ms
    (`python -m bench.speculative --lookup-cost`)."""
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
    n_tokens = len(arr)
    if k <= 0 or n_tokens < lookup_min + 1:
        return []
    for n in range(min(lookup_max, n_tokens - 1), lookup_min - 1, -1):
        # Starts of earlier occurrences: 0 .. n_tokens - n - 1 (not the suffix itself).
        starts = np.flatnonzero(arr[:n_tokens - n] == arr[n_tokens - n])
        for j in range(1, n):
            if not len(starts):
                break
            starts = starts[arr[starts + j] == arr[n_tokens - n + j]]
        if len(starts):
            # The latest start with k tokens after its match wins, else the earliest (the most tokens after it).
            full = starts[starts + n + k <= n_tokens]
            start = int(full[-1]) if len(full) else int(starts[0])
            return arr[start + n:start + n + k].tolist()
    return []


class TokenBuffer:
    """A request's tokens as a growing int64 array, extended by what was appended since the last call, so that
    propose searches a long context without converting it every step. Requests only append; a token list that
    shrank, or whose token at the buffer's end differs, is copied again all the same."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.int64)
        self._n = 0

    def view(self, tokens: Sequence[int]) -> np.ndarray:
        n = len(tokens)
        if n < self._n or (self._n and self._buf[self._n - 1] != tokens[self._n - 1]):
            self._n = 0
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf), 256), dtype=np.int64)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        if n > self._n:
            self._buf[self._n:n] = tokens[self._n:n]
            self._n = n
        return self._buf[:n]


def accept_greedy(target: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The tokens a greedy verification emits: target[i] is the target's argmax after the last token and
    draft[:i] (len(draft) + 1 of them). Drafts are kept while they equal the target's choice; the first
    disagreement is replaced by the target's token, and after all are kept the last position's (the bonus)
    follows. So 1 to len(draft) + 1 tokens, each the one plain decoding would have produced."""
    assert len(target) == len(draft) + 1, "a verification has one more target position than drafts"
    out: list[int] = []
    for t, d in zip(target, draft):
        out.append(t)
        if t != d:
            return out
    out.append(target[-1])
    return out


def accept_sampled(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator,
                   q: torch.Tensor | None = None) -> list[int]:
    """The tokens a sampled verification emits, distributed as the target's own samples would be.

    probs: [len(draft) + 1, vocab], the target's distributions (after penalties, temperature, top-k/top-p)
    at each position; q: [len(draft), vocab], the distributions the drafts were drawn from (a draft model's),
    or None for a draft that puts all its mass on one token (prompt lookup). Draft d is kept with probability
    min(1, p(d) / q(d)); on rejection the token is drawn from max(p - q, 0) renormalised; after every draft is
    kept, the bonus token is drawn from the last position's p."""
    assert probs.shape[0] == len(draft) + 1, "a verification has one more target position than drafts"
    assert q is None or q.shape[0] == len(draft), "one draft distribution per draft"
    probs = probs.float()
    out: list[int] = []
    for i, d in enumerate(draft):
        p = probs[i]
        qd = 1.0 if q is None else float(q[i, d])
        u = torch.rand((), generator=generator, device=p.device)
        if u * qd < p[d]:  # u < p(d) / q(d), without dividing by a q(d) that rounding made 0
            out.append(int(d))
            continue
        if q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - q[i].to(p)).clamp_(min=0.0)
        total = residual.sum()
        if total <= 0:  # p <= q everywhere means p == q, where d is always kept (up to rounding): keep it
            out.append(int(d))
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[-1], 1, generator=generator)))
    return out


def verification_batch(params: SamplingParams, seed: int, output_index: int, draft: Sequence[int],
                       history: list[int] | None = None, banned: tuple[int, ...] = (),
                       masks: torch.Tensor | None = None, device: torch.device | str = "cpu") -> SamplingBatch:
    """The sampling inputs of a verification's len(draft) + 1 positions, each what a plain step would give
    the request there, had the drafts before it been sampled: position i samples output token
    output_index + i, its penalties count the request's tokens (history: prompt then output, if it is
    penalized) and draft[:i], the ids min_tokens holds back (banned) are banned while output_index + i is
    below min_tokens, and under structured output it draws from masks[i] (the matcher's bitmask after
    draft[:i], pdserve.engine.scheduler_spec.grammar_masks)."""
    rows = len(draft) + 1
    drafted = list(draft)
    return SamplingBatch.build(
        [params] * rows, [seed] * rows, [output_index + i for i in range(rows)], device,
        histories=[history + drafted[:i] for i in range(rows)] if history is not None else (),
        banned=[banned if output_index + i < params.min_tokens else () for i in range(rows)] if banned else (),
        masks=list(masks) if masks is not None else ())


def verify(logits: torch.Tensor, draft: Sequence[int], params: SamplingParams, seed: int, output_index: int,
           batch: SamplingBatch | None = None, q: torch.Tensor | None = None
           ) -> tuple[list[int], list[TokenLogprob] | None]:
    """The tokens a verification chunk emits (1 to len(draft) + 1), and their logprobs if the request asks.
    logits: [len(draft) + 1, vocab], the target's raw logits at the chunk's positions; batch: their sampling
    inputs (verification_batch; None: a request with no penalties, banned ids or mask); q: [len(draft), vocab],
    the draft model's distributions the drafts were drawn from (None: prompt lookup's, all on its token; unused
    when greedy, whose drafts are the draft's argmax). Each position's logits
    get what the sampler gives a plain step's (pdserve.engine.sampling.process_logits, scale_logits): greedy
    takes the argmax of the penalized and masked logits; sampling draws by the rejection rule from the
    distribution after the temperature, min-p and top-k / top-p, with a generator seeded by the request's seed
    and the first token's output index (the draw is reproducible, though not the one plain decoding makes: the
    distribution is the same, the tokens are not)."""
    if batch is None:
        batch = verification_batch(params, seed, output_index, draft, device=logits.device)
    processed = process_logits(logits, batch)
    if params.greedy:
        emitted = accept_greedy(processed.argmax(dim=-1).tolist(), draft)
        return emitted, emitted_logprobs(logits, processed, emitted, params)
    scaled = scale_logits(processed, batch)
    gen = torch.Generator(device=logits.device)
    gen.manual_seed(token_seed(seed, output_index))
    emitted = accept_sampled(scaled.softmax(dim=-1), draft, gen, q)
    return emitted, emitted_logprobs(logits, scaled, emitted, params)


def emitted_logprobs(raw: torch.Tensor, processed: torch.Tensor, emitted: Sequence[int],
                     params: SamplingParams) -> list[TokenLogprob] | None:
    """Each emitted token's logprob, rank and top k at the position it was drawn from, under the distribution a
    plain step reports (pdserve.engine.sampling.sample): the raw logits', or with logprobs_mode "processed" those
    the draw was made from. None if the request asks for no logprobs."""
    if params.logprobs is None:
        return None
    source = processed if params.logprobs_mode == "processed" else raw
    rows = source[:len(emitted)].float()
    tokens = torch.tensor(list(emitted), dtype=torch.int64, device=rows.device)
    return logprobs_of(rows.log_softmax(dim=-1), tokens, params.logprobs).rows(emitted, [params.logprobs] * len(emitted))


# A verification row's cost as a share of a plain step's, below the ridge point (where max_speculating_batch lets
# requests draft): the weights are read once whatever the rows, and what a row adds is its activations, attention
# and sampling. Measured on this project's 2-core CPU: a verification of 4 drafts costs 1.0-1.15x a plain step
# (docs/benchmarks.md, bench/speculative.py); a GPU's rows cost less. It keeps k from growing past what the
# acceptance pays for.
ROW_COST = 0.03
# The weight of a verification's outcome in the next one's estimate: each earlier one counts DECAY times less,
# so the rate follows the request's recent text (copying a span, then writing its own words).
DECAY = 0.7


@dataclass
class DraftState:
    """A request's adaptive draft length, from its recent acceptance.

    The acceptance rate a of a draft token is estimated from the request's verifications: each kept draft a success,
    the first rejected one a failure (the drafts after it say nothing), the counts decayed by DECAY per
    verification, starting from one of each (a = 0.5). k is then the length, up to the configured one, that emits
    the most tokens per unit of step cost: tokens_per_step(a, k) / (1 + ROW_COST k). A rejection does not cut k to
    what was kept: copying comes in spans, and a miss between two spans says little about the next one. A step
    where nothing matches drafts nothing and changes nothing (a later suffix may match)."""

    k: int
    successes: float = 1.0
    failures: float = 1.0
    tokens: TokenBuffer = field(default_factory=TokenBuffer)  # the request's tokens for propose

    def update(self, drafted: int, accepted: int, k_max: int) -> None:
        if drafted == 0:
            return
        self.successes = DECAY * self.successes + accepted
        self.failures = DECAY * self.failures + (1.0 if accepted < drafted else 0.0)
        self.k = best_draft_length(self.successes / (self.successes + self.failures), k_max)


def best_draft_length(acceptance: float, k_max: int) -> int:
    """The k in [1, k_max] with the most tokens a verification emits per its cost at this acceptance rate (the
    shortest of equals)."""
    return max(range(1, k_max + 1), key=lambda k: tokens_per_step(acceptance, k) / (1.0 + ROW_COST * k))


def free_rows(peak_flops: float, peak_bytes_per_second: float, weight_bytes_per_param: float) -> int:
    """The rows a step may carry while it stays bound by reading the weights, from the roofline the cost
    model uses (pdserve.perf.costs.RooflineCosts): a row costs 2 FLOPs per parameter, the step reads every
    parameter once, so the weights' read time covers rows up to the device's ridge point,
    peak_flops x bytes per parameter / (2 x peak bytes per second). Below it a verification's extra rows are
    about free; above it each costs its FLOPs."""
    return max(1, int(peak_flops * weight_bytes_per_param / (2.0 * peak_bytes_per_second)))


def max_speculating_batch(config: SpeculativeConfig, ridge_rows: int) -> int:
    """The most running requests at which requests still speculate: the configured disable_by_batch_size,
    else as many as keep a step of full drafts (k + 1 rows each) within the ridge rows."""
    if config.disable_by_batch_size is not None:
        return config.disable_by_batch_size
    return max(1, ridge_rows // (config.num_speculative_tokens + 1))
