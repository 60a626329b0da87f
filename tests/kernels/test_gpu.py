"""The CUDA path of the offline engine and of the KV-transfer helpers, on tiny seeded checkpoints.

Every test needs a CUDA device and is skipped without one (CI has none). CPU fp32 is the reference:
CUDA fp32 must give the same greedy tokens (TF32 stays off, torch's default for matmuls); CUDA bf16 is
reported (match rate printed, run with -s) and only its first token per prompt is required to match.
Two workers on one GPU: a PairChannel between two processes, and the hand-off (KVPusher -> KVIntake) in
one process, both staged through host memory over gloo (NCCL refuses two ranks on one GPU).
"""
from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.transfer.channel import extract_blocks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ARCHS = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3"]
PROMPT_LENS = [5, 17, 33, 8, 1]
NEW_TOKENS = 32


def prompts(vocab: int, lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def engine(path, device: str, dtype: str = "float32", prefix_caching: bool = True, budget: int = 16,
           fast_path: bool | None = None) -> LLMEngine:
    # Small blocks and a small token budget: prompts span several blocks, prefills are chunked and
    # share steps with decodes (the same shape as tests/model/test_model_parity.py). fast_path None: the
    # device's defaults (on CUDA: CUDA graphs and pipelined decode); False: both off.
    return LLMEngine(EngineConfig(
        model=str(path), dtype=dtype, device=device, cuda_graphs=fast_path, pipelined_decode=fast_path,
        cache=CacheConfig(block_size=4, num_blocks=128, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
    ))


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def tokens(eng: LLMEngine, batch, params) -> list[list[int]]:
    return [c.token_ids for c in eng.generate(batch, params)]


@pytest.fixture
def no_cpu_kernel(monkeypatch):
    """A CUDA engine must never build, load or call the CPU kernels (attention, linear, layer ops): every
    use of them asks pdserve.kernels.cpu_kernels.available() first."""
    from pdserve.kernels import cpu_kernels

    def refuse():
        raise AssertionError("the CPU kernels were asked for by a CUDA run")
    monkeypatch.setattr(cpu_kernels, "available", refuse)


def cpu_reference(path, batch, params, monkeypatch) -> list[list[int]]:
    """CPU fp32 tokens on the torch paths (the no_cpu_kernel guard stays meaningful for the CUDA run
    before it; the torch paths are the reference the C++ kernels are tested against)."""
    from pdserve.kernels import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    return tokens(engine(path, "cpu"), batch, params)


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_fp32_greedy_tokens_equal_cpu_fp32(tiny_checkpoints, arch, no_cpu_kernel, monkeypatch):
    path = tiny_checkpoints[arch]
    gpu = engine(path, "cuda")
    assert gpu.runner.kv_cache.is_cuda and gpu.runner.kv_cache.dtype == torch.float32
    batch = prompts(gpu.model_config.vocab_size)
    ours = tokens(gpu, batch, greedy())
    ref = cpu_reference(path, batch, greedy(), monkeypatch)
    assert ours == ref
    assert gpu.pool.num_used_blocks == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_bf16_greedy_vs_cpu_fp32(tiny_checkpoints, arch, no_cpu_kernel, monkeypatch):
    path = tiny_checkpoints[arch]
    gpu = engine(path, "cuda", "bfloat16")
    assert gpu.runner.kv_cache.dtype == torch.bfloat16
    batch = prompts(gpu.model_config.vocab_size)
    ours = tokens(gpu, batch, greedy())
    ref = cpu_reference(path, batch, greedy(), monkeypatch)
    same = sum(a == b for x, y in zip(ours, ref) for a, b in zip(x, y))
    first_div = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, ref)]
    print(f"\n[bf16 vs fp32 {arch}] positional match {same}/{NEW_TOKENS * len(batch)}; first divergence {first_div}")
    assert all(len(x) == NEW_TOKENS for x in ours)
    assert [x[0] for x in ours] == [y[0] for y in ref]


def test_cuda_seeded_sampling_is_reproducible_and_batch_independent(tiny_checkpoints, no_cpu_kernel):
    eng = engine(tiny_checkpoints["llama"], "cuda")
    batch = prompts(eng.model_config.vocab_size)
    p = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, seed=1234, ignore_eos=True)
    alone = tokens(eng, [batch[2]], p)[0]
    again = tokens(eng, [batch[2]], p)[0]
    # In a batch with greedy and differently seeded rows: the same tokens (noise is per request and index).
    mixed = [greedy(24), SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True), p,
             SamplingParams(max_tokens=24, temperature=1.3, top_p=0.5, seed=99, ignore_eos=True), greedy(24)]
    in_batch = [c.token_ids for c in eng.generate(batch, mixed)]
    other_seed = tokens(eng, [batch[2]], SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9,
                                                         seed=4321, ignore_eos=True))[0]
    vocab = eng.model_config.vocab_size
    assert alone == again == in_batch[2]
    assert other_seed != alone
    assert all(0 <= t < vocab for row in in_batch for t in row)
    assert in_batch[0] == tokens(eng, [batch[0]], greedy(24))[0]


