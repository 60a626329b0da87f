"""The Triton attention kernels (pdserve.kernels.triton_attention) against the torch reference paths.

Without CUDA they run in Triton's interpreter on CPU tensors: tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton, since triton.language reads it once at its first import. Where CUDA is
available the same tests run the compiled kernels on the GPU. A process that imported triton without the
interpreter and has no CUDA cannot run them: the module fails at import, saying so, rather than skip.
A missing triton fails the same way (the `test` extra installs it).

Tolerances:
- fp32: 1e-5 absolute (values are O(1); fp32 sums in another order and exp2 for exp differ by ~1e-6).
- bf16 (fp16) against the fp32 reference on the same bf16 (fp16) values: the kernel's only roundings are
  the probabilities before P.V and the output, each off by a relative u at most, so
  |error| <= 2 * u * max|V|, plus 1e-5 for the fp32 arithmetic. u is 2**-8 for bf16 rounded to nearest
  (the GPU), 2**-7 under the interpreter, whose fp32 -> bf16 conversion truncates (triton 3.9), and
  2**-11 for fp16 (rounded to nearest on both).
"""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import triton_attention
from pdserve.model import attention
from pdserve.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    _decode_attention_torch,
    _prefill_attention_torch,
    paged_attention,
)

from conftest import triton_device

DEVICE = triton_device(triton_attention.INTERPRETER)

pytestmark = pytest.mark.triton

FP32_TOL = 1e-5
GQA = [(4, 4), (8, 4), (8, 2), (8, 1)]
GQA_IDS = ["G1", "G2", "G4", "MQA"]


def make_cache(kv_heads, head_dim, block_size, lens, seed):
    """A random cache and block tables for rows of the given context lengths: block ids shuffled across rows
    (no row's blocks contiguous or ordered), every row padded with arbitrary valid ids past its context."""
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in lens]
    width = max(used) + 2
    num_blocks = sum(used) + 5
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(lens), width), generator=g)
    start = 0
    for i, n in enumerate(used):
        tables[i, :n] = perm[start:start + n]
        start += n
    kv = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=g)
    return kv.to(DEVICE), tables.to(DEVICE)


def bf16_bound(kv: torch.Tensor) -> float:
    u = 2 ** -7 if triton_attention.INTERPRETER else 2 ** -8
    return 2 * u * kv[1].abs().max().item() + FP32_TOL


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# --- decode ---------------------------------------------------------------------------------------------

DECODE_LENS = [1, 16, 37, 200, 5, 64, 130]  # a single token, exactly full blocks, partial last blocks, varied


