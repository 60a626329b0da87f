"""Configuration: one small frozen dataclass per component, validated on construction."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pdserve.hf_config import ARCHITECTURES, SUPPORTED_ARCHITECTURES, RopeScaling, family_of, moe_fields  # noqa: F401
from pdserve.tiers import TiersConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREFIX_ROUTING = ("exact", "estimate", "random")  # ClusterConfig.prefix_routing


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3), dense or with mixture-of-experts
    blocks in place of some or all MLPs (Qwen3-MoE, Mixtral). `architecture` is the family's key
    (ARCHITECTURES maps a checkpoint's `architectures` to it)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 experts: a dense model). The layers in moe_layers have a router over num_experts
    # experts (each a gated MLP of moe_intermediate_size), num_experts_per_tok of them per token, their
    # weights renormalised to sum 1 when norm_topk_prob; the other layers a dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # One rank's share under expert parallelism (pdserve.parallel.layout.rank_config): the experts it holds,
    # consecutive; 0: all num_experts.
    experts_per_rank: int = 0
    # Qwen2-MoE: a shared expert (a gated MLP of this size) every token runs beside its k, scaled by
    # sigmoid(shared_expert_gate . x); 0: none.
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.moe_layers:
            if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ValueError(f"a mixture of experts needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) "
                                 f"<= num_experts ({self.num_experts}) and moe_intermediate_size >= 1 "
                                 f"({self.moe_intermediate_size})")
            if any(not 0 <= i < self.num_layers for i in self.moe_layers):
                raise ValueError(f"moe_layers {self.moe_layers} out of range for {self.num_layers} layers")

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """Matmul parameters of a layer's MLP or MoE block (its router included); active: those one token
        uses (its num_experts_per_tok experts)."""
        h = self.hidden_size
        if layer not in self.moe_layers:
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return h * self.num_experts + experts * 3 * h * self.moe_intermediate_size + shared

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count, counting tied embeddings once."""
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        layers = self.num_layers * (attn + 2 * h) + sum(self.mlp_params(i) for i in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + embed + h

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses (a mixture of experts: its experts only); num_params for a dense model."""
        return self.num_params - sum(self.mlp_params(i) - self.mlp_params(i, active=True)
                                     for i in self.moe_layers)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x and 5.x layouts). The family is the
        one its `architectures` names (ARCHITECTURES; ValueError naming it if unsupported), or its model_type
        where it names none."""
        model_type = family_of(cfg)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers 5 moves rope_theta and rope_scaling under rope_parameters.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling_src = legacy_scaling or rope
        rope_type = scaling_src.get("rope_type", scaling_src.get("type", "default"))
        scaling: RopeScaling | None = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(scaling_src["factor"]),
                low_freq_factor=float(scaling_src["low_freq_factor"]),
                high_freq_factor=float(scaling_src["high_freq_factor"]),
                original_max_position_embeddings=int(scaling_src["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, llama3")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        max_pos = cfg.get("max_position_embeddings", 4096)
        # Without a sliding-window kernel, attention is exact only inside the window: cap the context.
        if model_type == "mistral" and cfg.get("sliding_window"):
            max_pos = min(max_pos, cfg["sliding_window"])
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; others say so with attention_bias.
            attention_bias=model_type in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe_fields(model_type, cfg),
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: fixed-size blocks of token slots."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from memory_bytes
    memory_bytes: int = 1 << 30  # budget for the KV cache when num_blocks is not given
    enable_prefix_caching: bool = True
    # KV tiers beneath the cache (pdserve.engine.kv_offload): host memory for evicted blocks (0: no tiers), and
    # from there a directory on local disk with its own budget (None / 0: no disk tier).
    offload_bytes: int = 0
    offload_dir: str | None = None
    offload_disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_bytes < 1:
            raise ValueError(f"memory_bytes must be >= 1, got {self.memory_bytes}")
        if self.offload_bytes < 0 or self.offload_disk_bytes < 0:
            raise ValueError("offload_bytes and offload_disk_bytes must be >= 0")
        if (self.offload_dir is not None or self.offload_disk_bytes) and not self.offload_bytes:
            raise ValueError("a disk tier (--kv-offload-dir, --kv-offload-disk-mib) needs a host tier (--kv-offload-mib)")
        if (self.offload_dir is None) != (self.offload_disk_bytes == 0):
            raise ValueError("--kv-offload-dir and --kv-offload-disk-mib go together")

    def resolve_num_blocks(self, model: ModelConfig, dtype: torch.dtype, tp: int = 1) -> int:
        """Blocks of the cache: num_blocks, or as many as memory_bytes holds on each rank of a worker of
        TP size tp (a rank holds its KV heads of every block; pdserve.parallel.layout)."""
        if self.num_blocks is not None:
            return self.num_blocks
        if tp > 1:  # a rank's KV heads: its share, or one replicated head (pdserve.parallel.layout.TPLayout)
            model = replace(model, num_kv_heads=max(1, model.num_kv_heads // tp))
        per_block = kv_bytes_per_token(model, dtype) * self.block_size
        n = self.memory_bytes // per_block
        if n < 1:
            raise ValueError(f"KV cache budget {self.memory_bytes} B holds no block of {per_block} B")
        return n


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers."""
    return 2 * model.num_layers * model.kv_size * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of one engine step, and the knobs of each role (pdserve.engine.scheduler_types.Role).

    Prefill role: max_num_batched_tokens (prompt tokens a step), enable_chunked_prefill.
    Decode role: max_num_seqs (running requests, and those whose KV is on its way), reservation_headroom_blocks.
    Colocated: all but the last.
    """

    max_num_seqs: int = 64  # requests in the running batch
    max_num_batched_tokens: int = 2048  # tokens computed in one step (prefill chunks + decodes)
    enable_chunked_prefill: bool = True
    # Decode role: free blocks a reservation for incoming KV must leave per running request, so that
    # taking the request in does not force a preemption at the very next step.
    reservation_headroom_blocks: int = 1
    # Service tiers (pdserve.tiers): this share of max_num_seqs (rounded up) is flex's floor: running
    # flex requests are preempted for other tiers only above it. Set from ClusterConfig.tiers.
    flex_min_share: float = 0.1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.reservation_headroom_blocks < 0:
            raise ValueError(f"reservation_headroom_blocks must be >= 0, got {self.reservation_headroom_blocks}")


@dataclass(frozen=True)
class EngineConfig:
    """What the offline engine (and each worker) needs to load and run a model."""

    model: str | None = None  # HF directory, .gguf file, or None for the default model
    load_format: str = "auto"  # auto | hf | gguf | dummy | sim
    dtype: str = "float32"  # weights, activations and KV cache
    quantization: str | None = None  # "int8": weight-only int8 linear layers (activations stay `dtype`)
    device: str = "cpu"
    seed: int = 0  # for dummy weights and requests that carry no seed
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # The device's peaks for utilization metrics; None: a known GPU's datasheet figures, else measured.
    peak_flops: float | None = None
    peak_bytes_per_second: float | None = None
    # Pipelined decode (pdserve.engine.llm_engine.EngineCore): step t+1 is scheduled and launched before step t's
    # sampled tokens reach the host. None: on for CUDA, off elsewhere (a CPU step does not overlap the host).
    pipelined_decode: bool | None = None
    # CUDA graphs for decode-only steps (pdserve.engine.cuda_graphs). None: on for CUDA (decode and colocated
    # roles), off elsewhere; True on a CPU runs the same padded buckets eagerly (tests).
    cuda_graphs: bool | None = None
    # Tensor parallelism (pdserve.parallel.layout, pdserve.engine.tp_runner): the model split over this many
    # processes, one per device; rank 0 schedules. In a cluster, each pool may set its own (PoolConfig).
    tensor_parallel_size: int = 1
    # Expert parallelism (a mixture of experts, pdserve.model.moe): 1, each expert sliced over the worker's ranks
    # like a dense MLP, or the rank count, the experts split whole over the ranks and tokens sent to them
    # (all-to-all). Attention stays tensor-parallel over the same ranks: an expert-parallel size above 1 with
    # tensor_parallel_size 1 makes the worker that many ranks.
    expert_parallel_size: int = 1
    # Every wait on the worker's ranks is bounded by this: a rank that dies or hangs takes the worker
    # down within it (at once, for a rank whose process ends).
    tensor_parallel_timeout_s: float = 60.0
    # A simulated engine (load_format "sim", pdserve.engine.sim_runner): no weights, `model` names the shape (a
    # preset of pdserve.model.loader.DUMMY_PRESETS or a config.json). A step sleeps the time sim_gpu's roofline
    # (pdserve.perf.hardware) gives for its chunks, times sim_time_scale; the cache has the blocks that GPU's
    # KV budget holds, each token's KV held sim_kv_scale times smaller than the real model's.
    sim_gpu: str = "H100"
    sim_kv_scale: int = 1024
    sim_time_scale: float = 1.0
    # The version of the weights `model` holds (pdserve.weights): 0 for those a cluster starts with; a worker
    # started after updates comes up on the latest version, loaded from its checkpoint.
    weight_version: int = 0
    # Where a weight update from a path may read checkpoints (pdserve.weights.update.checkpoint_path: the path
    # and the files it reads there must resolve under it, symlinks followed). None: the directory that holds
    # the model (its siblings).
    weights_root: str | None = None
    # The cluster's key of the KV checksum, in a worker whose transfers carry one (ClusterConfig.kv_checksum).
    kv_checksum_key: bytes | None = field(default=None, repr=False)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Speculative decoding (pdserve.engine.speculative.SpeculativeConfig, `--speculative-config`): decode and
    # colocated engines draft by prompt lookup and verify the drafts in one forward; None: off. A prefill
    # engine ignores it. In a cluster each pool sets its own (PoolConfig.speculative).
    speculative: Any = None

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)
        if self.speculative is not None and not hasattr(self.speculative, "num_speculative_tokens"):
            # pdserve.config imports no engine module: the SpeculativeConfig checks its own fields.
            raise ValueError(f"speculative must be a SpeculativeConfig, got {type(self.speculative).__name__}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be int8 or unset, got {self.quantization!r}")
        if self.load_format not in ("auto", "hf", "gguf", "dummy", "sim"):
            raise ValueError(f"load_format must be auto, hf, gguf, dummy or sim, got {self.load_format!r}")
        if not isinstance(self.sim_kv_scale, int) or self.sim_kv_scale < 1:
            raise ValueError(f"sim_kv_scale must be an integer >= 1, got {self.sim_kv_scale!r}")
        if not self.sim_time_scale > 0:
            raise ValueError(f"sim_time_scale must be positive, got {self.sim_time_scale!r}")
        if self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size must be >= 1, got {self.expert_parallel_size}")
        if self.expert_parallel_size > 1 and self.tensor_parallel_size == 1:
            object.__setattr__(self, "tensor_parallel_size", self.expert_parallel_size)
        if self.load_format == "sim":
            self._check_simulated()
        if self.weights_root is not None and not os.path.isabs(self.weights_root):
            raise ValueError(f"weights_root must be an absolute path, got {self.weights_root!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.expert_parallel_size not in (1, self.tensor_parallel_size):
            raise ValueError(f"expert_parallel_size ({self.expert_parallel_size}) must be 1 or the worker's rank count, "
                             f"tensor_parallel_size ({self.tensor_parallel_size}): attention and experts share the ranks")
        if getattr(self.speculative, "method", None) == "draft_model" and self.tensor_parallel_size > 1:
            raise ValueError("speculation with a draft model on a tensor-parallel worker is not supported yet "
                             "(method ngram is)")
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError(f"tensor_parallel_timeout_s must be positive, got {self.tensor_parallel_timeout_s}")
        if not isinstance(self.weight_version, int) or self.weight_version < 0:
            raise ValueError(f"weight_version must be an integer >= 0, got {self.weight_version!r}")

    def _check_simulated(self) -> None:
        """A simulated engine is one CPU process standing for one GPU that runs the model in 16 bits."""
        if self.dtype == "float32":
            raise ValueError("a simulated GPU runs the model in 16 bits (the roofline's peaks are 16-bit tensor-core "
                             "figures): give dtype bfloat16 or float16 with load_format sim")
        if torch.device(self.device).type != "cpu":
            raise ValueError(f"a simulated engine holds its KV in host memory: device must be cpu, got {self.device!r}")
        if self.tensor_parallel_size != 1:
            raise ValueError("a simulated engine stands for one GPU: tensor_parallel_size must be 1, "
                             f"got {self.tensor_parallel_size}")
        if self.quantization is not None or self.cuda_graphs:
            raise ValueError("a simulated engine has no weights to quantize and no CUDA graphs")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


@dataclass(frozen=True)
class PoolConfig:
    """One pool of workers: how many, what each gets from Ray, how each batches."""

    num_workers: int = 1  # the pool's size; its minimum (and size at start) when max_workers is larger
    max_workers: int | None = None  # autoscaled between num_workers and this (router.autoscaler); None: fixed
    num_cpus: float = 0.5  # fractional on CPU machines: 2-core boxes run several workers
    num_gpus: float = 0.0
    # Ray custom resources each worker needs, e.g. {"prefill": 1} so prefill actors land only on
    # nodes of the prefill group (whose Ray start declares that resource).
    resources: dict[str, float] = field(default_factory=dict)
    # How this pool's workers batch and size their KV cache; None: the cluster engine's (one source per
    # knob: a pool either sets its own or takes the engine's, see ClusterConfig.engine_for).
    scheduler: SchedulerConfig | None = None
    cache: CacheConfig | None = None
    torch_threads: int | None = None  # None: torch's default for the process (per rank)
    # Each worker of the pool is this many ranks (tensor parallelism), each taking num_cpus, num_gpus and
    # resources, packed on one node by a placement group. None: the cluster engine's.
    tensor_parallel_size: int | None = None
    # Of a mixture of experts: 1, or the worker's ranks (EngineConfig.expert_parallel_size). None: the engine's.
    expert_parallel_size: int | None = None
    # The pool's speculative decoding (EngineConfig.speculative): None, none (a prefill pool never speculates).
    speculative: Any = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size is not None and self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.expert_parallel_size is not None and self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size must be >= 1, got {self.expert_parallel_size}")
        if self.num_workers < 1:
            raise ValueError(f"a pool needs at least one worker, got {self.num_workers}")
        if self.max_workers is not None and self.max_workers < self.num_workers:
            raise ValueError(f"a pool's range MIN:MAX needs MIN <= MAX, got {self.num_workers}:{self.max_workers}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("num_cpus and num_gpus must be >= 0")


@dataclass(frozen=True)
class AutoscaleConfig:
    """How autoscaled pools (PoolConfig.max_workers) are sized: by the planner's cost model
    (pdserve.planner.autoscale), from a measured profile or a GPU's roofline, towards SLO targets."""

    profile: str | None = None  # `pdserve profile` output for this model and device
    gpu: str | None = None  # or the roofline of this GPU (pdserve.perf.hardware.GPUS)
    ttft_target_s: float = 1.0  # the sizing keeps a prompt's wait + compute within this
    tpot_target_s: float = 0.1  # and a decode step within this
    interval_s: float = 2.0  # how often the pools' sizes are decided
    window_s: float = 30.0  # arrival rate and lengths are measured over this
    scale_down_delay_s: float = 60.0  # a pool shrinks only to the most it needed over this long

    def __post_init__(self) -> None:
        if min(self.ttft_target_s, self.tpot_target_s, self.interval_s, self.window_s) <= 0 \
                or self.scale_down_delay_s < 0:
            raise ValueError("autoscale targets, interval and window must be positive, the scale-down delay >= 0")
        if self.profile is not None and self.gpu is not None:
            raise ValueError("autoscaling takes its costs from a profile or a GPU's roofline, not both")


@dataclass(frozen=True)
class ClusterConfig:
    """The whole deployment: the model, the pools and how requests flow between them."""

    engine: EngineConfig = field(default_factory=EngineConfig)  # model, dtype, device, seed
    mode: str = "disaggregated"  # or "colocated": one pool whose workers do both phases
    # The pools of the mode (prefill and decode, or colocated); None: a default pool. A pool of the
    # other mode is an error, not a setting silently ignored.
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    colocated: PoolConfig | None = None
    # The fast lane (pdserve.tiers): decode workers serving priority requests only, with a small running
    # batch (tiers.fast_lane_max_running). None: no lane. Its batching is the decode pool's but for that cap.
    fast: PoolConfig | None = None
    tiers: TiersConfig = field(default_factory=TiersConfig)
    transfer_timeout_s: float = 30.0
    # Where decode workers listen for KV-transfer rendezvous, and the router for its workers' links
    # (pdserve.serving.link). None: the node's IP as Ray knows it (127.0.0.1 on a local cluster started on
    # loopback, the pod IP on Kubernetes).
    bind_host: str | None = None
    stats_interval_s: float = 1.0  # heartbeat: how often the router asks every worker for its stats
    worker_timeout_s: float = 30.0  # a worker that does not answer the heartbeat this long is stuck: replaced
    worker_start_timeout_s: float = 300.0  # a replacement must be ready within this (model load included)
    # A replacement that fails to start is tried again after the first value's seconds, then twice as long each
    # time, up to the second's.
    replace_backoff_s: tuple[float, float] = (1.0, 30.0)
    # A request that finds a pool with no live worker (its replacement is starting) waits this long for
    # one, then ends with UNAVAILABLE.
    pool_wait_timeout_s: float = 60.0
    # Each KV transfer carries a checksum the decode worker verifies (a mismatch fails the transfer, which
    # is retried). Off by default: on a CPU it costs 15-30 % of a transfer's time (docs/benchmarks.md).
    kv_checksum: bool = False
    # The cluster's key for that checksum (pdserve.transfer.protocol.KVMac: keyed, an HMAC at the end). None with
    # kv_checksum: a random one made here, for a router that owns its workers alone; router replicas, any of
    # which may start workers, must all be given the same (--kv-checksum-key-file).
    kv_checksum_key: bytes | None = field(default=None, repr=False)
    max_retries: int = 2  # attempts after the first for a request whose worker was lost
    on_decode_failure: str = "resume"  # or "fail": end the request with UNAVAILABLE
    # Tokens of a request sent in one message (gRPC or SSE), the last ones excepted: each message costs the
    # router about as much as its tokens' other work together (docs/benchmarks.md). The first token is
    # never held back, and tokens already waiting always go out together, whatever this is.
    stream_interval: int = 1
    # Placement by where the KV is (router.kv_index, router.placement): a decode worker's request in its batch
    # weighs as much as this many prompt tokens its prefix cache holds (0: by load alone).
    placement_load_tokens: int = 256
    # A decode worker that holds a prefix of a prompt (a conversation's earlier turns) and lacks at most this
    # many of its tokens computes them itself, with no prefill worker and no hand-off (0: never).
    local_prefill_max_tokens: int = 512
    # What placement knows of the workers' prefix caches (router.dispatch): "exact" (their KV events), "estimate"
    # (the router's record of the prompts it placed on each), "random" (nothing: any worker with room).
    prefix_routing: str = "exact"
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)  # for pools with max_workers
    # Router replicas (router.registry): this router's name among the routers serving one Ray cluster
    # (each gives its own); None: the only router. Its workers are then detached named actors.
    router_name: str | None = None

    def __post_init__(self) -> None:
        if self.router_name is not None and (not self.router_name or "/" in self.router_name
                                             or len(self.router_name) > 64):
            raise ValueError(f"router_name must be 1-64 characters without '/', got {self.router_name!r}")
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        self._check_kv_key()
        mine = ("colocated",) if self.mode == "colocated" else ("prefill", "decode")
        for name in ("prefill", "decode", "colocated"):
            if name in mine and getattr(self, name) is None:
                object.__setattr__(self, name, PoolConfig())
            elif name not in mine and getattr(self, name) is not None:
                raise ValueError(f"a {name} pool is not part of a {self.mode} cluster")
        if self.fast is not None:
            if self.mode == "colocated":
                raise ValueError("the fast lane is a set of decode workers: it needs a disaggregated cluster")
            decode = self.engine_for(self.decode)
            lane = replace(decode.scheduler, max_num_seqs=self.tiers.fast_lane_max_running)
            object.__setattr__(self, "fast", replace(self.fast, scheduler=lane, cache=self.fast.cache or decode.cache,
                                                     tensor_parallel_size=self.fast.tensor_parallel_size
                                                     or decode.tensor_parallel_size,
                                                     expert_parallel_size=self.fast.expert_parallel_size
                                                     or decode.expert_parallel_size))
        if self.mode == "disaggregated":
            sizes = {name: self.engine_for(pool).cache.block_size for name, pool in self.pools.items()}
            if len(set(sizes.values())) > 1:  # KV moves between the pools block for block
                raise ValueError(f"prefill and decode pools need one KV block size, got {sizes}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be positive, got {self.transfer_timeout_s}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.placement_load_tokens < 0 or self.local_prefill_max_tokens < 0:
            raise ValueError("placement_load_tokens and local_prefill_max_tokens must be >= 0")
        if self.prefix_routing not in PREFIX_ROUTING:
            raise ValueError(f"prefix_routing must be one of {PREFIX_ROUTING}, got {self.prefix_routing!r}")
        if self.on_decode_failure not in ("resume", "fail"):
            raise ValueError(f"on_decode_failure must be resume or fail, got {self.on_decode_failure!r}")
        if self.ranges:
            if self.mode == "colocated":
                raise ValueError("a colocated pool does not autoscale: give it a fixed size")
            if self.autoscale.profile is None and self.autoscale.gpu is None and self.engine.load_format != "sim":
                raise ValueError("autoscaled pools are sized by a cost model: give a profile (`pdserve profile`, "
                                 "then --profile FILE) or a GPU for its roofline (--gpu NAME)")
        if self.max_retries < 0 or min(self.worker_timeout_s, self.stats_interval_s, self.pool_wait_timeout_s) <= 0:
            raise ValueError("max_retries must be >= 0; worker_timeout_s, stats_interval_s and pool_wait_timeout_s "
                             "positive")
        first, most = self.replace_backoff_s
        if not 0 < first <= most:
            raise ValueError(f"replace_backoff_s must be (first, max) with 0 < first <= max, got "
                             f"{self.replace_backoff_s}")

    def _check_kv_key(self) -> None:
        if self.kv_checksum_key is not None and len(self.kv_checksum_key) < 16:
            raise ValueError("the KV checksum's key must have at least 16 bytes")
        if self.kv_checksum and self.kv_checksum_key is None:
            if self.router_name is not None:  # another router may start a worker: one key for all
                raise ValueError("--kv-checksum with router replicas needs the cluster's key, the same for every "
                                 "router: --kv-checksum-key-file")
            object.__setattr__(self, "kv_checksum_key", secrets.token_bytes(32))

    @property
    def pools(self) -> dict[str, PoolConfig]:
        """The mode's pools by name (with the fast lane, "fast", if there is one)."""
        names = ("colocated",) if self.mode == "colocated" else ("prefill", "decode", "fast")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    @property
    def ranges(self) -> dict[str, tuple[int, int]]:
        """The autoscaled pools by name: (MIN, MAX) workers."""
        return {name: (p.num_workers, p.max_workers) for name, p in self.pools.items()
                if p.max_workers is not None and p.max_workers > p.num_workers}

    def engine_for(self, pool: PoolConfig) -> EngineConfig:
        """What a worker of the pool runs: the engine's model and device, with the pool's batching and
        KV cache where the pool sets them, the engine's where it does not."""
        scheduler = pool.scheduler or self.engine.scheduler
        if scheduler.flex_min_share != self.tiers.flex_min_share:
            scheduler = replace(scheduler, flex_min_share=self.tiers.flex_min_share)
        ep = pool.expert_parallel_size or self.engine.expert_parallel_size
        # A pool that sets only an expert-parallel size above 1 is that many ranks; otherwise the engine's ranks.
        tp = pool.tensor_parallel_size or (1 if (pool.expert_parallel_size or 1) > 1 else self.engine.tensor_parallel_size)
        return replace(self.engine, scheduler=scheduler, cache=pool.cache or self.engine.cache,
                       tensor_parallel_size=tp, expert_parallel_size=ep, speculative=pool.speculative,
                       kv_checksum_key=self.kv_checksum_key if self.kv_checksum else None)
