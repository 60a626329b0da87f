"""The disaggregated cluster on a real local Ray cluster: token-for-token equal to the offline engine."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import pytest
import ray
import torch

from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams
from router.cluster import Cluster

from conftest import wait_for
from served import (
    CANCEL_WITHIN_STEPS,
    CancelWatch,
    assert_same_logprobs,
    collect,
    collect_all,
    collect_group,
    collect_logprobs,
    logprob_params,
    mixed_params,
)

# 16 prompts; the 200-token one is longer than the prefill token budget (below) and is chunked.
TINY_LENS = [5, 40, 13, 70, 2, 33, 9, 21, 200, 17, 3, 55, 8, 26, 11, 64]
TINY_BUDGET = 64
SMOL_BUDGET = 256
LAYOUTS = {"1P1D": (1, 1), "2P2D": (2, 2)}


def tiny_prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 320, (n,), generator=g).tolist() for n in TINY_LENS]


def smol_prompts(tok):
    topics = ["the sea", "a red bicycle", "volcanoes", "the moon landing", "bread", "chess openings", "owls",
              "prime numbers", "rainforests", "jazz", "glaciers", "the printing press", "honey bees", "deserts",
              "lighthouses"]
    ps = [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {t}." + " Please be brief." * (i % 4)}])
          for i, t in enumerate(topics)]
    long = "Summarise the following notes. " + " ".join(f"Note {i}: the value of item {i} is {i * 7}."
                                                         for i in range(40))
    ps.append(tok.apply_chat_template([{"role": "user", "content": long}]))
    assert max(map(len, ps)) > SMOL_BUDGET
    return ps


def engine_config(model: str, block_size: int, kv_blocks: int, budget: int) -> EngineConfig:
    return EngineConfig(model=model, cache=CacheConfig(block_size=block_size, num_blocks=kv_blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=budget))


def cluster_config(engine: EngineConfig, layout: tuple[int, int], budget: int, decode_blocks: int | None = None,
                   mode: str = "disaggregated") -> ClusterConfig:
    cache = engine.cache if decode_blocks is None else CacheConfig(block_size=engine.cache.block_size,
                                                                   num_blocks=decode_blocks)
    sched = SchedulerConfig(max_num_batched_tokens=budget)
    pools = dict(colocated=PoolConfig(1, num_cpus=0.25, cache=engine.cache, scheduler=sched)) if mode == "colocated" \
        else dict(prefill=PoolConfig(layout[0], num_cpus=0.25, cache=engine.cache, scheduler=sched),
                  decode=PoolConfig(layout[1], num_cpus=0.25, cache=cache))
    return ClusterConfig(engine=engine, mode=mode, transfer_timeout_s=20.0, **pools)


def used_blocks(aloop, cluster) -> int:
    return sum(s.kv_blocks_used for s in aloop.run(cluster.stats()))


def assert_no_leaks(aloop, cluster):
    wait_for(lambda: used_blocks(aloop, cluster) == 0, timeout=30, what="every worker to report zero used KV blocks")


class RunningCluster:
    def __init__(self, aloop, config):
        self.aloop = aloop
        self.cluster = Cluster(config)
        aloop.run(self.cluster.start(), timeout=600)

    def close(self):
        self.aloop.run(self.cluster.shutdown())


# -- tiny checkpoint ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine_config(tiny_checkpoints):
    return engine_config(str(tiny_checkpoints["llama"]), block_size=4, kv_blocks=512, budget=TINY_BUDGET)


@pytest.fixture(scope="module")
def tiny_reference(tiny_engine_config):
    params = mixed_params(len(TINY_LENS), 16)
    outs = LLMEngine(tiny_engine_config).generate(tiny_prompts(), params)
    return params, [o.token_ids for o in outs]


@pytest.fixture(scope="module", params=list(LAYOUTS) + ["colocated"])
def tiny_cluster(request, ray_local, aloop, tiny_engine_config):
    mode = "colocated" if request.param == "colocated" else "disaggregated"
    rc = RunningCluster(aloop, cluster_config(tiny_engine_config, LAYOUTS.get(request.param, (1, 1)), TINY_BUDGET,
                                              mode=mode))
    yield rc
    rc.close()


def test_tiny_matches_offline_engine(aloop, tiny_cluster, tiny_reference):
    params, ref = tiny_reference
    got = aloop.run(collect_all(tiny_cluster.cluster, tiny_prompts(), params))
    assert [g[0] for g in got] == ref
    assert all(g[2] is FinishReason.LENGTH for g in got)
    assert_no_leaks(aloop, tiny_cluster.cluster)


def test_tiny_logprobs_and_penalties_match_offline_engine(aloop, tiny_cluster, tiny_engine_config):
    """Logprobs (raw and processed, top k, the prompt's through chunked prefill: the 200-token prompt is
    longer than the token budget), penalties and min_tokens: through 1P1D, 2P2D and a colocated worker
    the tokens and every logprob equal the offline engine's; prompt logprobs come once, with the first
    token, from the worker that computed the prompt."""
    prompts = tiny_prompts()
    params = logprob_params(len(prompts), 12)
    with LLMEngine(tiny_engine_config) as engine:
        want = engine.generate(prompts, params)

    async def run():
        return await asyncio.gather(*(collect_logprobs(tiny_cluster.cluster, p, sp) for p, sp in zip(prompts, params)))

    got = aloop.run(run())
    for (tokens, logprobs, prompt_logprobs), w, p, sp in zip(got, want, prompts, params):
        assert tokens == w.token_ids
        assert_same_logprobs(logprobs, w.logprobs)
        assert_same_logprobs(prompt_logprobs, w.prompt_logprobs)
        if sp.prompt_logprobs is not None:
            assert len(prompt_logprobs) == len(p) and prompt_logprobs[0] is None
        assert len(tokens) >= sp.min_tokens
    assert_no_leaks(aloop, tiny_cluster.cluster)


def test_tiny_groups_match_the_offline_engine_and_share_the_prompt(aloop, tiny_cluster, tiny_engine_config):
    """Requests of n samples through 1P1D, 2P2D and a colocated worker: each sample's tokens, text and
    logprobs equal the offline engine's sample of the same index (which is the n=1 request seeded
    sample_seed(seed, i)); disaggregated, each group's prompt is computed once and its KV moved once."""
    g = torch.Generator().manual_seed(97)  # prompts no other test sends: none is in a prefix cache yet
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 40, 13, 70, 2, 33)]
    params = [SamplingParams(max_tokens=8, temperature=1.0, top_k=50, seed=40 + i, n=2 + i % 3, logprobs=1,
                             ignore_eos=True) for i in range(len(prompts))]
    with LLMEngine(tiny_engine_config) as engine:
        want = engine.generate(prompts, params)
    before = aloop.run(tiny_cluster.cluster.stats())

    async def run():
        return await asyncio.gather(*(collect_group(tiny_cluster.cluster, p, sp) for p, sp in zip(prompts, params)))

    got = [sample for group in aloop.run(run()) for sample in group]
    assert len(got) == len(want) == sum(sp.n for sp in params)
    for (tokens, logprobs, text, reason), w in zip(got, want):
        assert (tokens, text, reason) == (w.token_ids, w.text, w.finish_reason)
        assert_same_logprobs(logprobs, w.logprobs)
    after = aloop.run(tiny_cluster.cluster.stats())
    computed = sum(a.prompt_tokens_computed - b.prompt_tokens_computed for a, b in zip(after, before))
    assert computed == sum(map(len, prompts))  # each prompt once
    if "decode" in tiny_cluster.cluster.pools:
        moved = sum(a.transfer.get("transfers", 0) - b.transfer.get("transfers", 0)
                    for a, b in zip(after, before) if a.pool == "decode")
        assert moved <= len(prompts)  # one transfer per group at most (several groups may share one)
    assert_no_leaks(aloop, tiny_cluster.cluster)


