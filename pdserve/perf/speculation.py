"""What speculative decoding buys a decode step, from the cost model (pdserve.perf.costs).

A decoding request that drafts k tokens has them verified with its last token in one forward of k + 1 rows
(pdserve.engine.speculative). In the step's cost that is k more rows of the linear layers and of the LM head,
and the drafts' attention over the request's context (k x context pairs, and the triangle among the drafts):
costed as the prompt-chunk rows of a mixed step (StepCosts.step_time's prefill terms), so at a small batch,
where a step reads the weights whatever its rows, a verification costs about a plain step, and once the rows'
compute outgrows the weights' read it costs more (verify_step_time).

A verification emits the accepted drafts and one more token. With each draft accepted with probability a,
independently, given the ones before it were, the run has j + 1 tokens with probability a^j (1 - a) (j < k) and
k + 1 with probability a^k, so a step emits (1 - a^(k + 1)) / (1 - a) tokens per request on average
(tokens_per_step; k + 1 at a = 1). A measured rate comes from the workers' counts (pdserve.serving.messages
WorkerStats.speculation, the router's pdserve_worker_spec_* metrics): the mean accepted length per verification is
a (1 - a^k) / (1 - a) for k drafted, which acceptance_from_lengths inverts.

SpeculationModel is a pool's speculation as the planner sees it: k, the acceptance rate, and the batch above which
no request drafts (the engine's disable_by_batch_size; None: wherever a verification's tokens cost less than
plain steps', the roofline's rule: pdserve.engine.speculative.max_speculating_batch). SpeculativeCosts is a cost
model whose decode steps speculate: what a simulated step of one token per request costs is the verification's
time over the tokens it emits (a fluid model: a request's tokens come at the mean rate, not in runs, so
TPOT and throughput are the expected ones; a step that carries prompt chunks is costed as a plain mixed step,
its decodes one token each, which undercounts what they gain).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.perf.costs import StepCosts, Transport

def tokens_per_step(acceptance: float, k: float) -> float:
    """Expected tokens a verification of k drafts emits, each accepted with probability `acceptance`
    (independently, given the ones before): (1 - a^(k + 1)) / (1 - a); 1 with no drafts, k + 1 at a = 1."""
    _check_rate(acceptance)
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def accepted_per_step(acceptance: float, k: float) -> float:
    """Expected drafts a verification of k keeps: tokens_per_step less the one it always emits."""
    return tokens_per_step(acceptance, k) - 1.0


def acceptance_from_lengths(mean_accepted: float, k: float) -> float:
    """The acceptance rate a whose verifications of k drafts keep mean_accepted on average (the inverse of
    accepted_per_step, which rises with a from 0 to k): by bisection, to 1e-9."""
    if not k > 0 or not 0 <= mean_accepted <= k:
        raise ValueError(f"a mean accepted length must be in [0, k] for k > 0 drafts, got {mean_accepted} of {k}")
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        if accepted_per_step(mid, k) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def verify_step_time(costs: StepCosts, seqs: int, context: int, k: int) -> float:
    """A decode step of `seqs` requests (`context` tokens of KV between them) each verifying k drafts: the
    plain step with seqs x k more rows (linear layers and LM head) and the drafts' attention over the contexts
    (each draft sees its request's context and the drafts before it), as a mixed step costs them."""
    if k == 0:
        return costs.step_time(0, 0, 0, seqs, context)
    pairs = k * context + seqs * k * (k + 1) // 2
    return costs.step_time(seqs * k, pairs, seqs * k, seqs, context)


@dataclass(frozen=True)
class SpeculationModel:
    """A pool's speculative decoding as the planner prices it: k drafts per verification (the engine's
    num_speculative_tokens), the acceptance rate a of a draft, and max_batch, the most running requests at
    which requests still draft (None: while it pays, speedup > 1)."""

    k: int
    acceptance: float
    max_batch: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or not 1 <= self.k <= 16:
            raise ValueError(f"speculative tokens (k) must be an integer in [1, 16], got {self.k!r}")
        _check_rate(self.acceptance)
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"a speculating batch cap must be >= 1, got {self.max_batch}")

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(self.acceptance, self.k)

    def speedup(self, costs: StepCosts, seqs: int, context: int) -> float:
        """Tokens per second of a speculating step against a plain one, at this batch and context:
        tokens_per_step x plain step / verification step (below 1 where verification is not free enough)."""
        return self.tokens_per_step * costs.step_time(0, 0, 0, seqs, context) / verify_step_time(
            costs, seqs, context, self.k)

    def token_time(self, costs: StepCosts, seqs: int, context: int) -> float:
        """The time per emitted token of each running request at this batch: a verification step over the
        tokens it emits where requests draft (batch within max_batch, or where it pays when max_batch is
        None), else the plain step."""
        plain = costs.step_time(0, 0, 0, seqs, context)
        if self.max_batch is not None and seqs > self.max_batch:
            return plain
        spec = verify_step_time(costs, seqs, context, self.k) / self.tokens_per_step
        return spec if self.max_batch is not None else min(plain, spec)

    def as_dict(self) -> dict:
        return {"num_speculative_tokens": self.k, "acceptance": self.acceptance, "max_batch": self.max_batch,
                "tokens_per_step": self.tokens_per_step}


class SpeculativeCosts:
    """A cost model (StepCosts) whose decode-only steps speculate: step_time of such a step is the time per token
    each request gets (SpeculationModel.token_time), so a simulator that makes one token per request a step runs
    at the speculating rate. Steps that compute prompt tokens are the base model's."""

    def __init__(self, base: StepCosts, model: SpeculationModel):
        self.base, self.model = base, model

    @property
    def kv_bytes_per_token(self) -> int:
        return self.base.kv_bytes_per_token

    @property
    def weight_bytes(self) -> int:
        return self.base.weight_bytes

    @property
    def transport(self) -> Transport:
        return self.base.transport

    def step_time(self, prefill_tokens: int, prefill_pairs: int, prefill_seqs: int, decode_seqs: int,
                  decode_context: int) -> float:
        if prefill_tokens or not decode_seqs:
            return self.base.step_time(prefill_tokens, prefill_pairs, prefill_seqs, decode_seqs, decode_context)
        return self.model.token_time(self.base, decode_seqs, decode_context)


def measured_speculation(metrics_text: str) -> tuple[float, float]:
    """(acceptance rate, mean drafts per verification) from a scrape of the router's /metrics (Prometheus text):
    the pdserve_worker_spec_* counts summed over the workers that speculate. ValueError if it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"drafted": 0.0, "accepted": 0.0, "verifications": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "pdserve_worker_spec_drafted_tokens_total":
                totals["drafted"] += s.value
            elif s.name == "pdserve_worker_spec_accepted_tokens_total":
                totals["accepted"] += s.value
            elif s.name == "pdserve_worker_spec_acceptance_length_count":
                totals["verifications"] += s.value
    if not totals["verifications"] or not totals["drafted"]:
        raise ValueError("the metrics have no speculative verifications (pdserve_worker_spec_*): were they scraped "
                         "from a cluster serving with --speculative-config, after some traffic?")
    k = totals["drafted"] / totals["verifications"]
    mean = min(totals["accepted"] / totals["verifications"], k)
    return acceptance_from_lengths(mean, k), k


def _check_rate(a: float) -> None:
    if not (isinstance(a, (int, float)) and math.isfinite(a) and 0.0 <= a <= 1.0):
        raise ValueError(f"an acceptance rate must be in [0, 1], got {a!r}")

