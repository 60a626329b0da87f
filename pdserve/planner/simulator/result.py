"""What the simulator gives back: each request's times, the workers' peaks and busy time, and the
statistics per service tier."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.tiers import TIERS, TiersConfig


@dataclass
class SimResult:
    """Per request: seconds after the start (NaN where it does not apply); per worker: peaks and busy time."""

    arrival: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    first_token: np.ndarray  # when the client sees the first token
    second_token: np.ndarray
    end: np.ndarray  # when the client sees the last token
    rejected: np.ndarray  # bool: refused by admission (RESOURCE_EXHAUSTED)
    peak_kv_blocks: dict[str, int]  # worker -> most blocks in use at once
    busy_s: dict[str, float]  # worker -> seconds spent in steps
    kv_overflows: int  # decode steps that needed more blocks than the worker has (preemption in reality)
    steps: int
    worker_seconds: float = 0.0  # summed over workers, from asked for to gone (or the last request's end)
    sizes: list[tuple[float, int, int]] = field(default_factory=list)  # autoscaled: (time, prefill, decode) after each change
    tier: np.ndarray | None = None  # the rank of the tier each request asked for (pdserve.tiers)
    served_tier: np.ndarray | None = None  # ... and of the tier it was served as (priority -> default)
    preemptions: np.ndarray | None = None  # times each request was preempted (flex only)
    recomputes: np.ndarray | None = None  # ... of which its KV was dropped and its context recomputed

    @property
    def ok(self) -> np.ndarray:
        return ~self.rejected & ~np.isnan(self.end)

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def e2el(self) -> np.ndarray:
        return self.end - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.output_len > 1, (self.end - self.first_token) / (self.output_len - 1), np.nan)

    def tier_stats(self, tiers: TiersConfig | None = None) -> dict[str, dict]:
        """Per tier asked for: counts, TTFT and TPOT (median, p99), and the share of its requests within
        its own SLO (tiers.slo; a refused or downgraded request is judged by the tier it asked for)."""
        tiers = tiers or TiersConfig()
        out = {}
        for t in TIERS:
            sel = self.tier == t.rank
            if not sel.any():
                continue
            ok = sel & self.ok
            slo = tiers.slo_of(t)
            ttft, tpot = self.ttft[ok], self.tpot[ok]
            tpot = tpot[~np.isnan(tpot)]
            with np.errstate(invalid="ignore"):
                met = ok & (self.ttft <= slo.ttft_s) & (np.nan_to_num(self.tpot, nan=0.0) <= slo.tpot_s)

            def pct(v: np.ndarray, q: float, scale: float = 1.0) -> float | None:
                return float(np.percentile(v, q)) * scale if v.size else None

            out[t.value] = {
                "requests": int(sel.sum()), "completed": int(ok.sum()), "rejected": int((sel & self.rejected).sum()),
                "served_lower": int((sel & (self.served_tier != t.rank)).sum()),
                "median_ttft_s": pct(ttft, 50), "p99_ttft_s": pct(ttft, 99),
                "median_tpot_ms": pct(tpot, 50, 1e3), "p99_tpot_ms": pct(tpot, 99, 1e3),
                "slo_attainment": float(met.sum() / sel.sum()),
                "preemptions": int(self.preemptions[sel].sum()), "recomputes": int(self.recomputes[sel].sum())}
        return out