def test_cuda_prefix_reuse_gives_the_same_tokens(tiny_checkpoints, no_cpu_kernel):
    path = tiny_checkpoints["llama"]
    cached = engine(path, "cuda")
    fresh = engine(path, "cuda", prefix_caching=False)
    base = prompts(cached.model_config.vocab_size, lens=[37])[0]
    longer = base + prompts(cached.model_config.vocab_size, lens=[11], seed=2)[0]
    first = tokens(cached, [base], greedy())
    hits = cached.pool.prefix_hits
    second = tokens(cached, [longer], greedy())
    assert cached.pool.prefix_hits > hits, "the second prompt reused no cached block"
    assert first == tokens(fresh, [base], greedy())
    assert second == tokens(fresh, [longer], greedy())
    # The same prompt again: all but the last partial block comes from the cache.
    assert tokens(cached, [longer], greedy()) == second
    cached.pool.check_integrity()


def _cache(device: str, dtype: torch.dtype, num_blocks: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(num_blocks)
    return torch.randn(2, 2, 2, num_blocks, 4, 8, generator=g).to(device=device, dtype=dtype)


def test_cuda_fast_path_gives_the_eager_plain_tokens(tiny_checkpoints, no_cpu_kernel):
    """CUDA graphs (captured at start-up) and pipelined decode, the CUDA defaults, against both off on the
    same GPU: the same greedy and seeded tokens, fp32; the graphs were replayed; no block left used."""
    path = tiny_checkpoints["llama"]
    batch = prompts(320)
    seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=3, ignore_eos=True)
    fast, eager = engine(path, "cuda"), engine(path, "cuda", fast_path=False)
    assert fast.core.pipelined and fast.runner.graphs is not None and fast.runner.graphs.captured
    assert not eager.core.pipelined and eager.runner.graphs is None
    replays = []
    run = fast.runner.graphs.run
    fast.runner.graphs.run = lambda chunks, previous=None: replays.append(len(chunks)) or run(chunks, previous)
    for params in (greedy(), seeded):
        assert tokens(fast, batch, params) == tokens(eager, batch, params)
    assert replays and fast.pool.num_used_blocks == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_extract_insert_blocks_round_trip(dtype):
    from pdserve.transfer.channel import extract_blocks, insert_blocks

    src, dst = _cache("cuda", dtype), torch.zeros(2, 2, 2, 12, 4, 8, device="cuda", dtype=dtype)
    src_ids, dst_ids = [5, 0, 11, 3], [7, 2, 9, 0]
    data = extract_blocks(src, src_ids)
    assert data.is_cuda and data.is_contiguous() and data.shape == (2, 2, 2, 4, 4, 8)
    insert_blocks(dst, dst_ids, data)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[:, :, :, d], src[:, :, :, s])
    untouched = [b for b in range(12) if b not in dst_ids]
    assert not dst[:, :, :, untouched].any()
    with pytest.raises(ValueError, match="cuda"):
        insert_blocks(dst, dst_ids, data.cpu())


# --- same GPU: a PairChannel of two ranks on one GPU stages through host memory over gloo ----------

STAGED_TIMEOUT_S = 30.0  # a spawned process imports torch and initialises CUDA before its rendezvous


def _staged_plan() -> list[tuple[int, list[int], torch.dtype]]:
    """(transfer id, source blocks, dtype) of each transfer; the receiver knows the plan beforehand."""
    return [(1, [5, 0, 11], torch.float32), (2, [3], torch.bfloat16), (3, [7, 2, 9, 1], torch.bfloat16)]


