"""What a worker's step and a KV hand-off cost, as the planner's simulator and the simulated engine
(pdserve.engine.sim_runner) ask for them.

A step is described by five numbers, whatever the worker's role:
  prefill_tokens   prompt tokens computed in the step (all chunks)
  prefill_pairs    attention work of those chunks: sum over chunks of n * start + n * (n + 1) / 2
                   (token i of a chunk starting at `start` attends to start + i + 1 tokens)
  prefill_seqs     chunks that end a prompt and sample its first token
  decode_seqs      requests decoding one token each
  decode_context   tokens of KV those decoding requests read (their contexts, summed)
A prefill worker's step has only the first three, a decode worker's only the last two; a colocated
worker's step mixes both.

Two models answer: `MeasuredCosts`, fitted to what `pdserve profile` measured on a device (least squares,
each term non-negative), and `RooflineCosts`, from the model's FLOPs and bytes against a GPU's
datasheet peaks (pdserve.perf.hardware; mixtures of experts, tensor and expert parallelism included).
Both describe the KV hand-off the same way: a latency and a bandwidth of the transport between two
workers.
"""
from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import numpy as np

from pdserve.config import ModelConfig
from pdserve.parallel.layout import TPLayout
from pdserve.perf.shapes import LatentAttentionShape
from pdserve.transfer.protocol import MIN_PART_BYTES


def attention_pairs(start: int, n: int) -> int:
    """Query-key pairs of a chunk of n tokens after `start` cached ones (causal)."""
    return n * start + n * (n + 1) // 2


@dataclass(frozen=True)
class Transport:
    """The KV hand-off between two workers: t(bytes) = latency_s + bytes / bytes_per_s."""

    latency_s: float
    bytes_per_s: float
    # A layer-by-layer push sends parts of at least this many bytes while later layers compute; what is
    # left after the first token is sampled is the last part (or more, when the link is slower than the
    # prefill that feeds it).
    part_bytes: int = MIN_PART_BYTES

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not self.bytes_per_s > 0:
            raise ValueError(f"transport needs latency >= 0 and bandwidth > 0, got {self}")

    def send_time(self, nbytes: int) -> float:
        """A whole transfer sent at once (KV held until its destination was ready)."""
        return self.latency_s + nbytes / self.bytes_per_s

    def exposed_time(self, nbytes: int, step_s: float) -> float:
        """First token sampled -> KV usable on the decode worker, for KV pushed during a step of step_s."""
        tail = min(nbytes, self.part_bytes) / self.bytes_per_s
        return self.latency_s + max(tail, nbytes / self.bytes_per_s - step_s)


class StepCosts(Protocol):
    kv_bytes_per_token: int
    weight_bytes: int
    transport: Transport

    def step_time(self, prefill_tokens: int, prefill_pairs: int, prefill_seqs: int, decode_seqs: int,
                  decode_context: int) -> float: ...


PREFILL_TERMS = ("overhead_s", "per_token_s", "per_pair_s", "per_seq_s")


