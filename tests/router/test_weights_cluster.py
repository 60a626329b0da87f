"""Weight updates under a running 1P1D cluster of the tiny Llama (router.weights), through the router's gRPC
Weights service and the Python client: versions on every worker and every token, the new version's tokens
equal to the offline engine loaded from the same checkpoint, each version policy for a request in flight
across the switch (references: the offline engine; for "keep", transformers), pause and resume, and bad
updates refused with nothing applied."""
from __future__ import annotations

import functools
import json
import threading

import grpc
import pytest
import torch

from pdserve.client import Client
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from router.config import RouterConfig

from conftest import keep_reference, wait_for
from served import Served

PROMPT = [7, 81, 19, 240, 5, 33, 100, 12, 64, 3, 150]


def engine_config(path) -> EngineConfig:
    return EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64))


@pytest.fixture(scope="module")
def served(ray_local, aloop, weight_versions):
    config = ClusterConfig(engine=engine_config(weight_versions[0]), prefill=PoolConfig(1, num_cpus=0.25),
                           decode=PoolConfig(1, num_cpus=0.25), transfer_timeout_s=20.0,
                           local_prefill_max_tokens=0)  # every prompt handed off, repeats included
    s = Served(aloop, config, RouterConfig(port=0, metrics_port=0))  # metrics: tokens by weight staleness
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(served):
    with Client(served.target) as c:
        yield c


class Versions:
    """The module's cluster goes through versions in test order: the version served and its checkpoint."""

    def __init__(self, paths):
        self.paths, self.version, self.path = paths, 0, paths[0]

    def next(self) -> tuple[int, object]:
        """The next version and the checkpoint it loads: v1 and v2 in turn (path None: a partial update made
        the weights a mix of two checkpoints)."""
        return self.version + 1, self.paths[2] if self.path == self.paths[1] else self.paths[1]


@pytest.fixture(scope="module")
def versions(weight_versions):
    return Versions(weight_versions)


def reference(path, prompt, max_tokens) -> list[int]:
    return list(_reference(str(path), tuple(prompt), max_tokens))


