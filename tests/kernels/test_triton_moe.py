"""The fused mixture-of-experts kernels (pdserve.kernels.triton_moe) against a torch reference and against
pdserve.model.moe.MoE itself.

Without CUDA they run in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports triton); where CUDA is available the same tests run the compiled kernels on the GPU, and
the gpu-marked test at the end runs a model-sized block there. As in tests/kernels/test_triton_attention.py,
a process that imported triton without the interpreter and has no CUDA fails at import rather than skip.
Shapes are small (H 70, I 44: neither a multiple of the 16-wide blocks, so every edge is masked) to keep the
interpreter at well under a second a case.

The reference (`reference`) is the experts' loop of MoE.forward in fp64 with the routing given: each
expert's tokens found with nonzero, not by the kernels' sort.

Tolerances:
- fp32: 1e-5 of the largest output (fp32 sums in another order than fp64: ~1e-7 here).
- bf16 against fp64 arithmetic on the same bf16 values, per element: the kernels round h (the
  intermediate) to bf16 and the output once, so |error| <= u * mag + 2**-8 * |ref| + 1e-5, where mag is
  sum over the token's slots of |w| * |down| @ |h| (what h's rounding can move) and u is 2**-8 (rounded to
  nearest, on the GPU) or 2**-7 (the interpreter's fp32 -> bf16 conversion truncates, triton 3.9). The
  output is rounded by torch, to nearest, in both.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.config import ModelConfig
from pdserve.kernels import triton_moe
from pdserve.model.moe import MoE

from conftest import triton_device

DEVICE = triton_device(triton_moe.INTERPRETER)

pytestmark = pytest.mark.triton

E, H, I = 8, 70, 44
SMALL = dict(block_m=16, block_n=16, block_k=16)
FP32_TOL = 1e-5  # of the largest output
# Skewed routing: expert 3 takes most slots, 0, 5, 6 and 7 a few, 1, 2 and 4 none.
SKEW = torch.tensor([0.03, 0.0, 0.0, 0.88, 0.0, 0.03, 0.03, 0.03])


def experts(hidden=H, inter=I, num_experts=E, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5
    return gate_up.to(DEVICE), down.to(DEVICE)


def routing(tokens, k, skewed, num_experts=E, seed=0):
    """ids [tokens, k] (k distinct experts a token, as top-k gives) and weights [tokens, k] summing to 1."""
    g = torch.Generator().manual_seed(seed)
    probs = SKEW if skewed else torch.ones(num_experts)
    ids = torch.multinomial(probs.expand(tokens, -1), k, replacement=False, generator=g)
    weights = torch.rand(tokens, k, generator=g) + 0.1
    return (weights / weights.sum(1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def reference(x, gate_up, down, weights, ids):
    """(output, mag) in fp64: MoE.forward's experts with this routing; mag as in the module docstring."""
    x, gate_up, down, weights = (t.double() for t in (x, gate_up, down, weights))
    inter = down.shape[2]
    out, mag = torch.zeros_like(x), torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, choice = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        a = x[token] @ gate_up[e].T
        h = F.silu(a[:, :inter]) * a[:, inter:]
        w = weights[token, choice][:, None]
        out.index_add_(0, token, w * (h @ down[e].T))
        mag.index_add_(0, token, w.abs() * (h.abs() @ down[e].abs().T))
    return out, mag


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def bf16_excess(out, ref, mag):
    """The largest error over its bound (<= 1 passes)."""
    u = 2 ** -7 if triton_moe.INTERPRETER else 2 ** -8
    bound = u * mag + 2 ** -8 * ref.abs() + 1e-5
    return ((out.double() - ref).abs() / bound).max().item()


# --- align_by_expert ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,k,skewed", [(1, 1, False), (1, 4, True), (37, 1, True), (37, 2, False),
                                             (37, 4, True), (200, 2, True)])
