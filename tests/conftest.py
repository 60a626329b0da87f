from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path

import pytest
import torch

# Keep the suite's tokenizer cache out of the user's home and shared across the session.
os.environ.setdefault("PDSERVE_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "pdserve"))

# Without CUDA, Triton's interpreter runs the GPU kernels' tests (tests/kernels/test_triton_attention.py) on CPU
# tensors. Triton reads TRITON_INTERPRET once, when triton.language is first imported in the process, so it is set
# here, before any test module can import triton. With CUDA the kernels are compiled and those tests run on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_device(interpreter: bool) -> torch.device:
    """Where the Triton kernels' tests run: CPU tensors in the interpreter, else the GPU."""
    if interpreter:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    raise RuntimeError("triton was imported without TRITON_INTERPRET=1 on a machine without CUDA: set it before "
                       "triton's first import (tests/conftest.py does) to run these tests in the interpreter")


def build_tiny_checkpoint(directory: Path, arch: str, **overrides) -> Path:
    """A seeded random Hugging Face checkpoint (config.json + safetensors) of a tiny model.

    initializer_range 0.3 keeps logit gaps large, so greedy tokens are not decided by rounding.
    """
    import transformers

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.3, rms_norm_eps=1e-6, tie_word_embeddings=False)
    common.update(overrides)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    if arch == "mistral":
        common.setdefault("sliding_window", None)
    torch.manual_seed(0)
    model = cls[1](cls[0](**common)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def perturbed_checkpoint(src: Path, dst: Path, scale: float = 0.05, seed: int = 1) -> Path:
    """A copy of a checkpoint with every tensor moved by seeded noise: the next version of its weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: (v + scale * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in tensors.items()},
                  str(dst / f.name))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def keep_reference(old: Path, new: Path, prompt: list[int], tokens: list[int], n: int) -> list[int]:
    """Greedy tokens of the new checkpoint decoding over the old one's KV of prompt + tokens[:-1], in
    transformers: what the "keep" version policy means, computed independently of pdserve."""
    import transformers

    a = transformers.AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32).eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).eval()
    kw = cache_keyword(b)
    with torch.no_grad():
        cache = getattr(a(torch.tensor([prompt + tokens[:-1]]), use_cache=True), kw)
        out, nxt = [], tokens[-1]
        for _ in range(n):
            res = b(torch.tensor([[nxt]]), use_cache=True, **{kw: cache})
            cache, nxt = getattr(res, kw), int(res.logits[0, -1].argmax())
            out.append(nxt)
    return out


def cache_keyword(model) -> str:
    """The name transformers gives a forward's KV cache, argument and output alike: `cache` since 5.x renamed it
    (`past_key_values` still taken, with a warning, until 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.fixture(scope="session")
def weight_versions(tiny_checkpoints, tmp_path_factory) -> list[Path]:
    """Three versions of the tiny Llama: v0 as built, v1 and v2 each perturbed from the one before, beside it
    (under the weights root a cluster serving v0 has by default: the directory that holds it)."""
    v0 = tiny_checkpoints["llama"]
    v1 = perturbed_checkpoint(v0, v0.parent / "llama-v1", seed=1)
    return [v0, v1, perturbed_checkpoint(v1, v0.parent / "llama-v2", seed=2)]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": build_tiny_checkpoint(root / "llama", "llama"),
        "llama3-rope": build_tiny_checkpoint(
            root / "llama3-rope", "llama", tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "mistral": build_tiny_checkpoint(root / "mistral", "mistral"),
        "qwen2": build_tiny_checkpoint(root / "qwen2", "qwen2"),
        "qwen3": build_tiny_checkpoint(root / "qwen3", "qwen3"),
    }


@functools.cache
def _transformers_gguf(path: Path) -> torch.nn.Module:
    import transformers
    from safetensors.torch import load_model, save_model

    from pdserve.derived import cached_conversion

    def read(out: Path) -> None:
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32, local_files_only=True)
        model.config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        save_model(model, str(out / "model.safetensors"))  # a tied LM head once, as the embedding

    kept = cached_conversion("transformers-gguf", path, "model.safetensors", read)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(kept),
                                                          dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig.from_pretrained(kept)
    load_model(model, str(kept / "model.safetensors"))
    return model.eval()


def transformers_gguf(path: Path) -> torch.nn.Module:
    """transformers' own load of a GGUF file (fp32, eval mode), made once per file per session: SmolLM2's
    read dequantizes in Python (16 s of CPU on 2 cores), so what it read is kept in pdserve's derived cache
    (its weights, config and generation config; loaded again in 1.6 s, bit for bit the same weights and
    logits), and tests/model/test_gguf.py, tests/model/test_default_model.py, tests/engine/test_logprobs.py
    (with test_penalties.py) and tests/router/test_lm_eval.py all hold pdserve to it. Shared: a test may run it
    (under no_grad) or read its state_dict, never change it."""
    return _transformers_gguf(Path(path).resolve())


class LoopThread:
    """An asyncio loop on its own thread, so sync tests can drive async components that keep tasks alive."""

    def __init__(self):
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 300.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster on loopback for every test that needs Ray."""
    import ray

    from router.pools import init_local_ray

    init_local_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def aloop():
    lt = LoopThread()
    yield lt
    lt.close()


def other_address() -> str | None:
    """An address of this machine that is not loopback, if it has one: a test reaches a server from it to see
    what a peer elsewhere on the network would get."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only the route is looked up
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Poll until predicate() is truthy; fail with `what` after the deadline."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="module")
def cpu_kernels_built():
    """Builds (or loads the cached build of) the CPU kernels once; where a toolchain exists they must
    build, elsewhere the module is skipped with the reason."""
    import shutil

    from pdserve.kernels import cpu_kernels

    if cpu_kernels.available():
        return
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("CPU kernels cannot be built: no C++ compiler on PATH")
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            pytest.skip("CPU kernels cannot be built: ninja is not installed")
    pytest.fail("a compiler and ninja exist but the CPU kernels did not build (see the warning)")


# -- SmolLM2 clusters shared by the modules that serve the same one ----------------------------------------------
# tests/router/test_api.py, test_grpc_logprobs.py, test_openai_api.py, test_openai_logprobs.py and the real run of
# tests/loadgen/test_loadgen.py serve SmolLM2 on one prefill and one decode worker; each used to start its own (~15 s
# on 2 cores). They share one through `smol_1p1d` (each module keeps its own routers on it): their modules run one
# after another, where the first of them is collected, and the cluster is shut down once the last of them is done,
# so no other module of the same process ever runs beside it (under `make test`, the other process's modules run
# beside it on the other core: see "two test processes" below). A test of theirs reads what the cluster did as a
# delta (a cancel by its request id, KV blocks back to zero, prompt tokens computed over a run), never as a total
# since it started, and sends no prompt another module's test needs to find uncached.
# tests/router/test_metrics.py reads every dashboard expression off it: a dense model's scrape without a start-up.
# `smol_colocated` is the same for one colocated SmolLM2 worker (tests/router/test_structured_api.py and
# test_tools_api.py, which use both: their modules run next to each other inside the 1P1D group).
SMOL_1P1D = "smol_1p1d"
SMOL_COLOCATED = "smol_colocated"


def smol_1p1d_engine_config():
    """The engine config of the shared clusters (SmolLM2, 512 KV blocks of 16 tokens, a 512-token budget, 64
    sequences): the one their modules build their offline engines from. Skips where SmolLM2 is not installed."""
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.model.loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return EngineConfig(cache=CacheConfig(block_size=16, num_blocks=512),
                        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64))


