"""One worker's engine: requests, the paged KV cache, the scheduler, the model runner, the offline engine.

request.py      a request's state and the token-level stop rules
sampling.py     sampling parameters and the batched sampler (seeded per token)
block_pool.py   the KV cache's block ids: ref counts, free queue, prefix cache
kv_cache.py     requests onto blocks: admission with prefix reuse, slots, freeing
scheduler.py    continuous batching in a role: prefill (HELD), decode (WAITING_FOR_KV), colocated
scheduler_types.py  the role, a scheduled step, a sampled token, a request's next chunk
pipelined.py    pipelined decode: steps launched before the last resolved (a base of Scheduler)
chunk.py        one sequence's part of a step
runner.py       a step on the model: inputs, forward, sampling; CUDA graphs (cuda_graphs.py) for decode
tp_runner.py    a tensor-parallel engine's ranks: rank 0 schedules, every rank runs the forward
tp_wire.py      what rank 0 tells the other ranks (steps, weight commands), as JSON: no pickle of a peer's bytes
sim_runner.py   the simulated engine's runner (load_format "sim"): a step sleeps the cost model's time for
                it (pdserve.perf)
llm_engine.py   EngineCore (a worker's engine) and LLMEngine (the offline engine, the cluster's reference)
step_loop.py    the one thread that owns a worker's engine
output.py       per-request text: incremental detokenization and stop strings
utilization.py  model FLOPs and bytes per step, device peaks (MFU and MBU)
args.py         the engine's command-line flags

May import pdserve.config, pdserve.tiers, pdserve.model, pdserve.kernels, pdserve.parallel,
pdserve.transfer (the TP ranks' groups), pdserve.perf (the simulated runner's clock) and pdserve.weights
(staging and committing weight updates: EngineCore.stage_weights / commit_weights). `LLMEngine` is
re-exported here, loaded on first use.
"""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazily, so that `from pdserve.engine.sampling import ...` does not load the model code.
    if name in ("LLMEngine", "EngineCore"):
        from pdserve.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
