"""Prefill and decode workers as plain Python, wired together in one process (no Ray, no channel)."""
from __future__ import annotations

import pytest
import torch

from decode_worker.worker import DecodeWorker
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.kv_transfer import extract_blocks
from pdserve.loader import load
from pdserve.messages import DecodeTask, PrefillTask
from pdserve.request import token_stop_reason
from pdserve.sampling import SamplingParams
from prefill_worker.worker import PrefillWorker

LENS = [5, 40, 13, 70, 2, 33, 9, 21]


def config(path, blocks=256, budget=32, seqs=16) -> EngineConfig:
    return EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs))


def prompts(n=len(LENS)):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 320, (LENS[i % len(LENS)],), generator=g).tolist() for i in range(n)]


def run_disaggregated(prefill: PrefillWorker, decode: DecodeWorker, batch, params) -> dict[str, list[int]]:
    """The request path with the KV copied by hand: prefill -> first token -> reserve -> insert -> decode."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(batch):
        prefill.add(PrefillTask(f"r{i}", tuple(p), params[i], 100 + i))
    eos, max_len = decode.core.eos_token_ids, decode.core.max_model_len
    while prefill.has_work:
        for r in prefill.step():
            i = int(r.request_id[1:])
            out[r.request_id] = [r.first_token]
            decode.add(DecodeTask(r.request_id, tuple(batch[i]), (r.first_token,), params[i], 100 + i, "p"))
    while decode.pending or decode.reserved or decode.has_work:
        while (res := decode.reserve_next()) is not None:
            task, blocks = res
            kv = extract_blocks(prefill.runner.kv_cache, prefill.held_blocks(task.request_id))
            assert kv.shape[3] == len(blocks)
            assert decode.complete_transfer(task.request_id, kv)
            assert prefill.release(task.request_id)
        for ev in decode.step():
            out[ev.request_id].append(ev.token)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return path, load(config(path))


def test_disaggregated_equals_offline_engine(tiny):
    path, loaded = tiny
    batch = prompts()
    params = [SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.8, seed=100 + i, ignore_eos=True)
              for i in range(len(batch))]
    ref = [c.token_ids for c in LLMEngine(config(path), loaded).generate(batch, params)]
    # Budget 16 < the 40- and 70-token prompts: they are ingested in chunks.
    prefill = PrefillWorker("p", config(path, budget=16), loaded)
    decode = DecodeWorker("d", config(path), loaded)
    got = run_disaggregated(prefill, decode, batch, params)
    assert [got[f"r{i}"] for i in range(len(batch))] == ref
    assert prefill.pool.num_used_blocks == 0 and decode.pool.num_used_blocks == 0
    prefill.pool.check_integrity()
    decode.pool.check_integrity()


def test_small_decode_cache_backpressure_completes_everything(tiny):
    path, loaded = tiny
    batch = prompts(8)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 8
    ref = [c.token_ids for c in LLMEngine(config(path), loaded).generate(batch, params)]
    decode = DecodeWorker("d", config(path, blocks=24), loaded)  # room for one or two requests at a time
    got = run_disaggregated(PrefillWorker("p", config(path), loaded), decode, batch, params)
    assert [got[f"r{i}"] for i in range(8)] == ref
    assert decode.pool.num_used_blocks == 0


def test_prefill_reuses_cached_prefix_and_first_token_matches(tiny):
    path, loaded = tiny
    prefill = PrefillWorker("p", config(path), loaded)
    p = prompts()[3]  # 70 tokens
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prefill.add(PrefillTask("a", tuple(p), params, 1))
    (first,) = [r for _ in range(10) for r in prefill.step()]
    prefill.release("a")
    prefill.add(PrefillTask("b", tuple(p), params, 1))
    (second,) = [r for _ in range(10) for r in prefill.step()]
    assert second.first_token == first.first_token
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 68)  # 17 full blocks; the last token recomputed
    assert second.num_kv_blocks == 18
    prefill.release("b")
    assert prefill.pool.num_used_blocks == 0


def test_prefill_token_budget_and_backpressure(tiny):
    path, loaded = tiny
    prefill = PrefillWorker("p", config(path, blocks=20, budget=16), loaded)
    ps = prompts()
    for i in (1, 3):  # 40 and 70 tokens: 10 + 18 blocks > 20
        prefill.add(PrefillTask(f"r{i}", tuple(ps[i]), SamplingParams(max_tokens=1), 0))
    done = []
    for _ in range(3):
        done += prefill.step()
    assert [r.request_id for r in done] == ["r1"]  # 40 tokens at 16 per step: 3 steps
    for _ in range(5):
        done += prefill.step()
    assert len(done) == 1 and len(prefill.waiting) == 1  # r3 waits: r1's held KV fills the pool
    prefill.release("r1")
    for _ in range(5):
        done += prefill.step()
    assert [r.request_id for r in done] == ["r1", "r3"]
    with pytest.raises(ValueError, match="does not fit"):
        prefill.add(PrefillTask("big", tuple(range(90)), SamplingParams(), 0))


def test_cancel_everywhere_frees_blocks(tiny):
    path, loaded = tiny
    prefill = PrefillWorker("p", config(path), loaded)
    decode = DecodeWorker("d", config(path), loaded)
    ps = prompts()
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(3):
        prefill.add(PrefillTask(f"r{i}", tuple(ps[i]), params, 0))
    results = prefill.step()  # r0 (5 tokens) completes; r1 (40) is ingested in chunks of the budget of 32
    assert prefill.cancel("r2")  # still waiting
    results += [r for _ in range(5) for r in prefill.step()]
    assert [r.request_id for r in results] == ["r0", "r1"]
    for r in results:
        decode.add(DecodeTask(r.request_id, tuple(ps[int(r.request_id[1:])]), (r.first_token,), params, 0, "p"))
    task, blocks = decode.reserve_next()
    decode.complete_transfer(task.request_id, extract_blocks(prefill.runner.kv_cache, prefill.held_blocks(task.request_id)))
    prefill.release(task.request_id)
    task2, _ = decode.reserve_next()
    decode.step()
    assert decode.cancel(task.request_id)  # running
    assert decode.cancel(task2.request_id)  # reserved, transfer in flight
    assert not decode.complete_transfer(task2.request_id, torch.empty(0))  # late arrival is dropped
    assert prefill.cancel(task2.request_id)  # held
    assert not decode.cancel("unknown") and not prefill.cancel("unknown")
    assert prefill.pool.num_used_blocks == 0 and decode.pool.num_used_blocks == 0


def test_first_token_stop_rules():
    from pdserve.request import FinishReason, Request

    r = Request("a", [1, 2], SamplingParams(max_tokens=1), 0)
    r.token_ids.append(5)
    assert token_stop_reason(r, (9,), 100) is FinishReason.LENGTH
    r = Request("a", [1, 2], SamplingParams(max_tokens=5), 0)
    r.token_ids.append(9)
    assert token_stop_reason(r, (9,), 100) is FinishReason.STOP


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=12, temperature=1.0, seed=9, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_resumed_request_continues_exactly(tiny, params):
    """A request re-prefilled with the tokens it already streamed samples exactly the tokens it would have."""
    path, loaded = tiny
    p = prompts()[1]
    ref = LLMEngine(config(path), loaded).generate([p], params)[0].token_ids
    prefill = PrefillWorker("p", config(path), loaded)
    decode = DecodeWorker("d", config(path), loaded)
    streamed = ref[:5]  # what the client got before the decode worker was lost
    prefill.add(PrefillTask("r", tuple(p), params, 9, tuple(streamed)))
    (r,) = [x for _ in range(5) for x in prefill.step()]
    assert r.first_token == ref[5]
    decode.add(DecodeTask("r", tuple(p), (*streamed, r.first_token), params, 9, "p"))
    _, blocks = decode.reserve_next()
    decode.complete_transfer("r", extract_blocks(prefill.runner.kv_cache, prefill.held_blocks("r")))
    prefill.release("r")
    rest = []
    while decode.has_work:
        rest += [ev.token for ev in decode.step()]
    assert [*streamed, r.first_token, *rest] == ref
    assert decode.pool.num_used_blocks == 0 and prefill.pool.num_used_blocks == 0
