"""What a benchmark sends and when: length distributions, arrival schedules and JSONL traces.

Everything here is pure and seeded: the same seed gives the same requests and the same schedule, so
two deployments (disaggregated and colocated) can be driven by exactly the same workload.

Synthetic prompts are token ids drawn uniformly from the vocabulary minus the end-of-sequence ids, so
the input length is exact; with ignore_eos the output length is exact too (as `vllm bench serve`
does for its random dataset).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.tiers import TIERS, ServiceTier

LENGTH_DISTS = ("fixed", "uniform", "longtail")
ARRIVALS = ("poisson", "closed", "bursty", "trace")
LONGTAIL_SIGMA = 1.0  # log-normal shape: mean = 1.65 x median, p99 = 10 x median (conversation traces)
LONGTAIL_CAP = 10  # default longest draw, as a multiple of the median


@dataclass(frozen=True)
class LengthSpec:
    """A token-length distribution.

    fixed     always `length`
    uniform   integers in [length * (1 - range_ratio), length * (1 + range_ratio)] (vLLM's random dataset)
    longtail  ShareGPT-like: log-normal with median `length` and sigma 1, rounded and clipped to
              [1, max_len] (default 10 x length): most requests are short, a few are very long
    """

    dist: str = "fixed"
    length: int = 128
    range_ratio: float = 0.5
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.dist not in LENGTH_DISTS:
            raise ValueError(f"length distribution must be one of {LENGTH_DISTS}, got {self.dist!r}")
        if self.length < 1:
            raise ValueError(f"length must be >= 1, got {self.length}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.max_len is not None and self.max_len < self.length:
            raise ValueError(f"max_len ({self.max_len}) must be >= length ({self.length})")

    @property
    def bounds(self) -> tuple[int, int]:
        """The smallest and largest length this distribution can draw."""
        if self.dist == "fixed":
            return self.length, self.length
        if self.dist == "uniform":
            return (max(1, int(self.length * (1 - self.range_ratio))),
                    max(1, int(self.length * (1 + self.range_ratio))))
        return 1, self.max_len if self.max_len is not None else LONGTAIL_CAP * self.length

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        lo, hi = self.bounds
        if self.dist == "fixed":
            return np.full(n, self.length, dtype=np.int64)
        if self.dist == "uniform":
            return rng.integers(lo, hi + 1, size=n)
        draws = rng.lognormal(mean=math.log(self.length), sigma=LONGTAIL_SIGMA, size=n)
        return np.clip(np.rint(draws), lo, hi).astype(np.int64)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: exactly one of token_ids, prompt or messages."""

    max_tokens: int
    token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    ignore_eos: bool = False
    timestamp: float | None = None  # trace replay: seconds after the start
    service_tier: str | None = None  # sent as GenerateRequest.service_tier; None: not sent (the server's default)

    @property
    def input_len(self) -> int | None:
        """Known up front for token-id prompts; text is tokenized by the server (see usage)."""
        return len(self.token_ids) if self.token_ids is not None else None

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for pdserve.client.grpc_client (build_request / AsyncClient.generate)."""
        kw: dict[str, Any] = {"max_tokens": self.max_tokens, "ignore_eos": self.ignore_eos}
        if self.token_ids is not None:
            kw["token_ids"] = list(self.token_ids)
        elif self.prompt is not None:
            kw["prompt"] = self.prompt
        else:
            kw["messages"] = [{"role": r, "content": c} for r, c in self.messages or ()]
        if self.service_tier is not None:
            kw["service_tier"] = self.service_tier
        return kw


class TokenSampler:
    """Random prompt token ids from the vocabulary without the excluded (end-of-sequence) ids."""

    def __init__(self, vocab_size: int, exclude: Iterable[int] = ()):
        allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.fromiter(exclude, dtype=np.int64))
        if allowed.size == 0:
            raise ValueError("no token id is left to build prompts from")
        self.allowed = allowed

    def __call__(self, rng: np.random.Generator, n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in self.allowed[rng.integers(0, self.allowed.size, size=n)])


class LengthSampler(TokenSampler):
    """Stand-in prompts for the planner's simulator: it needs lengths, not ids. It advances the random
    stream exactly as TokenSampler does, so one seed gives the same lengths and arrivals as a bench
    run, and returns range(n) instead of building n ids."""

    def __call__(self, rng: np.random.Generator, n: int) -> range:  # type: ignore[override]
        rng.integers(0, self.allowed.size, size=n)
        return range(n)


def check_context(input_spec: LengthSpec, output_spec: LengthSpec, max_model_len: int) -> None:
    out_hi = output_spec.bounds[1]
    if out_hi >= max_model_len:
        raise ValueError(f"output lengths reach {out_hi} tokens; the model's context is {max_model_len} "
                         "(a prompt needs at least one token)")


def synthetic_requests(input_spec: LengthSpec, output_spec: LengthSpec, sampler: TokenSampler,
                       max_model_len: int, seed: int, ignore_eos: bool = True) -> Iterator[BenchRequest]:
    """An endless seeded stream of token-id requests; prompts are shortened to fit the context."""
    check_context(input_spec, output_spec, max_model_len)
    rng = np.random.default_rng([seed, 1])
    while True:
        n_in = int(input_spec.sample(rng, 1)[0])
        n_out = int(output_spec.sample(rng, 1)[0])
        n_in = min(n_in, max_model_len - n_out)
        yield BenchRequest(max_tokens=n_out, token_ids=sampler(rng, n_in), ignore_eos=ignore_eos)


# -- service tiers --------------------------------------------------------------------------------
def tier_draws(mix: Mapping[ServiceTier, float], seed: int) -> Iterator[ServiceTier]:
    """An endless seeded stream of tiers, each drawn independently with the probabilities of `mix`
    (pdserve.tiers.parse_mix). It has its own random stream, so adding a mix to a workload changes none
    of its lengths, prompts or arrivals; and the tiers are laid out in rank order whatever the mix's
    order, so `default=0.6,priority=0.1,flex=0.3` draws exactly what `priority=0.1,default=0.6,flex=0.3` does."""
    tiers = [t for t in TIERS if mix.get(t, 0.0) > 0]
    if not tiers:
        raise ValueError("a tier mix needs a positive share")
    shares = np.array([mix[t] for t in tiers], dtype=np.float64)
    cum = np.cumsum(shares / shares.sum())
    rng = np.random.default_rng([seed, 4])
    while True:
        for u in rng.random(256):
            yield tiers[min(int(np.searchsorted(cum, u, side="right")), len(tiers) - 1)]


def with_tiers(requests: Iterable[BenchRequest], mix: Mapping[ServiceTier, float], seed: int) -> Iterator[BenchRequest]:
    """The requests, the i-th asking for the i-th tier of tier_draws(mix, seed)."""
    for req, tier in zip(requests, tier_draws(mix, seed)):
        yield dataclasses.replace(req, service_tier=tier.value)


# -- arrival schedules (seconds after the start; endless, the runner stops them) --------------------
def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Exponential gaps of mean 1 / rate; rate = inf sends everything at once."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {rate}")
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
        return
    rng = np.random.default_rng([seed, 2])
    t = 0.0
    while True:
        yield t
        t += float(rng.exponential(1.0 / rate))


def closed_arrivals() -> Iterator[float]:
    """Every request is ready at once; the runner's concurrency limit turns this into a closed loop."""
    return itertools.repeat(0.0)


def bursty_arrivals(burst_size: int, interval: float) -> Iterator[float]:
    """On/off: `burst_size` requests at the same instant every `interval` seconds, nothing in between
    (reinforcement-learning rollouts: the trainer idles the cluster, then submits a whole batch)."""
    if burst_size < 1:
        raise ValueError(f"burst size must be >= 1, got {burst_size}")
    if not interval > 0:
        raise ValueError(f"burst interval must be > 0, got {interval}")
    for k in itertools.count():
        yield from itertools.repeat(k * interval, burst_size)


def trace_arrivals(requests: Sequence[BenchRequest]) -> Iterator[float]:
    if any(r.timestamp is None for r in requests):
        raise ValueError("--arrival trace needs a timestamp on every line of the trace")
    return (float(r.timestamp) for r in requests)  # type: ignore[arg-type]


# -- JSONL traces -----------------------------------------------------------------------------------
TRACE_INPUT_KEYS = ("prompt", "messages", "token_ids", "input_len")
TRACE_KEYS = (*TRACE_INPUT_KEYS, "output_len", "max_tokens", "timestamp", "ignore_eos")


class TraceError(ValueError):
    pass


def load_trace(path: str | Path, sampler: TokenSampler | None = None, seed: int = 0,
               default_output_len: int | None = None, ignore_eos: bool = False,
               max_model_len: int | None = None) -> list[BenchRequest]:
    """Read a JSONL trace: one JSON object per line (blank lines skipped), for example

        {"prompt": "Hello", "output_len": 64, "timestamp": 0.0}
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}
        {"token_ids": [1, 2, 3], "output_len": 8}
        {"input_len": 512, "output_len": 128, "timestamp": 1.25}   (random token ids of that length)

    Exactly one input key; output_len (or max_tokens) unless a default is given; timestamp in seconds
    after the start (optional; sorted on load); ignore_eos overrides the flag for that line.
    Any problem raises TraceError naming the file and line.
    """
    path = Path(path)
    rng = np.random.default_rng([seed, 3])
    out: list[BenchRequest] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_trace_entry(json.loads(line), sampler, rng, default_output_len, ignore_eos, max_model_len))
            except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
                raise TraceError(f"{path}:{lineno}: {e}") from None
    if not out:
        raise TraceError(f"{path}: the trace has no requests")
    stamped = sum(r.timestamp is not None for r in out)
    if 0 < stamped < len(out):
        raise TraceError(f"{path}: {stamped} of {len(out)} lines have a timestamp; give it on all or none")
    if stamped:
        out.sort(key=lambda r: r.timestamp)  # stable: equal timestamps keep file order
    return out