def test_tiny_group_resumes_each_sample_after_its_decode_worker_dies(aloop, tiny_cluster, tiny_engine_config):
    """A group whose decode worker is killed mid-stream: each unfinished sample resumes on its own from the
    tokens it streamed, and every sample still equals the offline engine's, nothing repeated or lost; a
    group closed midway frees every block on every worker."""
    cluster = tiny_cluster.cluster
    if len(cluster.pools.get("decode", ())) < 2:
        pytest.skip("needs two decode workers")
    prompt = tiny_prompts()[1]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, n=3, logprobs=0, ignore_eos=True)
    with LLMEngine(tiny_engine_config) as engine:
        want = engine.generate([prompt], params)
    lost = cluster.retries["decode_lost"]

    async def run():
        samples = [([], []) for _ in range(params.n)]
        killed = False
        async with contextlib.aclosing(cluster.generate(prompt, params, "group-resumed")) as gen:
            async for out in gen:
                samples[out.index][0].extend(out.new_token_ids)
                samples[out.index][1].extend(out.logprobs)
                if not killed and sum(len(t) for t, _ in samples) >= 3 * params.n:
                    victim = next(w for w in cluster.pools["decode"] if "group-resumed#0" in w.requests)
                    ray.kill(victim.handle, no_restart=True)
                    killed = True
        return samples

    for (tokens, logprobs), w in zip(aloop.run(run(), timeout=300), want):
        assert tokens == w.token_ids
        assert_same_logprobs(logprobs, w.logprobs)
    assert cluster.retries["decode_lost"] == lost + 1

    async def close_midway():
        gen = cluster.generate(prompt, replace(params, max_tokens=cluster.info.max_model_len - len(prompt)))
        async for out in gen:
            if out.num_output_tokens >= 3:
                break
        await gen.aclose()

    aloop.run(close_midway())
    wait_for(lambda: all(len(cluster.pools[p]) == n for p, n in (("prefill", 2), ("decode", 2))), timeout=120,
             what="the pools back to size")
    assert_no_leaks(aloop, cluster)


