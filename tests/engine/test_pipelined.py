"""Pipelined decode on the CPU: step t+1 scheduled and launched before step t's sampled tokens reach the
host gives exactly the tokens of the plain loop, greedy and seeded, with requests joining and finishing
(by a stop token, by length, by a stop string, cancelled) mid-run and under preemption; nothing leaks."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.request import PENDING
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import load


def config(path, pipelined: bool, blocks=256, seqs=8) -> EngineConfig:
    return EngineConfig(model=str(path), pipelined_decode=pipelined, cache=CacheConfig(block_size=4, num_blocks=blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=seqs))


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load(config(tiny_checkpoints["llama"], False))


def prompts(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(engine: LLMEngine, schedule: dict[int, list[tuple[str, list[int], SamplingParams]]],
        cancel: dict[int, str] | None = None) -> dict[str, tuple[list[int], str, int]]:
    """Step the engine; at step k add schedule[k]'s requests and cancel cancel[k]. Per request: its
    tokens, finish reason and reported output length."""
    out: dict[str, tuple[list[int], str, int]] = {}
    tokens: dict[str, list[int]] = {}
    k = 0
    while k <= max(schedule) or engine.has_unfinished:
        for rid, p, params in schedule.get(k, []):
            engine.add_request(p, params, request_id=rid)
            tokens[rid] = []
        if cancel and k in cancel and cancel[k] in tokens and cancel[k] not in out:
            engine.abort(cancel[k])
            out[cancel[k]] = (tokens[cancel[k]], "cancelled", len(tokens[cancel[k]]))
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                out[o.request_id] = (tokens[o.request_id], o.finish_reason.value, o.num_output_tokens)
        k += 1
        assert k < 5000
    return out


PREEMPTIONS: list[int] = []  # of the pipelined engine of the last `both`


def both(loaded, path, schedule, cancel=None, **kw):
    results = []
    for pipelined in (False, True):
        engine = LLMEngine(config(path, pipelined, **kw), loaded)
        assert engine.core.pipelined is pipelined
        results.append(run(engine, schedule, cancel))
        assert engine.pool.num_used_blocks == 0 and not engine.scheduler.requests
        assert not engine.scheduler.launched and not engine.scheduler._free_after
    PREEMPTIONS[:] = [engine.scheduler.num_preemptions]
    return results


def workload(params_of, n=10, join_every=3):
    ps = prompts(n)
    return {i * join_every: [(f"r{i}", ps[i], params_of(i))] for i in range(n)}


def test_pipelined_equals_plain_greedy_with_joins_and_finishes(loaded, tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # A stop token that some requests produce mid-run: find one in a plain greedy run.
    plain = LLMEngine(config(path, False), loaded).generate(prompts(10), greedy)
    stop = plain[0].token_ids[5]

    def params(i):
        if i % 3 == 0:
            return replace(greedy, stop_token_ids=(stop,))
        return replace(greedy, max_tokens=4 + 3 * i)

    a, b = both(loaded, path, workload(params))
    assert a == b
    assert {reason for _, reason, _ in a.values()} == {"stop", "length"}
    assert all(n == len(toks) for toks, _, n in b.values())


def test_pipelined_equals_plain_seeded(loaded, tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    sampled = SamplingParams(max_tokens=20, temperature=0.9, top_k=40, ignore_eos=True)
    a, b = both(loaded, path, workload(lambda i: replace(sampled, seed=100 + i), n=8, join_every=2))
    assert a == b


def test_pipelined_equals_plain_with_stop_strings_and_eos():
    """The real model: EOS and stop strings end requests mid-run (text-level stops end a request whose
    next token is already in flight)."""
    from pdserve.model.loader import default_model_path

    try:
        model = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg = EngineConfig(model=str(model), scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
    loaded = load(cfg)
    tok = loaded.info.tokenizer
    texts = ["The capital of France is", "List three colors:", "1, 2, 3,", "Once upon a time"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    schedule = {2 * i: [(f"r{i}", tok.encode(t), replace(greedy, stop=(",",)) if i == 2 else greedy)]
                for i, t in enumerate(texts)}
    results = []
    for pipelined in (False, True):
        engine = LLMEngine(replace(cfg, pipelined_decode=pipelined), loaded)
        results.append(run(engine, schedule))
        assert engine.pool.num_used_blocks == 0
    assert results[0] == results[1]
    assert results[0]["r2"][1] == "stop"


def test_pipelined_equals_plain_under_preemption_and_cancel(loaded, tiny_checkpoints):
    """A cache too small for the batch: requests are preempted (some with a token in flight) and
    recomputed; one request is cancelled mid-run. Same tokens, nothing leaked."""
    path = tiny_checkpoints["llama"]
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    a, b = both(loaded, path, workload(lambda i: greedy, n=8, join_every=1), cancel={12: "r3"}, blocks=40)
    assert PREEMPTIONS[0] > 0
    cut_a, cut_b = a.pop("r3"), b.pop("r3")
    assert a == b
    # Cancelled at the same step: the pipelined stream is one step behind (its last token was in flight).
    assert cut_a[1] == cut_b[1] == "cancelled" and cut_b[0] == cut_a[0][:len(cut_b[0])]
    assert len(cut_a[0]) - len(cut_b[0]) in (0, 1)


def test_the_next_step_launches_before_the_previous_resolves(loaded, tiny_checkpoints):
    """The first step returns nothing (its tokens are in flight); the second step's decode input is the
    first step's token read on the device, before the host has it."""
    engine = LLMEngine(config(tiny_checkpoints["llama"], True), loaded)
    engine.add_request(prompts(1)[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), request_id="a")
    sched = engine.scheduler
    assert engine.step() == [] and len(sched.launched) == 1
    req = sched.requests["a"]
    assert req.token_ids[-1] == PENDING and req.unresolved == 1
    seen = []
    execute = engine.runner.execute

    def spy(chunks, layer_done=None, previous=None):
        seen.append(([c.pending_row for c in chunks], [c.token_ids for c in chunks], previous is not None))
        return execute(chunks, layer_done, previous)

    engine.core.runner.execute = spy
    out = engine.step()  # launches step 2 with the pending token, then resolves step 1
    assert seen == [([0], [[PENDING]], True)]
    assert len(out) == 1 and out[0].new_token_ids[0] != PENDING and req.unresolved == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_pipelined_workers_stream_token_exact(ray_local, aloop, tiny_checkpoints, mode):
    """Decode and colocated workers with pipelined decode forced on (the CUDA default) on a real local
    Ray cluster: every stream equals the offline engine's; no KV block is left used."""
    from pdserve.config import ClusterConfig, PoolConfig

    from served import Served, Streams, assert_exact

    engine = replace(config(tiny_checkpoints["llama"], True), pipelined_decode=True)
    pool = PoolConfig(1, num_cpus=0.25, cache=engine.cache, scheduler=engine.scheduler)
    pools = dict(colocated=pool) if mode == "colocated" else dict(prefill=pool, decode=pool)
    s = Served(aloop, ClusterConfig(engine=engine, mode=mode, **pools))
    try:
        batch = prompts(6)
        streams = Streams(s, batch, 24)
        plain = LLMEngine(replace(engine, pipelined_decode=False))  # the reference: the plain loop
        reference = [c.token_ids for c in plain.generate(batch, SamplingParams(max_tokens=24, temperature=0.0,
                                                                                ignore_eos=True))]
        assert_exact(streams.future.result(120), reference)
        s.settle()
    finally:
        s.close()