def _trace_entry(obj: Any, sampler: TokenSampler | None, rng: np.random.Generator, default_output_len: int | None,
                 ignore_eos: bool, max_model_len: int | None) -> BenchRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(TRACE_KEYS))
    if unknown:
        raise ValueError(f"unknown keys {unknown}; accepted: {list(TRACE_KEYS)}")
    given = [k for k in TRACE_INPUT_KEYS if k in obj]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {list(TRACE_INPUT_KEYS)}, got {given or 'none'}")
    if "output_len" in obj and "max_tokens" in obj:
        raise ValueError("give output_len or max_tokens, not both")
    n_out = obj.get("output_len", obj.get("max_tokens", default_output_len))
    if n_out is None:
        raise ValueError("output_len is missing (and no default output length was given)")
    n_out = _positive_int(n_out, "output_len")
    ts = obj.get("timestamp")
    if ts is not None:
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise ValueError(f"timestamp must be a number of seconds >= 0, got {ts!r}")
        ts = float(ts)
    eos = obj.get("ignore_eos", ignore_eos)
    if not isinstance(eos, bool):
        raise ValueError(f"ignore_eos must be true or false, got {eos!r}")
    key = given[0]
    value = obj[key]
    kw: dict[str, Any] = {}
    if key == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError("prompt must be a non-empty string")
        kw["prompt"] = value
    elif key == "messages":
        if not isinstance(value, list) or not value or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value):
            raise ValueError('messages must be a non-empty list of {"role": str, "content": str}')
        kw["messages"] = tuple((m["role"], m["content"]) for m in value)
    elif key == "token_ids":
        if not isinstance(value, list) or not value or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            raise ValueError("token_ids must be a non-empty list of non-negative integers")
        kw["token_ids"] = tuple(value)
    else:
        n_in = _positive_int(value, "input_len")
        if sampler is None:
            raise ValueError("input_len needs the model's vocabulary (a TokenSampler)")
        if max_model_len is not None and n_in + n_out > max_model_len:
            raise ValueError(f"input_len + output_len = {n_in + n_out} exceeds the model's context of {max_model_len}")
        kw["token_ids"] = sampler(rng, n_in)
    return BenchRequest(max_tokens=n_out, ignore_eos=eos, timestamp=ts, **kw)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value
