"""RL frameworks' own client code, installed from PyPI, driving a 1P1D cluster of the tiny Llama through
pdserve's SGLang and vLLM routes (router.sglang_api, router.vllm_api):

- AReaL 1.0.4's RemoteSGLangEngine (its CPU platform): rollouts with logprobs equal to pdserve's gRPC API's;
  pause_generation while rollouts run, a weight update from disk (its own request, abort_all_requests), then
  continue_generation: its abort-and-resubmit loop completes every rollout, each one's tokens the old
  weights' up to the abort and the new weights' after it (the offline engine's, on each checkpoint); and
  rollouts after the update equal the offline engine's on the new weights.
- AReaL 1.0.4's own sender of a weight update over its group: its FSDP train engine on its CPU platform (gloo,
  one process) joins the group with the cluster's workers and pushes its parameters (update_weights, type
  "xccl") while rollouts run, in its RL trainer's order; the same checks as the update from disk.
- SkyRL 0.3.0's RemoteInferenceClient: generate through /inference/v1/generate with token ids and logprobs
  equal to pdserve's gRPC API's; pause (keep) and resume around requests in flight; reset_prefix_cache.

`make setup` installs both from tests/rl_clients.txt without their dependencies (AReaL pins a torch older than
the project's; its client module and its FSDP engine need only the packages listed there). Each is skipped,
saying so, where its package is not installed (a venv set up otherwise)."""
from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import socket
import threading
import time

import pytest

from pdserve.client import Client
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from router.cluster import Cluster
from router.compose import build_router
from router.config import RouterConfig

from conftest import wait_for

pytestmark = pytest.mark.slow
PROMPTS = [[7, 81, 19, 240, 5, 33, 100, 12], [64, 3, 150, 9, 2, 77], [11, 12, 13, 14, 15], [200, 100, 50, 25]]


def engine_config(path) -> EngineConfig:
    return EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64))


@pytest.fixture(scope="module")
def served(ray_local, aloop, weight_versions):
    cluster = Cluster(ClusterConfig(engine=engine_config(weight_versions[0]), prefill=PoolConfig(1, num_cpus=0.25),
                                    decode=PoolConfig(1, num_cpus=0.25), local_prefill_max_tokens=0))
    aloop.run(cluster.start(), timeout=600)
    router = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name="tiny"))
    aloop.run(router.start())
    yield router
    aloop.run(router.stop(grace=2))
    aloop.run(cluster.shutdown())


@pytest.fixture(scope="module")
def held(weight_versions) -> dict[int, object]:
    """The checkpoint each weight version of the module's cluster holds (each test that updates it records its
    own), and the next one to push: any other of the three."""
    return {0: weight_versions[0]}


def next_checkpoint(served, held, weight_versions):
    """(version served, its checkpoint, the next version, a checkpoint of other weights for it)."""
    old = served.weights.version
    return old, held[old], old + 1, weight_versions[(weight_versions.index(held[old]) + 1) % len(weight_versions)]


