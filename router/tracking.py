"""What the router records of each request it serves, whatever the protocol (gRPC or HTTP): one
timeline per request, observed into the request metrics (router.metrics) when the request ends."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from router.metrics import RouterMetrics


@dataclass
class Timeline:
    """What the router saw of one request, for its response timings and its metrics."""

    protocol: str  # "grpc" or "http"
    arrived: float = field(default_factory=time.monotonic)
    admitted: float = 0.0
    token_times: list[float] = field(default_factory=list)  # when each output token was streamed
    token_versions: list[int] = field(default_factory=list)  # the weight version that sampled each
    prompt_tokens: int = 0
    finish_reason: str = "none"  # until the request ends with one
    code: str = "OK"  # gRPC's status names, for HTTP requests too
    service_tier: str = "default"  # the tier asked for (pdserve.tiers)
    served_tier: str = "default"  # and the tier served

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        self.token_times.extend([now] * n)

    def record(self, metrics: RouterMetrics | None) -> None:
        if metrics is None:
            return
        t = self
        metrics.observe_request(
            finish_reason=t.finish_reason, code=t.code, protocol=t.protocol,
            queue_s=t.admitted - t.arrived if t.admitted else None,
            ttft_s=t.token_times[0] - t.arrived if t.token_times else None,
            e2e_s=t.token_times[-1] - t.arrived if t.token_times and t.finish_reason != "cancelled" else None,
            token_times=t.token_times, prompt_tokens=t.prompt_tokens, output_tokens=len(t.token_times),
            service_tier=t.service_tier, served_tier=t.served_tier, token_versions=t.token_versions)
