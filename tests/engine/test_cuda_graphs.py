"""Decode steps padded to fixed buckets (pdserve.engine.cuda_graphs): buckets, padding, fallbacks, isolation.

The padded computation runs eagerly on CPU (the stand-in for a graph: the same buffers and padding, no
capture) against the unpadded runner on a tiny checkpoint, with decode attention three ways: the CPU
kernels; the torch path (PDSERVE_CPU_KERNELS=torch: what a CUDA device runs only when
PDSERVE_GPU_ATTENTION=torch forces it); and the Triton kernel, which is what a CUDA device runs by
default (pdserve.model.attention), here in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before triton's first import). None of them is a captured graph: capture and replay
need CUDA (marked gpu), and so does the compiled Triton kernel.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.chunk import Chunk
from pdserve.engine.cuda_graphs import (
    DecodeGraphs,
    batch_buckets,
    is_decode_only,
    num_rows,
    pad_inputs,
    select_bucket,
    split_inputs,
)
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import SamplingParams
from pdserve.model.loader import load

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 4
NUM_BLOCKS = 24  # blocks requests may own: 0..23; the cache has one more, the scratch block
SCRATCH = NUM_BLOCKS
MAX_BLOCKS = 6
# Prompts and their (deliberately scattered) block tables; a table may hold more blocks than are used.
PROMPTS = [[11, 42, 7, 99, 3], [5] * 9, [250, 1], [17, 18, 19, 20], list(range(30, 43))]
TABLES = [[3, 0, 20], [5, 1, 7], [2, 10], [9, 4], [12, 13, 14, 15]]


def decode(token: int, start: int, blocks: list[int], pending_row: int | None = None) -> Chunk:
    return Chunk([token], start, blocks, GREEDY, pending_row=pending_row)


# --- buckets and fallbacks ------------------------------------------------------------------------

def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_select_bucket():
    buckets = [1, 2, 4, 8, 16, 32, 48, 64]
    assert [select_bucket(buckets, n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 33, 48, 49, 64)] == \
        [1, 2, 4, 4, 8, 8, 16, 32, 48, 48, 64, 64]
    assert select_bucket(buckets, 65) is None


def test_fallback_decisions():
    graphs = DecodeGraphs(None, torch.zeros(1, 2, 1, NUM_BLOCKS + 1, BS, 2), BS, SCRATCH, MAX_BLOCKS, [1, 2, 4])
    d = decode(1, 5, [0, 1])
    assert graphs.bucket_for([d]) == 1
    assert graphs.bucket_for([d] * 3) == 4
    assert graphs.bucket_for([d] * 4) == 4
    assert graphs.bucket_for([d] * 5) is None  # more rows than the largest bucket
    assert graphs.bucket_for([]) is None
    prefill = Chunk([1, 2, 3], 0, [0], GREEDY)
    assert graphs.bucket_for([d, prefill]) is None
    one_token_prefill = Chunk([1], 0, [0], None)  # a chunk that ends short of its sequence's end
    assert not is_decode_only([d, one_token_prefill]) and is_decode_only([d, d])
    assert graphs.bucket_for([d, one_token_prefill]) is None
    assert graphs.bucket_for([d], layer_done=lambda i: None) is None
    last = MAX_BLOCKS * BS - 1  # the last position the table covers
    assert graphs.bucket_for([decode(1, last, list(range(MAX_BLOCKS)))]) == 1
    assert graphs.bucket_for([d, decode(1, last + 1, list(range(MAX_BLOCKS + 1)))]) is None


def test_verification_chunks_are_a_row_per_token():
    """A speculative verification (the last token and k drafts) takes k + 1 rows of a bucket; one that asks for
    prompt logprobs or routed experts, or a group's first sampling, runs eagerly."""
    graphs = DecodeGraphs(None, torch.zeros(1, 2, 1, NUM_BLOCKS + 1, BS, 2), BS, SCRATCH, MAX_BLOCKS, [1, 2, 4, 8])
    d = decode(1, 5, [0, 1])
    verify = Chunk([1, 2, 3], 5, [0, 1, 2], GREEDY, draft=(2, 3))
    assert is_decode_only([d, verify]) and num_rows([d, verify]) == 4
    assert graphs.bucket_for([verify]) == 4 and graphs.bucket_for([d, verify]) == 4
    assert graphs.bucket_for([d, verify, verify]) == 8 and graphs.bucket_for([verify] * 3) is None  # 9 rows
    for odd in (verify._replace(routed_experts=True), verify._replace(fanout=2), verify._replace(draft=(2,)),
                verify._replace(prompt_logprobs=(1, [2]))):
        assert not is_decode_only([d, odd]) and graphs.bucket_for([d, odd]) is None
    last = MAX_BLOCKS * BS - 1  # its last draft at the table's last position: served; one past it: not
    assert graphs.bucket_for([verify._replace(start=last - 2, block_ids=list(range(MAX_BLOCKS)))]) == 4
    assert graphs.bucket_for([verify._replace(start=last - 1, block_ids=list(range(MAX_BLOCKS + 1)))]) is None


