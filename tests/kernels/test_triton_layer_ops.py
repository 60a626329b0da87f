"""The Triton layer ops (pdserve.kernels.triton_layer_ops) against the torch versions in pdserve.model.layer_ops.

Without CUDA they run in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton); where CUDA is available the same tests run the compiled kernels on the
GPU. The reference is always the torch version on CPU copies of the same values (PDSERVE_CPU_KERNELS=torch).

Tolerances: fp32 1e-5 relative to the row's largest value (sums in another order). 16-bit: the kernels
round where torch rounds, so the results differ by the rounding of those steps alone: at most a few units
of the last place, u = 2**-8 for bf16 rounded to nearest (the GPU), 2**-7 under the interpreter, whose
fp32 -> bf16 conversion truncates (triton 3.9); 2**-11 for fp16.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import triton_layer_ops
from pdserve.model import layer_ops

from conftest import triton_device

DEVICE = triton_device(triton_layer_ops.INTERPRETER)

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def torch_reference(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "torch")  # the CPU reference: the torch versions


def ulp(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 1e-6
    if dtype == torch.float16:
        return 2 ** -11
    return 2 ** -7 if triton_layer_ops.INTERPRETER else 2 ** -8


def assert_close(got: torch.Tensor, want: torch.Tensor, units: float, floor: float = 1e-2) -> None:
    """|got - want| <= units * u * (|want| + floor * max|want|), elementwise, in the output's dtype. A
    difference of rounded products (RoPE) cancels: its rounding error scales with the operands, not the
    result, so it takes floor 1."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float().cpu(), want.float()
    bound = units * ulp(want.dtype) * (w.abs() + floor * w.abs().max())
    bad = (g - w).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off; worst {(g - w).abs().max().item():.3g}"


def rand(*shape, dtype, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dim", [64, 100, 576])
@pytest.mark.parametrize("add", [True, False], ids=["add", "norm-only"])
def test_add_rms_norm(dtype, dim, add):
    x = rand(7, dim, dtype=dtype, seed=1) if add else None
    res = rand(7, dim, dtype=dtype, seed=2, scale=3.0)
    w = rand(dim, dtype=dtype, seed=3)
    want_res = res.clone()
    want = layer_ops.add_rms_norm(x, want_res, w, 1e-5)  # torch, on the CPU copies
    got_res = res.to(DEVICE)
    got = triton_layer_ops.add_rms_norm(None if x is None else x.to(DEVICE), got_res, w.to(DEVICE), 1e-5)
    if triton_layer_ops.INTERPRETER:  # its fp32 -> bf16 truncates
        assert_close(got_res, want_res, 1)
    else:
        assert torch.equal(got_res.cpu(), want_res)  # the residual add rounds as torch's does
    assert_close(got, want, 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_leaves_its_input_and_matches(dtype):
    x = rand(5, 100, dtype=dtype, seed=4, scale=2.0)
    w = rand(100, dtype=dtype, seed=5)
    xd = x.to(DEVICE)
    got = triton_layer_ops.rms_norm(xd, w.to(DEVICE), 1e-6)
    assert torch.equal(xd.cpu(), x)
    assert_close(got, layer_ops.rms_norm(x, w, 1e-6), 4)


def test_rms_norm_of_strided_rows():
    """Rows of a wider tensor (a row stride past the row's length) are normed in place of a copy."""
    wide = rand(6, 160, dtype=torch.float32, seed=6)
    x = wide[:, :96]
    w = rand(96, dtype=torch.float32, seed=7)
    assert_close(triton_layer_ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5), layer_ops.rms_norm(x.contiguous(), w, 1e-5), 10)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [44, 1536])  # 1536: two column blocks of 1024, the second masked
def test_silu_and_mul(dtype, d):
    gu = rand(9, 2 * d, dtype=dtype, seed=8, scale=3.0)
    assert_close(triton_layer_ops.silu_and_mul(gu.to(DEVICE)), layer_ops.silu_and_mul(gu), 2)


