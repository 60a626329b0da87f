"""The models the sections run: the engine core on the dummy-weight shape (decode, prefill and the experiments
share one), requests on it, its decode mode switched, and the random transformers checkpoint of SmolLM2-135M's
shape (offline and cluster)."""
from __future__ import annotations

import random
import time
import traceback
from pathlib import Path

import torch

from bench.gpu.timing import GiB, RESULTS, free_memory, sync


def make_core(args, device: torch.device, max_batched: int, prefix_caching: bool):
    """The engine core on the dummy-weight shape, with the device's default fast path. Where building it
    fails (CUDA-graph capture is the step most likely to), the failure is recorded and a core without
    graphs is built instead, so the eager figures still come."""
    from dataclasses import replace

    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import EngineCore

    cfg = EngineConfig(model=args.model, load_format="dummy", dtype=args.dtype, device=str(device),
                       cache=CacheConfig(memory_bytes=int(args.kv_gib * GiB), enable_prefix_caching=prefix_caching),
                       scheduler=SchedulerConfig(max_num_seqs=max(64, max(args.batches)),
                                                 max_num_batched_tokens=max_batched))
    t = time.perf_counter()
    try:
        core = EngineCore(cfg)
    except Exception as e:  # noqa: BLE001 - reported, then the eager core
        print(traceback.format_exc(), flush=True)
        RESULTS["errors"]["engine_with_graphs"] = f"{type(e).__name__}: {e}"
        free_memory()
        core = EngineCore(replace(cfg, cuda_graphs=False))
    sync(device)
    graphs = core.runner.graphs
    RESULTS.setdefault("env", {})["graph_buckets_captured"] = graphs.captured if graphs is not None else None
    print(f"CUDA graphs captured for buckets {graphs.captured if graphs is not None else None} "
          f"({time.perf_counter() - t:.1f} s with the load)", flush=True)
    print(f"EngineCore({args.model}, {args.dtype}, {device}): {time.perf_counter() - t:.1f} s, "
          f"{core.pool.num_blocks} KV blocks", flush=True)
    return core


def add_requests(core, n: int, length: int, max_tokens: int, rng: random.Random) -> list:
    from pdserve.engine.request import Request
    from pdserve.engine.sampling import SamplingParams

    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = []
    for _ in range(n):
        req = Request(f"r{rng.getrandbits(48)}", [rng.randrange(3, vocab) for _ in range(length)], params, 0)
        core.scheduler.add(req)
        reqs.append(req)
    return reqs


def run_prefill_until_decoding(core, reqs) -> None:
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in reqs):
        core.step()


def set_mode(core, graphs, use_graphs: bool, pipelined: bool) -> None:
    """Switch a core's decode step between modes (the launched steps resolved first)."""
    while core.scheduler.launched:
        core.scheduler.resolve(core.scheduler.launched[0])
    core.runner.graphs = graphs if use_graphs else None
    core.pipelined = pipelined


def build_hf_checkpoint(directory: Path, small: bool, initializer_range: float) -> dict:
    import transformers

    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    if small:
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    cfg = transformers.LlamaConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   initializer_range=initializer_range,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return shape
