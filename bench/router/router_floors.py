"""What one message costs the router, with nothing of pdserve in the way: the floors under its hot path.

    .venv/bin/python -m bench.router.router_floors [--messages 20000] [--items 1000]

1. gRPC: an asyncio gRPC server streams `GenerateResponse` messages of k tokens each (k = 1, 4, 16) to 16
   concurrent streams of a client in another process; the server's CPU per message and per token; then
   one token a message paced as a decode worker paces them (every stream's next message a step later,
   so nothing queues behind a write: the floor of one token a message in serving). And
   per request: --requests calls of Generate (32 at a time), each answered with two messages, the
   shortest a streamed request can be; the server's CPU per call, with no work of its own.
2. Ray: an async actor yields StepOutputs of 16 token events from a streaming generator (one every 3 ms,
   as a decode worker would) to an asyncio consumer; the consumer process's CPU per item. This is what
   each step's output cost the router before pdserve/serving/link.py replaced the Ray stream.
Both count the CPU of the measuring process (every thread: gRPC's and Ray's own included).
"""
from __future__ import annotations

import argparse
import asyncio
import queue
import sys
import threading
import time

import grpc

from bench.common import ROOT, cpu_model
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc

STREAMS = 16
# The clients run in their own process from the checkout's root (pdserve on their sys.path).
_CLIENT = """
import asyncio, sys, grpc
from pdserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
async def main(port):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{{port}}") as ch:
        stub = pb_grpc.GenerationStub(ch)
        async def one():
            async for _ in stub.Generate(pb.GenerateRequest(prompt="x")):
                pass
        await asyncio.gather(*(one() for _ in range({streams})))
asyncio.run(main(int(sys.argv[1])))
"""
_CALLS = """
import asyncio, sys, grpc
from pdserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
async def main(port):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{{port}}") as ch:
        stub = pb_grpc.GenerationStub(ch)
        left = [{requests}]
        async def worker():
            while left[0] > 0:
                left[0] -= 1
                async for _ in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(128))))):
                    pass
        await asyncio.gather(*(worker() for _ in range(32)))
asyncio.run(main(int(sys.argv[1])))
"""


async def _server_cpu(per_call: int, k: int, client: str, step: float = 0.0) -> float:
    """Server CPU seconds while `client` (a script given the port) runs against a Generate that answers
    each call with `per_call` messages of k tokens: back to back, or (step > 0) one message on every call
    each `step` seconds, as a decode step's tokens reach the router."""
    loop = asyncio.get_running_loop()
    tick = [loop.create_future()]

    async def steps() -> None:
        while True:
            await asyncio.sleep(step)
            done, tick[0] = tick[0], loop.create_future()
            done.set_result(None)

    class Service(pb_grpc.GenerationServicer):
        async def Generate(self, request, context):
            for i in range(per_call):
                if step:
                    await tick[0]
                yield pb.GenerateResponse(request_id="req-0123456789abcdef", text=" token" * k, token_ids=[i] * k)

    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stepper = asyncio.create_task(steps()) if step else None
    t0 = time.process_time()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", client, str(port), cwd=ROOT)
    await proc.wait()
    cpu = time.process_time() - t0
    if stepper is not None:
        stepper.cancel()
    await server.stop(None)
    return cpu


async def grpc_floor(messages: int, k: int, step: float = 0.0) -> float:
    """Server CPU seconds for `messages` messages of k tokens over STREAMS streams (step: see _server_cpu)."""
    return await _server_cpu(messages // STREAMS, k, _CLIENT.format(streams=STREAMS), step)


async def grpc_request_floor(requests: int) -> float:
    """Server CPU seconds for `requests` Generate calls of two messages each, 32 at a time."""
    return await _server_cpu(2, 1, _CALLS.format(requests=requests))


def ray_floor(items: int) -> float:
    """Consumer CPU seconds for `items` StepOutputs of 16 events through a Ray streaming generator."""
    import ray

    from pdserve.serving.messages import StepOutput, TokenEvent, WorkerStats

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Streamer:
        def __init__(self):
            self.q: queue.SimpleQueue = queue.SimpleQueue()
            stats = WorkerStats(worker_id="d", pool="decode", waiting=0, waiting_tokens=0, running=16,
                                kv_blocks_used=1, kv_blocks_total=2)
            self.item = StepOutput("d", tuple(TokenEvent(f"req-{i:032d}#0", 5, None, " token") for i in range(16)),
                                   (), stats)

        def produce(self, n: int, period: float) -> None:
            def run():
                for _ in range(n):
                    self.q.put(self.item)
                    time.sleep(period)
            threading.Thread(target=run, daemon=True).start()

        async def stream(self):
            while True:
                yield await asyncio.to_thread(self.q.get)

    async def consume() -> float:
        s = Streamer.remote()
        gen = s.stream.remote()
        await s.produce.remote(items, 0.003)
        t0, n = time.process_time(), 0
        async for ref in gen:
            await ref
            n += 1
            if n == items:
                break
        return time.process_time() - t0

    try:
        return asyncio.run(consume())
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--items", type=int, default=1000)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--paced-messages", type=int, default=4800, help="messages of the paced row (16 a step)")
    p.add_argument("--step-ms", type=float, default=10.0, help="the paced row's decode step")
    args = p.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu_model()}")
    print("| path | per message | per token |\n|---|---:|---:|")
    for k in (1, 4, 16):
        n = args.messages // k
        secs = asyncio.run(grpc_floor(n, k))
        print(f"| gRPC asyncio server stream, {k} token(s) a message | {1e6 * secs / n:.0f} us | "
              f"{1e6 * secs / (n * k):.1f} us |")
    # Paced: what a router pays per message in serving, where each stream's next token comes a step later
    # (and the server's step timer, one wake-up a step for all streams, is counted in).
    n = args.paced_messages
    secs = asyncio.run(grpc_floor(n, 1, args.step_ms / 1e3))
    print(f"| gRPC asyncio server stream, 1 token a message, every stream's next message {args.step_ms:g} ms later "
          f"| {1e6 * secs / n:.0f} us | {1e6 * secs / n:.1f} us |")
    secs = asyncio.run(grpc_request_floor(args.requests))
    print(f"| gRPC asyncio Generate call of 2 messages (per request) | {1e6 * secs / args.requests:.0f} us | |")
    secs = ray_floor(args.items)
    print(f"| Ray streaming generator item (a step of 16 tokens) | {1e6 * secs / args.items:.0f} us | "
          f"{1e6 * secs / (args.items * 16):.1f} us |")


if __name__ == "__main__":
    main()
