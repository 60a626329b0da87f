"""Per-request timelines and the aggregate report, with the definitions of `vllm bench serve`.

All times are seconds after the start of the run (the runner's clock); the report shows milliseconds.

  TTFT  arrival of the first message carrying a token - send time
  E2EL  arrival of the last message - send time (end-to-end latency)
  TPOT  (E2EL - TTFT) / (output_tokens - 1): the mean time per output token after the first, one value
        per request; undefined for one-token requests (left out of the TPOT statistics, and such a
        request meets any TPOT SLO, as in vLLM)
  ITL   every gap between consecutive tokens, one sample per token after the first. pdserve streams
        one message per token, so a sample is the gap between two messages. Where a message carries
        k > 1 tokens after a gap g, each of its tokens gets g / k (SGLang's bench_serving does the same;
        vLLM would count one sample of g); extra tokens in the first message get 0. So a request has
        output_tokens - 1 ITL samples summing to its last-token time - TTFT: its mean ITL is its TPOT
        up to the final message's own gap.

Group sampling (`pdserve bench --n N`: every request asks for N samples of its prompt): a request's
samples stream side by side, and its record keeps which sample each message is of. Its output tokens
are every sample's; TTFT is its first token of any sample, E2EL its last message; TPOT is the mean over
its samples of each sample's own (last message - first token) / (tokens - 1), and its ITL samples are
the gaps within each sample, as above: what one sequence of the group sees, not the gaps between
samples' messages. Input tokens count its prompt once.

Only successful requests count towards tokens, throughput and latency statistics (as in vLLM); failed
ones are counted by gRPC status code. Goodput is the rate of successful requests that met every SLO
given (DistServe; vLLM's --goodput); SLO attainment is their share of all requests sent, failures
included (a failed request misses its SLO).

Service tiers (`pdserve bench --service-tier-mix`): each record keeps the tier it asked for and the tier
the server reports it served (the last message's service_tier; lower than asked when downgraded). The
report then has `by_service_tier`, keyed by the tier asked for: the same statistics over that tier's
requests alone (throughputs over the whole run's duration, so the tiers' throughputs add up to the
run's), judged by that tier's SLO, plus `sent`, `served` (successful requests by the tier served),
`downgraded` (served lower than asked) and `refused` (failed with RESOURCE_EXHAUSTED: a full queue, as
flex's when it is refused at once). The run's own goodput then judges each request by its tier's SLO,
so the tiers' good requests add up to the run's (a tier with no SLO given, where another tier has one,
counts each of its successful requests as good: it met every SLO it was given).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.tiers import TIERS, ServiceTier

METRICS = ("ttft", "tpot", "itl", "e2el")
STAT_NAMES = ("mean", "median", "std", "p90", "p99")


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    send: float  # when the request left the client
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in that message)
    end: float | None = None  # last message, or the error
    input_tokens: int = 0
    max_tokens: int = 0
    finish_reason: str = ""
    error_code: str | None = None  # gRPC status name (or the exception's class for a client-side failure)
    error: str = ""
    service_tier: str | None = None  # the tier asked for; None: none was sent
    served_tier: str = ""  # the tier the server says it served ("" if it did not say)
    samples: int = 1  # samples of the prompt asked for (n)
    chunk_index: list[int] = field(default_factory=list)  # with samples > 1: the sample of each chunk

    @property
    def ok(self) -> bool:
        return self.error_code is None and self.end is not None

    @property
    def output_tokens(self) -> int:
        return sum(k for _, k in self.chunks)

    @property
    def first_token_time(self) -> float | None:
        return next((t for t, k in self.chunks if k > 0), None)

    @property
    def ttft(self) -> float | None:
        t = self.first_token_time
        return None if t is None else t - self.send

    @property
    def e2el(self) -> float | None:
        return None if self.end is None else self.end - self.send

    def streams(self) -> list[list[tuple[float, int]]]:
        """Each sample's chunks, by index (the chunks themselves with one sample)."""
        if self.samples == 1:
            return [self.chunks]
        out: list[list[tuple[float, int]]] = [[] for _ in range(self.samples)]
        for chunk, i in zip(self.chunks, self.chunk_index):
            out[i].append(chunk)
        return out

    @property
    def output_tokens_per_sample(self) -> list[int]:
        return [sum(k for _, k in chunks) for chunks in self.streams()]

    @property
    def tpot(self) -> float | None:
        if self.samples > 1:
            per_sample = []
            for chunks in self.streams():
                n, first = sum(k for _, k in chunks), next((t for t, k in chunks if k > 0), None)
                if n >= 2 and first is not None:
                    per_sample.append((chunks[-1][0] - first) / (n - 1))
            return sum(per_sample) / len(per_sample) if per_sample else None
        n, ttft, e2el = self.output_tokens, self.ttft, self.e2el
        if n < 2 or ttft is None or e2el is None:
            return None
        return (e2el - ttft) / (n - 1)

    @property
    def itl(self) -> list[float]:
        gaps: list[float] = []
        for chunks in self.streams():
            prev: float | None = None
            for t, k in chunks:
                if k == 0:
                    continue
                if prev is None:
                    gaps += [0.0] * (k - 1)
                else:
                    gaps += [(t - prev) / k] * k
                prev = t
        return gaps


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None: not part of the goodput."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name} must be > 0, got {v}")

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot or 0.0), (self.e2el_ms, r.e2el))
        return all(limit is None or (value is not None and value * 1e3 <= limit) for limit, value in checks)

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2el_ms": self.e2el_ms}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std (population), p90, p99; None for each when there are no values."""
    if not values:
        return dict.fromkeys(STAT_NAMES)
    n = len(values)
    mean = sum(values) / n
    return {"mean": mean, "median": percentile(values, 50), "std": math.sqrt(sum((v - mean) ** 2 for v in values) / n),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Most intervals open at once; one that ends at t and one that starts at t do not overlap."""
    events = sorted(ev for s, e in intervals for ev in ((s, 1), (e, -1)))  # at equal times -1 sorts first
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


NICE_BINS = (0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0)


def timeline_bin(duration: float, max_bins: int = 40, min_bin: float = 0.5) -> float:
    """A round bin width giving at most max_bins bins, and no narrower than min_bin: a bin must hold
    several decode steps or the curve shows the step rhythm instead of the throughput."""
    return next((b for b in NICE_BINS if b >= min_bin and duration / b <= max_bins), NICE_BINS[-1])


def timeline(records: Sequence[RequestRecord], duration: float, bin_s: float | None = None) -> dict[str, Any]:
    """Per time bin: output tokens delivered per second (failed requests' partial streams included),
    requests completed, and requests in flight at the start of the bin."""
    bin_s = bin_s or timeline_bin(duration)
    n = max(1, math.ceil(duration / bin_s - 1e-9))
    tokens = [0] * n
    completed = [0] * n
    for r in records:
        for t, k in r.chunks:
            tokens[min(int(t // bin_s), n - 1)] += k
        if r.ok:
            completed[min(int(r.end // bin_s), n - 1)] += 1
    starts = [round(i * bin_s, 6) for i in range(n)]
    in_flight = [sum(1 for r in records if r.send <= s and (r.end is None or r.end > s)) for s in starts]
    return {"bin_s": bin_s, "start_s": starts, "output_tokens_per_s": [k / bin_s for k in tokens],
            "completed": completed, "in_flight": in_flight}


def build_report(records: Sequence[RequestRecord], slo: Slo = Slo(), duration: float | None = None,
                 bin_s: float | None = None, tier_slos: Mapping[str, Slo] | None = None,
                 tiers: Sequence[str] | None = None) -> dict[str, Any]:
    """The aggregate of a run (vLLM's key names where vLLM has one) plus per-request rows and a timeline.

    duration: the run's wall time; default the last request's end (the first send is time 0).
    tier_slos: the SLO of a tier asked for (by name), where it is not `slo`.
    tiers: the tiers to report in by_service_tier (default: those the records asked for); the key is
    left out when there are none, as in a run without a tier mix.
    """
    if duration is None:
        duration = max((r.end if r.end is not None else r.send for r in records), default=0.0)
    tier_slos = dict(tier_slos or {})
    slo_of = lambda r: tier_slos.get(r.service_tier, slo) if r.service_tier else slo  # noqa: E731
    judged = slo.given or any(s.given for s in tier_slos.values())
    rep = _aggregate(records, slo_of, judged, duration, slo)
    if tiers is None:
        asked = {r.service_tier for r in records if r.service_tier}
        tiers = sorted(asked, key=_tier_order)
    if tiers:
        by_tier: dict[str, Any] = {}
        for tier in tiers:
            mine = [r for r in records if r.service_tier == tier]
            tslo = tier_slos.get(tier, slo)
            by_tier[tier] = {"sent": len(mine), **_tier_outcome(tier, mine),
                             **_aggregate(mine, lambda r, s=tslo: s, judged, duration, tslo)}
        rep["by_service_tier"] = by_tier
    rep["timeline"] = timeline(records, duration, bin_s)
    rep["requests"] = [request_row(r, slo_of(r), judged) for r in records]
    return rep


def _tier_order(name: str) -> tuple[int, str]:
    try:
        return ServiceTier(name).rank, name
    except ValueError:
        return len(TIERS), name


def _tier_outcome(tier: str, records: Sequence[RequestRecord]) -> dict[str, Any]:
    """What the successful requests asking for `tier` were served, how many lower, how many were refused."""
    ok = [r for r in records if r.ok]
    served = Counter(r.served_tier or "unreported" for r in ok)
    asked = _tier_order(tier)[0]
    return {"served": {t: served[t] for t in sorted(served, key=_tier_order)},
            "downgraded": sum(1 for r in ok if r.served_tier and _tier_order(r.served_tier)[0] > asked),
            "refused": sum(1 for r in records if r.error_code == "RESOURCE_EXHAUSTED")}


def _aggregate(records: Sequence[RequestRecord], slo_of, judged: bool, duration: float, slo: Slo) -> dict[str, Any]:
    """Counts, tokens, throughputs, latency statistics and goodput of these records; slo_of(record) is the
    SLO a record is judged by, judged whether any SLO was given (no goodput otherwise), slo the one shown."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: None)  # noqa: E731
    n_in = sum(r.input_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    codes = Counter(r.error_code or "INCOMPLETE" for r in failed)
    samples = Counter((r.error_code or "INCOMPLETE", r.error) for r in failed)
    rep: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "failed_by_code": dict(sorted(codes.items())),
        "errors": [{"code": c, "message": m, "count": k} for (c, m), k in samples.most_common(10)],
        "duration": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": rate(len(ok)),
        "input_throughput": rate(n_in),
        "output_throughput": rate(n_out),
        "total_token_throughput": rate(n_in + n_out),
        "peak_concurrency": peak_concurrency((r.send, r.end if r.end is not None else r.send) for r in records),
    }
    values = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.e2el for r in ok if r.e2el is not None],
    }
    for metric in METRICS:
        for stat, v in summarize(values[metric]).items():
            rep[f"{stat}_{metric}_ms"] = None if v is None else v * 1e3
    # The ITL split in two: the 1st->2nd token gap holds a disaggregated server's KV hand-off; the
    # later gaps show whether decoding is interrupted (by prefills sharing its steps, for one).
    first_gaps = [r.itl[0] for r in ok if r.itl]
    later = [g for r in ok for g in r.itl[1:]]
    for name, vals in (("first_gap", first_gaps), ("later_itl", later)):
        summary = summarize(vals)
        for stat in ("median", "p99"):
            rep[f"{stat}_{name}_ms"] = None if summary[stat] is None else summary[stat] * 1e3
    rep["max_later_itl_ms"] = max(later) * 1e3 if later else None
    good = sum(slo_of(r).met(r) for r in ok) if judged else None
    rep["slo"] = slo.as_dict()
    rep["good_requests"] = good
    rep["request_goodput"] = None if good is None else rate(good)
    rep["slo_attainment"] = None if good is None or not records else good / len(records)
    return rep


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def request_row(r: RequestRecord, slo: Slo = Slo(), judged: bool | None = None) -> dict[str, Any]:
    """judged: whether the run has any SLO (default: whether `slo` has one); met_slo is None if not."""
    judged = slo.given if judged is None else judged
    row = {"send_s": round(r.send, 6), "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
           "max_tokens": r.max_tokens, "ttft_ms": _ms(r.ttft), "tpot_ms": _ms(r.tpot), "e2el_ms": _ms(r.e2el),
           "itl_ms": [_ms(g) for g in r.itl], "finish_reason": r.finish_reason, "error_code": r.error_code,
           "error": r.error, "met_slo": slo.met(r) if judged else None}
    if r.service_tier is not None:
        row["service_tier"], row["served_tier"] = r.service_tier, r.served_tier or None
    if r.samples > 1:
        row["samples"], row["output_tokens_per_sample"] = r.samples, r.output_tokens_per_sample
    return row