# --- padding ---------------------------------------------------------------------------------------

def test_pad_inputs_exact():
    chunks = [decode(7, 5, [3, 0, 20]), decode(8, 0, [2, 9]), decode(9, 11, [5, 1, 7, 6])]
    flat = pad_inputs(chunks, 4, 5, BS, SCRATCH)
    ids, pos, slots, ctx, tables = split_inputs(flat, 4, 5)
    s = SCRATCH
    assert ids.tolist() == [7, 8, 9, 0]
    assert pos.tolist() == [5, 0, 11, 0]
    assert slots.tolist() == [0 * BS + 1, 2 * BS + 0, 7 * BS + 3, s * BS]
    assert ctx.tolist() == [6, 1, 12, 1]
    assert tables.tolist() == [[3, 0, s, s, s], [2, s, s, s, s], [5, 1, 7, s, s], [s] * 5]
    assert flat.dtype == torch.int64 and flat.shape == (4 * (4 + 5),)
    assert all(t.is_contiguous() for t in (ids, pos, slots, ctx, tables))
    assert pad_inputs([], 2, 3, BS, s).tolist() == [0, 0, 0, 0, s * BS, s * BS, 1, 1] + [s] * 6


def test_pad_inputs_of_a_verification():
    """Each of a verification's tokens is a row at its own position, writing its own slot and attending up to
    itself; a plain decode after it takes the row after its last."""
    chunks = [Chunk([7, 8, 9], 3, [3, 0, 20], GREEDY, draft=(8, 9)), decode(4, 1, [2])]
    ids, pos, slots, ctx, tables = split_inputs(pad_inputs(chunks, 8, 3, BS, SCRATCH), 8, 3)
    s = SCRATCH
    assert ids.tolist() == [7, 8, 9, 4, 0, 0, 0, 0]
    assert pos.tolist() == [3, 4, 5, 1, 0, 0, 0, 0]
    assert slots.tolist() == [3 * BS + 3, 0 * BS + 0, 0 * BS + 1, 2 * BS + 1] + [s * BS] * 4
    assert ctx.tolist() == [4, 5, 6, 2, 1, 1, 1, 1]
    assert tables.tolist() == [[3, s, s], [3, 0, s], [3, 0, s], [2, s, s]] + [[s] * 3] * 4
    graphs = DecodeGraphs(None, torch.zeros(1, 2, 1, NUM_BLOCKS + 1, BS, 2), BS, SCRATCH, 3, [8])
    previous = torch.tensor([50, 51])
    buf = graphs.prepare([chunks[0], decode(-1, 1, [2], pending_row=1)], previous)
    assert buf.input_ids.tolist()[:4] == [7, 8, 9, 51]  # the pending token is the decode's row, after the drafts


def test_prepare_rewrites_the_whole_bucket_and_reads_pending_tokens():
    graphs = DecodeGraphs(None, torch.zeros(1, 2, 1, NUM_BLOCKS + 1, BS, 2), BS, SCRATCH, MAX_BLOCKS, [1, 2, 4])
    full = [decode(10 + i, 3 * i + 1, [i, i + 4, i + 8]) for i in range(4)]
    buf = graphs.prepare(full)
    assert buf.bucket == 4 and buf.input_ids.tolist() == [10, 11, 12, 13]
    # Three rows in the same bucket: the fourth becomes padding again; rows 0 and 2 read the previous
    # step's sampled rows 5 and 1 on the device (their token_ids hold a placeholder).
    previous = torch.tensor([100, 101, 102, 103, 104, 105])
    step = [decode(-1, 2, [6], pending_row=5), decode(21, 3, [7]), decode(-1, 6, [8, 9], pending_row=1)]
    buf = graphs.prepare(step, previous)
    assert buf is graphs.buffers[4]
    want = pad_inputs(step, 4, MAX_BLOCKS, BS, SCRATCH)
    want[[0, 2]] = torch.tensor([105, 101])
    assert torch.equal(buf.flat, want)
    assert buf.meta.decode_groups[0].block_tables.data_ptr() == buf.block_tables.data_ptr()
    assert buf.meta.slot_mapping.data_ptr() == buf.slot_mapping.data_ptr()
    with pytest.raises(AssertionError, match="previous"):
        graphs.prepare(step)


