"""KV transfer over a gloo PairChannel between two Ray actors vs an in-process copy of the same bytes,
then the whole prefill -> decode hand-off of real workers.

    .venv/bin/python -m bench.cluster.kv_transfer [--reps 20] [--warmup 2] [--tokens 16 256 2048] [--extra-mb 64]
                                                  [--handoff-tokens 128 512 2048] [--handoff-reps 5] [--no-handoff]

Payloads are the KV blocks of --tokens tokens of SmolLM2-135M (30 layers, 3 KV heads, head_dim 64,
fp32, 16-token blocks, so whole blocks move), plus one flat payload of --extra-mb MiB. A local Ray
cluster bound to 127.0.0.1 runs two actors: the decode side (StoreServer, rank 1, receives) and the
prefill side (rank 0, sends). A transfer's time is what the receiver waits for one recv_into, header
included; the baseline is `dst.copy_(src)` into a preallocated tensor inside the receiving actor.
Each figure is the median of --reps repetitions, after a sweep of --warmup unrecorded ones per
payload. The checksum column is pdserve.transfer.protocol.KVMac of the payload in the receiving actor; a
transfer computes it on both ends, so its cost is twice that, shown as a share of the gloo time.
Prints one table.

Hand-off table: a real prefill worker and decode worker (the cluster's actors, SmolLM2, one torch
thread each) serve one request at a time of --handoff-tokens prompt tokens and 2 output tokens. The
decode worker reserves room before the prefill starts (the router reserves once the prefill worker has
admitted the prompt: for a lone prompt that reservation reaches it a round trip into the forward), so
the KV is pushed during the prefill step; each length is also run with the push held to the end of the forward (the
whole KV at once), and layer-wise with the KV checksum (--kv-checksum). Hand-off = first token
sampled on the prefill worker -> KV usable on the decode
worker (the decode worker's pdserve_kv_handoff_seconds); prefill step = the prefill worker's busy time
for the request. Medians of --handoff-reps requests after one warm-up each.
"""
from __future__ import annotations

import asyncio
import statistics
import threading
import time

import ray
import torch

from bench.common import Table, parser
from pdserve.transfer.channel import PairChannel, StoreServer

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16  # SmolLM2-135M
TIMEOUT_S = 120.0


@ray.remote(num_cpus=0.5)  # fractional: two whole-CPU actors can stay pending on a 2-core machine
class Endpoint:
    def __init__(self) -> None:
        self.server: StoreServer | None = None
        self.channel: PairChannel | None = None
        self.next_id = 0

    def serve_store(self) -> int:
        self.server = StoreServer()
        return self.server.port

    def open(self, port: int, rank: int) -> float:
        start = time.perf_counter()
        self.channel = PairChannel("127.0.0.1", port, "prefill0", "decode0", rank, TIMEOUT_S)
        return time.perf_counter() - start

    def send(self, shape: tuple[int, ...], count: int) -> None:
        assert self.channel is not None
        data = torch.randn(shape)
        for _ in range(count):
            self.channel.send(self._take_id(), data)

    def recv(self, shape: tuple[int, ...], count: int) -> list[float]:
        """Seconds of each of count transfers, as the receiver waits for them."""
        assert self.channel is not None
        out = torch.empty(shape)
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            self.channel.recv_into(self._take_id(), out)
            seconds.append(time.perf_counter() - start)
        return seconds

    def copy(self, shape: tuple[int, ...], count: int) -> list[float]:
        src, dst = torch.randn(shape), torch.empty(shape)
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - start)
        return seconds

    def checksum(self, shape: tuple[int, ...], count: int) -> list[float]:
        from pdserve.transfer.protocol import KVMac

        kv_checksum = KVMac(b"a key of the bench's own").checksum

        data = torch.randn(shape)
        if data.dim() != 6:  # a flat payload, seen as blocks of SmolLM2's shape
            data = data.view(1, 1, 1, -1, BLOCK_SIZE, HEAD_DIM)
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            kv_checksum(data)
            seconds.append(time.perf_counter() - start)
        return seconds

    def threads(self) -> int:
        return torch.get_num_threads()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.server is not None:
            self.server.close()

    def _take_id(self) -> int:
        # Both actors count the same way, so their ids agree transfer by transfer.
        self.next_id += 1
        return self.next_id