def test_align_by_expert_puts_every_slot_once_in_its_experts_blocks(tokens, k, skewed):
    weights, ids = routing(tokens, k, skewed)
    block_m = 16
    slots, block_expert, used = triton_moe.align_by_expert(ids, E, block_m)
    n = tokens * k
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=E)
    blocks = -(-counts // block_m)
    max_blocks = (n + min(E, n) * (block_m - 1)) // block_m
    assert slots.dtype == block_expert.dtype == torch.int32 and slots.device == ids.device
    assert slots.shape == (max_blocks * block_m,) and block_expert.shape == (max_blocks,)
    assert int(used) == int(blocks.sum()) <= max_blocks

    slots, block_expert = slots.cpu().long(), block_expert.cpu().long()
    real = slots < n
    assert sorted(slots[real].tolist()) == list(range(n)) and (slots[~real] == n).all()  # each slot once
    expected = torch.repeat_interleave(torch.arange(E), blocks)
    assert block_expert[:int(used)].tolist() == expected.tolist() and (block_expert[int(used):] == -1).all()
    row_expert = block_expert.repeat_interleave(block_m)
    assert (ids.reshape(-1).cpu()[slots[real]] == row_expert[real]).all()  # each row in its expert's block
    for e in range(E):  # an expert's slots first in its blocks, ascending, then its padding
        mine = slots[row_expert == e]
        assert mine[:counts[e]].tolist() == sorted(mine[:counts[e]].tolist()) and (mine[counts[e]:] == n).all()


def test_skewed_routing_leaves_experts_empty_and_fills_one_past_a_block():
    """The routing the kernel tests below call skewed is: experts with no token, one with several blocks."""
    counts = torch.bincount(routing(37, 1, True)[1].reshape(-1).cpu(), minlength=E)
    assert (counts == 0).sum() >= 3 and counts.max() > 2 * 16


# --- fp32 -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("skewed", [False, True], ids=["even", "skewed"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 37])
def test_fp32_matches_reference(tokens, k, skewed):
    gate_up, down = experts(seed=tokens + k)
    weights, ids = routing(tokens, k, skewed, seed=tokens * k)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(k)).to(DEVICE)
    out = triton_moe.fused_moe(x, gate_up, down, weights, ids, **SMALL)
    ref, _ = reference(x, gate_up, down, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    assert rel_err(out, ref) <= FP32_TOL


@pytest.mark.parametrize("hidden,inter", [(64, 48), (16, 16), (100, 20)])
def test_fp32_other_sizes(hidden, inter):
    """Sizes that are multiples of the blocks, one block each, and I a little over one block."""
    gate_up, down = experts(hidden, inter, seed=hidden)
    weights, ids = routing(37, 2, True, seed=hidden)
    x = torch.randn(37, hidden, generator=torch.Generator().manual_seed(inter)).to(DEVICE)
    out = triton_moe.fused_moe(x, gate_up, down, weights, ids, **SMALL)
    assert rel_err(out, reference(x, gate_up, down, weights, ids)[0]) <= FP32_TOL


def test_default_and_wider_blocks():
    """The default block sizes (block_m from the routing's shape, 64 x 32 tiles) and block_m 32, n 32, k 64."""
    gate_up, down = experts(seed=3)
    weights, ids = routing(37, 4, True, seed=3)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref, _ = reference(x, gate_up, down, weights, ids)
    assert rel_err(triton_moe.fused_moe(x, gate_up, down, weights, ids), ref) <= FP32_TOL
    out = triton_moe.fused_moe(x, gate_up, down, weights, ids, block_m=32, block_n=32, block_k=64)
    assert rel_err(out, ref) <= FP32_TOL


def test_strided_inputs():
    """Strides come from the tensors: x a column slice, gate_up and down transposed copies seen as views,
    int32 ids."""
    gate_up, down = experts(seed=4)
    weights, ids = routing(37, 2, False, seed=4)
    x = torch.randn(37, 2 * H, generator=torch.Generator().manual_seed(4)).to(DEVICE)[:, ::2]
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)  # H-major: hidden not contiguous
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    out = triton_moe.fused_moe(x, gate_up_t, down_t, weights, ids.int(), **SMALL)
    assert rel_err(out, reference(x, gate_up, down, weights, ids)[0]) <= FP32_TOL


