"""Tensor-parallel head layouts and the hand-off between a prefill worker of TP A and a decode worker of
TP B (pdserve.tensor_parallel): exact layouts, the errors, and every (A, B) moving exactly the KV each
decode rank owns, each head from a prefill rank that holds it."""
from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.tensor_parallel import HeadTransfer, TPLayout, handoff_plan


def test_layouts_split_or_replicate_kv_heads():
    # 8 query heads, 2 KV heads (GQA 4): TP 1 and 2 split, TP 4 and 8 replicate.
    assert [TPLayout(8, 2, 1).kv_heads(0)] == [[0, 1]]
    assert [TPLayout(8, 2, 2).kv_heads(r) for r in range(2)] == [[0], [1]]
    assert [TPLayout(8, 2, 4).kv_heads(r) for r in range(4)] == [[0], [0], [1], [1]]
    assert [TPLayout(8, 2, 8).kv_heads(r) for r in range(8)] == [[0]] * 4 + [[1]] * 4
    assert [TPLayout(8, 2, t).replication for t in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert list(TPLayout(8, 2, 4).q_heads(3)) == [6, 7] and TPLayout(8, 2, 4).holders(1) == [2, 3]
    # MQA: every rank holds the one KV head.
    assert [TPLayout(8, 1, 4).kv_heads(r) for r in range(4)] == [[0]] * 4
    # SmolLM2-135M's 9 heads and 3 KV heads at TP 3 and 9.
    assert [TPLayout(9, 3, 3).kv_heads(r) for r in range(3)] == [[0], [1], [2]]
    assert [TPLayout(9, 3, 9).kv_heads(r) for r in range(9)] == [[0]] * 3 + [[1]] * 3 + [[2]] * 3


@pytest.mark.parametrize("heads, kv, tp, match", [
    (9, 3, 2, "does not divide the model's 9 attention heads"),
    (12, 4, 6, "neither divides the model's 4 KV heads"),
    (8, 2, 0, ">= 1"),
])
def test_layouts_that_cannot_be_made_are_clear_errors(heads, kv, tp, match):
    with pytest.raises(ValueError, match=match):
        TPLayout(heads, kv, tp)


def test_exact_plans():
    gqa = lambda t: TPLayout(8, 2, t)  # noqa: E731
    assert handoff_plan(gqa(1), gqa(2)) == [HeadTransfer(0, 0, (0,), (0,), (0,)), HeadTransfer(0, 1, (1,), (1,), (0,))]
    # Prefill TP 4 (heads replicated on ranks 0-1 and 2-3) to decode TP 1: one head from each half.
    assert handoff_plan(gqa(4), gqa(1)) == [HeadTransfer(0, 0, (0,), (0,), (0,)), HeadTransfer(2, 0, (1,), (0,), (1,))]
    # Decode TP 4 replicates: each replica receives its head, once each.
    assert [(t.src_rank, t.dst_rank, t.kv_heads) for t in handoff_plan(gqa(1), gqa(4))] == \
        [(0, 0, (0,)), (0, 1, (0,)), (0, 2, (1,)), (0, 3, (1,))]
    # Equal layouts: every rank from its own counterpart, nothing through rank 0.
    assert [(t.src_rank, t.dst_rank) for t in handoff_plan(gqa(4), gqa(4))] == [(0, 0), (1, 1), (2, 2), (3, 3)]


SHAPES = [(8, 2), (8, 1), (8, 8)]


@pytest.mark.parametrize("heads, kv", SHAPES)
def test_every_prefill_decode_pair_moves_exactly_each_decode_ranks_kv(heads, kv):
    """For every (A, B) the model allows: applying the plan to per-rank caches cut from one full cache
    fills each decode rank's cache with exactly its heads, each sent by a rank that holds it; with more
    than one prefill rank holding what a decode rank needs, more than one rank sends."""
    layers, blocks, bs, dim = 2, 3, 4, 5
    full = torch.randn(layers, 2, kv, blocks, bs, dim, generator=torch.Generator().manual_seed(heads * kv))
    sizes = [t for t in (1, 2, 4, 8) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    for a, b in itertools.product(sizes, sizes):
        pre, dec = TPLayout(heads, kv, a), TPLayout(heads, kv, b)
        src = [full[:, :, pre.kv_heads(r)] for r in range(a)]
        dst = [torch.zeros_like(full[:, :, dec.kv_heads(r)]) for r in range(b)]
        plan = handoff_plan(pre, dec)
        for t in plan:
            assert set(t.kv_heads) <= set(pre.kv_heads(t.src_rank)) and set(t.kv_heads) <= set(dec.kv_heads(t.dst_rank))
            dst[t.dst_rank][:, :, list(t.dst_index)] = src[t.src_rank][:, :, list(t.src_index)]
        for r in range(b):
            assert torch.equal(dst[r], full[:, :, dec.kv_heads(r)]), (a, b, r)
        received = [h for t in plan for h in t.kv_heads]
        assert len(received) == sum(len(dec.kv_heads(r)) for r in range(b))  # each needed head once per rank
        senders = {t.src_rank for t in plan}
        needed = {h for r in range(b) for h in dec.kv_heads(r)}
        distinct_holders = {tuple(pre.holders(h)) for h in needed}
        assert len(senders) >= min(len(distinct_holders), a), (a, b, senders)


def test_the_two_sides_must_serve_one_model():
    with pytest.raises(ValueError, match="same model"):
        handoff_plan(TPLayout(8, 2, 2), TPLayout(8, 4, 2))
