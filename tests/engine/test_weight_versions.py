"""Weight updates in the offline engine: versions, the version-keyed prefix cache, and what each version
policy does to a request in flight. References: an engine loaded from the new checkpoint, and for "keep"
transformers itself (the old model's KV cache handed to the new model)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import LLMEngine
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import SamplingParams
from pdserve.weights.update import WeightError

from conftest import keep_reference

PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 18, 200, 11, 73, 9]


def engine(path: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=64)))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_until(eng: LLMEngine, rid: str, n: int) -> tuple[list[int], list[int]]:
    """Step until request rid has n output tokens: (its tokens, their versions)."""
    tokens, versions = [], []
    while len(tokens) < n:
        for out in eng.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                versions += out.weight_versions
    return tokens, versions


def finish(eng: LLMEngine, outs=()) -> dict[str, tuple[list[int], list[int], FinishReason | None]]:
    """Every output from here to the end, per request: (tokens, versions, finish reason)."""
    got: dict[str, tuple[list[int], list[int], list]] = {}

    def add(out):
        t, v, r = got.setdefault(out.request_id, ([], [], [None]))
        t += out.new_token_ids
        v += out.weight_versions
        r[0] = out.finish_reason or r[0]

    for out in outs:
        add(out)
    for out in eng.stream():
        add(out)
    return {rid: (t, v, r[0]) for rid, (t, v, r) in got.items()}


def reference(path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    return engine(path).generate([prompt], greedy(max_tokens))[0].token_ids


def test_new_requests_after_an_update_match_the_new_checkpoint(weight_versions):
    eng = engine(weight_versions[0])
    assert eng.weight_version == 0
    before = eng.generate([PROMPT], greedy(8))[0].token_ids
    assert before == reference(weight_versions[0], PROMPT, 8)
    assert eng.update_weights(str(weight_versions[1]), 1) == []
    assert eng.weight_version == 1
    after = reference(weight_versions[1], PROMPT, 8)
    assert after != before, "the perturbation must change the greedy tokens, or this test shows nothing"
    hits = eng.pool.prefix_hits
    rid = eng.add_request(PROMPT, greedy(8))
    done = finish(eng)[rid]
    assert done[0] == after and done[1] == [1] * 8
    # The prompt's blocks of version 0 are still cached, and were not a hit for version 1 ...
    assert eng.pool.prefix_hits == hits
    # ... while version 1's own blocks are, for the next request at version 1.
    rid = eng.add_request(PROMPT, greedy(8))
    assert finish(eng)[rid][0] == after
    assert eng.pool.prefix_hits == hits + (len(PROMPT) - 1) // 4


def test_an_update_from_tensors_equals_one_from_the_checkpoint(weight_versions):
    from safetensors.torch import load_file

    eng = engine(weight_versions[0])
    tensors = {k: v for f in weight_versions[1].glob("*.safetensors") for k, v in load_file(str(f)).items()}
    eng.update_weights(tensors.items(), 5)
    assert eng.weight_version == 5
    assert eng.generate([PROMPT], greedy(8))[0].token_ids == reference(weight_versions[1], PROMPT, 8)


def test_recompute_continues_as_the_new_weights_would_from_the_tokens_so_far(weight_versions):
    eng = engine(weight_versions[0])
    rid = eng.add_request(PROMPT, greedy(12, version_policy="recompute"))
    first, v = run_until(eng, rid, 4)
    assert v == [0] * 4
    assert eng.update_weights(str(weight_versions[1]), 1) == []
    assert eng.core.version_outcomes["recomputed"] == 1
    rest, v, reason = finish(eng)[rid]
    expected = reference(weight_versions[1], PROMPT + first, 12 - len(first))
    assert first + rest == reference(weight_versions[0], PROMPT, 4) + expected
    assert v == [1] * len(rest) and reason is FinishReason.LENGTH
    assert eng.pool.num_used_blocks == 0


def test_keep_decodes_over_the_old_kv(weight_versions):
    eng = engine(weight_versions[0])
    rid = eng.add_request(PROMPT, greedy(12, version_policy="keep"))
    first, _ = run_until(eng, rid, 4)
    eng.update_weights(str(weight_versions[1]), 1)
    assert eng.core.version_outcomes == {"kept": 1}
    rest, v, _ = finish(eng)[rid]
    assert rest == keep_reference(weight_versions[0], weight_versions[1], PROMPT, first, 8)
    assert v == [1] * 8
    # Not the same as recomputing: the old KV made a difference (else this test shows nothing).
    assert rest != reference(weight_versions[1], PROMPT + first, 8)


def test_abort_ends_the_request_with_its_tokens_so_far(weight_versions):
    eng = engine(weight_versions[0])
    rid = eng.add_request(PROMPT, greedy(12, version_policy="abort"))
    other = eng.add_request([1, 2, 3, 4, 5], greedy(6))  # recompute, the default
    first, _ = run_until(eng, rid, 3)
    outs = eng.update_weights(str(weight_versions[1]), 1)
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [(rid, [], FinishReason.ABORT)]
    assert outs[0].num_output_tokens == len(first)
    assert eng.core.version_outcomes == {"aborted": 1, "recomputed": 1}
    done = finish(eng)
    assert rid not in done and done[other][2] is FinishReason.LENGTH
    assert eng.pool.num_used_blocks == 0


def test_max_staleness_bounds_keep(weight_versions):
    eng = engine(weight_versions[0])
    bounded = eng.add_request(PROMPT, greedy(14, version_policy="keep", max_staleness=1))
    strict = eng.add_request(PROMPT[:9], greedy(14, version_policy="keep", max_staleness=0))
    first, _ = run_until(eng, bounded, 3)
    eng.update_weights(str(weight_versions[1]), 1)  # bounded: 1 version old, kept; strict: recomputed
    assert eng.core.version_outcomes == {"kept": 1, "recomputed": 1}
    second, v = run_until(eng, bounded, 2)
    assert v == [1, 1]
    eng.update_weights(str(weight_versions[2]), 2)  # bounded's KV began at version 0: 2 old, recomputed; strict again
    assert eng.core.version_outcomes == {"kept": 1, "recomputed": 3}
    done = finish(eng)
    so_far = first + second
    assert done[bounded][0] == reference(weight_versions[2], PROMPT + so_far, 14 - len(so_far))
    assert done[bounded][1] == [2] * (14 - len(so_far)) and done[strict][2] is FinishReason.LENGTH
    assert eng.pool.num_used_blocks == 0


def test_bad_updates_apply_nothing(weight_versions, tmp_path):
    eng = engine(weight_versions[0])
    rid = eng.add_request(PROMPT, greedy(10))
    first, _ = run_until(eng, rid, 3)
    good = [("model.norm.weight", torch.ones(64))]
    with pytest.raises(WeightError, match="lm_head"):
        eng.update_weights(good + [("lm_head.weight", torch.zeros(3, 3))], 1)
    with pytest.raises(WeightError, match="no_such"):
        eng.update_weights(good + [("model.no_such.weight", torch.zeros(3))], 1)
    with pytest.raises(ValueError, match="not newer"):
        eng.update_weights(str(weight_versions[1]), 0)
    bad = tmp_path / "other-shape"
    bad.mkdir()
    cfg = json.loads((weight_versions[1] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(WeightError):
        eng.update_weights(str(bad), 1)
    assert eng.weight_version == 0 and not eng.core.version_outcomes
    rest, v, _ = finish(eng)[rid]
    assert first + rest == reference(weight_versions[0], PROMPT, 10) and v == [0] * len(rest)


def test_an_update_stages_into_the_memory_of_the_one_before(weight_versions):
    eng = engine(weight_versions[0])
    eng.update_weights(str(weight_versions[1]), 1)
    first = {k: v.data_ptr() for k, v in eng.core._spare.buffers().items()}
    eng.update_weights(str(weight_versions[2]), 2)
    second = {k: v.data_ptr() for k, v in eng.core._spare.buffers().items()}
    assert first == second  # the same memory, written again (no page faulted in anew)
    assert eng.generate([PROMPT], greedy(8))[0].token_ids == reference(weight_versions[2], PROMPT, 8)


def test_a_tensor_parallel_engine_updates_every_rank(weight_versions, tmp_path):
    config = EngineConfig(model=str(weight_versions[0]), cache=CacheConfig(block_size=4, num_blocks=64),
                          tensor_parallel_size=2)
    with LLMEngine(config) as eng:
        bad = tmp_path / "other-shape"
        bad.mkdir()
        cfg = json.loads((weight_versions[1] / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
        with pytest.raises(WeightError):
            eng.update_weights(str(bad), 1)
        assert eng.generate([PROMPT], greedy(8))[0].token_ids == reference(weight_versions[0], PROMPT, 8)
        with pytest.raises(NotImplementedError):  # rank 0 alone cannot take tensors for every rank
            eng.update_weights([("model.norm.weight", torch.ones(64))], 1)
        eng.update_weights(str(weight_versions[1]), 1)
        assert eng.weight_version == 1
        assert eng.generate([PROMPT], greedy(8))[0].token_ids == reference(weight_versions[1], PROMPT, 8)
        eng.update_weights(str(weight_versions[2]), 2)  # every rank stages into its own memory of the last one
        assert eng.generate([PROMPT], greedy(8))[0].token_ids == reference(weight_versions[2], PROMPT, 8)


def test_a_trainers_group_reaches_every_rank_of_a_tensor_parallel_engine(weight_versions):
    """A trainer (this thread, rank 0) broadcasts whole tensors on a weight group that both ranks of a TP 2
    engine joined (as ranks 1 and 2); each stages its share and the engine then serves the new weights. A
    trainer that sends another update than announced fails every rank's receive: nothing is applied."""
    import threading

    from safetensors.torch import load_file

    from pdserve.weights.group import GroupAddress, WeightGroup, WeightGroupError, free_port
    from pdserve.weights.update import TensorMeta

    config = EngineConfig(model=str(weight_versions[0]), cache=CacheConfig(block_size=4, num_blocks=64),
                          tensor_parallel_size=2)
    tensors = sorted(load_file(str(weight_versions[1] / "model.safetensors")).items())
    metas = [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in tensors]
    with LLMEngine(config) as eng:
        address = GroupAddress("127.0.0.1", free_port(), 3, "tp-engine")
        joined: list = []
        t = threading.Thread(target=lambda: joined.append(eng.core.join_weight_group(address, 1, 30.0)))
        t.start()
        with WeightGroup.join(address, 0, 30.0) as trainer:
            t.join(30)
            group = joined[0]
            assert group.rank == 1
            received: list = []
            t = threading.Thread(target=lambda: received.append(eng.core.receive_weights(group, metas, 4096)))
            t.start()
            trainer.send(tensors, 4096)
            t.join(60)
            eng.core.commit_weights(received[0], 1)
            assert eng.generate([PROMPT], greedy(8))[0].token_ids == reference(weight_versions[1], PROMPT, 8)

            # An update other than the one announced: every rank refuses it, the engine serves on.
            failed: list = []

            def receive() -> None:
                try:
                    eng.core.receive_weights(group, metas, 4096)
                except (WeightError, WeightGroupError) as e:
                    failed.append(e)

            t = threading.Thread(target=receive)
            t.start()
            with pytest.raises(WeightGroupError):
                trainer.send(tensors[:-1], 4096)
            t.join(60)
            assert failed
        eng.core.leave_weight_group(group)
        assert eng.generate([PROMPT], greedy(8))[0].token_ids == reference(weight_versions[1], PROMPT, 8)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_exported_weights_load_back_exactly(weight_versions, tmp_path, quantization):
    """What a worker writes for a late worker to catch up from (EngineCore.export_weights) is what it serves."""
    config = EngineConfig(model=str(weight_versions[0]), quantization=quantization,
                          cache=CacheConfig(block_size=4, num_blocks=64))
    eng = LLMEngine(config)
    eng.update_weights(str(weight_versions[1]), 1)
    assert eng.core.export_weights(str(tmp_path / "v1")) > 0
    late = LLMEngine(config)
    late.update_weights(str(tmp_path / "v1"), 1)
    mine, theirs = dict(eng.runner.model.state_dict()), dict(late.runner.model.state_dict())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