# --- the padded step on a tiny model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load(EngineConfig(model=str(tiny_checkpoints["llama"]))).model


def prefilled(model) -> tuple[ModelRunner, list[Chunk]]:
    """A runner whose cache holds the prompts' KV, and each prompt's first decode chunk."""
    runner = ModelRunner(model, NUM_BLOCKS + 1, BS)  # the last block is the scratch block
    firsts = []
    for prompt, table in zip(PROMPTS, TABLES):
        res = runner.execute([Chunk(prompt, 0, table, GREEDY)])
        firsts.append(decode(int(res.sampled[0]), len(prompt), table))
    return runner, firsts


@pytest.fixture(params=["cpu-kernels", "torch-ops", "triton"])
def ops(request, monkeypatch):
    """Decode attention by the CPU kernels; by the torch ops everywhere; or by the Triton kernel (as on CUDA)."""
    if request.param != "cpu-kernels":
        monkeypatch.setenv("PDSERVE_CPU_KERNELS", "torch")
    if request.param == "triton":
        triton_decode(monkeypatch)
    return request.param


def triton_decode(monkeypatch) -> list[tuple[int, int]]:
    """Send attention on these CPU tensors to the Triton kernels, in Triton's interpreter, as
    pdserve.model.attention sends CUDA tensors to them; every decode call's (rows, block table width) is
    appended to the list returned."""
    from pdserve.kernels import triton_attention  # imports triton: only the tests that use it pay for it
    from pdserve.model import attention

    if not triton_attention.INTERPRETER:
        pytest.skip("triton was imported without its interpreter (a CUDA machine): the compiled kernel "
                    "runs in the gpu tests' replays")
    calls: list[tuple[int, int]] = []
    kernel = triton_attention.paged_decode_attention

    def counted(q, kv_layer, block_tables, context_lens, scale, out=None):
        calls.append(tuple(block_tables.shape))
        return kernel(q, kv_layer, block_tables, context_lens, scale, out=out)

    monkeypatch.setattr(triton_attention, "paged_decode_attention", counted)
    monkeypatch.setattr(attention, "_gpu_kernels",
                        lambda q, kv_layer: triton_attention if triton_attention.supports(q, kv_layer) else None)
    return calls


def changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Slots (block * BS + offset) whose K or V differs in any layer or head."""
    diff = (before != after).any(-1).any(2).any(1).any(0)  # [blocks, block_size]
    return set(diff.flatten().nonzero().flatten().tolist())


@pytest.mark.parametrize("rows", [3, 5])  # buckets 4 and 8: one and three padding rows
def test_padded_step_gives_the_unpadded_logits(model, ops, rows):
    runner, steps = prefilled(model)
    chunks = steps[:rows]
    graphs = DecodeGraphs(model, runner.kv_cache, BS, SCRATCH, MAX_BLOCKS, batch_buckets(8))
    assert graphs.bucket_for(chunks) == {3: 4, 5: 8}[rows]
    start = runner.kv_cache.clone()
    want = runner.execute(chunks)
    unpadded_cache = runner.kv_cache.clone()
    runner.kv_cache.copy_(start)
    got = graphs.run(chunks)
    assert got.shape == (rows, model.cfg.vocab_size)
    torch.testing.assert_close(got, want.logits, rtol=1e-5, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.sampled)
    # The real rows wrote the same K/V as unpadded; nothing else outside the scratch block changed.
    real = runner.kv_cache[:, :, :, :NUM_BLOCKS]
    torch.testing.assert_close(real, unpadded_cache[:, :, :, :NUM_BLOCKS], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_padding_rows_touch_only_the_scratch_slot(model, ops, rows):
    runner, steps = prefilled(model)
    chunks = steps[:rows]
    graphs = DecodeGraphs(model, runner.kv_cache, BS, SCRATCH, MAX_BLOCKS, [1, 2, 4, 8])
    before = runner.kv_cache.clone()
    assert not before[:, :, :, SCRATCH].any()
    logits = graphs.forward(graphs.prepare(chunks))  # every row, padding included
    real = {c.block_ids[c.start // BS] * BS + c.start % BS for c in chunks}
    padding = {SCRATCH * BS} if graphs.bucket_for(chunks) > rows else set()
    assert changed_slots(before, runner.kv_cache) == real | padding
    assert torch.isfinite(logits).all()


def test_a_padded_verification_gives_the_rows_of_one_token_steps(model, ops):
    """A verification step in a bucket (two requests' last tokens with 3 and 1 drafts, a plain decode, padding):
    each row's logits are those the same token gets decoded alone, one step after another, on an unpadded runner
    (row j of a request attends to the drafts before it, written in the same step)."""
    runner, steps = prefilled(model)
    ref_runner, _ = prefilled(model)
    graphs = DecodeGraphs(model, runner.kv_cache, BS, SCRATCH, MAX_BLOCKS, [4, 8])
    check_verification(graphs, runner, ref_runner, verification_step(steps))
    assert graphs.steps["verify"] == 1


def verification_step(steps: list[Chunk]) -> list[Chunk]:
    """Two requests' last tokens with 3 and 1 drafts, and a plain decode: 7 rows."""
    drafts = [[5, 9, 2], [7]]
    return [Chunk([c.token_ids[0], *d], c.start, c.block_ids, GREEDY, draft=tuple(d))
            for c, d in zip(steps[:2], drafts)] + [steps[2]]


def check_verification(graphs: DecodeGraphs, runner: ModelRunner, ref_runner: ModelRunner, chunks: list[Chunk]):
    """graphs' rows for the step equal each token decoded alone, in turn, on ref_runner; so do the caches."""
    got = graphs.run(chunks)
    assert got.shape == (sum(len(c.token_ids) for c in chunks), graphs.model.cfg.vocab_size)
    want = [ref_runner.execute([decode(token, c.start + j, c.block_ids)]).logits[0]
            for c in chunks for j, token in enumerate(c.token_ids)]
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-4, atol=1e-4)
    real = runner.kv_cache[:, :, :, :NUM_BLOCKS]
    torch.testing.assert_close(real, ref_runner.kv_cache[:, :, :, :NUM_BLOCKS], rtol=1e-4, atol=1e-4)


def test_padding_rows_are_a_one_token_sequence(model, ops):
    """A padding row's logits are those of token 0 alone at position 0: it attends to nothing else."""
    runner, steps = prefilled(model)
    graphs = DecodeGraphs(model, runner.kv_cache, BS, SCRATCH, MAX_BLOCKS, [4])
    logits = graphs.forward(graphs.prepare(steps[:2]))
    alone = runner.execute([Chunk([0], 0, [23], GREEDY)]).logits[0]
    torch.testing.assert_close(logits[2], alone, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(logits[3], alone, rtol=1e-5, atol=1e-4)


def test_successive_steps_reuse_the_buffers(model, ops):
    """Three decode steps through the padded path give the runner's tokens (buffers refilled each step)."""
    runner, steps = prefilled(model)
    ref_runner, ref_steps = prefilled(model)
    graphs = DecodeGraphs(model, runner.kv_cache, BS, SCRATCH, MAX_BLOCKS, [2, 4, 8])
    chunks, ref_chunks = steps[:3], ref_steps[:3]
    for _ in range(3):
        got = graphs.run(chunks).argmax(-1).tolist()
        want = ref_runner.execute(ref_chunks).sampled.tolist()
        assert got == want
        chunks = [decode(t, c.start + 1, c.block_ids) for t, c in zip(got, chunks)]
        ref_chunks = [decode(t, c.start + 1, c.block_ids) for t, c in zip(want, ref_chunks)]


def test_padded_buckets_with_the_triton_kernel_are_token_exact(model, monkeypatch):
    """The padded buckets with decode attention in the Triton kernel (the pairing a CUDA device runs by
    default), step by step as rows join (1, 2, 3, then 5 rows: buckets 1, 2, 4, 8, with one, then three
    padding rows), give the unpadded eager runner's tokens on the torch path; every decode call was the
    kernel's, on the whole padded bucket."""
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "torch")

    def tokens(step_fn, firsts: list[Chunk]) -> list[list[int]]:
        out, chunks, joined = [], [], 0
        for n in (1, 1, 1, 2):  # rows joining at each step (the tables leave room for these steps only)
            chunks += firsts[joined:joined + n]
            joined += n
            out.append(step_fn(chunks))
            chunks = [decode(t, c.start + 1, c.block_ids) for t, c in zip(out[-1], chunks)]
        return out

    ref_runner, ref_steps = prefilled(model)  # the reference: unpadded, eager, torch attention
    want = tokens(lambda chunks: ref_runner.execute(chunks).sampled.tolist(), ref_steps)
    runner, steps = prefilled(model)
    calls = triton_decode(monkeypatch)
    graphs = DecodeGraphs(model, runner.kv_cache, BS, SCRATCH, MAX_BLOCKS, [1, 2, 4, 8])
    buckets = []

    def padded(chunks: list[Chunk]) -> list[int]:
        buckets.append(graphs.bucket_for(chunks))
        return graphs.run(chunks).argmax(-1).tolist()

    assert tokens(padded, steps) == want
    assert buckets == [1, 2, 4, 8]
    assert calls == [(b, MAX_BLOCKS) for b in buckets for _ in range(model.cfg.num_layers)]