@pytest.mark.parametrize("pipelined", [False, True])
def test_decode_graph_buckets_give_the_plain_tokens(loaded, tiny_checkpoints, pipelined):
    """The CUDA path's step machinery on the CPU: decode-only steps padded to the graphs' buckets (eager,
    no graph captured here), with and without pipelining, give the plain loop's tokens and leave the
    pool's blocks free; the scratch block is the cache's one extra block."""
    path = tiny_checkpoints["llama"]
    sampled = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True)
    schedule = workload(lambda i: replace(sampled, seed=7 + i), n=6, join_every=2)
    plain = run(LLMEngine(config(path, False), loaded), schedule)
    engine = LLMEngine(replace(config(path, pipelined), cuda_graphs=True), loaded)
    runner = engine.runner
    assert runner.graphs is not None and runner.kv_cache.shape[3] == runner.num_blocks + 1
    calls = []
    run_graph = runner.graphs.run
    runner.graphs.run = lambda chunks, previous=None: calls.append(len(chunks)) or run_graph(chunks, previous)
    assert run(engine, schedule) == plain
    assert calls and engine.pool.num_used_blocks == 0


def test_serve_flags_turn_the_fast_path_off():
    from router.cli import cluster_config_from_args, parse_args

    e = cluster_config_from_args(parse_args(["serve", "--enforce-eager", "--no-pipelined-decode"])).engine
    assert (e.cuda_graphs, e.pipelined_decode) == (False, False)
    e = cluster_config_from_args(parse_args(["serve"])).engine
    assert (e.cuda_graphs, e.pipelined_decode) == (None, None)  # the device decides: on for CUDA