@dataclass(frozen=True)
class MeasuredCosts:
    """Step times fitted to measurements (pdserve profile).

    prefill step = overhead + per_token * tokens + per_pair * pairs + per_seq * seqs   (linear)
    decode step  = batch_s(seqs) + per_context_token * context
        batch_s is piecewise linear through the measured batch sizes (extended along its last slope):
        a decode step is flat while reading the weights dominates and grows once the rows' compute
        does, which no single line follows.
    mixed step (colocated: decodes riding with prompt chunks) = the larger of the decode step and a
        prefill step whose rows are the chunks' tokens plus one per decode, with the decodes' context
        read on top: one forward over all rows, the weights read once.
    """

    prefill: dict[str, float]
    decode_batches: tuple[int, ...]
    decode_batch_s: tuple[float, ...]
    per_context_token_s: float
    transport: Transport
    kv_bytes_per_token: int
    weight_bytes: int

    def __post_init__(self) -> None:
        if set(self.prefill) != set(PREFILL_TERMS) or any(v < 0 for v in self.prefill.values()):
            raise ValueError(f"prefill costs need non-negative {PREFILL_TERMS}, got {self.prefill}")
        b, s = self.decode_batches, self.decode_batch_s
        if not b or len(b) != len(s) or list(b) != sorted(set(b)) or b[0] < 1 or min(s) < 0 \
                or self.per_context_token_s < 0:
            raise ValueError(f"decode costs need increasing batch sizes >= 1 and non-negative times, got {b}, {s}")

    def prefill_time(self, tokens: int, pairs: int, seqs: int) -> float:
        p = self.prefill
        return p["overhead_s"] + p["per_token_s"] * tokens + p["per_pair_s"] * pairs + p["per_seq_s"] * seqs

    def batch_time(self, seqs: int) -> float:
        b, s = self.decode_batches, self.decode_batch_s
        if seqs <= b[0] or len(b) == 1:  # below the smallest batch measured: the weights' read dominates
            return s[0]
        i = min(bisect.bisect_right(b, seqs), len(b) - 1)  # segment [i-1, i], the last one beyond
        slope = (s[i] - s[i - 1]) / (b[i] - b[i - 1])
        return s[i - 1] + slope * (seqs - b[i - 1])

    def step_time(self, prefill_tokens: int, prefill_pairs: int, prefill_seqs: int, decode_seqs: int,
                  decode_context: int) -> float:
        ctx = self.per_context_token_s * decode_context
        if not prefill_tokens:
            return self.batch_time(decode_seqs) + ctx if decode_seqs else 0.0
        t = self.prefill_time(prefill_tokens + decode_seqs, prefill_pairs, prefill_seqs + decode_seqs)
        if decode_seqs:
            t = max(t, self.batch_time(decode_seqs)) + ctx
        return t

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "measured", "prefill": dict(self.prefill),
                "decode": {"batches": list(self.decode_batches), "batch_s": list(self.decode_batch_s),
                           "per_context_token_s": self.per_context_token_s},
                "transport": asdict(self.transport), "kv_bytes_per_token": self.kv_bytes_per_token,
                "weight_bytes": self.weight_bytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MeasuredCosts:
        if d.get("kind") != "measured":
            raise ValueError(f"not a measured cost model: kind {d.get('kind')!r}")
        dec = d["decode"]
        return cls(dict(d["prefill"]), tuple(int(b) for b in dec["batches"]), tuple(map(float, dec["batch_s"])),
                   float(dec["per_context_token_s"]), Transport(**d["transport"]), int(d["kv_bytes_per_token"]),
                   int(d["weight_bytes"]))


