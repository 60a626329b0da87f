"""The Weights service's bounds (#47, findings 3, 5 and 6), against a real 1P1D cluster of the tiny Llama over
real gRPC: versions within int64, checkpoint paths under the weights root (no `..`, no symlink out, the same
answer whether a path outside exists or not), NaN and infinite weights refused (from a path and from a
trainer's group), a trainer's group with a bounded timeout, no lock held across its join (a replacement
worker becomes routable meanwhile, a pause goes through) and errors without internal addresses."""
from __future__ import annotations

import math
import os
import shutil
import socket
import threading
import time

import grpc
import pytest
import ray
import torch

from pdserve.client import Client
from pdserve.v1 import generation_pb2 as pb
from router.config import RouterConfig

from conftest import perturbed_checkpoint, wait_for
from served import Served, tiny_1p1d

PROMPT = [7, 81, 19, 240, 5, 33]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def served(ray_local, aloop, weight_versions):
    s = Served(aloop, tiny_1p1d(weight_versions[0], batched_tokens=64, worker_timeout_s=60), RouterConfig(port=0))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(served):
    with Client(served.target) as c:
        yield c


def refused(fn) -> str:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == INVALID, (e.value.code(), e.value.details())
    return e.value.details()


def generates(client) -> bool:
    out = client.complete(token_ids=PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True, timeout=60)
    return len(out.token_ids) == 4


def test_a_version_past_int64_is_refused_and_generation_goes_on(client, weight_versions):
    """Finding 3 as found: version 18446744073709551615 was accepted; every Generate then answered
    INVALID_ARGUMENT ("Value out of range") until a restart."""
    why = refused(lambda: client.update_weights(str(weight_versions[1]), 2**64 - 1, timeout=120))
    assert why.startswith("ValueError: version must be in [1, 2**63 - 1]")
    assert client.weight_versions(timeout=30).version == 0
    assert generates(client)


def test_paths_outside_the_weights_root_get_one_answer(client, weight_versions, tmp_path):
    """Finding 3's /etc/passwd (UNAVAILABLE "NotADirectoryError: ... '/etc/passwd/config.json'") and finding
    6: no allowed root, `..` and symlinks followed, errors that said whether a path existed."""
    root = weight_versions[0].parent
    outside = perturbed_checkpoint(weight_versions[0], tmp_path / "outside", seed=5)
    (root / "escape").unlink(missing_ok=True)
    os.symlink(outside, root / "escape")  # a symlink under the root to a checkpoint outside it
    smuggled = root / "smuggled"
    shutil.rmtree(smuggled, ignore_errors=True)
    smuggled.mkdir()
    shutil.copy(outside / "config.json", smuggled / "config.json")
    for f in outside.glob("*.safetensors"):  # a checkpoint under the root whose weights link out
        os.symlink(f, smuggled / f.name)
    answers = {}
    for path in ("/etc/passwd", "/etc/no-such-file", str(outside), f"{root}/llama/../../{outside.parent.name}/outside",
                 str(root / "escape"), "relative/path"):
        answers[path] = refused(lambda: client.update_weights(path, 5, timeout=60))
        assert "NotADirectory" not in answers[path] and "config.json" not in answers[path], answers[path]
    assert answers["/etc/passwd"].replace("passwd", "X") == answers["/etc/no-such-file"].replace("no-such-file", "X")
    assert "not under the weights root" in answers["/etc/passwd"] and "absolute" in answers["relative/path"]
    why = refused(lambda: client.update_weights(str(smuggled), 5, timeout=60))
    assert "links outside the weights root" in why
    assert client.weight_versions(timeout=30).version == 0 and generates(client)


def test_nan_and_infinite_weights_are_refused_with_nothing_applied(client, served, weight_versions):
    from safetensors.torch import load_file, save_file

    bad = weight_versions[0].parent / "llama-nan"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(weight_versions[1], bad)
    (f,) = bad.glob("*.safetensors")
    tensors = load_file(str(f))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = math.nan
    save_file(tensors, str(f))
    why = refused(lambda: client.update_weights(str(bad), 7, timeout=120))
    assert "down_proj" in why and "NaN or infinite" in why
    from pdserve.weights.trainer import WeightSync

    with WeightSync(served.target, bucket_bytes=64 << 10) as sync:
        why = refused(lambda: sync.push({"model.norm.weight": torch.full((64,), math.inf)}, 7))
        assert "NaN or infinite" in why
    assert {w.version for w in client.weight_versions(timeout=30).workers} == {0}
    assert generates(client)


def test_a_trainer_group_takes_bounded_values(client):
    def init(**kw):
        req = dict(host="127.0.0.1", port=29999, world_size=3, name="g", timeout_seconds=5.0) | kw
        return client.weights.InitWeightGroup(pb.InitWeightGroupRequest(**req), timeout=60)

    for kw, field in ((dict(timeout_seconds=math.nan), "timeout_seconds"), (dict(timeout_seconds=math.inf), "timeout"),
                      (dict(timeout_seconds=1e9), "timeout"), (dict(timeout_seconds=-1), "timeout"),
                      (dict(port=0), "port"), (dict(host=""), "host"), (dict(host="a b"), "host"),
                      (dict(name="x" * 200), "name"), (dict(name="a/b"), "name")):
        assert field in refused(lambda: init(**kw)), kw
    for kw in (dict(timeout_seconds=math.nan), dict(timeout_seconds=1e9), dict(timeout_seconds=0)):
        req = pb.PauseRequest(mode="wait", **kw)
        assert "timeout_seconds" in refused(lambda: client.weights.Pause(req, timeout=30))
    assert "version" in refused(lambda: client.weights.BeginWeightUpdate(
        pb.BeginWeightUpdateRequest(version=2**64 - 1, bucket_bytes=1), timeout=30))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_join_holds_no_lock_and_its_error_names_no_address(client, served):
    """Finding 5: the join held the weights lock: a pause waited for it, and a replacement worker (which
    catches up under that lock before it is routable) was not routable until the join timed out. Its error
    echoed the address it could not reach."""
    port = free_port()  # nobody listens: the workers wait for the trainer's store until the timeout
    timeout = 40.0
    errors: list[grpc.RpcError] = []

    def join() -> None:
        try:
            client.weights.InitWeightGroup(pb.InitWeightGroupRequest(host="127.0.0.1", port=port, world_size=3,
                                                                     name="nobody-there", timeout_seconds=timeout),
                                           timeout=timeout + 60)
        except grpc.RpcError as e:
            errors.append(e)

    t0 = time.monotonic()
    t = threading.Thread(target=join, daemon=True)
    t.start()
    assert client.pause(timeout=30).paused and not client.resume(timeout=30).paused  # no wait for the join
    decode = served.worker("decode")
    ray.kill(decode.handle)
    wait_for(lambda: [w for w in served.cluster.pools["decode"] if w.worker_id != decode.worker_id], timeout=timeout,
             what="a replacement decode worker, routable")
    assert t.is_alive(), "the join ended before the replacement was routable: the test proves nothing"
    assert time.monotonic() - t0 < timeout
    # Shown; the join is ended rather than waited out: the other worker it waits on goes too.
    prefill = served.worker("prefill")
    ray.kill(prefill.handle)
    t.join(30)
    wait_for(lambda: [w for w in served.cluster.pools["prefill"] if w.worker_id != prefill.worker_id], timeout=120,
             what="a replacement prefill worker, routable")
    assert time.monotonic() - t0 < timeout, "the join was waited out"
    (e,) = errors
    assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
    assert str(port) not in e.details() and "127.0.0.1" not in e.details(), e.details()
    served.settle()
    assert generates(client)