def _staged_send(port: int, results, device: str) -> None:
    """Rank 0 (the prefill side), run in its own process. Transfer 3 goes in parts (one per layer)."""
    from pdserve.transfer.channel import PairChannel

    try:
        results.put(("ready",))
        with PairChannel("127.0.0.1", port, "p0", "d0", 0, STAGED_TIMEOUT_S, device) as ch:
            for transfer_id, src, dtype in _staged_plan():
                data = extract_blocks(_cache(device, dtype), src)
                if transfer_id == 3:
                    ch.send_parts(transfer_id, (data[layer].contiguous() for layer in range(data.shape[0])),
                                  data.numel())
                else:
                    ch.send(transfer_id, data)
            results.put(("done", ch.staged, ch.backend, ch.stats.snapshot()))
    except Exception as e:  # noqa: BLE001 - reported to the test process
        results.put(("error", f"{type(e).__name__}: {e}"))


def staged_round_trip(device: str) -> None:
    """The test process is rank 1 (the decode side, StoreServer); a spawned process is rank 0. device names
    its index ("cuda:0"), as a worker's does (its cache's device): a channel takes tensors of its device only."""
    import multiprocessing as mp

    from pdserve.transfer.channel import PairChannel, StoreServer

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with StoreServer() as server:
        proc = ctx.Process(target=_staged_send, args=(server.port, results, device), daemon=True)
        proc.start()
        try:
            assert results.get(timeout=STAGED_TIMEOUT_S) == ("ready",)
            with PairChannel(server.host, server.port, "p0", "d0", 1, STAGED_TIMEOUT_S, device) as ch:
                on_gpu = torch.device(device).type == "cuda"
                assert ch.staged is on_gpu and ch.backend == "gloo"
                for transfer_id, src, dtype in _staged_plan():
                    want = extract_blocks(_cache(device, dtype), src)
                    if transfer_id == 3:
                        buf = torch.empty(want.shape[1:], dtype=dtype, device=device)  # reused for every layer
                        got = [p.clone() for p in ch.recv_parts(transfer_id, [buf] * want.shape[0], want.numel())]
                        assert all(p.device == torch.device(device) for p in got)
                        got = torch.stack(got)
                    else:
                        got = ch.recv(transfer_id, want.shape, dtype)
                    assert got.device == torch.device(device) and got.dtype == dtype
                    assert torch.equal(got.cpu(), want.cpu()), f"transfer {transfer_id} differs"
                msg = results.get(timeout=STAGED_TIMEOUT_S)
                assert msg[0] == "done", msg
                _, sender_staged, sender_backend, sent = msg
                assert (sender_staged, sender_backend) == (on_gpu, "gloo")
                assert sent["transfers"] == ch.stats.transfers == 3 and sent["failures"] == 0
                assert sent["bytes"] == ch.stats.bytes
            proc.join(STAGED_TIMEOUT_S)
            assert proc.exitcode == 0
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(STAGED_TIMEOUT_S)


@pytest.mark.timeout(90)
def test_cuda_same_gpu_pair_channel_stages_through_host_between_processes():
    staged_round_trip("cuda:0")


# --- the hand-off (pdserve.transfer.sender, .receiver) with CUDA caches, both ranks in this process on one GPU

