"""A decode worker killed from outside (kill -9 of its process) while greedy streams run: token-exact?

    .venv/bin/python -m bench.cluster.kill_decode [--decode-workers 2] [--streams 12] [--max-tokens 160]
                                         [--kill-at 20] [--repeat 3] [--port 50071]

Starts `pdserve serve` (the default model, SmolLM2-135M) with one prefill and N decode workers as a
separate process, asks for the reference answers one at a time with no fault, then per repeat starts
all streams at once, sends SIGKILL to one decode worker's process (found by its Ray process title)
once the first stream has --kill-at tokens, and compares every stream with its reference. Prints, per
repeat, how many streams were identical; exits 1 if any differed or failed.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.common import ROOT
from pdserve.client.grpc_client import Client


def decode_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ray::DecodeActor"], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-workers", type=int, default=2)
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--kill-at", type=int, default=20, help="kill once the first stream has this many tokens")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--port", type=int, default=50071)
    args = ap.parse_args()

    log_path = Path(tempfile.gettempdir()) / "kill_decode.serve.log"
    log = open(log_path, "w")
    server = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--prefill-workers", "1",
                               "--decode-workers", str(args.decode_workers), "--port", str(args.port),
                               "--metrics-port", "0", "--http-port", "0"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    bad = 0
    try:
        client = Client(f"127.0.0.1:{args.port}")
        deadline = time.monotonic() + 600
        while True:
            try:
                if client.health(timeout=2) == "SERVING":
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"the server did not come up (see {log_path})")
            time.sleep(1)
        prompts = [f"Write a short story, number {i}, about a cat and a dog." for i in range(args.streams)]
        params = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        reference = [client.complete(p, **params).token_ids for p in prompts]
        for rep in range(args.repeat):
            results: list = [None] * args.streams
            progress = [0] * args.streams

            def one(i: int) -> None:
                tokens: list[int] = []
                try:
                    for r in client.generate(prompts[i], timeout=600, **params):
                        tokens += r.token_ids
                        progress[i] = len(tokens)
                    results[i] = tokens
                except grpc.RpcError as e:
                    results[i] = f"{e.code().name}: {e.details()}"

            threads = [threading.Thread(target=one, args=(i,)) for i in range(args.streams)]
            for t in threads:
                t.start()
            while max(progress) < args.kill_at:
                time.sleep(0.005)
            pid = decode_pids()[rep % args.decode_workers]
            at = list(progress)
            os.kill(pid, signal.SIGKILL)
            for t in threads:
                t.join()
            same = sum(r == e for r, e in zip(results, reference))
            bad += args.streams - same
            print(f"repeat {rep}: killed pid {pid} with streams at {at} tokens: {same} of {args.streams} "
                  f"token-exact", flush=True)
            for r, e in zip(results, reference):
                if r != e:
                    print("   differs:", r if isinstance(r, str) else f"{len(r)} tokens, first {r[:4]}",
                          f"(reference: {len(e)} tokens, first {e[:4]})")
            # The killed worker's replacement joins before the next repeat.
            while sum(len(p.workers) for p in client.cluster_status(timeout=30).pools if p.name == "decode") \
                    < args.decode_workers:
                time.sleep(0.5)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