def _smol_1p1d_config():
    from pdserve.config import ClusterConfig, PoolConfig

    # Its modules test the doors over the disaggregated path: every prompt through the prefill worker, even one the
    # decode worker holds (a repeat would otherwise be computed there: local prefill, which
    # tests/router/test_sessions.py covers).
    return ClusterConfig(engine=smol_1p1d_engine_config(), prefill=PoolConfig(1, num_cpus=0.25),
                         decode=PoolConfig(1, num_cpus=0.25), local_prefill_max_tokens=0)


def _smol_colocated_config():
    from pdserve.config import ClusterConfig, PoolConfig

    return ClusterConfig(engine=smol_1p1d_engine_config(), mode="colocated", colocated=PoolConfig(1, num_cpus=0.25))


class _SharedCluster:
    def __init__(self, name: str, config):
        self.name, self.config = name, config  # the fixture's name; a function that makes its ClusterConfig
        self.cluster = self.aloop = None
        self.users: set[Path] = set()  # the modules collected that use it
        self.last_module: Path | None = None  # the last of them to run: closed after it

    def get(self, request, aloop):
        # Known at collection only where a test names it (or a fixture of its does): one that reaches it through
        # request.getfixturevalue alone is marked @pytest.mark.usefixtures(<name>), so it is grouped and closed.
        if request.path not in self.users:
            raise RuntimeError(f"{request.path} uses the shared cluster {self.name} but no test of it names it: "
                               f"mark the test @pytest.mark.usefixtures({self.name!r})")
        if self.cluster is None:
            self.aloop = aloop
            from router.cluster import Cluster

            cluster = Cluster(self.config())
            aloop.run(cluster.start(), timeout=600)
            self.cluster = cluster
        return self.cluster

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            self.aloop.run(cluster.shutdown())