def handoff_round_trip(device: str) -> None:
    """A KVPusher and a KVIntake joined as two workers would be (tests/transfer/test_handoff.py's Pair, on a GPU):
    two channels of one pair, built by two threads at once, both on this process's GPU, so staged."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.transfer.channel import RECEIVER_RANK, SENDER_RANK, PairChannel, StoreServer
    from pdserve.transfer.receiver import InboundTable, KVIntake
    from pdserve.transfer.sender import KVPusher, PushJob

    from conftest import wait_for

    layers, timeout_s = 5, 20.0
    g = torch.Generator().manual_seed(1)
    src = torch.randn(layers, 2, 2, 24, 4, 8, generator=g).to(device=device, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    table, events, lock, channels = InboundTable(), [], threading.Lock(), []

    def record(*event) -> None:
        with lock:
            events.append(event)

    def of(kind: str) -> list[tuple]:
        with lock:
            return [e for e in events if e[0] == kind]

    store = StoreServer("127.0.0.1")
    intake = KVIntake("p0", "d0", dst, table, timeout_s, landed=lambda rid, tok, at, v: record("landed", rid, tok),
                      failed=lambda rid, err: record("failed", rid, err), cancelled=lambda rid: record("cancelled", rid))

    def open_pair(generation: int) -> PairChannel:
        def receiver() -> None:
            ch = PairChannel(store.host, store.port, "p0", "d0", RECEIVER_RANK, timeout_s, device, generation=generation)
            channels.append(ch)
            intake.install(ch, generation)

        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(receiver)
            ch = PairChannel(store.host, store.port, "p0", "d0", SENDER_RANK, timeout_s, device, generation=generation)
            fut.result(timeout_s)
        channels.append(ch)
        return ch

    pusher = KVPusher("p0", "d0", src, open_pair, intake.announce, done=lambda job, err: record("done", err),
                      min_part_bytes=1)
    try:
        table.publish("a", [10, 11])
        table.publish("b", [3])
        job = PushJob("d0", ["a", "b"], [[0, 1], [5]], layers)  # layer by layer, as a prefill step computes
        pusher.push(job)
        for layer in range(layers):
            src[layer] += 1  # "computed" on the current stream before the layer is reported done
            job.layer_done(layer)
        job.sampled([42, 7])
        table.publish("c", [20])
        pusher.push(PushJob("d0", ["c"], [[23]], layers, layers, [9], None))  # HELD KV: one part
        wait_for(lambda: len(of("landed")) == 3, timeout_s, what="three requests to land")
        assert [e[1:] for e in of("landed")] == [("a", (42,)), ("b", (7,)), ("c", (9,))]
        assert of("done") == [("done", None)] * 2 and not of("failed")
        on_gpu = torch.device(device).type == "cuda"
        if on_gpu:
            torch.cuda.synchronize()
        assert torch.equal(dst[:, :, :, [10, 11, 3, 20]].cpu(), src[:, :, :, [0, 1, 5, 23]].cpu())
        assert len(channels) == 2 and all(ch.staged is on_gpu for ch in channels)
    finally:
        pusher.stop()
        intake.stop()
        store.close()


@pytest.mark.timeout(60)
def test_cuda_handoff_pushes_layer_by_layer_on_one_gpu():
    handoff_round_trip("cuda:0")


def test_cuda_dispatch_uses_the_triton_kernels(monkeypatch):
    """On CUDA, decode and prefill over a cached prefix take pdserve.kernels.triton_attention's kernels (compiled
    here; tests/kernels/test_triton_attention.py runs them in the interpreter on CPU), within fp32 tolerance of
    the torch path; PDSERVE_GPU_ATTENTION=torch turns them off."""
    from test_triton_attention import DECODE_LENS, DEVICE, FP32_TOL, make_cache, max_err, prefill_case

    from pdserve.kernels import triton_attention
    from pdserve.model import attention
    from pdserve.model.attention import _decode_attention_torch, _prefill_attention_torch

    calls = []

    def spy(name):
        real = getattr(triton_attention, name)
        return lambda *a, **k: calls.append(name) or real(*a, **k)

    for name in ("paged_decode_attention", "prefill_attention"):
        monkeypatch.setattr(triton_attention, name, spy(name))
    kv, tables = make_cache(2, 64, 16, DECODE_LENS, seed=8)
    lens = torch.tensor(DECODE_LENS, device=DEVICE)
    q = torch.randn(len(DECODE_LENS), 8, 64, device=DEVICE)
    ref = _decode_attention_torch(q, kv, tables, lens, 0.125)
    assert max_err(attention._decode_attention(q, kv, tables, lens, 0.125), ref) <= FP32_TOL
    pq, k_new, v_new, pkv, blocks = prefill_case(37, 150, 8, 2, 64, 16, seed=9)
    out = attention._prefill_attention(pq, k_new, v_new, pkv, blocks, 150, 0.125)
    assert max_err(out, _prefill_attention_torch(pq, k_new, v_new, pkv, blocks, 150, 0.125)) <= FP32_TOL
    assert calls == ["paged_decode_attention", "prefill_attention"]
    monkeypatch.setenv(attention.GPU_ENV_VAR, "torch")
    assert torch.equal(attention._decode_attention(q, kv, tables, lens, 0.125), ref)  # forced off: the torch path
    assert len(calls) == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
def test_tp2_over_nccl_gives_the_cpu_tokens(tmp_path):
    """Tensor parallelism on CUDA: two ranks on two GPUs, NCCL for the model's collectives and a gloo
    group beside it for each step's inputs: the same greedy tokens as one rank on the CPU. (Never run:
    no machine with two GPUs has been lent.)"""
    from conftest import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "gqa", "llama", num_attention_heads=8, num_key_value_heads=2)
    config = lambda device, tp: EngineConfig(model=str(path), device=device, tensor_parallel_size=tp,  # noqa: E731
                                             cache=CacheConfig(block_size=4, num_blocks=128),
                                             scheduler=SchedulerConfig(max_num_batched_tokens=32))
    batch = prompts(320)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLMEngine(config("cpu", 1)) as cpu, LLMEngine(config("cuda", 2)) as gpu:
        assert [c.token_ids for c in gpu.generate(batch, greedy)] == [c.token_ids for c in cpu.generate(batch, greedy)]
