"""Service tiers: what a request buys, and the one order every stage decides by.

A request asks for `auto`, `default`, `priority` or `flex` (the `service_tier` field of OpenAI, Gemini and
Bedrock); `auto` is `default`. The tier served is reported back and can be lower than asked: a priority
request that finds the fast lane full is served as default (router.cluster).

- priority: first in every queue (the router's line, the prefill batch, the decode reservations, the KV
  pushes, decode admission); decoded on the fast lane's workers when the cluster has them, whose small
  running batch is what makes its tokens come faster.
- default: after priority, in arrival order.
- flex: idle capacity. Refused at once when its own queue is full (never queued behind defaults, never
  taking their admission places), preempted first, with a floor (`flex_min_share` of the decode slots)
  below which it is neither preempted for another tier nor kept waiting behind one, so it never starves.

Every queue orders by (rank, arrival): `ServiceTier.rank`.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class ServiceTier(str, enum.Enum):
    PRIORITY = "priority"
    DEFAULT = "default"
    FLEX = "flex"

    @property
    def rank(self) -> int:
        """Position in every queue: lower goes first."""
        return _RANK[self]

    @classmethod
    def of_rank(cls, rank: int) -> ServiceTier:
        return TIERS[rank]


TIERS = (ServiceTier.PRIORITY, ServiceTier.DEFAULT, ServiceTier.FLEX)
_RANK = {t: i for i, t in enumerate(TIERS)}
REQUESTABLE = ("auto", "default", "priority", "flex")


def parse_tier(value: str | None) -> ServiceTier:
    """The tier a request asks for; empty or `auto` is default. ValueError for anything else."""
    if value is None or value == "" or value == "auto":
        return ServiceTier.DEFAULT
    try:
        return ServiceTier(value)
    except ValueError:
        raise ValueError(f"unknown service_tier {value!r}; expected one of {', '.join(REQUESTABLE)}") from None


def parse_mix(text: str) -> dict[ServiceTier, float]:
    """`priority=0.1,default=0.6,flex=0.3` -> shares by tier (normalised to sum to 1)."""
    shares: dict[ServiceTier, float] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep:
            raise ValueError(f"a tier mix is TIER=SHARE,...; got {item!r}")
        tier = parse_tier(name.strip())
        try:
            share = float(value)
        except ValueError:
            raise ValueError(f"the share of {name} must be a number, got {value!r}") from None
        if share < 0 or tier in shares:
            raise ValueError(f"each tier once, with a share >= 0 (in {text!r})")
        shares[tier] = share
    total = sum(shares.values())
    if total <= 0:
        raise ValueError(f"a tier mix needs a positive share (got {text!r})")
    return {t: s / total for t, s in shares.items()}


@dataclass(frozen=True)
class TierSLO:
    """What a tier is sold: time to first token and time per output token, at most."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("SLO targets must be positive")

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        return ttft_s <= self.ttft_s and (tpot_s is None or tpot_s <= self.tpot_s)


def _default_slos() -> dict[str, TierSLO]:
    return {"priority": TierSLO(1.0, 0.05), "default": TierSLO(4.0, 0.15), "flex": TierSLO(120.0, 1.0)}


def parse_tier_slos(items: list[str]) -> dict[str, TierSLO]:
    """`--tier-slo TIER=TTFT_MS:TPOT_MS` items -> {tier name: TierSLO}; ValueError says what is wrong."""
    given: dict[str, TierSLO] = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        ttft, colon, tpot = value.partition(":")
        try:
            if not (sep and colon):
                raise ValueError
            slo = TierSLO(float(ttft) / 1e3, float(tpot) / 1e3)
        except ValueError:
            raise ValueError(f"--tier-slo is TIER=TTFT_MS:TPOT_MS with positive numbers, got {item!r}") from None
        given[parse_tier(name.strip()).value] = slo
    return given


@dataclass(frozen=True)
class TiersConfig:
    """The cluster's tier settings (ClusterConfig.tiers; the serve flags and config keys of the same names)."""

    # Decode workers beside the decode pool serving priority only, each with this running-batch cap.
    fast_lane_workers: int = 0
    fast_lane_max_running: int = 4
    # A priority request that finds every fast-lane worker full (its prefill goes first either way, its
    # KV held meanwhile: router.dispatch): "wait" up to fast_lane_max_wait_s for room, then is served as
    # default; "downgrade": served as default at once.
    fast_lane_when_full: str = "wait"
    fast_lane_max_wait_s: float = 5.0
    # flex requests waiting (for admission or for a worker) beyond this are refused: RESOURCE_EXHAUSTED.
    flex_max_queued: int = 64
    # flex's floor: this share of each decode worker's slots (rounded up), and of the cluster's decode
    # slots in the router's line, is flex's whenever flex wants it.
    flex_min_share: float = 0.1
    slo: dict[str, TierSLO] = field(default_factory=_default_slos)

    def __post_init__(self) -> None:
        if self.fast_lane_workers < 0 or self.fast_lane_max_running < 1:
            raise ValueError("fast_lane_workers must be >= 0 and fast_lane_max_running >= 1")
        if self.fast_lane_when_full not in ("wait", "downgrade"):
            raise ValueError(f"fast_lane_when_full must be wait or downgrade, got {self.fast_lane_when_full!r}")
        if self.fast_lane_max_wait_s < 0 or self.flex_max_queued < 0 or not 0 <= self.flex_min_share <= 1:
            raise ValueError("fast_lane_max_wait_s and flex_max_queued must be >= 0, flex_min_share in [0, 1]")
        slo = dict(_default_slos())
        for name, value in self.slo.items():
            tier = parse_tier(name)
            slo[tier.value] = value if isinstance(value, TierSLO) else TierSLO(**value)
        object.__setattr__(self, "slo", slo)

    def slo_of(self, tier: ServiceTier) -> TierSLO:
        return self.slo[tier.value]


def flex_floor(share: float, slots: int) -> int:
    """Slots out of `slots` that are flex's whenever flex wants them."""
    return math.ceil(share * slots - 1e-9) if share > 0 else 0
