"""Simulated workers (`load_format="sim"`) behind the real gRPC router: 1 prefill and 2 decode workers, each an
H100 running Llama-3-8B on the roofline's clock, with the real scheduler, block pool and KV hand-off (gloo,
checksummed). A simulated token reads the KV of its context, so a cluster's tokens equal the offline
simulated engine's only if every transfer moved the right blocks."""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from pdserve.client import AsyncClient
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.perf.hardware import gpu
from pdserve.engine.sampling import SamplingParams

from served import Served, Streams, assert_exact

H100 = gpu("H100")
SIM = EngineConfig(load_format="sim", model="llama3-8b", dtype="bfloat16", cache=CacheConfig(block_size=16),
                   peak_flops=H100.flops, peak_bytes_per_second=H100.bytes_per_s)
BUDGET = 256  # prompt tokens a prefill step: the 400-token prompt is pushed in chunks
LENS = [5, 40, 400, 13, 70, 2, 130, 21]
STREAM_INTERVAL = 4  # tokens a message (the first and last excepted): every test here runs through it


def sim_prompts():
    return [[(11 * i + 7 * j) % 49000 + 20 for j in range(n)] for i, n in enumerate(LENS)]


@pytest.fixture(scope="module")
def served(ray_local, aloop):
    pool = dict(num_cpus=0.2, scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET))
    config = ClusterConfig(engine=SIM, prefill=PoolConfig(1, **pool), decode=PoolConfig(2, **pool),
                           transfer_timeout_s=20.0, kv_checksum=True, stream_interval=STREAM_INTERVAL)
    s = Served(aloop, config)
    yield s
    s.close()


@pytest.mark.slow
def test_greedy_streams_equal_the_offline_engine(served):
    batch, t0 = sim_prompts(), time.monotonic()
    assert_exact(Streams(served, batch, 24).result(120, t0), served.reference(batch, 24))
    served.settle()


@pytest.mark.slow
def test_seeded_sampling_equals_the_offline_engine(served, aloop):
    batch, seeds = sim_prompts(), [3, 1, 4, 1, 5, 9, 2, 6]

    async def one(client, prompt, seed):
        out = []
        async for r in client.generate(token_ids=prompt, max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True,
                                       timeout=120):
            out += r.token_ids
        return out

    async def run():
        async with AsyncClient(served.target) as c:
            return await asyncio.gather(*(one(c, p, s) for p, s in zip(batch, seeds)))

    got = aloop.run(run())
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in seeds]
    assert got == [c.token_ids for c in served.offline.generate(batch, params)]
    assert len({tuple(t) for t in got[1::2]}) == 4  # the same seed, other prompts: other tokens
    served.settle()


@pytest.mark.slow
def test_text_prompts_use_the_default_tokenizer(served, aloop):
    async def run():
        async with AsyncClient(served.target) as c:
            return await c.complete("The simulated H100 says", max_tokens=8, temperature=0.0, timeout=60)

    out = aloop.run(run())
    prompt = served.offline.tokenizer.encode("The simulated H100 says")
    want = served.offline.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert (out.token_ids, out.text) == (want.token_ids, want.text)


@pytest.mark.slow
def test_a_simulated_worker_is_small(served):
    """Each worker has the blocks of an H100's KV budget for Llama-3-8B and holds them in ~52 MiB."""
    for w in (served.worker("prefill"), served.worker("decode", 0), served.worker("decode", 1)):
        stats = served.stats_of(w)
        assert stats.kv_blocks_total == 26674
        assert stats.peak_source == "configured" and stats.flops > 0
        status = Path(f"/proc/{stats.pid}/status").read_text()
        rss_mib = int(status.split("VmRSS:")[1].split()[0]) / 1024
        print(f"{w.worker_id}: RSS {rss_mib:.0f} MiB")
        assert rss_mib < 1024


def test_serve_flags_make_a_simulated_engine(caplog):
    from router.cli import cluster_config_from_args, parse_args

    args = parse_args(["serve", "--load-format", "sim", "--dtype", "bfloat16", "--sim-gpu", "A100",
                       "--sim-kv-scale", "256", "--sim-time-scale", "2"])
    with caplog.at_level(logging.INFO):
        config = cluster_config_from_args(args)
    for pool in config.pools.values():
        e = config.engine_for(pool)
        assert (e.load_format, e.model, e.sim_gpu, e.sim_kv_scale, e.sim_time_scale) == ("sim", None, "A100", 256, 2.0)
        assert (e.peak_flops, e.peak_bytes_per_second) == (gpu("A100").flops, gpu("A100").bytes_per_s)  # MFU, MBU
    assert "every worker is a simulated engine: an A100" in caplog.text
    assert "running llama3-8b" in caplog.text and "512 B held (scale 256" in caplog.text


@pytest.mark.slow
def test_stream_interval_sends_tokens_in_messages_of_n(served, aloop):
    """With stream_interval 4 the first token comes alone (TTFT is not held back), every later message
    but the last carries at least 4 tokens, and the tokens are those of the offline engine."""
    prompt = sim_prompts()[1]

    async def run():
        async with AsyncClient(served.target) as client:
            return [list(r.token_ids) async for r in client.generate(token_ids=prompt, max_tokens=30,
                                                                     temperature=0.0, ignore_eos=True, timeout=120)]

    messages = aloop.run(run())
    assert len(messages[0]) == 1
    assert all(len(m) >= STREAM_INTERVAL for m in messages[1:-1]), [len(m) for m in messages]
    assert len(messages) <= 2 + 29 // STREAM_INTERVAL
    assert [t for m in messages for t in m] == served.reference([prompt], 30)[0]