def test_tiny_cancel_midway_frees_blocks(aloop, tiny_cluster):
    """Six requests, each asking for the whole context, closed after 1 to 3 outputs: each close reaches the
    worker that streams the request (its record of the cancel: the request left its batch within a few
    steps, long before its end), and every block is freed."""
    cluster = tiny_cluster.cluster
    prompts = tiny_prompts()[:6]
    streaming = "colocated" if cluster.config.mode == "colocated" else "decode"

    async def cancel_after(i, prompt, n):
        rid, max_tokens = f"midway-{i}", cluster.info.max_model_len - len(prompt)
        # A watch on each worker that may stream it, made before it starts, so that no call to a worker comes
        # between the client's last read and its close: on a loaded machine the worker stepped on through those
        # calls (125 tokens past the client's 2, at load 20), which the bounds below would blame on the cancel.
        watches = {w.worker_id: await CancelWatch.of(w) for w in cluster.pools[streaming]}
        gen = cluster.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), rid)
        got = tokens = 0
        async for out in gen:
            got += 1
            tokens += len(out.new_token_ids)  # more than one when the client lags (the router coalesces)
            if got == n:
                break
        wrid = f"{rid}#0"  # the worker-side id of its first attempt (router.cluster)
        (worker,) = [w for w in cluster.pools[streaming] if wrid in w.requests]
        watch = watches[worker.worker_id]
        await gen.aclose()
        await watch.client_cancelled()
        return got, tokens, await watch.arrived(max_tokens, wrid)

    async def all_of_them():
        return await asyncio.gather(*(cancel_after(i, p, 1 + i % 3) for i, p in enumerate(prompts)))

    got = aloop.run(all_of_them())
    assert [n for n, _, _ in got] == [1 + i % 3 for i in range(6)]
    assert all(r.output_tokens <= tokens + CANCEL_WITHIN_STEPS for _, tokens, r in got), got
    assert_no_leaks(aloop, cluster)
    transfers = [s.transfer.get("transfers", 0) for s in aloop.run(cluster.stats()) if s.pool == "decode"]
    if cluster.config.mode == "disaggregated":
        assert sum(transfers) > 0


def test_tiny_small_decode_cache_completes_everything(ray_local, aloop, tiny_engine_config, tiny_reference):
    params, ref = tiny_reference
    # 60 blocks of 4 tokens: the 200-token prompt alone takes 51; the others must wait their turn.
    rc = RunningCluster(aloop, cluster_config(tiny_engine_config, (1, 1), TINY_BUDGET, decode_blocks=60))
    try:
        got = aloop.run(collect_all(rc.cluster, tiny_prompts(), params))
        assert [g[0] for g in got] == ref
        assert_no_leaks(aloop, rc.cluster)
    finally:
        rc.close()


def test_bad_prompt_rejected_before_any_worker(aloop, tiny_cluster):
    async def bad():
        async for _ in tiny_cluster.cluster.generate([1, 2, 99999], SamplingParams()):
            pass

    with pytest.raises(ValueError, match="outside the vocabulary"):
        aloop.run(bad())


# -- the default model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_engine_config():
    from pdserve.model.loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return engine_config(None, block_size=16, kv_blocks=256, budget=SMOL_BUDGET)


@pytest.fixture(scope="module")
def smol_reference(smol_engine_config):
    eng = LLMEngine(smol_engine_config)
    prompts = smol_prompts(eng.tokenizer)
    params = mixed_params(len(prompts), 12)
    return eng, prompts, params, [o.token_ids for o in eng.generate(prompts, params)]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def smol_cluster(request, ray_local, aloop, smol_engine_config):
    rc = RunningCluster(aloop, cluster_config(smol_engine_config, LAYOUTS[request.param], SMOL_BUDGET))
    yield rc
    rc.close()


@pytest.mark.slow
def test_smol_matches_offline_engine(aloop, smol_cluster, smol_reference):
    _, prompts, params, ref = smol_reference
    got = aloop.run(collect_all(smol_cluster.cluster, prompts, params))
    assert [g[0] for g in got] == ref
    assert_no_leaks(aloop, smol_cluster.cluster)