_SHARED = [_SharedCluster(SMOL_1P1D, _smol_1p1d_config), _SharedCluster(SMOL_COLOCATED, _smol_colocated_config)]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """The modules that use a shared cluster run one after another, where the first of them is (each module's own
    order kept), so the cluster is up only while they run. The groups are made in the order of _SHARED: a later
    one's modules (a subset of an earlier group's, or none of them) stay inside that group."""
    for shared in _SHARED:
        users = list(dict.fromkeys(item.path for item in items if shared.name in getattr(item, "fixturenames", ())))
        if len(users) > 1:
            first = next(i for i, item in enumerate(items) if item.path in users)
            group = sorted((item for item in items if item.path in users), key=lambda item: users.index(item.path))
            items[:] = items[:first] + group + [item for item in items[first:] if item.path not in users]
        shared.users, shared.last_module = set(users), None
    for item in items:  # the last user of each, in the final order
        for shared in _SHARED:
            if item.path in shared.users:
                shared.last_module = item.path
    _write_groups(items)


# -- two test processes (pytest-xdist; `make test` runs `-n 2 --dist loadfile`) ------------------------------------
# Run one after another, the modules keep the two cores 66 % busy (docs/benchmarks.md, "Where the suite's time goes"):
# a cluster test waits on a worker's step, a heartbeat, a timeout. A second process fills that time. Each module runs
# whole in one process (loadfile), so its fixtures start once; and every module that uses a shared SmolLM2 cluster
# runs in the same process, so each shared cluster starts once and closes after its last module, as above. Only the
# processes that collect know which modules those are: the first to collect writes them to a file the controller's
# scheduler reads (xdist's own groups, `--dist loadgroup`, rename node ids, which pytest 9.2 no longer allows). Each
# process computes on one torch thread: two processes of two threads would oversubscribe two cores.
SHARED_GROUP = "shared-smollm2"
_GROUPS_FILE = "PDSERVE_TEST_GROUPS"  # the environment variable that names the file, set by the controller


def _write_groups(items) -> None:
    path = os.environ.get(_GROUPS_FILE)
    if not path or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import json

    groups = {module: SHARED_GROUP for shared in _SHARED for module in
              dict.fromkeys(item.nodeid.split("::", 1)[0] for item in items if item.path in shared.users)}
    tmp = f"{path}.{os.getpid()}"
    Path(tmp).write_text(json.dumps(groups))
    os.replace(tmp, path)  # each process collects the same items: whichever writes last writes the same