@pytest.fixture(scope="module", autouse=True)
def logging_kept():
    """AReaL's getLogger replaces the logging module's hierarchy (Logger.root and Logger.manager, then a
    dictConfig that disables existing loggers): every later test's caplog would see nothing. The hierarchy as
    it was is put back after this module."""
    manager, root = logging.Logger.manager, logging.Logger.root
    handlers, level = logging.root.handlers[:], logging.root.level
    kept = {name: (lg.disabled, lg.level, lg.propagate, lg.handlers[:])
            for name, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    yield
    logging.Logger.manager, logging.Logger.root = manager, root
    logging.root.handlers[:], logging.root.level = handlers, level
    for name, (disabled, lvl, propagate, hs) in kept.items():
        lg = manager.loggerDict[name]
        lg.disabled, lg.level, lg.propagate, lg.handlers[:] = disabled, lvl, propagate, hs
    manager._clear_cache()


@functools.lru_cache(maxsize=None)
def reference(path: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return tuple(LLMEngine(engine_config(path)).generate([list(prompt)], params)[0].token_ids)


async def areal_rollouts(engine, max_new_tokens: int) -> list:
    """AReaL's agenerate of each of PROMPTS at once, greedy."""
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest

    g = GenerationHyperparameters(max_new_tokens=max_new_tokens, greedy=True, ignore_eos=True)
    return await asyncio.gather(*(engine.agenerate(ModelRequest(input_ids=list(p), gconfig=g)) for p in PROMPTS))


def in_background(served, engine, n: int) -> tuple[threading.Thread, dict]:
    """AReaL's rollouts of n tokens in a thread (their list at "r" once it ends), returned once all are admitted."""
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("r", asyncio.run(areal_rollouts(engine, n))))
    runner.start()
    wait_for(lambda: served.front.admitted == len(PROMPTS), 60, what="the rollouts admitted")
    return runner, result


def check_resumed(results, n: int, old: tuple[int, str], new: tuple[int, str]) -> None:
    """AReaL's rollouts of PROMPTS across an update from weights `old` to `new` (version, checkpoint): each has
    all its n tokens, the old weights' up to the abort and the new weights' after it, tagged so; and the pause
    did abort some."""
    for p, r in zip(PROMPTS, results):
        assert len(r.output_tokens) == n and r.stop_reason == "length"
        k = r.output_versions.count(old[0])  # tokens out before the abort: the old weights'
        assert r.output_versions == [old[0]] * k + [new[0]] * (n - k)
        assert r.output_tokens[:k] == list(reference(old[1], tuple(p), n))[:k]
        assert r.output_tokens[k:] == list(reference(new[1], tuple(p) + tuple(r.output_tokens[:k]), n - k))
    assert any(r.output_versions.count(old[0]) < n for r in results)


def grpc_greedy(router, prompt, max_tokens):
    with Client(f"127.0.0.1:{router.port}") as c:
        return c.complete(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0,
                          timeout=120)


def test_areals_remote_sglang_engine_rollouts_pause_update_from_disk_and_continue(served, weight_versions, held,
                                                                                  tmp_path):
    sglang_remote = pytest.importorskip("areal.engine.sglang_remote")
    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.io_struct import WeightUpdateMeta

    engine = sglang_remote.RemoteSGLangEngine(InferenceEngineConfig(
        experiment_name="pdserve", trial_name="rl-routes", setup_timeout=60, request_timeout=120,
        max_concurrent_rollouts=8, pause_grace_period=0.0))
    engine.initialize(addr=f"127.0.0.1:{served.http_port}", train_data_parallel_size=1)
    try:
        # Rollouts with logprobs: pdserve's own API's tokens and logprobs.
        first = asyncio.run(areal_rollouts(engine, 10))
        for p, r in zip(PROMPTS, first):
            ref = grpc_greedy(served, p, 10)
            assert r.output_tokens == list(ref.token_ids) == list(reference(str(weight_versions[0]), tuple(p), 10))
            assert r.output_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
            assert r.stop_reason == "length"
        # Rollouts in flight: pause (abort), update from disk, continue; every rollout completes.
        n = 200
        runner, result = in_background(served, engine, n)
        engine.pause_generation()
        assert served.weights.paused
        # AReaL removes the checkpoint once loaded: a copy of v1, under the weights root (the tiny model's directory)
        copy = weight_versions[0].parent / f"areal-{time.monotonic_ns()}"
        shutil.copytree(weight_versions[1], copy)
        meta = WeightUpdateMeta(type="disk", path=str(copy))
        _announce_save(engine, meta)
        engine.update_weights_from_disk(meta).result(timeout=120)
        engine.set_version(1)
        engine.continue_generation()
        runner.join(300)
        assert not runner.is_alive() and served.weights.version == 1
        held[1] = weight_versions[1]
        v0, v1 = str(weight_versions[0]), str(weight_versions[1])
        check_resumed(result["r"], n, (0, v0), (1, v1))
        after = asyncio.run(areal_rollouts(engine, 10))
        assert [r.output_tokens for r in after] == [list(reference(v1, tuple(p), 10)) for p in PROMPTS]
    finally:
        engine.destroy()


def test_areals_fsdp_engine_pushes_weights_over_its_group_while_rollouts_run(served, aloop, weight_versions, held,
                                                                             tmp_path, monkeypatch):
    """AReaL's own sender: its FSDP train engine (CPU platform, gloo, one process, the tiny Llama) joins a weight
    group with the cluster's workers through /init_weights_update_group and pushes its parameters with its
    update_weights (type "xccl": /pause_generation, /update_weights_from_distributed with every tensor broadcast in
    the announced order, /continue_generation) while rollouts run, in the order of AReaL's RL trainer: rollout
    paused, update, versions set, rollout resumed."""
    sglang_remote = pytest.importorskip("areal.engine.sglang_remote")
    fsdp_engine = pytest.importorskip("areal.engine.fsdp_engine")
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta

    old, before, new, after = next_checkpoint(served, held, weight_versions)
    trainer_dir = tmp_path / "trainer"
    shutil.copytree(after, trainer_dir)
    _word_tokenizer(trainer_dir)  # AReaL's engine loads a tokenizer beside the model; the tiny model has none
    # One trainer process of its own default group (whose store listens on every address: a port free on all of
    # them); its weight group's store on loopback, as the cluster's.
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            TORCHELASTIC_USE_AGENT_STORE="False").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(fsdp_engine, "gethostip", lambda: "127.0.0.1")

    engine = sglang_remote.RemoteSGLangEngine(InferenceEngineConfig(
        experiment_name="pdserve", trial_name="rl-xccl", setup_timeout=60, request_timeout=120,
        max_concurrent_rollouts=8, pause_grace_period=0.0))
    engine.initialize(addr=f"127.0.0.1:{served.http_port}", train_data_parallel_size=1)
    engine.set_version(old)
    trainer = fsdp_engine.FSDPEngine.from_pretrained(str(trainer_dir), "pdserve", "rl-xccl", dtype="float32",
                                                     attn_impl="sdpa")
    try:
        trainer.create_process_group()
        trainer.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1))
        world = sum(v.ranks for v in aloop.run(served.weights.versions()))
        meta = WeightUpdateMeta.from_fsdp_xccl(ModelAllocation.from_str(f"sglang:d{world}"))
        trainer.connect_engine(engine, meta)  # the group: AReaL's request and its rendezvous as rank 0
        assert served.weights.client_group == "update_weight_group"

        n = 200
        runner, result = in_background(served, engine, n)
        engine.pause()
        trainer.update_weights(meta)
        assert served.weights.version == new and not served.weights.paused
        trainer.set_version(new)
        engine.set_version(new)
        engine.resume()
        runner.join(300)
        assert not runner.is_alive()
        held[new] = after
        check_resumed(result["r"], n, (old, str(before)), (new, str(after)))
        fresh = asyncio.run(areal_rollouts(engine, 10))
        assert [r.output_tokens for r in fresh] == [list(reference(str(after), tuple(p), 10)) for p in PROMPTS]
    finally:
        engine.destroy()
        trainer.destroy()  # its default group and the weight group with it
        aloop.run(served.weights.destroy_group())