@pytest.mark.parametrize("heads,kv_heads", GQA, ids=GQA_IDS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: padded to 64 inside the kernel
def test_decode_matches_torch_fp32(heads, kv_heads, block_size, head_dim):
    kv, tables = make_cache(kv_heads, head_dim, block_size, DECODE_LENS, seed=heads * 100 + kv_heads + block_size)
    lens = torch.tensor(DECODE_LENS, device=DEVICE)
    q = torch.randn(len(DECODE_LENS), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    scale = head_dim ** -0.5
    out = triton_attention.paged_decode_attention(q, kv, tables, lens, scale)
    ref = _decode_attention_torch(q, kv, tables, lens, scale)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert max_err(out, ref) <= FP32_TOL


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 1)], ids=["G4", "MQA"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_bf16_matches_fp32_math_on_the_same_values(heads, kv_heads, block_size):
    kv, tables = make_cache(kv_heads, 64, block_size, DECODE_LENS, seed=7 + block_size)
    lens = torch.tensor(DECODE_LENS, device=DEVICE)
    q = torch.randn(len(DECODE_LENS), heads, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    q16, kv16 = q.bfloat16(), kv.bfloat16()
    out = triton_attention.paged_decode_attention(q16, kv16, tables, lens, 0.125)
    assert out.dtype == torch.bfloat16
    ref = _decode_attention_torch(q16.float(), kv16.float(), tables, lens, 0.125)
    assert max_err(out, ref) <= bf16_bound(kv16.float())


@pytest.mark.parametrize("block_size,head_dim", [(5, 128), (32, 16)])
def test_decode_other_block_sizes_and_head_dims(block_size, head_dim):
    """A block size that is not a power of two, head_dim 128 and 16: tokens are gathered one by one."""
    kv, tables = make_cache(2, head_dim, block_size, DECODE_LENS, seed=block_size)
    lens = torch.tensor(DECODE_LENS, device=DEVICE)
    q = torch.randn(len(DECODE_LENS), 6, head_dim, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = triton_attention.paged_decode_attention(q, kv, tables, lens, head_dim ** -0.5)
    assert max_err(out, _decode_attention_torch(q, kv, tables, lens, head_dim ** -0.5)) <= FP32_TOL


def test_fp16():
    kv, tables = make_cache(2, 64, 16, DECODE_LENS, seed=12)
    lens = torch.tensor(DECODE_LENS, device=DEVICE)
    q = torch.randn(len(DECODE_LENS), 8, 64, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    q16, kv16 = q.half(), kv.half()
    out = triton_attention.paged_decode_attention(q16, kv16, tables, lens, 0.125)
    assert out.dtype == torch.float16
    ref = _decode_attention_torch(q16.float(), kv16.float(), tables, lens, 0.125)
    assert max_err(out, ref) <= 2 * 2 ** -11 * kv16[1].float().abs().max().item() + FP32_TOL
    pq, _, _, pkv, blocks = prefill_case(37, 150, 8, 2, 64, 16, seed=13)
    pq16, pkv16 = pq.half(), pkv.half()
    out = triton_attention.prefill_attention(pq16, None, None, pkv16, blocks, 150, 0.125)
    ref = _prefill_attention_torch(pq16.float(), None, None, pkv16.float(), blocks, 150, 0.125)
    assert max_err(out, ref) <= 2 * 2 ** -11 * pkv16[1].float().abs().max().item() + FP32_TOL


def test_decode_writes_into_out_in_place():
    kv, tables = make_cache(2, 64, 16, DECODE_LENS, seed=3)
    lens = torch.tensor(DECODE_LENS, device=DEVICE)
    q = torch.randn(len(DECODE_LENS), 8, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref = _decode_attention_torch(q, kv, tables, lens, 0.125)
    whole = torch.full((len(DECODE_LENS) + 2, 8, 64), 7.0, device=DEVICE)
    got = triton_attention.paged_decode_attention(q, kv, tables, lens, 0.125, out=whole[1:-1])
    assert got.data_ptr() == whole[1].data_ptr()
    assert max_err(whole[1:-1], ref) <= FP32_TOL
    assert (whole[0] == 7).all() and (whole[-1] == 7).all()  # nothing written outside out
    strided = torch.empty(len(DECODE_LENS), 8, 128, device=DEVICE)[..., ::2]  # head_dim not contiguous
    triton_attention.paged_decode_attention(q, kv, tables, lens, 0.125, out=strided)
    assert max_err(strided, ref) <= FP32_TOL


def test_decode_reads_a_layer_of_the_whole_model_cache():
    """A layer of the model's cache is a strided view ([layers, 2, ...] indexed by layer): strides come
    from the tensor, not from its shape."""
    kv, tables = make_cache(2, 64, 16, DECODE_LENS, seed=4)
    cache = torch.stack([torch.zeros_like(kv), kv, torch.zeros_like(kv)])  # [layers, 2, kv_heads, ...]
    lens = torch.tensor(DECODE_LENS, device=DEVICE)
    q = torch.randn(len(DECODE_LENS), 4, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = triton_attention.paged_decode_attention(q, cache[1], tables, lens, 0.125)
    assert max_err(out, _decode_attention_torch(q, kv, tables, lens, 0.125)) <= FP32_TOL


# --- prefill --------------------------------------------------------------------------------------------

PREFILL_CASES = [  # (q_len, ctx_len)
    (70, 70),  # no cached prefix, two query tiles
    (5, 5),  # no cached prefix, a short prompt
    (37, 150),  # a chunk after a cached prefix
    (100, 101),  # a prefix of one token, query tiles spanning the whole context
    (1, 9),  # a single new token after a prefix
    (130, 300),  # three query tiles after a prefix: later tiles see more key tiles
]


def prefill_case(q_len, ctx_len, heads, kv_heads, head_dim, block_size, seed):
    """q for one sequence, the cache holding all ctx_len tokens (the chunk's K/V written, as layer_ops does
    before attention), the sequence's shuffled blocks, and the chunk's K/V as the torch path takes them."""
    kv, tables = make_cache(kv_heads, head_dim, block_size, [ctx_len], seed)
    blocks = tables[0]
    q = torch.randn(q_len, heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    pos = torch.arange(ctx_len - q_len, ctx_len, device=DEVICE)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    k_new, v_new = (kv[i].flatten(1, 2)[:, slots].transpose(0, 1) for i in (0, 1))  # [q_len, kv_heads, head_dim]
    return q, k_new, v_new, kv, blocks


@pytest.mark.parametrize("q_len,ctx_len", PREFILL_CASES, ids=[f"q{q}-ctx{c}" for q, c in PREFILL_CASES])
@pytest.mark.parametrize("heads,kv_heads", GQA, ids=GQA_IDS)
@pytest.mark.parametrize("block_size,head_dim", [(4, 64), (16, 40)])
def test_prefill_matches_torch_fp32(q_len, ctx_len, heads, kv_heads, block_size, head_dim):
    q, k_new, v_new, kv, blocks = prefill_case(q_len, ctx_len, heads, kv_heads, head_dim, block_size,
                                               seed=q_len * 1000 + ctx_len + heads + kv_heads)
    scale = head_dim ** -0.5
    out = triton_attention.prefill_attention(q, k_new, v_new, kv, blocks, ctx_len, scale)
    ref = _prefill_attention_torch(q, k_new, v_new, kv, blocks, ctx_len, scale)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert max_err(out, ref) <= FP32_TOL


@pytest.mark.parametrize("q_len,ctx_len", [(70, 70), (37, 150)], ids=["no-prefix", "prefix"])
def test_prefill_bf16_matches_fp32_math_on_the_same_values(q_len, ctx_len):
    q, k_new, v_new, kv, blocks = prefill_case(q_len, ctx_len, 8, 2, 64, 16, seed=11)
    q16, kv16 = q.bfloat16(), kv.bfloat16()
    out = triton_attention.prefill_attention(q16, None, None, kv16, blocks, ctx_len, 0.125)
    assert out.dtype == torch.bfloat16
    ref = _prefill_attention_torch(q16.float(), k_new.bfloat16().float(), v_new.bfloat16().float(), kv16.float(),
                                   blocks, ctx_len, 0.125)
    assert max_err(out, ref) <= bf16_bound(kv16.float())


def test_prefill_ignores_keys_past_the_context():
    """Tokens of the last block past ctx_len, and keys after each query's own position, never count."""
    q, k_new, v_new, kv, blocks = prefill_case(20, 50, 4, 2, 64, 16, seed=5)
    ref = triton_attention.prefill_attention(q, k_new, v_new, kv, blocks, 50, 0.125)
    poisoned = kv.clone()
    flat = poisoned.flatten(2, 3)  # [2, kv_heads, blocks * block_size, head_dim], a view
    last = int(blocks[3]) * 16
    flat[:, :, last + 2:last + 16] = 1e4  # positions 50..63 of the last block
    assert torch.equal(triton_attention.prefill_attention(q, k_new, v_new, poisoned, blocks, 50, 0.125), ref)
    # Query 0 sits at position 30: every later position differs, its output does not.
    later = kv.clone()
    lf = later.flatten(2, 3)
    for p in range(31, 50):
        lf[:, :, int(blocks[p // 16]) * 16 + p % 16] = -3.0
    got = triton_attention.prefill_attention(q, k_new, v_new, later, blocks, 50, 0.125)
    assert torch.equal(got[0], ref[0]) and not torch.equal(got[-1], ref[-1])


# --- dispatch -------------------------------------------------------------------------------------------

def test_supports():
    kv = torch.zeros(2, 2, 4, 16, 64, device=DEVICE)
    q = torch.zeros(3, 4, 64, device=DEVICE)
    assert triton_attention.supports(q, kv)
    assert triton_attention.supports(q.bfloat16(), kv.bfloat16())
    assert not triton_attention.supports(q.bfloat16(), kv)  # mixed dtypes
    assert not triton_attention.supports(q.double(), kv.double())
    assert not triton_attention.supports(q, kv.transpose(-1, -2))  # head_dim not contiguous


def test_cpu_tensors_keep_the_cpu_path():
    """pdserve.model.attention sends only CUDA tensors to the kernels, whatever the interpreter setting."""
    kv, tables = make_cache(2, 64, 16, DECODE_LENS, seed=6)
    q = torch.zeros(len(DECODE_LENS), 4, 64)
    assert attention._gpu_kernels(q, kv.cpu()) is None


def test_paged_attention_with_the_kernels_matches_the_torch_path(monkeypatch):
    """A whole step through pdserve.model.attention.paged_attention (decodes in a padded group, a chunk after a
    cached prefix, a fresh prompt) with the kernels dispatched to, as on CUDA, against the torch path."""
    lens = [1, 37, 50, 10]  # two decodes; prefills of 20 new tokens (30 cached) and 10 (none cached)
    kv, tables = make_cache(2, 64, 16, lens, seed=14)
    q_lens = [1, 1, 20, 10]
    q = torch.randn(sum(q_lens), 8, 64, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    k, v = torch.zeros(2, sum(q_lens), 2, 64, device=DEVICE)
    start = 2
    for row in (2, 3):
        pos = torch.arange(lens[row] - q_lens[row], lens[row], device=DEVICE)
        slots = tables[row][pos // 16] * 16 + pos % 16
        k[start:start + q_lens[row]] = kv[0].flatten(1, 2)[:, slots].transpose(0, 1)
        v[start:start + q_lens[row]] = kv[1].flatten(1, 2)[:, slots].transpose(0, 1)
        start += q_lens[row]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=DEVICE),  # unused by attention
        num_decodes=2,
        decode_groups=[DecodeGroup(tables[:2], torch.tensor(lens[:2], device=DEVICE))],
        prefill_query_lens=q_lens[2:], prefill_context_lens=lens[2:], prefill_block_tables=[tables[2], tables[3]])
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
    monkeypatch.setenv(attention.GPU_ENV_VAR, "torch")
    ref = paged_attention(q, k, v, kv, meta, 0.125)
    monkeypatch.delenv(attention.GPU_ENV_VAR)
    monkeypatch.setattr(attention, "_gpu_kernels", lambda q, kv_layer: triton_attention)
    out = paged_attention(q, k, v, kv, meta, 0.125)
    assert max_err(out, ref) <= FP32_TOL