def test_capture_needs_cuda(model):
    runner, _ = prefilled(model)
    graphs = DecodeGraphs(model, runner.kv_cache, BS, SCRATCH, MAX_BLOCKS, [1, 2])
    if runner.kv_cache.is_cuda:
        pytest.skip("the cache is on CUDA")
    with pytest.raises(RuntimeError, match="CUDA"):
        graphs.capture()
    assert graphs.captured == []


# --- CUDA: capture and replay ----------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_model(tiny_checkpoints):
    return load(EngineConfig(model=str(tiny_checkpoints["llama"]), device="cuda")).model


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_cuda_replay_equals_eager_padded_and_unpadded(cuda_model, rows):
    runner, steps = prefilled(cuda_model)
    assert runner.kv_cache.is_cuda
    graphs = DecodeGraphs(cuda_model, runner.kv_cache, BS, SCRATCH, MAX_BLOCKS, [1, 2, 4, 8])
    start = runner.kv_cache.clone()
    graphs.capture()
    assert graphs.captured == [1, 2, 4, 8]
    # Capture wrote nothing outside the scratch block.
    assert changed_slots(start, runner.kv_cache) <= {SCRATCH * BS}
    runner.kv_cache.copy_(start)
    chunks = steps[:rows]
    eager = graphs.forward(graphs.prepare(chunks))[:rows].clone()
    eager_cache = runner.kv_cache.clone()
    runner.kv_cache.copy_(start)
    replayed = graphs.run(chunks).clone()
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(runner.kv_cache, eager_cache, rtol=1e-5, atol=1e-4)
    runner.kv_cache.copy_(start)
    unpadded = runner.execute(chunks)
    torch.testing.assert_close(replayed, unpadded.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(replayed.argmax(-1), unpadded.sampled)


@pytest.mark.gpu
@needs_cuda
def test_cuda_replays_follow_new_inputs(cuda_model):
    """Successive replays read the refilled buffers: the graph's tokens equal the runner's for 4 steps,
    rows joining the batch (other buckets) on the way."""
    runner, steps = prefilled(cuda_model)
    ref_runner, ref_steps = prefilled(cuda_model)
    graphs = DecodeGraphs(cuda_model, runner.kv_cache, BS, SCRATCH, MAX_BLOCKS, [1, 2, 4, 8])
    graphs.capture()
    chunks, ref_chunks = steps[:1], ref_steps[:1]
    for step in range(1, 5):  # 1, 2, 3, 4 rows: buckets 1, 2, 4, 4
        got = graphs.run(chunks).argmax(-1).tolist()
        want = ref_runner.execute(ref_chunks).sampled.tolist()
        assert got == want, f"step {step}"
        chunks = [decode(t, c.start + 1, c.block_ids) for t, c in zip(got, chunks)] + steps[step:step + 1]
        ref_chunks = [decode(t, c.start + 1, c.block_ids) for t, c in zip(want, ref_chunks)] + ref_steps[step:step + 1]


@pytest.mark.gpu
@needs_cuda
def test_cuda_replay_of_a_verification_step(cuda_model):
    """A verification step (7 rows) replayed from the 8-row graph: each row the token decoded alone, in turn."""
    runner, steps = prefilled(cuda_model)
    ref_runner, _ = prefilled(cuda_model)
    graphs = DecodeGraphs(cuda_model, runner.kv_cache, BS, SCRATCH, MAX_BLOCKS, [1, 2, 4, 8])
    start = runner.kv_cache.clone()
    graphs.capture()
    runner.kv_cache.copy_(start)
    check_verification(graphs, runner, ref_runner, verification_step(steps))