def payloads(tokens: list[int], extra_mb: int) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for n in tokens:
        blocks = -(-n // BLOCK_SIZE)
        out.append((f"{n} tokens", (LAYERS, 2, KV_HEADS, blocks, BLOCK_SIZE, HEAD_DIM)))
    if extra_mb:
        out.append((f"{extra_mb} MiB flat", (extra_mb * 2**20 // 4,)))  # fp32 elements
    return out


def handoff_table(lengths: list[int], reps: int) -> None:
    from decode_worker.actor import DecodeActor
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.sampling import SamplingParams
    from pdserve.serving.calls import WorkerCalls
    from pdserve.serving.link import LinkServer
    from pdserve.serving.messages import DecodeTask, PrefillTask
    from prefill_worker.actor import PrefillActor

    # The router's end of the workers' links, on a loop of its own: requests reach the workers as the
    # router's calls on their links (pdserve.serving.calls), as in the cluster.
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(make):
        """make() on the loop, its awaitable awaited there; the result."""
        async def run():
            return await make()
        return asyncio.run_coroutine_threadsafe(run(), loop).result(TIMEOUT_S)

    server = LinkServer("127.0.0.1")
    on_loop(server.start)

    async def linked(handle, worker_id: str) -> WorkerCalls:
        link = server.expect(worker_id, lambda out: None)  # the outputs are not read here: stats tell
        await handle.link_to.remote(server.host, server.port, server.token)
        await link.wait_open(TIMEOUT_S)
        return WorkerCalls(link)

    config = EngineConfig(cache=CacheConfig(memory_bytes=512 << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=max(lengths)))
    decode = ray.remote(DecodeActor).options(num_cpus=0.5).remote("decode-0", config, TIMEOUT_S, 1)
    ray.get(decode.ready.remote())
    to_decode = on_loop(lambda: linked(decode, "decode-0"))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    print("\nhand-off, prefill worker -> decode worker (SmolLM2, fp32, 1 torch thread each)")
    table = Table(("prompt", 8, ""), ("push", 20, ""), ("prefill step ms", 16, ".1f"), ("hand-off ms", 12, ".1f"),
                  ("hand-off/step", 14, ".3f"))
    print(table.header())
    ids = iter(range(10**6))
    for n_variant, (layerwise, checksum) in enumerate(((True, False), (True, True), (False, False))):
        pid = f"prefill-{n_variant}"
        prefill = ray.remote(PrefillActor).options(num_cpus=0.5).remote(pid, config, TIMEOUT_S, 1, layerwise,
                                                                          checksum)
        ray.get(prefill.ready.remote())
        to_prefill = on_loop(lambda: linked(prefill, pid))
        for n in lengths:
            steps, handoffs = [], []
            for rep in range(reps + 1):
                k = next(ids)
                rid = f"r{k}"
                prompt = tuple(100 + (k * 7919 + i) % 20000 for i in range(n))  # no prefix-cache hits
                before_p, before_d = ray.get([prefill.stats.remote(), decode.stats.remote()])
                on_loop(lambda: to_decode.reserve(DecodeTask(rid, prompt, (), params, 0, pid), prefill))
                on_loop(lambda: to_prefill.prefill(PrefillTask(rid, prompt, params, 0, hand_off=True)))
                deadline = time.monotonic() + TIMEOUT_S
                # Stats are read on the decode worker's step thread: the request has run by then.
                while (after_d := ray.get(decode.stats.remote())).handoff["counts"] == before_d.handoff["counts"]:
                    assert time.monotonic() < deadline, "the KV never landed"
                    time.sleep(0.005)
                after_p = ray.get(prefill.stats.remote())
                if rep:  # the first is a warm-up
                    steps.append(after_p.busy_seconds - before_p.busy_seconds)
                    handoffs.append(after_d.handoff["sum"] - before_d.handoff["sum"])
            step, handoff = statistics.median(steps), statistics.median(handoffs)
            name = ("layer-wise" if layerwise else "end of step") + (", checksum" if checksum else "")
            print(table.row(n, name, step * 1e3, handoff * 1e3, handoff / step))
        ray.get(prefill.shutdown.remote())
        ray.kill(prefill)
    ray.get(decode.shutdown.remote())
    on_loop(server.close)
    loop.call_soon_threadsafe(loop.stop)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048])
    ap.add_argument("--extra-mb", type=int, default=64)
    ap.add_argument("--handoff-tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--handoff-reps", type=int, default=5)
    ap.add_argument("--no-handoff", action="store_true", help="only the channel table")
    args = ap.parse_args()

    from router.pools import init_local_ray

    init_local_ray(num_cpus=2, object_store_bytes=100 * 2**20)
    try:
        decode, prefill = Endpoint.remote(), Endpoint.remote()
        port = ray.get(decode.serve_store.remote())
        # Both sides of the rendezvous must be in flight together.
        setup = ray.get([decode.open.remote(port, 1), prefill.open.remote(port, 0)])
        print(f"pair setup (rendezvous) {max(setup) * 1e3:.0f} ms; torch threads per actor: "
              f"{ray.get(decode.threads.remote())}")
        table = Table(("payload", 16, ""), ("MB", 8, ".2f"), ("gloo ms", 9, ".2f"), ("gloo GB/s", 10, ".2f"),
                      ("copy GB/s", 10, ".2f"), ("gloo/copy", 10, ".3f"), ("checksum ms", 12, ".2f"),
                      ("2 sums/gloo", 12, ".1%"))
        print(table.header())
        sizes = payloads(args.tokens, args.extra_mb)
        # The warm-up is a whole unrecorded sweep: a fresh cluster keeps the 2 cores busy for a few
        # seconds (workers starting), which would otherwise land on the first payload alone.
        for shape in [shape for _, shape in sizes] if args.warmup else []:
            ray.get([decode.recv.remote(shape, args.warmup), prefill.send.remote(shape, args.warmup),
                     decode.copy.remote(shape, args.warmup)])
        for name, shape in sizes:
            nbytes = 4 * torch.Size(shape).numel()
            recv_s, _ = ray.get([decode.recv.remote(shape, args.reps), prefill.send.remote(shape, args.reps)])
            copy_s = ray.get(decode.copy.remote(shape, args.reps))
            gloo_s = statistics.median(recv_s)
            sum_s = statistics.median(ray.get(decode.checksum.remote(shape, args.reps)))
            gloo, copy = nbytes / gloo_s / 1e9, nbytes / statistics.median(copy_s) / 1e9
            print(table.row(name, nbytes / 1e6, gloo_s * 1e3, gloo, copy, gloo / copy, sum_s * 1e3, 2 * sum_s / gloo_s))
        ray.get([decode.close.remote(), prefill.close.remote()])
        if not args.no_handoff:
            handoff_table(args.handoff_tokens, args.handoff_reps)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
