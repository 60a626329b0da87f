"""The CPU kernels (pdserve/kernels/csrc/linear.cpp, layer_ops.cpp) against their torch references, and the switch
between them. The attention kernel has its own file (test_cpu_attention.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_kernels
from pdserve.model import layer_ops
from pdserve.model.linear import Linear, quantize

pytestmark = pytest.mark.usefixtures("cpu_kernels_built")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# Shapes: K a multiple of every block (8, 16, 32 values), and not (tails); N not a multiple of the
# 4-channel group; M across the 4-row passes.
SHAPES = [(1, 576, 960), (3, 64, 7), (5, 96, 33), (8, 13, 5), (17, 1536, 64), (1, 40, 1)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(m, k, n, wdtype, bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    scale = None
    if wdtype == torch.int8:
        scale = torch.rand(n, generator=g) + 0.01
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        ref = F.linear(x, w.float() * scale[:, None], b)
    else:
        w = w.to(wdtype)
        ref = F.linear(x, w.float(), b)
    out = torch.ops.pdserve.linear(x, w, scale, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5
    # bf16 activations: computed in fp32, rounded once at the end.
    out16 = torch.ops.pdserve.linear(x.bfloat16(), w, scale, b)
    assert out16.dtype == torch.bfloat16
    assert rel_err(out16, torch.ops.pdserve.linear(x.bfloat16().float(), w, scale, b)) < 1e-2


def test_linear_rejects_bad_inputs():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight \\[N, K\\]"):
        torch.ops.pdserve.linear(x, torch.randn(4, 9), None, None)
    with pytest.raises(RuntimeError, match="per-channel scale"):
        torch.ops.pdserve.linear(x, w.to(torch.int8), None, None)
    with pytest.raises(RuntimeError, match="per-channel scale"):
        torch.ops.pdserve.linear(x, w, torch.ones(4), None)
    with pytest.raises(RuntimeError, match="one value per output channel"):
        torch.ops.pdserve.linear(x, w, None, torch.ones(3))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.pdserve.linear(x.double(), w, None, None)


def test_quantize_int8_per_channel():
    torch.manual_seed(0)
    lin = Linear(64, 10)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(10, 64) * torch.logspace(-3, 1, 10)[:, None])  # rows of very different scale
    w = lin.weight.detach().clone()
    quantize(lin, "int8")
    assert lin.weight.dtype == torch.int8 and lin.scale.shape == (10,)
    assert lin.weight.abs().max() == 127
    # Each row's error is at most half a step of its own scale (and the fp32 rounding of q * scale).
    err = (lin.dequantized(torch.float32) - w).abs().amax(dim=1)
    assert torch.all(err <= lin.scale * (0.5 + 1e-5))
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), F.linear(x, lin.dequantized(torch.float32)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unsupported quantization"):
        quantize(lin, "int4")


def test_linear_takes_kernel_unless_forced_off(monkeypatch):
    torch.manual_seed(1)
    lin = Linear(576, 64)
    with torch.no_grad():
        lin.weight.normal_()
    x = torch.randn(2, 576)
    kernel, reference = torch.ops.pdserve.linear(x, lin.weight, None, None), F.linear(x, lin.weight)
    assert not torch.equal(kernel, reference)  # summation orders differ: the two paths can be told apart
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "torch")
    with torch.no_grad():
        assert torch.equal(lin(x), reference)
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "auto")
    with torch.no_grad():
        assert torch.equal(lin(x), kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_linear_takes_the_kernel_up_to_its_row_limit(dtype, monkeypatch):
    """Up to KERNEL_MAX_ROWS rows of x a layer runs the kernel, one row more F.linear (an int8 weight
    dequantized), and computes what that path computes, bit for bit."""
    from pdserve.model import linear as module

    torch.manual_seed(2)
    lin = Linear(576, 64)
    with torch.no_grad():
        lin.weight.normal_()
    act = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    if dtype == torch.int8:
        lin.quantize_int8()
    else:
        lin.weight.data = lin.weight.data.to(dtype)
    calls = []
    f_linear = F.linear
    monkeypatch.setattr(module.F, "linear", lambda *a: calls.append(a[0].shape[0]) or f_linear(*a))
    limit = module.KERNEL_MAX_ROWS[dtype]
    for rows, kernel in ((limit, True), (limit + 1, False)):
        x = torch.randn(rows, 576).to(act)
        expected = torch.ops.pdserve.linear(x, lin.weight, lin.scale, None) if kernel else \
            f_linear(x, lin.dequantized(act))
        calls.clear()
        with torch.no_grad():
            assert torch.equal(lin(x), expected)
        assert calls == ([] if kernel else [rows])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_x", [False, True])
def test_add_rms_norm_matches_reference(monkeypatch, dtype, tol, with_x):
    g = torch.Generator().manual_seed(3)
    res = torch.randn(5, 96, generator=g).to(dtype)
    x = torch.randn(5, 96, generator=g).to(dtype) if with_x else None
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    res_ref = res.clone()
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "torch")
    ref = layer_ops.add_rms_norm(x, res_ref, w, 1e-5)
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "auto")
    out = layer_ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, res_ref)  # the residual add is exact in either dtype
    assert out.dtype == dtype and rel_err(out, ref) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_and_mul_matches_reference(monkeypatch, dtype, tol):
    gu = (torch.randn(7, 2 * 40, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "torch")
    ref = layer_ops.silu_and_mul(gu)
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "auto")
    out = layer_ops.silu_and_mul(gu)
    assert out.shape == (7, 40) and rel_err(out, ref) < tol


def _rope_case(dtype, tokens=6, heads=6, kv_heads=2, head_dim=16, blocks=8, block_size=4, seed=5):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 100, (tokens,), generator=g)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    kv = torch.zeros(2, kv_heads, blocks, block_size, head_dim, dtype=dtype)
    freqs = torch.outer(torch.arange(128, dtype=torch.float32), torch.rand(head_dim // 2, generator=g))
    return qkv, positions, freqs.cos(), freqs.sin(), kv, slots


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rope_and_cache_matches_reference(monkeypatch, dtype, tol):
    qkv, pos, cos, sin, kv, slots = _rope_case(dtype)
    qkv_ref, kv_ref = qkv.clone(), kv.clone()
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "torch")
    q_ref, k_ref, v_ref = layer_ops.rope_and_cache(qkv_ref, pos, cos, sin, kv_ref, slots, 6, 2)
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "auto")
    q, k, v = layer_ops.rope_and_cache(qkv, pos, cos, sin, kv, slots, 6, 2)
    for a, b in ((q, q_ref), (k, k_ref), (v, v_ref), (kv, kv_ref)):
        assert a.shape == b.shape and rel_err(a, b) < tol
    assert torch.equal(v, v_ref)  # v is only copied
    untouched = torch.ones(kv.shape[2] * kv.shape[3], dtype=torch.bool)
    untouched[slots] = False
    assert kv.view(2, 2, -1, 16)[:, :, untouched].abs().sum() == 0  # nothing written outside the slots


def test_rope_and_cache_rejects_out_of_range():
    qkv, pos, cos, sin, kv, slots = _rope_case(torch.float32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.pdserve.rope_and_cache(qkv, pos, cos, sin, kv, torch.full_like(slots, 10_000), 6, 2)
    with pytest.raises(RuntimeError, match="out of the RoPE table"):
        torch.ops.pdserve.rope_and_cache(qkv, torch.full_like(pos, 128), cos, sin, kv, slots, 6, 2)
    with pytest.raises(RuntimeError, match="qkv must be"):
        torch.ops.pdserve.rope_and_cache(qkv[:, :-1].contiguous(), pos, cos, sin, kv, slots, 6, 2)


def test_each_checkout_and_each_version_of_the_sources_builds_in_a_directory_of_its_own(tmp_path):
    """Two checkouts used in turn (or a checkout's two branches) each keep their build: the build directory is
    keyed by where the sources are and by what every source and header says, and by nothing else."""
    import shutil

    from pdserve.kernels.cpu_kernels import _SOURCE_DIR, sources_key

    assert cpu_kernels.build_directory().name == f"pdserve_cpu_kernels-{sources_key(_SOURCE_DIR)}"
    a, b = shutil.copytree(_SOURCE_DIR, tmp_path / "a" / "csrc"), shutil.copytree(_SOURCE_DIR, tmp_path / "b" / "csrc")
    keys = {sources_key(_SOURCE_DIR), sources_key(a), sources_key(b)}
    assert len(keys) == 3  # the same sources in three places: three builds
    (tmp_path / "a" / "notes.txt").write_text("not a source")
    (a / "README").write_text("not a source either")
    sources_key.cache_clear()
    assert sources_key(a) in keys  # what is not a source or header does not count
    with (b / "vec.h").open("a") as f:
        f.write("\n// changed\n")
    sources_key.cache_clear()
    assert sources_key(b) not in keys  # a header edited: another build


def _load_in_a_fresh_process(extensions_dir, code: str) -> str:
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions_dir))
    r = subprocess.run([sys.executable, "-c", "from pdserve.kernels import cpu_kernels; " + code], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def _copy_of_the_build(tmp_path, *leave_out: str):
    import shutil

    built = cpu_kernels.build_directory()
    copy = tmp_path / built.parent.name / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "pdserve.flock", *leave_out))
    return copy


def test_a_build_killed_midway_does_not_block_the_next_one(tmp_path):
    """A build killed midway (a router or worker SIGKILLed on its first start) leaves torch's lock file in
    the build directory and no library; the next process must not wait on it forever. A copy of the built
    directory with such a lock builds and loads in a fresh process, within a bound."""
    copy = _copy_of_the_build(tmp_path, "*.so")
    (copy / "lock").touch()  # what a killed build leaves
    assert _load_in_a_fresh_process(tmp_path, "print(cpu_kernels.available())") == "True"
    assert not (copy / "lock").exists() and (copy / "pdserve_cpu_kernels.so").is_file()


def test_a_finished_build_is_loaded_without_torchs_build_and_a_broken_one_is_built_again(tmp_path):
    """A process finding the library built loads it alone (torch's build path, which imports setuptools and
    runs ninja, is not taken); a library cut short (a link killed midway) does not load and is built again."""
    copy = _copy_of_the_build(tmp_path)
    took = "import sys; print(cpu_kernels.available(), 'torch.utils.cpp_extension' in sys.modules)"
    assert _load_in_a_fresh_process(tmp_path, took) == "True False"
    library = copy / "pdserve_cpu_kernels.so"
    whole = library.stat().st_size
    library.write_bytes(library.read_bytes()[:4096])
    assert _load_in_a_fresh_process(tmp_path, took) == "True True"
    assert library.stat().st_size == whole