@functools.lru_cache(maxsize=None)
def _reference(path: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return tuple(LLMEngine(engine_config(path)).generate([list(prompt)], params)[0].token_ids)


def greedy(client, prompt=PROMPT, max_tokens=8, **kw):
    return client.complete(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=120,
                           **kw)


def update(client, versions, **kw):
    version, path = versions.next()
    r = client.update_weights(str(path), version, timeout=120, **kw)
    versions.version, versions.path = version, path
    return r


def test_an_update_switches_every_worker_and_new_requests_follow_it(client, versions):
    before = greedy(client)
    assert before.token_ids == reference(versions.path, PROMPT, 8) and before.choices[0].weight_versions == [0] * 8
    r = update(client, versions)
    assert r.version == 1 and len(r.workers) == 2 and all(w.bytes > 0 for w in r.workers)
    v = client.weight_versions(timeout=30)
    assert v.version == 1 and not v.paused and sorted(w.pool for w in v.workers) == ["decode", "prefill"]
    assert all(w.version == 1 and not w.paused for w in v.workers)
    after = greedy(client)  # the same prompt: the prefill worker's cached blocks of version 0 are no hit
    assert after.token_ids == reference(versions.path, PROMPT, 8) != before.token_ids
    assert after.choices[0].weight_versions == [1] * 8


def test_bad_updates_are_refused_with_nothing_applied(client, versions, tmp_path):
    with pytest.raises(grpc.RpcError) as e:
        client.update_weights(str(tmp_path / "nowhere"), versions.version + 1, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nowhere" in e.value.details()
    other = versions.paths[0].parent / "other-shape"  # under the weights root: refused for its shape
    other.mkdir(exist_ok=True)
    cfg = json.loads((versions.paths[1] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    for f in versions.paths[1].glob("*.safetensors"):
        (other / f.name).write_bytes(f.read_bytes())
    with pytest.raises(grpc.RpcError) as e:
        client.update_weights(str(other), versions.version + 1, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "shape" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.update_weights(str(versions.paths[1]), versions.version, timeout=60)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in e.value.details()
    assert all(w.version == versions.version for w in client.weight_versions(timeout=30).workers)
    out = greedy(client)
    assert out.token_ids == reference(versions.path, PROMPT, 8)
    assert out.choices[0].weight_versions == [versions.version] * 8


class Stream:
    """A greedy request streaming on a thread: its tokens, each token's version, its finish reason."""

    def __init__(self, client, max_tokens: int, **kw):
        self.tokens: list[int] = []
        self.versions: list[int] = []
        self.finish = ""
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(client, max_tokens, kw), daemon=True)
        self._thread.start()

    def _run(self, client, max_tokens, kw):
        try:
            out = None
            for r in client.generate(token_ids=PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                     timeout=120, **kw):
                self.tokens += r.token_ids
                self.versions += r.weight_versions
                if r.finish_reason:
                    out = r
            from pdserve.client.grpc_client import FINISH_REASONS

            self.finish = FINISH_REASONS[out.finish_reason]
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def join(self):
        self._thread.join(120)
        assert not self._thread.is_alive() and self.error is None, self.error


def paused_mid_stream(client, policy: str, max_tokens: int = 200) -> Stream:
    """A request of `policy` paused (pause keep) once it has streamed a few tokens."""
    s = Stream(client, max_tokens, version_policy=policy)
    wait_for(lambda: len(s.tokens) >= 4, timeout=60, what="the request's first tokens")
    client.pause("keep", timeout=60)
    assert not s.finish, "the request ended before the pause: nothing crosses the update"
    return s


def stale_tokens(served) -> list[float]:
    """The router's count of tokens streamed by versions behind: 0, 1, 2, 3+."""
    g = served.router.metrics.registry.get_sample_value
    return [g("pdserve_request_generation_tokens_by_staleness_total", {"versions_behind": b})
            for b in ("0", "1", "2", "3+")]


@pytest.mark.parametrize("policy", ["recompute", "keep", "abort"])
def test_a_request_in_flight_across_an_update_follows_its_policy(client, served, versions, policy):
    old = versions.path
    stale = stale_tokens(served)
    s = paused_mid_stream(client, policy)
    assert all(w.paused for w in client.weight_versions(timeout=30).workers)
    update(client, versions)  # while paused: the update leaves the cluster paused
    assert client.weight_versions(timeout=30).paused
    client.resume(timeout=60)
    s.join()
    k = s.versions.count(versions.version - 1)
    assert s.versions == [versions.version - 1] * k + [versions.version] * (len(s.tokens) - k)
    so_far = s.tokens[:k]
    assert so_far == reference(old, PROMPT, 200)[:k]
    if policy == "abort":
        assert s.finish == "abort" and len(s.tokens) == k
    elif policy == "recompute":
        assert s.finish == "length" and s.tokens[k:] == reference(versions.path, PROMPT + so_far, 200 - k)
    else:
        assert s.finish == "length" and s.tokens[k:] == keep_reference(old, versions.path, PROMPT, so_far, 200 - k)
    # The router counts the tokens the old weights sampled as one version behind the one served when the request
    # ended (an aborted request ends at its worker's switch: the cluster may not have switched yet, 0 behind).
    wait_for(lambda: stale_tokens(served) != stale, timeout=30, what="the request's tokens to be counted")
    delta = [b - a for a, b in zip(stale, stale_tokens(served))]
    if policy == "abort":
        assert delta[0] + delta[1] == k and delta[2:] == [0, 0]
    else:
        assert delta == [len(s.tokens) - k, k, 0, 0]
    served_settles = client.cluster_status(timeout=30)
    assert sum(w.kv_blocks_used for p in served_settles.pools for w in p.workers) == 0


def test_pause_abort_ends_requests_in_flight_and_new_ones_wait_for_resume(client, served, versions):
    # Paused (keep) first, so the request is surely in flight when the abort comes (unpaused, the tiny model can
    # stream its 200 tokens before the abort reaches the router).
    s = paused_mid_stream(client, "recompute")
    client.pause("abort", timeout=60)
    s.join()
    assert s.finish == "abort" and s.tokens == reference(versions.path, PROMPT, 200)[:len(s.tokens)]
    late = Stream(client, 8)  # waits at the gate until the resume
    wait_for(lambda: served.router.front.admitted == 1, timeout=30, what="the late request to be admitted")
    assert not late.tokens and not late.finish
    client.resume(timeout=60)
    late.join()
    assert late.finish == "length" and late.tokens == reference(versions.path, PROMPT, 8)


def test_pause_wait_lets_requests_in_flight_end(client, versions):
    s = Stream(client, 60)
    wait_for(lambda: len(s.tokens) >= 2, timeout=60, what="the request's first tokens")
    client.pause("wait", timeout=120)
    s.join()  # it had ended when the pause returned
    assert s.finish == "length" and s.tokens == reference(versions.path, PROMPT, 60)
    client.resume(timeout=60)


def test_a_rolling_update(client, versions):
    r = update(client, versions, mode="rolling")
    assert r.version == versions.version
    out = greedy(client)
    assert out.token_ids == reference(versions.path, PROMPT, 8)
    assert out.choices[0].weight_versions == [versions.version] * 8


def test_a_worker_killed_at_its_switch_is_replaced_at_the_new_version(client, served, versions):
    import math
    import os
    import signal

    import ray

    decode = served.worker("decode")
    pid = served.pid(decode)
    ray.get(decode.handle.inject_fault.remote("commit_weights", math.inf), timeout=30)
    version, path = versions.next()
    done: list = []
    t = threading.Thread(target=lambda: done.append(client.update_weights(str(path), version, timeout=120)),
                         daemon=True)
    t.start()
    assert ray.get(decode.handle.fault_reached.remote("commit_weights", 60), timeout=90)
    os.kill(pid, signal.SIGKILL)  # staged, about to switch
    t.join(120)
    assert done and done[0].version == version and [w.worker_id for w in done[0].workers] == ["prefill-0"]
    versions.version, versions.path = version, path
    served.settle()  # the decode worker replaced
    assert served.pid(served.worker("decode")) != pid
    assert {w.version for w in client.weight_versions(timeout=30).workers} == {version}
    out = greedy(client)
    assert out.token_ids == reference(path, PROMPT, 8) and out.choices[0].weight_versions == [version] * 8


def test_a_hand_off_from_a_newer_prefill_worker_follows_the_policy(client, served, versions):
    """A rolling update with the decode worker held before it reads the checkpoint (it serves on): the prefill
    worker computes at the new version, the decode worker decodes at the old one. (The other order, KV older
    than its decode worker: tests/serving/test_decode_actor.py.)"""
    import math

    import ray

    decode = served.worker("decode")
    old = versions.version
    ray.get(decode.handle.inject_fault.remote("stage_weights", math.inf), timeout=30)
    version, path = versions.next()
    done: list = []
    t = threading.Thread(target=lambda: done.append(
        client.update_weights(str(path), version, mode="rolling", timeout=120)), daemon=True)
    t.start()
    try:
        assert ray.get(decode.handle.fault_reached.remote("stage_weights", 60), timeout=90)
        wait_for(lambda: {w.pool: w.version for w in client.weight_versions(timeout=30).workers}
                 == {"prefill": version, "decode": old}, timeout=60, what="the prefill worker alone to switch")
        # and the router's view of it, which placement reads (no partial hand-off across two versions)
        wait_for(lambda: served.worker("prefill").stats.weight_version == version, timeout=30,
                 what="the prefill worker's heartbeat to say its version")
        aborted = greedy(client, version_policy="abort")
        assert aborted.finish_reason == "abort" and aborted.choices[0].weight_versions == [version]
        assert aborted.token_ids == reference(path, PROMPT, 1)  # the prefill worker's first token, new weights
        kept = greedy(client, version_policy="keep")
        assert kept.finish_reason == "length" and kept.choices[0].weight_versions == [version] + [old] * 7
        assert kept.token_ids[0] == reference(path, PROMPT, 1)[0]
        outcomes = served.stats_of(decode).version_outcomes
        assert outcomes["aborted"] >= 1 and outcomes["kept"] >= 1
    finally:
        ray.get(decode.handle.release_fault.remote("stage_weights"), timeout=30)
        t.join(120)
    assert done and done[0].version == version
    versions.version, versions.path = version, path
    assert {w.version for w in client.weight_versions(timeout=30).workers} == {version}
    assert greedy(client).token_ids == reference(path, PROMPT, 8)


# -- a trainer's weight group (pdserve.weights.trainer) -------------------------------------------
def checkpoint_tensors(path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_a_trainer_pushes_weights_over_its_group(client, served, versions):
    from pdserve.weights.trainer import WeightSync

    with WeightSync(served.target, bucket_bytes=64 << 10) as sync:
        assert sorted(sync.worker_ids) == sorted(w.worker_id for p in served.cluster.pools.values() for w in p)
        version, path = versions.next()
        r = sync.push(checkpoint_tensors(path), version)
        versions.version, versions.path = version, path
        assert r.version == version and all(w.bytes > 0 for w in r.workers)
        out = greedy(client)
        assert out.token_ids == reference(path, PROMPT, 8) and out.choices[0].weight_versions == [version] * 8
        # A tensor the model has no place for, or of the wrong shape: refused before a byte moves, nothing applied.
        for bad in ({"model.layers.0.mlp.no_such.weight": torch.zeros(4)},
                    {"model.norm.weight": torch.zeros(3)}):
            with pytest.raises(grpc.RpcError) as e:
                sync.push(bad, version + 1)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert {w.version for w in client.weight_versions(timeout=30).workers} == {version}
        # The group is still whole: the next update goes through it (a partial one, the final norm alone).
        version, path = versions.next()
        norm = checkpoint_tensors(path)["model.norm.weight"]
        sync.push({"model.norm.weight": norm}, version, mode="rolling")
        versions.version, versions.path = version, None  # the previous checkpoint with this one's final norm
    assert {w.version for w in client.weight_versions(timeout=30).workers} == {version}


def test_a_worker_started_after_a_trainers_update_catches_up(client, served, versions):
    """A trainer's update has no checkpoint: a replacement loads the configured model, then a checkpoint that a
    worker serving the version writes, before it is routable."""
    import os
    import signal

    version = versions.version
    assert versions.path is None  # the weights are the trainer's last push (a mix of two checkpoints)
    before = greedy(client)
    decode = served.worker("decode")
    pid = served.pid(decode)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: served.cluster.pools["decode"] and served.worker("decode").worker_id != decode.worker_id,
             timeout=120, what="the decode worker's replacement to be routable")
    served.settle()
    assert {w.version for w in client.weight_versions(timeout=30).workers} == {version}
    out = greedy(client)
    assert out.token_ids == before.token_ids and out.choices[0].weight_versions == [version] * 8


TRAINER = r"""
import os, sys, threading
import torch
from safetensors.torch import load_file
from pdserve.v1 import generation_pb2 as pb
from pdserve.weights.trainer import WeightSync

target, path, version = sys.argv[1], sys.argv[2], int(sys.argv[3])
tensors = {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
           for k, v in load_file(os.path.join(path, f)).items()}
sync = WeightSync(target, bucket_bytes=16 << 10)
sync.connect()
named = [(n, t.contiguous()) for n, t in tensors.items()]
sync.stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(version=version, bucket_bytes=sync.bucket_bytes, tensors=[
    pb.TensorMeta(name=n, shape=list(t.shape), dtype="float32") for n, t in named]))

def after_bucket(i, sent):
    if i == 2:
        print("sent", flush=True)
        threading.Event().wait()  # until killed

sync.group.send(named, sync.bucket_bytes, after_bucket=after_bucket)
"""


def test_a_trainer_killed_mid_broadcast_leaves_every_worker_on_its_version(client, served, versions, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    served_version = versions.version
    before = greedy(client)
    version, path = versions.next()
    trainer = subprocess.Popen([sys.executable, str(script), served.target, str(path), str(version + 10)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "sent", "the trainer did not get to its third bucket"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    # Every worker is still on the version it served, and serves it token for token; nothing was applied.
    assert {w.version for w in client.weight_versions(timeout=30).workers} == {served_version}
    out = greedy(client)
    assert out.token_ids == before.token_ids and out.choices[0].weight_versions == [served_version] * 8
    with pytest.raises(grpc.RpcError) as e:  # the broken update cannot be finished
        client.weights.FinishWeightUpdate(pb.FinishWeightUpdateRequest(version=version + 10), timeout=60)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)
    # A new group can be made, and updates through it.
    from pdserve.weights.trainer import WeightSync

    with WeightSync(served.target) as sync:
        sync.push(checkpoint_tensors(path), version)
    versions.version, versions.path = version, path
    assert greedy(client).token_ids == reference(path, PROMPT, 8)


# -- the other layouts: colocated, 2P2D, the fast lane ---------------------------------------------
LAYOUTS = {
    "colocated": dict(mode="colocated", colocated=PoolConfig(1, num_cpus=0.25)),
    "2P2D": dict(prefill=PoolConfig(2, num_cpus=0.25), decode=PoolConfig(2, num_cpus=0.25)),
    "fast lane": dict(prefill=PoolConfig(1, num_cpus=0.25), decode=PoolConfig(1, num_cpus=0.25),
                      fast=PoolConfig(1, num_cpus=0.25)),
    # Tensor parallelism: every rank stages its share of the checkpoint, or of a trainer's broadcast
    # (pdserve.engine.tp_runner).
    "TP (2, 1)": dict(prefill=PoolConfig(1, num_cpus=0.1, tensor_parallel_size=2, torch_threads=1),
                      decode=PoolConfig(1, num_cpus=0.1, torch_threads=1)),
    "TP (1, 2)": dict(prefill=PoolConfig(1, num_cpus=0.1, torch_threads=1),
                      decode=PoolConfig(1, num_cpus=0.1, tensor_parallel_size=2, torch_threads=1)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_worker_of_a_layout_switches_and_serves_the_new_version(ray_local, aloop, weight_versions, layout):
    s = Served(aloop, ClusterConfig(engine=engine_config(weight_versions[0]), transfer_timeout_s=20.0,
                                    **LAYOUTS[layout]))
    tier = "priority" if layout == "fast lane" else ""
    try:
        with Client(s.target) as c:
            r = c.update_weights(str(weight_versions[1]), 1, timeout=120)
            assert len(r.workers) == sum(s.sizes.values())
            assert {w.version for w in c.weight_versions(timeout=30).workers} == {1}
            for prompt in (PROMPT, PROMPT[3:]):
                out = greedy(c, prompt, service_tier=tier)
                assert out.token_ids == reference(weight_versions[1], prompt, 8)
                assert out.choices[0].weight_versions == [1] * 8
            if layout == "fast lane":  # served by the lane's worker, at the new version
                assert out.timings["decode_worker"].startswith("fast")
            # A trainer's push reaches every rank of every worker (a TP worker's ranks each join the group).
            from pdserve.weights.trainer import WeightSync

            with WeightSync(s.target, bucket_bytes=64 << 10) as sync:
                r = sync.push(checkpoint_tensors(weight_versions[2]), 2)
            assert len(r.workers) == sum(s.sizes.values())
            out = greedy(c, PROMPT, service_tier=tier)
            assert out.token_ids == reference(weight_versions[2], PROMPT, 8)
            assert out.choices[0].weight_versions == [2] * 8
        s.settle()
    finally:
        s.close()