@pytest.mark.slow
def test_smol_stop_string_matches_offline_and_frees_blocks(aloop, smol_cluster, smol_reference):
    eng, prompts, _, _ = smol_reference
    free = eng.generate([prompts[0]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    words = free.text.split()
    stop = words[len(words) // 2]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,))
    ref = eng.generate([prompts[0]], params)[0]
    tokens, text, reason = aloop.run(collect(smol_cluster.cluster, prompts[0], params))
    assert (tokens, text, reason) == (ref.token_ids, ref.text, FinishReason.STOP)
    assert text == free.text[:free.text.index(stop)]
    assert_no_leaks(aloop, smol_cluster.cluster)


def test_tiny_prefix_affinity_routes_repeats_to_the_cached_worker(aloop, tiny_cluster):
    cluster = tiny_cluster.cluster
    if cluster.config.mode != "disaggregated" or len(cluster.pools["prefill"]) < 2:
        pytest.skip("needs two prefill workers")
    prompt = tiny_prompts()[3]  # 70 tokens: 17 full blocks of 4
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def last_output():
        last = None
        async for out in cluster.generate(prompt, params):
            last = out
        return last

    first = aloop.run(last_output())
    repeats = [aloop.run(last_output()) for _ in range(3)]
    # Each repeat finds the prompt's KV where it is: on the prefill worker that computed it, or (local prefill)
    # on the decode worker it was moved to; 17 blocks of it cached, 2 tokens computed.
    for again in repeats:
        assert again.placement[0] in first.placement, (again.placement, first.placement)
        assert again.placement[0] == repeats[0].placement[0]
        assert again.num_cached_tokens == 68


@pytest.mark.slow
def test_smol_lagging_client_gets_the_waiting_tokens_in_one_message(aloop, smol_cluster, smol_reference):
    """A client that lags behind the decode steps gets the tokens already at the router together, in one
    message: the same tokens, text, stop-string cut and finish reason as the offline engine, with the stop
    string inside such a message."""
    eng, prompts, _, _ = smol_reference
    cluster = smol_cluster.cluster
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    free = eng.generate([prompts[1]], base)[0]
    words = free.text.split()
    stop = words[2 * len(words) // 3]  # a stop string well after the lag began
    for params in (base, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))):
        ref = eng.generate([prompts[1]], params)[0]

        async def lagging():
            outs = []
            async with contextlib.aclosing(cluster.generate(prompts[1], params, "lagging")) as gen:
                async for out in gen:
                    outs.append(out)
                    if len(outs) == 2:  # lag until the decode worker's tokens up to the last one wait here
                        inbox, deadline = cluster.streams.inbox("lagging"), time.monotonic() + 60
                        while not any(e.finish_reason for e in inbox.items) and time.monotonic() < deadline:
                            await asyncio.sleep(0.01)
            return outs

        outs = aloop.run(lagging())
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
        assert "".join(o.new_text for o in outs) == ref.text
        assert outs[-1].finish_reason is (FinishReason.STOP if params.stop else FinishReason.LENGTH)
        assert len(outs) == 3  # the first token, the first decoded one, then all the rest at once
    assert_no_leaks(aloop, cluster)


@pytest.mark.slow
def test_smol_text_resumes_exactly_after_its_decode_worker_dies(aloop, smol_cluster, smol_reference):
    """A stream resumed on another decode worker continues its text from the characters already sent (the
    workers make the text): tokens, text and the cut of a stop string met after the resume equal the
    offline engine's, nothing repeated or lost."""
    cluster = smol_cluster.cluster
    if len(cluster.pools["decode"]) < 2:
        pytest.skip("needs two decode workers")
    eng, prompts, _, _ = smol_reference
    free = eng.generate([prompts[2]], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0]
    stop = next(w for w in reversed(free.text.split()) if free.text.count(w) == 1)  # met late, once
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=(stop,))
    ref = eng.generate([prompts[2]], params)[0]
    assert len(ref.token_ids) > 12, "the stop string must come after the kill"
    lost = cluster.retries["decode_lost"]

    async def run():
        tokens, text, reason, killed = [], "", None, False
        async with contextlib.aclosing(cluster.generate(prompts[2], params, "resumed-text")) as gen:
            async for out in gen:
                tokens += out.new_token_ids
                text += out.new_text
                reason = out.finish_reason
                if not killed and len(tokens) >= 6:
                    victim = next(w for w in cluster.pools["decode"] if "resumed-text#0" in w.requests)
                    ray.kill(victim.handle, no_restart=True)
                    killed = True
        return tokens, text, reason

    assert aloop.run(run()) == (ref.token_ids, ref.text, FinishReason.STOP)
    assert cluster.retries["decode_lost"] == lost + 1
