"""The C++ CPU decode-attention kernel against the torch reference path, and the dispatch between them."""
from __future__ import annotations

import logging

import pytest
import torch

from pdserve.kernels import cpu_attention, cpu_kernels
from pdserve.model import attention
from pdserve.model.attention import AttentionMetadata, DecodeGroup, _decode_attention_torch, paged_attention

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("cpu_kernels_built")


def make_case(batch, heads, kv_heads, head_dim, block_size=16, max_ctx=400, seed=0, pad_value=None):
    """A random cache and block tables: shuffled block ids, non-aligned lengths, padded tables."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=g)
    lens[0] = 1  # a single-token context
    if batch > 2:
        lens[1] = block_size  # exactly one full block
        lens[2] = max_ctx  # the longest
    used = [-(-int(n) // block_size) for n in lens]
    width = max(used) + 2  # every row has padding entries past its context
    num_blocks = sum(used) + 7
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (batch, width), generator=g)  # padding: arbitrary valid ids
    if pad_value is not None:
        tables.fill_(pad_value)
    start = 0
    for i, n in enumerate(used):
        tables[i, :n] = perm[start:start + n]
        start += n
    kv = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=g)
    q = torch.randn(batch, heads, head_dim, generator=g)
    return q, kv, tables, lens


@pytest.mark.parametrize("batch", [1, 3, 17])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)], ids=["G1", "G3", "G4"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_parity_with_torch_path(batch, heads, kv_heads, head_dim):
    q, kv, tables, lens = make_case(batch, heads, kv_heads, head_dim, seed=batch * 1000 + heads + head_dim)
    scale = head_dim ** -0.5
    ref = _decode_attention_torch(q, kv, tables, lens, scale)
    out = cpu_attention.paged_decode_attention(q, kv, tables, lens, scale)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("batch,head_dim", [(1, 64), (5, 36), (17, 128)])
def test_bf16_cache_matches_fp32_arithmetic_on_the_same_values(batch, head_dim):
    """bf16 K/V are read as stored and widened: the result is the fp32 kernel's on the same (rounded)
    values, rounded once to bf16 at the end."""
    q, kv, tables, lens = make_case(batch, 9, 3, head_dim, seed=batch + head_dim)
    q16, kv16 = q.bfloat16(), kv.bfloat16()
    out = cpu_attention.paged_decode_attention(q16, kv16, tables, lens, head_dim ** -0.5)
    assert out.dtype == torch.bfloat16
    ref = cpu_attention.paged_decode_attention(q16.float(), kv16.float(), tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(out, ref.bfloat16(), atol=0, rtol=0)
    torch_path = _decode_attention_torch(q16, kv16, tables, lens, head_dim ** -0.5)  # bf16 matmuls
    assert (out.float() - torch_path.float()).abs().max() / torch_path.float().abs().max() < 2e-2


@pytest.mark.parametrize("block_size,head_dim", [(1, 64), (8, 20), (32, 36), (16, 80)])
def test_other_block_sizes_head_dims_and_peaked_softmax(block_size, head_dim):
    # head_dim not a multiple of 8 or 32 exercises the kernel's tail loops. scale 1.0: scores span
    # tens to hundreds, so most probabilities underflow (the exp clamp path).
    q, kv, tables, lens = make_case(5, 6, 2, head_dim, block_size=block_size, max_ctx=300, seed=block_size)
    ref = _decode_attention_torch(q, kv, tables, lens, 1.0)
    out = cpu_attention.paged_decode_attention(q, kv, tables, lens, 1.0)
    assert (out - ref).abs().max().item() <= TOL


def test_padding_entries_are_never_read():
    q, kv, tables, lens = make_case(6, 9, 3, 64, seed=3)
    ref = _decode_attention_torch(q, kv, tables, lens, 0.125)
    bad = tables.clone()
    for i, n in enumerate(lens.tolist()):
        bad[i, -(-n // 16):] = -1  # out of range: reading one would fail validation or crash
    out = cpu_attention.paged_decode_attention(q, kv, bad, lens, 0.125)
    assert (out - ref).abs().max().item() <= TOL


def test_same_result_on_any_thread_count():
    q, kv, tables, lens = make_case(17, 9, 3, 64, max_ctx=600, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_decode_attention(q, kv, tables, lens, 0.125)
        torch.set_num_threads(max(2, threads))
        many = cpu_attention.paged_decode_attention(q, kv, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_writes_into_out_and_accepts_strided_q():
    q, kv, tables, lens = make_case(3, 9, 3, 64, seed=5)
    ref = _decode_attention_torch(q, kv, tables, lens, 0.125)
    wide = torch.randn(3, 9, 128)
    wide[..., :64] = q  # a non-contiguous view equal to q
    out = torch.full_like(q, float("nan"))
    got = cpu_attention.paged_decode_attention(wide[..., :64], kv, tables, lens, 0.125, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert (out - ref).abs().max().item() <= TOL
    strided_out = torch.full((3, 9, 128), float("nan"))[..., :64]  # not contiguous: copied into
    cpu_attention.paged_decode_attention(q, kv, tables, lens, 0.125, out=strided_out)
    assert (strided_out - ref).abs().max().item() <= TOL


def test_rejects_bad_inputs():
    q, kv, tables, lens = make_case(3, 9, 3, 64, seed=6)
    bad = tables.clone()
    bad[1, 0] = kv.shape[2]  # a used block id past the cache
    with pytest.raises(RuntimeError, match="block id"):
        cpu_attention.paged_decode_attention(q, kv, bad, lens, 0.125)
    with pytest.raises(RuntimeError, match="context length"):
        cpu_attention.paged_decode_attention(q, kv, tables, torch.tensor([1, 0, 5]), 0.125)
    with pytest.raises(RuntimeError, match="context length"):
        cpu_attention.paged_decode_attention(q, kv, tables, torch.tensor([1, tables.shape[1] * 16 + 1, 5]), 0.125)
    with pytest.raises(RuntimeError, match="multiple of"):
        cpu_attention.paged_decode_attention(q[:, :8], kv, tables, lens, 0.125)


def _spy(monkeypatch):
    calls = []
    real = cpu_attention.paged_decode_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "paged_decode_attention", spy)
    return calls


def _mixed_step(seed=7):
    """A step of three decode rows in two groups, then one prefill chunk over cached context."""
    q1, kv, t1, l1 = make_case(3, 9, 3, 64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.cat([q1, torch.randn(4, 9, 64, generator=g)])  # 3 decodes + a 4-token prefill chunk
    k = torch.randn(7, 3, 64, generator=g)
    v = torch.randn(7, 3, 64, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(7), num_decodes=3,
        decode_groups=[DecodeGroup(t1[:2], l1[:2]), DecodeGroup(t1[2:], l1[2:])],
        prefill_query_lens=[4], prefill_context_lens=[20], prefill_block_tables=[t1[2, :2].clone()])
    return q, k, v, kv, meta


def test_paged_attention_dispatches_to_kernel(monkeypatch):
    monkeypatch.delenv(cpu_attention.ENV_VAR, raising=False)
    calls = _spy(monkeypatch)
    q, k, v, kv, meta = _mixed_step()
    out = paged_attention(q, k, v, kv, meta, 0.125)
    assert len(calls) == 2  # one call per decode group
    monkeypatch.setenv(cpu_attention.ENV_VAR, "torch")
    ref = paged_attention(q, k, v, kv, meta, 0.125)
    assert len(calls) == 2  # forced off: the torch path ran
    assert (out - ref).abs().max().item() <= TOL
    assert torch.equal(out[3:], ref[3:])  # prefill rows never take the kernel


def test_forced_torch_path_matches_reference(monkeypatch):
    monkeypatch.setenv(cpu_attention.ENV_VAR, "torch")
    calls = _spy(monkeypatch)
    q, kv, tables, lens = make_case(17, 9, 3, 64, seed=8)
    assert not cpu_attention.supports(q, kv, tables, lens)
    out = attention._decode_attention(q, kv, tables, lens, 0.125)
    assert calls == []
    assert torch.equal(out, _decode_attention_torch(q, kv, tables, lens, 0.125))
    monkeypatch.setenv(cpu_attention.ENV_VAR, "auto")
    assert cpu_attention.supports(q, kv, tables, lens)


def test_unsupported_inputs_take_torch_path(monkeypatch):
    monkeypatch.delenv(cpu_attention.ENV_VAR, raising=False)
    calls = _spy(monkeypatch)
    q, kv, tables, lens = make_case(3, 9, 3, 64, seed=9)
    # fp64, and a non-contiguous cache (a view of a bigger one)
    attention._decode_attention(q.double(), kv.double(), tables, lens, 0.125)
    big = torch.randn(2, 3, kv.shape[2], 16, 128)
    big[..., :64] = kv
    out = attention._decode_attention(q, big[..., :64], tables, lens, 0.125)
    assert calls == []
    assert (out - cpu_attention.paged_decode_attention(q, kv, tables, lens, 0.125)).abs().max().item() <= TOL


def test_failed_build_warns_once_and_falls_back(monkeypatch, caplog):
    monkeypatch.delenv(cpu_attention.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpu_kernels, "_failed", False)
    attempts = []

    def broken_build():
        attempts.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_kernels, "_build", broken_build)
    q, kv, tables, lens = make_case(3, 9, 3, 64, seed=10)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        out = attention._decode_attention(q, kv, tables, lens, 0.125)
        attention._decode_attention(q, kv, tables, lens, 0.125)
        assert not cpu_attention.available()
    assert attempts == [1]
    assert len([r for r in caplog.records if "no compiler here" in r.getMessage()]) == 1
    assert torch.equal(out, _decode_attention_torch(q, kv, tables, lens, 0.125))
