"""How closely `pdserve bench`'s runner keeps to its schedule on this machine, against a scripted server.

    .venv/bin/python -m bench.router.runner_schedule [--repeats 5] [--output runner_schedule.json]

A gRPC server in this process streams max_tokens one-token messages 20 ms apart (no model). Each repeat
runs the three schedules tests/loadgen/test_loadgen.py runs, and measures what that test can only bound from
one side (a loaded machine makes any upper bound there flaky):
- bursts: two bursts of three requests, 0.3 s apart: how late each request went out after its time;
- poisson: 50 requests/s for 0.3 s (seed 0: 19 arrivals before 0.3 s): how many went out, how late;
- closed: 6 requests, 2 in flight: the mean inter-token latency the client saw (the server's is 20 ms).
Prints one row per repeat and schedule, and whether it kept to the bounds the unit test used to assert
(first burst out within 50 ms, second within 100 ms of its time; at least 8 Poisson sends; mean ITL
between 15 and 200 ms). Exit status 1 if a repeat did not.
"""
from __future__ import annotations

import asyncio
import statistics
import sys

from bench.common import parser, write_json

SPACING_S = 0.02  # the scripted server's gap between two messages


async def serve():
    import grpc

    from pdserve.v1 import generation_pb2 as pb
    from pdserve.v1 import generation_pb2_grpc as pb_grpc

    class Scripted(pb_grpc.GenerationServicer):
        async def Generate(self, request, context):
            for i in range(request.max_tokens):
                await asyncio.sleep(SPACING_S)
                r = pb.GenerateResponse(request_id="x", token_ids=[i])
                if i == request.max_tokens - 1:
                    r.finish_reason = pb.FINISH_REASON_LENGTH
                    r.usage.prompt_tokens = len(request.token_ids.ids)
                    r.usage.completion_tokens = request.max_tokens
                yield r

    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(Scripted(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def one_repeat(target: str) -> dict:
    import itertools

    from pdserve.loadgen.runner import RunConfig, run_workload
    from pdserve.loadgen.stats import Slo, build_report
    from pdserve.loadgen.workload import BenchRequest, bursty_arrivals, closed_arrivals, poisson_arrivals

    req = BenchRequest(max_tokens=4, token_ids=(1, 2, 3))
    burst, _ = await run_workload(target, [req] * 6, bursty_arrivals(3, 0.3), RunConfig(num_prompts=6))
    late = [r.send - at for r, at in zip(burst, [0.0] * 3 + [0.3] * 3)]
    schedule = list(itertools.islice(poisson_arrivals(50, 0), 40))
    timed, _ = await run_workload(target, itertools.repeat(req), iter(schedule), RunConfig(duration=0.3))
    poisson_late = [r.send - at for r, at in zip(timed, schedule)]
    closed, wall = await run_workload(target, [req] * 6, closed_arrivals(), RunConfig(num_prompts=6, concurrency=2))
    itl = build_report(closed, Slo(), wall)["mean_itl_ms"]
    out = {"burst1_late_ms": max(late[:3]) * 1e3, "burst2_late_ms": max(late[3:]) * 1e3,
           "poisson_sent": len(timed), "poisson_due": sum(1 for t in schedule if t < 0.3),
           "poisson_max_late_ms": max(poisson_late) * 1e3, "closed_mean_itl_ms": itl}
    out["within_unit_test_bounds"] = (out["burst1_late_ms"] < 50 and out["burst2_late_ms"] < 100
                                      and out["poisson_sent"] >= 8 and 15 <= itl <= 200)
    return out


async def run(repeats: int) -> list[dict]:
    server, target = await serve()
    try:
        return [await one_repeat(target) for _ in range(repeats)]
    finally:
        await server.stop(0)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = asyncio.run(run(args.repeats))
    print(f"{'repeat':>6} {'burst 1 late':>13} {'burst 2 late':>13} {'poisson sent':>13} {'poisson late':>13} "
          f"{'mean ITL':>9}  bounds")
    for i, r in enumerate(rows):
        print(f"{i:>6} {r['burst1_late_ms']:>10.1f} ms {r['burst2_late_ms']:>10.1f} ms "
              f"{r['poisson_sent']:>6} of {r['poisson_due']:<3} {r['poisson_max_late_ms']:>10.1f} ms "
              f"{r['closed_mean_itl_ms']:>6.1f} ms  {'kept' if r['within_unit_test_bounds'] else 'MISSED'}")
    itls = [r["closed_mean_itl_ms"] for r in rows]
    print(f"mean ITL over repeats: median {statistics.median(itls):.1f} ms (the server's spacing: "
          f"{SPACING_S * 1e3:.0f} ms)")
    if args.output:
        write_json(args.output, rows)
    return 0 if all(r["within_unit_test_bounds"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