def _word_tokenizer(directory) -> None:
    """A word-level tokenizer of the tiny model's 320 ids, saved beside it ("t0".."t319")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(320)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t0").save_pretrained(
        directory)


def _announce_save(engine, meta) -> None:
    """The trainer's side of AReaL's disk update: it names the saved checkpoint's time (name_resolve, on a
    file system), which the rollout side waits for before it sends /update_weights_from_disk."""
    import tempfile

    from areal.api.cli_args import NameResolveConfig
    from areal.utils import name_resolve, names

    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=tempfile.mkdtemp(prefix="areal-names-")))
    name_resolve.add(names.update_weights_from_disk(engine.config.experiment_name, engine.config.trial_name,
                                                    engine.get_version()), str(time.time()), replace=True)


def test_skyrls_remote_inference_client_generates_pauses_and_resets(served):
    import typing

    typing_extensions = pytest.importorskip("typing_extensions")
    pytest.importorskip("skyrl")
    # SkyRL declares Python 3.12 (its TypedDicts are typing's, which pydantic takes only from 3.12 on); on 3.11
    # its TypedDicts must be typing_extensions', the same class there.
    original = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict
    try:
        from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    finally:
        typing.TypedDict = original

    async def run():
        client = RemoteInferenceClient(proxy_url=f"http://127.0.0.1:{served.http_port}",
                                       server_urls=[f"http://127.0.0.1:{served.http_port}"], data_parallel_size=1,
                                       model_name="tiny")
        try:
            sampling = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
            outs = [await client._generate_single(list(p), sampling, None, "tiny") for p in PROMPTS[:2]]
            for p, out in zip(PROMPTS, outs):
                ref = grpc_greedy(served, p, 12)
                assert out["response_ids"] == list(ref.token_ids) and out["stop_reason"] == "length"
                assert out["response_logprobs"] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
            # keep: requests in flight stay where they are while paused and go on at resume
            long = {**sampling, "max_tokens": 200}
            task = asyncio.ensure_future(client._generate_single(list(PROMPTS[0]), long, None, "tiny"))
            deadline = time.monotonic() + 60
            while served.front.admitted == 0 and time.monotonic() < deadline:  # poll: it is in the cluster
                await asyncio.sleep(0.005)
            await client.pause(mode="keep")
            assert served.weights.paused and not task.done()
            await client.resume()
            out = await asyncio.wait_for(task, 120)
            assert out["response_ids"] == list(grpc_greedy(served, PROMPTS[0], 200).token_ids)
            await client.reset_prefix_cache()
            assert await client.get_world_size() == (2, 2)  # the two workers' ranks
        finally:
            await client.teardown()

    asyncio.run(run())


def test_vllms_checkpoint_path_weight_transfer_while_a_request_waits(served, weight_versions, held):
    """vLLM's weight-transfer routes in their checkpoint-path form (router.vllm_weights_api), as a trainer calls
    them around a pause: init, pause (abort), start, the checkpoint, finish with its version, resume; a request
    sent while paused waits and runs on the new weights; /weight_info says the new version."""
    import httpx

    old, before, new, after = next_checkpoint(served, held, weight_versions)
    copy = weight_versions[0].parent / f"vllm-{time.monotonic_ns()}"  # under the weights root
    shutil.copytree(after, copy)
    body = {"token_ids": PROMPTS[0], "sampling_params": {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}}
    with httpx.Client(base_url=f"http://127.0.0.1:{served.http_port}", timeout=120) as h:
        def ok(route, json=None):
            r = h.post(route, json=json)
            assert r.status_code == 200, (route, r.text)
            return r.json()

        assert h.get("/weight_info").json() == {"weight_version": str(old)}
        ok("/init_weight_transfer_engine", {"init_info": {}})
        ok("/pause")  # vLLM's default: abort, caches cleared
        assert served.weights.paused
        held_request = {}
        waiting = threading.Thread(target=lambda: held_request.setdefault(
            "r", h.post("/inference/v1/generate", json=body)))
        waiting.start()
        ok("/start_weight_update", {"is_checkpoint_format": True})
        ok("/update_weights", {"update_info": {"path": str(copy)}})
        assert served.weights.version == old  # read and switched at finish
        assert ok("/finish_weight_update", {"weight_version": str(new)})["weight_version"] == str(new)
        assert served.weights.version == new and served.weights.paused and waiting.is_alive()
        ok("/resume")
        waiting.join(120)
        held[new] = after
        want = list(reference(str(after), tuple(PROMPTS[0]), 10))
        choice = held_request["r"].json()["choices"][0]
        assert choice["token_ids"] == want and choice["weight_versions"] == [new] * 10
        assert h.get("/weight_info").json() == {"weight_version": str(new)}
        assert h.post("/inference/v1/generate", json=body).json()["choices"][0]["token_ids"] == want
        # A checkpoint the workers cannot read: refused at finish, nothing applied, the update ended.
        ok("/start_weight_update")
        ok("/update_weights", {"update_info": {"path": str(weight_versions[0].parent / "no-such-checkpoint")}})
        r = h.post("/finish_weight_update", json={})
        assert r.status_code == 400 and "not applied" in r.json()["error"]["message"], r.text
        assert served.weights.version == new and h.post("/finish_weight_update").status_code == 409


def test_skyrl_trains_remote_inference_engine_generates_and_takes_one_tensor_a_call(served, weight_versions, held,
                                                                                   tmp_path, monkeypatch):
    """SkyRL-train 0.3.1's RemoteInferenceEngine (backend sglang) and its own broadcast sender
    (BroadcastTransferStrategy.create_sender, send_chunks: one /update_weights_from_distributed call per tensor,
    each broadcast as its call is made): batched rollouts equal the offline engine's before and after; nothing
    switches until the model's last tensor has come. Three things of SkyRL-train's are bridged here, nothing else:
    it declares Python 3.12 (installed past it: this code runs on 3.11); it imports a name Ray 2.60 no longer
    re-exports from ray.util.placement_group; it picks torch's keyword for process-group options by comparing
    version strings ("2.13.0" < "2.6"), so it passes pg_options, which torch renamed backend_options in 2.6."""
    import importlib

    import httpx
    import torch.distributed as dist
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pytest.importorskip("loguru")
    monkeypatch.setattr(importlib.import_module("ray.util.placement_group"), "PlacementGroupSchedulingStrategy",
                        PlacementGroupSchedulingStrategy, raising=False)
    remote = pytest.importorskip("skyrl_train.inference_engines.remote_inference_engine")
    import skyrl_train.distributed.utils as skyrl_dist

    helper = skyrl_dist._new_process_group_helper

    def renamed(*args, pg_options=None, **kwargs):
        return helper(*args, backend_options=pg_options, **kwargs)

    monkeypatch.setattr(skyrl_dist, "_new_process_group_helper", renamed)
    from skyrl_train.weight_sync import BroadcastInitInfo, BroadcastTransferStrategy
    from skyrl_train.weight_sync.base import WeightChunk
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    old, before, new, after = next_checkpoint(served, held, weight_versions)
    _word_tokenizer(tmp_path)
    engine = remote.RemoteInferenceEngine(url=f"127.0.0.1:{served.http_port}", model_name="tiny",
                                          engine_backend="sglang", tokenizer=AutoTokenizer.from_pretrained(tmp_path),
                                          tp_size=1, pp_size=1, dp_size=1, ep_size=1)
    greedy = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}

    async def rollouts():
        return await engine.generate({"prompt_token_ids": [list(p) for p in PROMPTS], "sampling_params": greedy})

    first = asyncio.run(rollouts())
    assert first["response_ids"] == [list(reference(str(before), tuple(p), 10)) for p in PROMPTS]
    assert first["stop_reasons"] == ["length"] * len(PROMPTS)

    # The sender's own rank in a default group of one (send_chunks asks its rank and meets a barrier there).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        ranks = httpx.get(f"http://127.0.0.1:{served.http_port}/get_world_size", timeout=60).json()["world_size"]
        info = BroadcastInitInfo(master_addr="127.0.0.1", master_port=_free_port(), rank_offset=1,
                                 world_size=1 + ranks, group_name="skyrl", backend="gloo", model_dtype_str="float32",
                                 override_existing_receiver=True)

        async def connect():
            joined = asyncio.ensure_future(engine.init_weight_update_communicator(info))
            sender = await asyncio.to_thread(BroadcastTransferStrategy.create_sender, info, engine)
            assert (await joined)["success"]
            return sender

        sender = asyncio.run(connect())
        named = [(k, v) for f in sorted(after.glob("*.safetensors")) for k, v in load_file(str(f)).items()]
        chunks = [WeightChunk(names=[k], dtypes=["float32"], shapes=[list(v.shape)], tensors=[v]) for k, v in named]
        asyncio.run(sender.send_chunks(chunks[:-1]))
        assert served.weights.version == old  # the model's last tensor has not come
        asyncio.run(sender.send_chunks(chunks[-1:]))
        assert served.weights.version == new
        held[new] = after
        assert asyncio.run(rollouts())["response_ids"] == [list(reference(str(after), tuple(p), 10))
                                                           for p in PROMPTS]
        assert asyncio.run(engine.reset_prefix_cache())["success"]
        asyncio.run(engine.teardown())
        assert not served.weights.client_group
        sender.teardown()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