def fit_nonnegative(features: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Least squares on relative error (each row divided by its time, so short steps count as much as
    long ones), with every coefficient >= 0: a term that comes out negative is dropped and the rest
    refitted (a negative cost per token would be noise, and would let long steps cost less)."""
    a = features / times[:, None]
    b = np.ones_like(times)
    active = list(range(features.shape[1]))
    while True:
        coef = np.zeros(features.shape[1])
        if active:
            sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
            coef[active] = sol
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))


def fit_measured(prefill_rows: list[dict[str, float]], decode_rows: list[dict[str, float]], transport: Transport,
                 kv_bytes_per_token: int, weight_bytes_: int) -> tuple[MeasuredCosts, dict[str, float]]:
    """The fitted model and its worst relative error on the measurements of each phase.

    prefill_rows: {"tokens", "pairs", "seqs", "seconds"}; decode_rows: {"seqs", "context", "seconds"}.
    """
    x = np.array([[1.0, r["tokens"], r["pairs"], r["seqs"]] for r in prefill_rows])
    t = np.array([r["seconds"] for r in prefill_rows])
    pc = fit_nonnegative(x, t)
    prefill = dict(zip(PREFILL_TERMS, map(float, pc)))
    batches = sorted({int(r["seqs"]) for r in decode_rows})
    # One unknown per measured batch size (its step time at zero context) and one per context token.
    xd = np.array([[float(r["seqs"] == b) for b in batches] + [r["context"]] for r in decode_rows])
    td = np.array([r["seconds"] for r in decode_rows])
    dc = fit_nonnegative(xd, td)
    batch_s = tuple(float(v) for v in np.maximum.accumulate(dc[:-1]))  # a bigger batch never costs less
    costs = MeasuredCosts(prefill, tuple(batches), batch_s, float(dc[-1]), transport, kv_bytes_per_token,
                          weight_bytes_)
    perr = max(abs(costs.prefill_time(r["tokens"], r["pairs"], r["seqs"]) - r["seconds"]) / r["seconds"]
               for r in prefill_rows)
    derr = max(abs(costs.step_time(0, 0, 0, int(r["seqs"]), int(r["context"])) - r["seconds"]) / r["seconds"]
               for r in decode_rows)
    return costs, {"prefill_max_rel_error": perr, "decode_max_rel_error": derr}


def kv_heads_per_rank(model: ModelConfig, tp: int) -> int:
    """KV heads each of tp tensor-parallel ranks holds (pdserve.parallel.layout.TPLayout: split when tp
    divides them, one per rank, replicated, when tp is a multiple of them); ValueError for a tp the
    heads cannot be laid out over."""
    return TPLayout(model.num_heads, model.num_kv_heads, tp).kv_heads_per_rank


def _shard(n: int, tp: int) -> int:
    """A dimension split over tp ranks (padded up when tp does not divide it, as a vocab-parallel table is)."""
    return -(-n // tp)


def expected_experts(num_experts: int, k: int, tokens: int) -> float:
    """Distinct experts that `tokens` tokens touch between them, on average, each picking k of num_experts.

    A given expert is among one token's k with probability k / E, so it escapes all of them with probability
    (1 - k / E) ** tokens: E (1 - (1 - k / E) ** tokens) are touched. Routing is taken as uniform and
    independent from token to token, what a balanced router gives over unrelated requests; skewed routing
    touches fewer, so this is the most a step reads on average. One token touches k experts; a batch of a few
    times E / k tokens nearly all of them."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - k / num_experts) ** tokens)


def _shared_experts(model: ModelConfig) -> int:
    return model.num_shared_experts if isinstance(model, LatentAttentionShape) else 0


@dataclass(frozen=True)
class RooflineCosts:
    """Step times from FLOPs and bytes against a device's peaks, each derated by an efficiency factor:

        step = overhead_s + max(FLOPs / (peak_flops * mfu), bytes / (peak_bandwidth * mbu)) + collectives

    FLOPs: the matmuls of every new token (pdserve.engine.utilization), attention over the pairs each chunk
    computes and over each decoding request's context, the LM head of every sampled row. Bytes: every
    weight once, the KV that decoding requests read, the KV the step writes. Efficiencies <= 1 and a
    non-negative overhead keep every prediction at or above the physical floor.

    With tp > 1 a worker is tp GPUs (Megatron-style tensor parallelism) and every figure is one rank's:
    q/k/v and gate/up split by output (attention heads, KV heads unless replicated: kv_heads_per_rank),
    o_proj and down_proj by input, the embedding and the LM head by vocabulary; norms are replicated.
    Each layer then all-reduces its hidden activations twice (after o_proj and after down_proj): a ring
    all-reduce of B bytes takes latency + 2 (tp - 1) / tp * B / bus bandwidth (`collective`), and is
    added to the step, not overlapped with it. The embedding's all-reduce and the logits' gather (one
    each per step, against 2 * num_layers) are left out.

    A mixture of experts: FLOPs count the parameters each token runs (its router, its k experts, any shared
    expert); a step's weight bytes count every dense weight and, in each MoE layer, the experts its rows
    touch (expected_experts), each read once; the memory a rank needs (weight_bytes, resident_weight_bytes)
    counts every expert it holds. Over tp ranks the experts are sliced like an MLP (ep 1: a rank reads its
    slice of every expert touched) or split whole (ep = tp: a rank holds num_experts / ep of them and, with
    uniform routing, reads 1/ep of those touched; the busiest rank reads more, which is left out). The two
    read the same bytes and do the same FLOPs a rank on average: they differ in their collectives
    (collective_time) and in how wide each expert's matmuls are, which a roofline does not see.
    """

    model: ModelConfig
    dtype_bytes: int
    peak_flops: float
    peak_bytes_per_s: float
    mfu: float
    mbu: float
    overhead_s: float
    transport: Transport
    tp: int = 1
    collective: Transport | None = None  # the collectives between the tp ranks: latency per call, bus bandwidth
    ep: int = 1  # a mixture of experts over the tp ranks: 1, every expert sliced; tp, the experts split whole

    def slowed(self, factor: float) -> RooflineCosts:
        """The same device `factor` times slower: every step (compute, memory reads, overhead, collectives)
        takes factor times as long, as a simulated worker's do (--sim-time-scale). The KV link between
        workers (transport) is left as it is: a simulated hand-off moves real, smaller tensors."""
        if not factor > 0:
            raise ValueError(f"a slowdown factor must be positive, got {factor}")
        coll = self.collective
        return replace(self, peak_flops=self.peak_flops / factor, peak_bytes_per_s=self.peak_bytes_per_s / factor,
                       overhead_s=self.overhead_s * factor,
                       collective=None if coll is None else replace(coll, latency_s=coll.latency_s * factor,
                                                                    bytes_per_s=coll.bytes_per_s / factor))

    def __post_init__(self) -> None:
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1) or self.overhead_s < 0:
            raise ValueError(f"efficiencies must be in (0, 1] and overhead >= 0, got mfu={self.mfu} mbu={self.mbu} "
                             f"overhead={self.overhead_s}")
        kv_heads_per_rank(self.model, self.tp)
        if self.tp > 1 and self.collective is None:
            raise ValueError(f"tensor-parallel size {self.tp} needs the all-reduce's link (collective)")
        if self.ep != 1:
            m = self.model
            if not m.is_moe:
                raise ValueError(f"expert parallelism needs a mixture of experts; this {m.architecture} is dense")
            if self.ep != self.tp or m.num_experts % self.ep:
                raise ValueError(f"expert-parallel size {self.ep} must be the worker's rank count ({self.tp}) and "
                                 f"divide the model's {m.num_experts} experts")

    @property
    def kv_size_per_rank(self) -> int:
        return kv_heads_per_rank(self.model, self.tp) * self.model.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.model
        if isinstance(m, LatentAttentionShape):  # the latent and the RoPE key, whole on every rank
            return m.num_layers * m.kv_values_per_token_per_layer * self.dtype_bytes
        return 2 * m.num_layers * self.kv_size_per_rank * self.dtype_bytes

    def _attention_params(self) -> int:
        """One layer's attention matmul weights on one rank."""
        m = self.model
        if isinstance(m, LatentAttentionShape):
            return m.attention_params(self.tp)
        h, q = m.hidden_size, m.q_size // self.tp
        return h * (q + 2 * self.kv_size_per_rank) + q * h

    def _layer_params(self) -> int:
        """Matmul weights of the layers on one rank that every step reads, whatever its tokens: attention, the
        dense MLPs and, in each MoE layer, the router (whole on every rank: every rank routes every token) and
        any shared expert (sliced like an MLP)."""
        m, tp, h = self.model, self.tp, self.model.hidden_size
        moe, mlp = len(m.moe_layers), 3 * h * _shard(m.intermediate_size, tp)
        params = m.num_layers * self._attention_params() + (m.num_layers - moe) * mlp
        if moe:
            shared = m.shared_expert_intermediate_size + _shared_experts(m) * m.moe_intermediate_size
            # sliced like an MLP, or (ep = tp) whole on every rank, as pdserve.model.moe holds it
            params += moe * (h * m.num_experts + 3 * h * (_shard(shared, tp) if self.ep == 1 else shared))
        return params

    def _expert_params(self) -> int:
        """One routed expert's matmul weights on one rank: its slice (ep 1), or all of it (ep = tp)."""
        m = self.model
        inter = m.moe_intermediate_size if self.ep > 1 else _shard(m.moe_intermediate_size, self.tp)
        return 3 * m.hidden_size * inter

    @property
    def experts_per_rank(self) -> int:
        return self.model.num_experts // self.ep

    @property
    def weight_bytes(self) -> int:
        """Bytes of the matmul weights one rank holds, the layers' and the LM head, every expert of its share
        included: what a dense model's step reads once, the most a mixture of experts' step can read
        (step_weight_bytes)."""
        m = self.model
        experts = len(m.moe_layers) * self.experts_per_rank * self._expert_params()
        return (self._layer_params() + experts + m.hidden_size * _shard(m.vocab_size, self.tp)) * self.dtype_bytes

    def step_weight_bytes(self, rows: int) -> float:
        """Bytes of the matmul weights a step of `rows` new tokens reads on one rank, each once: weight_bytes
        for a dense model; for a mixture of experts, the dense weights and in each MoE layer the experts its
        rows touch (expected_experts; split whole over ep ranks, 1/ep of them on each)."""
        m = self.model
        if not m.is_moe:
            return self.weight_bytes
        touched = expected_experts(m.num_experts, m.num_experts_per_tok, rows) / self.ep
        lm_head = m.hidden_size * _shard(m.vocab_size, self.tp)
        return (self._layer_params() + len(m.moe_layers) * touched * self._expert_params() + lm_head) * self.dtype_bytes

    @property
    def resident_weight_bytes(self) -> int:
        """Bytes of every weight one rank holds: weight_bytes, the embedding (unless tied to the LM head),
        the norms and biases. At tp 1 this is the model's num_params in dtype_bytes."""
        m = self.model
        per_layer = 2 * m.hidden_size
        if m.attention_bias:
            per_layer += m.q_size // self.tp + 2 * self.kv_size_per_rank
        if m.qk_norm:
            per_layer += 2 * m.head_dim
        if isinstance(m, LatentAttentionShape):
            per_layer += m.attention_norm_params
        embed = 0 if m.tie_word_embeddings else m.hidden_size * _shard(m.vocab_size, self.tp)
        return self.weight_bytes + (m.num_layers * per_layer + embed + m.hidden_size) * self.dtype_bytes

    def _attention_flops_per_pair(self, decode: bool) -> int:
        """QK^T and PV of one query and one key, over all layers, on one rank."""
        m = self.model
        heads = m.num_heads // self.tp
        qk = pv = m.head_dim
        if isinstance(m, LatentAttentionShape):
            # A decode step attends in the latent (keys kv_lora_rank + rope wide, values kv_lora_rank); a
            # prefill with keys and values expanded per head (head_dim + rope, and head_dim).
            qk, pv = ((m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank) if decode
                      else (m.head_dim + m.qk_rope_head_dim, m.head_dim))
        return 2 * heads * (qk + pv) * m.num_layers

    def flops(self, prefill_tokens: int, prefill_pairs: int, prefill_seqs: int, decode_seqs: int,
              decode_context: int) -> float:
        m = self.model
        linear = 2 * self._layer_params()  # at tp 1: pdserve.engine.utilization's
        if m.is_moe:  # a token's k experts: k slices on every rank (ep 1), or k / ep whole ones a rank on average
            linear += 2 * len(m.moe_layers) * m.num_experts_per_tok * self._expert_params() / self.ep
        lm_head = 2 * m.hidden_size * _shard(m.vocab_size, self.tp)
        return ((prefill_tokens + decode_seqs) * linear
                + self._attention_flops_per_pair(decode=False) * prefill_pairs
                + self._attention_flops_per_pair(decode=True) * decode_context
                + (prefill_seqs + decode_seqs) * lm_head)

    def bytes(self, prefill_tokens: int, decode_seqs: int, decode_context: int) -> float:
        return (self.step_weight_bytes(prefill_tokens + decode_seqs)
                + self.kv_bytes_per_token * (decode_context + prefill_tokens + decode_seqs))

    def collective_time(self, rows: int) -> float:
        """The step's collectives over the tp ranks for `rows` new tokens.

        Every layer all-reduces its attention output (rows x hidden; a ring moves 2 (tp - 1) / tp of it over
        each rank's link) and its MLP's, or its sliced experts', output. Experts split whole (ep = tp) instead
        send each token's k rows to their experts' ranks and the results back (two all-to-alls: a rank owns
        ceil(rows / ep) of the tokens and sends their k rows each, (ep - 1) / ep of them to other ranks), then
        all-gather the tokens' outputs ((ep - 1) / ep of the rows reach each rank from the others), as
        pdserve.model.moe does; a shared expert, sliced, is all-reduced apart.
        """
        if self.tp == 1 or not rows:
            return 0.0
        m, link, tp = self.model, self.collective, self.tp
        row_bytes = m.hidden_size * self.dtype_bytes
        nbytes = rows * row_bytes
        allreduce = link.send_time(2 * (tp - 1) / tp * nbytes)
        if self.ep == 1:
            return 2 * m.num_layers * allreduce
        moe, owned, others = len(m.moe_layers), -(-rows // self.ep), (self.ep - 1) / self.ep
        all_to_all = link.send_time(others * owned * m.num_experts_per_tok * row_bytes)
        all_gather = link.send_time(others * owned * self.ep * row_bytes)
        # a shared expert is whole on every rank under expert parallelism (pdserve.model.moe): no all-reduce of its own
        return (2 * m.num_layers - moe) * allreduce + moe * (2 * all_to_all + all_gather)

    def step_time(self, prefill_tokens: int, prefill_pairs: int, prefill_seqs: int, decode_seqs: int,
                  decode_context: int) -> float:
        if not prefill_tokens and not decode_seqs:
            return 0.0
        compute = self.flops(prefill_tokens, prefill_pairs, prefill_seqs, decode_seqs, decode_context) / (
            self.peak_flops * self.mfu)
        memory = self.bytes(prefill_tokens, decode_seqs, decode_context) / (self.peak_bytes_per_s * self.mbu)
        return self.overhead_s + max(compute, memory) + self.collective_time(prefill_tokens + decode_seqs)
