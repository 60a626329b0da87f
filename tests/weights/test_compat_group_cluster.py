"""A client's weight group against a real SmolLM2 cluster (colocated and 1P1D) behind the router's HTTP door: the
trainer pushes weights as the RL frameworks push them into SGLang (tests/weights/compat_trainer.py: their sender
written with plain torch.distributed as their source does it, since neither AReaL nor SkyRL-train installs here
beside torch 2.13.0+cpu): SGLang's /init_weights_update_group, /update_weights_from_distributed (the list form,
and one tensor a call), /destroy_weights_update_group. After each update, greedy tokens equal the offline engine's
loaded from the same weights saved to disk; bad calls are refused with nothing applied; a trainer that vanishes
mid-update leaves the old weights serving."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pdserve.client import Client
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.weights.group import free_port
from router.config import RouterConfig

from compat_trainer import init_group, push
from conftest import perturbed_checkpoint, wait_for
from served import Served

PROMPT = [1, 504, 3458, 314, 260, 1345, 30, 378, 2133, 253, 9690, 28]
LAYOUTS = {"colocated": dict(mode="colocated", colocated=PoolConfig(1, num_cpus=0.25)),
           "1P1D": dict(prefill=PoolConfig(1, num_cpus=0.25), decode=PoolConfig(1, num_cpus=0.25),
                        local_prefill_max_tokens=0)}


def engine_config(path) -> EngineConfig:
    return EngineConfig(model=str(path), cache=CacheConfig(block_size=16, num_blocks=128),
                        scheduler=SchedulerConfig(max_num_batched_tokens=256))


@pytest.fixture(scope="module")
def smol_versions(tmp_path_factory) -> list[Path]:
    """SmolLM2 as a Hugging Face directory (the loader's dequantized copy of the packaged GGUF), and two versions
    of it, each perturbed from the one before."""
    from pdserve.model.loader import _weights_dir, default_model_path, resolve_format

    try:
        path, fmt = resolve_format(str(default_model_path()), "auto")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    v0 = _weights_dir(path, fmt)
    root = tmp_path_factory.mktemp("smol")
    v1 = perturbed_checkpoint(v0, root / "smol-v1", scale=0.02, seed=1)
    return [v0, v1, perturbed_checkpoint(v1, root / "smol-v2", scale=0.02, seed=2)]


@functools.lru_cache(maxsize=None)
def reference(path: str) -> tuple[int, ...]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return tuple(LLMEngine(engine_config(path)).generate([PROMPT], params)[0].token_ids)


def tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [(k, v) for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, ray_local, aloop, smol_versions):
    config = ClusterConfig(engine=engine_config(smol_versions[0]), transfer_timeout_s=30.0, **LAYOUTS[request.param])
    s = Served(aloop, config, RouterConfig(port=0, metrics_port=0, http_port=0))
    s.base = f"http://127.0.0.1:{s.router.http_port}"
    s.world_size = 1 + sum(len(p) for p in s.cluster.pools.values())
    yield s
    s.close()


def greedy(served):
    with Client(served.target) as c:
        out = c.complete(token_ids=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, timeout=120)
        return tuple(out.token_ids), set(out.choices[0].weight_versions), {
            w.version for w in c.weight_versions(timeout=30).workers}


def make_group(served, name: str):
    pg, answer = init_group(served.base, served.world_size, free_port(), name)
    assert answer["status"] == 200 and answer["success"], answer
    return pg


def leave(served, pg) -> None:
    import httpx

    r = httpx.post(f"{served.base}/destroy_weights_update_group", json={"group_name": "x"}, timeout=60)
    assert r.status_code == 200 and r.json()["success"]
    dist.destroy_process_group(pg)


def test_a_whole_update_then_one_tensor_a_call(served, smol_versions):
    before = served.router.weights.version
    assert greedy(served)[0] == reference(str(smol_versions[0]))
    pg = make_group(served, f"list-{served.world_size}")
    # AReaL: the whole model announced in one call, each tensor broadcast in that order.
    answer = push(served.base, pg, tensors(smol_versions[1]), before + 1)
    assert answer["status"] == 200 and answer["success"] and answer["weight_version"] == str(before + 1), answer
    assert greedy(served) == (reference(str(smol_versions[1])), {before + 1}, {before + 1})
    # SkyRL-train: one tensor a call; nothing switches until the model's last tensor has arrived.
    named = tensors(smol_versions[2])
    for i, item in enumerate(named):
        answer = push(served.base, pg, [item], before + 2)
        assert answer["status"] == 200 and answer["success"], answer
        if i == len(named) // 2:  # half sent: still the previous version, token for token
            assert greedy(served) == (reference(str(smol_versions[1])), {before + 1}, {before + 1})
    assert answer["weight_version"] == str(before + 2)
    assert greedy(served) == (reference(str(smol_versions[2])), {before + 2}, {before + 2})
    leave(served, pg)


def test_bad_calls_are_refused_with_nothing_applied(served, smol_versions):
    import httpx

    served_version = served.router.weights.version
    want = greedy(served)
    pg = make_group(served, f"bad-{served.world_size}")
    named = tensors(smol_versions[1])
    # Half an update kept, then a call the model refuses: its tensors are still received, the update dropped.
    assert push(served.base, pg, named[:10], served_version + 1)["success"]
    for bad, why in (([("model.layers.0.mlp.no_such.weight", torch.zeros(4))], "no such tensor"),
                     ([("model.norm.weight", torch.zeros(3))], "shape (3,), expected (576,)"),
                     ([("model.norm.weight", torch.zeros(576, dtype=torch.int32))], "dtype int32")):
        answer = push(served.base, pg, bad, served_version + 1)
        assert answer["status"] == 400 and not answer["success"] and why in answer["message"], answer
        assert greedy(served) == want
    answer = push(served.base, pg, named[10:], served_version + 1)  # the rest alone is not a whole model
    assert answer["success"] and "weight_version" not in answer and greedy(served) == want
    answer = push(served.base, pg, named[:10], served_version)  # not newer
    assert answer["status"] == 400 and "not newer" in answer["message"], answer
    # The group is still in step: a whole update goes through it.
    assert push(served.base, pg, named, served_version + 1)["success"]
    assert greedy(served) == (reference(str(smol_versions[1])), {served_version + 1}, {served_version + 1})
    # An update for another group: refused, naming the field, and the group closed (its broadcasts are elsewhere).
    r = httpx.post(f"{served.base}/update_weights_from_distributed",
                   json={**dict(names=["model.norm.weight"], dtypes=["float32"], shapes=[[576]]), "group_name": "x"},
                   timeout=60)
    assert r.status_code == 400 and "group_name" in r.json()["message"] and "closed" in r.json()["message"]
    assert not served.router.weights.client_group
    dist.destroy_process_group(pg)
    pg = make_group(served, f"bad-again-{served.world_size}")
    # A description that cannot be read: refused, naming the field, and the group closed (its bytes unreadable).
    r = httpx.post(f"{served.base}/update_weights_from_distributed",
                   json={"names": ["model.norm.weight"], "dtypes": ["complex64"], "shapes": [[576]]}, timeout=60)
    assert r.status_code == 400 and "dtypes[0]" in r.json()["message"] and "closed" in r.json()["message"]
    assert not served.router.weights.client_group
    r = httpx.post(f"{served.base}/init_weights_update_group", json={"master_address": "127.0.0.1",
                   "master_port": 1234, "rank_offset": 1, "world_size": 1, "group_name": "g"}, timeout=60)
    assert r.status_code == 400 and "world_size" in r.json()["message"]
    dist.destroy_process_group(pg)


def test_a_trainer_that_vanishes_mid_update_leaves_the_old_weights_serving(served, smol_versions, tmp_path):
    want = greedy(served)
    version = served.router.weights.version + 1
    port = free_port()
    trainer = subprocess.Popen([sys.executable, str(Path(__file__).parent / "compat_trainer.py"), served.base,
                                str(smol_versions[2]), "die", str(version), "vanish", str(port),
                                str(served.world_size)], stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(trainer.stdout.readline())["success"]
        assert trainer.stdout.readline().strip() == "sent"
        trainer.kill()
        trainer.wait(30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    wait_for(lambda: not served.router.weights.client_group, timeout=120, what="the broken group to be closed")
    assert greedy(served) == want
    # A new group works.
    pg = make_group(served, f"after-{served.world_size}")
    assert push(served.base, pg, tensors(smol_versions[2]), version)["success"]
    assert greedy(served) == (reference(str(smol_versions[2])), {version}, {version})
    leave(served, pg)