def rope_tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (9, 3, 64), (4, 1, 40)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_rope_and_cache(dtype, heads, kv_heads, head_dim, block_size):
    tokens, num_blocks = 11, 9
    g = torch.Generator().manual_seed(9)
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=10, scale=2.0)
    positions = torch.randint(0, 500, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    cos, sin = rope_tables(512, head_dim)
    cache = rand(4, 2, kv_heads, num_blocks, block_size, head_dim, dtype=dtype, seed=11)  # 4 layers
    want_cache, want_qkv = cache.clone(), qkv.clone()
    want = layer_ops.rope_and_cache(want_qkv, positions, cos, sin, want_cache[2], slots, heads, kv_heads)
    got_cache, got_qkv = cache.to(DEVICE), qkv.to(DEVICE)
    got = triton_layer_ops.rope_and_cache(got_qkv, positions.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE),
                                          got_cache[2], slots.to(DEVICE), heads, kv_heads)
    for a, b in zip(got, want):  # q, k, v
        assert_close(a, b, 2, floor=1)
    # Only this layer's cache, and in it only the step's slots, were written.
    assert torch.equal(got_cache[[0, 1, 3]].cpu(), cache[[0, 1, 3]])
    flat = lambda c: c.view(2, kv_heads, num_blocks * block_size, head_dim)  # noqa: E731
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat(got_cache[2].cpu())[:, :, untouched], flat(cache[2])[:, :, untouched])
    assert_close(flat(got_cache[2])[:, :, slots], flat(want_cache[2])[:, :, slots], 2, floor=1)


def test_empty_steps():
    x = torch.empty(0, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    assert triton_layer_ops.rms_norm(x, w, 1e-5).shape == (0, 64)
    assert triton_layer_ops.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


def test_supports():
    assert triton_layer_ops.supports(torch.empty(2, 8, device=DEVICE))
    assert not triton_layer_ops.supports(torch.empty(2, 8, dtype=torch.int64, device=DEVICE))
    assert not triton_layer_ops.supports(torch.empty(2, 3, 8, device=DEVICE))  # Qwen3's per-head q/k norm: torch
    assert not triton_layer_ops.supports(torch.empty(8, 2, device=DEVICE).t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or triton_layer_ops.INTERPRETER, reason="needs a CUDA device")
def test_cuda_layer_ops_dispatch_to_the_kernels(monkeypatch):
    """On CUDA activations pdserve.model.layer_ops calls these kernels; PDSERVE_GPU_KERNELS=torch turns them off."""
    calls = []
    for name in ("add_rms_norm", "rms_norm", "silu_and_mul", "rope_and_cache"):
        fn = getattr(triton_layer_ops, name)
        monkeypatch.setattr(triton_layer_ops, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    x = torch.randn(3, 64, device="cuda")
    w = torch.ones(64, device="cuda")
    cos, sin = rope_tables(16, 16)
    cache = torch.zeros(2, 1, 4, 4, 16, device="cuda")
    ops = {
        "add_rms_norm": lambda: layer_ops.add_rms_norm(x, x.clone(), w, 1e-5),
        "rms_norm": lambda: layer_ops.rms_norm(x, w, 1e-5),
        "silu_and_mul": lambda: layer_ops.silu_and_mul(torch.randn(3, 128, device="cuda")),
        "rope_and_cache": lambda: layer_ops.rope_and_cache(torch.randn(3, 64, device="cuda"), torch.arange(3, device="cuda"),
                                                           cos.cuda(), sin.cuda(), cache, torch.arange(3, device="cuda"), 2, 1),
    }
    for name, op in ops.items():
        calls.clear()
        op()
        assert calls[:1] == [name]  # the kernel module's own entry point (rms_norm goes on to add_rms_norm)
    monkeypatch.setenv("PDSERVE_GPU_KERNELS", "torch")
    calls.clear()
    for op in ops.values():
        op()
    assert calls == []


@pytest.mark.skipif(not triton_layer_ops.INTERPRETER, reason="the CUDA engine tests (tests/kernels/test_gpu.py) run "
                    "the compiled kernels through the model")
@pytest.mark.parametrize("arch", ["qwen3"])  # q/k biases off, per-head q/k norms (those stay torch's)
def test_the_model_with_the_kernels_gives_the_torch_tokens(tiny_checkpoints, arch, monkeypatch):
    """The whole engine on CPU tensors with every layer op in these kernels (the interpreter standing for
    the GPU, as pdserve.model.layer_ops dispatches CUDA tensors): greedy tokens of the torch versions, fp32,
    chunked prefills sharing steps with decodes."""
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    def tokens() -> list[list[int]]:
        eng = LLMEngine(EngineConfig(model=str(tiny_checkpoints[arch]), cache=CacheConfig(block_size=4, num_blocks=64),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)))
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, eng.model_config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9)]
        return [c.token_ids for c in eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                                          ignore_eos=True))]
    want = tokens()
    calls = []

    def counted(t):
        calls.append(t.shape)
        return triton_layer_ops if triton_layer_ops.supports(t) else None
    monkeypatch.setattr(layer_ops, "_gpu", counted)
    assert tokens() == want
    assert calls  # the kernels ran
