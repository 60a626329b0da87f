from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Keep the suite's tokenizer cache out of the user's home and shared across the session.
os.environ.setdefault("PDSERVE_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "pdserve"))

# Without CUDA, Triton's interpreter runs the GPU kernels' tests (tests/kernels/test_triton_attention.py) on CPU tensors.
# Triton reads TRITON_INTERPRET once, when triton.language is first imported in the process, so it is set here,
# before any test module can import triton. With CUDA the kernels are compiled and those tests run on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    with torch.no_grad():
        cache = a(torch.tensor([prompt + tokens[:-1]]), use_cache=True).past_key_values
        out, nxt = [], tokens[-1]
        for _ in range(n):
            res = b(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            cache, nxt = res.past_key_values, int(res.logits[0, -1].argmax())
            out.append(nxt)
    return out


@pytest.fixture(scope="session")
def weight_versions(tiny_checkpoints, tmp_path_factory) -> list[Path]:
    """Three versions of the tiny Llama: v0 as built, v1 and v2 each perturbed from the one before."""
    root = tmp_path_factory.mktemp("versions")
    v0 = tiny_checkpoints["llama"]
    v1 = perturbed_checkpoint(v0, root / "v1", seed=1)
    return [v0, v1, perturbed_checkpoint(v1, root / "v2", seed=2)]


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