@pytest.mark.parametrize("renormalize", [True, False])
def test_equals_the_moe_block(renormalize, monkeypatch):
    """pdserve.model.moe.MoE's forward (the torch path) against the kernels given its route(x)."""
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "torch")
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=32, hidden_size=H, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64, num_experts=E,
                      num_experts_per_tok=2, moe_intermediate_size=I, norm_topk_prob=renormalize, moe_layers=(0,))
    moe = MoE(cfg).to(DEVICE)
    gate_up, down = experts(seed=5)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(5)))
        moe.experts.gate_up_proj.copy_(gate_up)
        moe.experts.down_proj.copy_(down)
        x = torch.randn(37, H, generator=torch.Generator().manual_seed(6)).to(DEVICE)
        weights, ids = moe.route(x)
        out = triton_moe.fused_moe(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids, **SMALL)
        ref = moe(x)
    assert rel_err(out, ref.double()) <= FP32_TOL


def test_no_tokens():
    gate_up, down = experts()
    x = torch.empty(0, H, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    out = triton_moe.fused_moe(x, gate_up, down, torch.empty(0, 2, device=DEVICE), ids, **SMALL)
    assert out.shape == (0, H)


# --- bf16 -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,k,skewed", [(1, 2, False), (37, 1, True), (37, 4, True)])
def test_bf16_matches_fp64_math_on_the_same_values(tokens, k, skewed):
    gate_up, down = (t.bfloat16() for t in experts(seed=7))
    weights, ids = routing(tokens, k, skewed, seed=7)
    weights = weights.bfloat16()  # route() gives the weights in x's dtype
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(7)).to(DEVICE).bfloat16()
    out = triton_moe.fused_moe(x, gate_up, down, weights, ids, **SMALL)
    assert out.dtype == torch.bfloat16
    ref, mag = reference(x, gate_up, down, weights, ids)
    assert bf16_excess(out, ref, mag) <= 1


def test_fp16():
    gate_up, down = (t.half() for t in experts(seed=8))
    weights, ids = routing(37, 2, True, seed=8)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(8)).to(DEVICE).half()
    out = triton_moe.fused_moe(x, gate_up, down, weights.half(), ids, **SMALL)
    ref, mag = reference(x, gate_up, down, weights.half(), ids)
    u = 2 ** -11  # fp16 rounds to nearest on both
    assert out.dtype == torch.float16
    assert ((out.double() - ref).abs() <= u * mag + u * ref.abs() + 1e-5).all()


def test_supports():
    gate_up, down = experts()
    x = torch.randn(3, H, device=DEVICE)
    assert triton_moe.supports(x, gate_up, down)
    assert not triton_moe.supports(x.bfloat16(), gate_up, down)  # mixed dtypes
    assert not triton_moe.supports(x.double(), gate_up.double(), down.double())
    with pytest.raises(AssertionError, match="powers of two"):
        triton_moe.fused_moe(x, gate_up, down, *routing(3, 2, False), block_m=24)


# --- a model-sized block on the GPU ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or triton_moe.INTERPRETER,
                    reason="needs a CUDA device, the kernels compiled")
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_cuda_model_sized_block(tokens):
    """Qwen3-30B-A3B's expert shapes (H 2048, I 768, k 8) with 64 experts, the default block sizes, compiled:
    fp32 within FP32_TOL of the reference, bf16 within its bound."""
    hidden, inter, num_experts, k = 2048, 768, 64, 8
    gate_up, down = experts(hidden, inter, num_experts, seed=9)
    weights, ids = routing(tokens, k, False, num_experts=num_experts, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    ref, _ = reference(x, gate_up, down, weights, ids)
    assert rel_err(triton_moe.fused_moe(x, gate_up, down, weights, ids), ref) <= FP32_TOL
    x16, gate_up16, down16, weights16 = x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), weights.bfloat16()
    out = triton_moe.fused_moe(x16, gate_up16, down16, weights16, ids)
    ref, mag = reference(x16, gate_up16, down16, weights16, ids)
    assert bf16_excess(out, ref, mag) <= 1