class _SharedModulesTogether:
    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadScopeScheduling

        path = os.environ[_GROUPS_FILE]

        class ModulesAndSharedGroup(LoadScopeScheduling):
            groups: dict[str, str] | None = None

            def _split_scope(self, nodeid: str) -> str:
                if self.groups is None:  # first asked once every process has collected (and written the file)
                    import json

                    self.groups = json.loads(Path(path).read_text())
                module = nodeid.split("::", 1)[0]
                return self.groups.get(module, module)

        return ModulesAndSharedGroup(config, log)


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    elif config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        import tempfile

        fd, path = tempfile.mkstemp(prefix="pdserve-test-groups-", suffix=".json")
        os.close(fd)
        os.environ[_GROUPS_FILE] = path  # the processes xdist starts next inherit it
        config.add_cleanup(lambda: os.unlink(path))
        config.pluginmanager.register(_SharedModulesTogether(), "pdserve-shared-modules-together")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    # After the last module that uses a shared cluster, with its own fixtures (its routers) torn down.
    for shared in _SHARED:
        if item.path == shared.last_module and (nextitem is None or nextitem.path != item.path):
            shared.close()
    _collect_if_grown()


# An engine a test drops is held by reference cycles (its scheduler, runner and callbacks point at each other) until
# the cyclic collector runs, and the collector counts objects, not bytes: a module that makes an engine per test kept
# each one's KV cache (1 GiB by default) and model until then, 12.5 GB at the peak of
# tests/engine/test_speculative_engine.py, and its run took twice as long. A full collection costs ~0.1 s in this
# process, so it runs after a test only where the process has grown by GC_GROWTH since the last one.
GC_GROWTH = 1 << 30
_rss_after_gc = 0


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None  # not Linux: nothing is collected early


def _collect_if_grown() -> None:
    import gc

    global _rss_after_gc
    rss = _rss()
    if rss is not None and rss > _rss_after_gc + GC_GROWTH:
        gc.collect()
        _rss_after_gc = _rss() or 0


@pytest.fixture(scope="session")
def _shared_clusters(ray_local, aloop):
    yield {shared.name: shared for shared in _SHARED}
    for shared in _SHARED:
        shared.close()  # a run stopped before the last module that uses it was done


@pytest.fixture(scope="module")
def smol_1p1d(_shared_clusters, request, aloop):
    """The shared SmolLM2 1P1D cluster (a router.cluster.Cluster), started by the first module that asks."""
    return _shared_clusters[SMOL_1P1D].get(request, aloop)


@pytest.fixture(scope="module")
def smol_colocated(_shared_clusters, request, aloop):
    """The shared colocated SmolLM2 cluster (one worker), started by the first module that asks."""
    return _shared_clusters[SMOL_COLOCATED].get(request, aloop)


SMOL_MODEL = "smollm2"


@pytest.fixture(scope="module")
def smol_router(smol_1p1d, aloop):
    """A router over the shared SmolLM2 cluster, its HTTP door on, the model served as SMOL_MODEL; stopped after
    the module."""
    from router.compose import build_router
    from router.config import RouterConfig

    r = build_router(smol_1p1d, RouterConfig(port=0, http_port=0, served_model_name=SMOL_MODEL))
    aloop.run(r.start())
    yield r
    aloop.run(r.stop(grace=5))


# -- time per module, in the terminal summary ----------------------------------------------------------------------
# CI prints it so the next slow module is seen where it appears, not found by bisecting a slow run. A module's time is
# its tests' setup + call + teardown, so a fixture shared across modules (a session's Ray, the shared SmolLM2 cluster)
# is charged to the module that starts it.
# The setup column is what its fixtures took (clusters started, engines loaded, references computed): where it is
# most of a module's time, sharing the fixture is the lead; where the calls are, the tests' own work is.
MODULE_TIMES_SHOWN = 25
_module_seconds: dict[str, float] = {}
_module_setup_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    module = report.nodeid.split("::", 1)[0]
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration
    if report.when == "setup":
        _module_setup_seconds[module] = _module_setup_seconds.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _module_seconds:
        return
    ranked = sorted(_module_seconds.items(), key=lambda kv: kv[1], reverse=True)
    terminalreporter.write_sep("-", f"time per module (slowest {min(MODULE_TIMES_SHOWN, len(ranked))} "
                                    f"of {len(ranked)})")
    terminalreporter.write_line(f"{'all':>9s} {'setup':>9s}")
    for module, seconds in ranked[:MODULE_TIMES_SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f}s {_module_setup_seconds.get(module, 0.0):8.1f}s  {module}")
    terminalreporter.write_line(f"{sum(_module_seconds.values()):8.1f}s "
                                f"{sum(_module_setup_seconds.values()):8.1f}s  total")
