"""The composition root: `pdserve serve` wires the pools, the cluster and the gRPC router together.

The `pdserve` console script starts here: the client-side commands come from pdserve/cli.py, which
imports no service; this module adds `serve`, which needs all of them.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from pdserve.client.grpc_client import ADMIN_API_KEY_ENV, API_KEY_ENV, read_api_key
from pdserve.engine.args import add_model_args

SIM_WORKER_CPUS = 1 / 16  # Ray CPUs of a simulated worker by default (--load-format sim)


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    serve = sub.add_parser("serve", help="start the worker pools and the gRPC router")
    serve.add_argument("--config", default=None, metavar="FILE.yaml",
                       help="a YAML mapping of any of these flags (without the dashes, - or _), e.g. "
                            "'prefill-workers: 2'; flags given on the command line override it")
    add_model_args(serve)
    _door_args(serve)
    _pool_args(serve)
    _fault_args(serve)
    _scaling_and_tier_args(serve)
    _admission_args(serve)
    serve.set_defaults(func=cmd_serve)
    return serve


def _door_args(serve: argparse.ArgumentParser) -> None:
    """The doors: addresses and ports, the HTTP API's model name, request defaults, TLS and API key."""
    serve.add_argument("--host", default="127.0.0.1", help="address the router binds (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--http-port", type=int, default=8000,
                       help="port of the OpenAI-compatible HTTP API on --host (/v1/completions, /v1/chat/completions, "
                            "/v1/models, /health); 0 turns it off")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the HTTP API (default: its file or directory name)")
    serve.add_argument("--logprobs-mode", default="raw", choices=["raw", "processed"],
                       help="where a request that asks for logprobs and names no mode reads its generated tokens' "
                            "logprobs from: the model's distribution (raw: log_softmax of the logits) or the one "
                            "sampled from (processed: after penalties, temperature, top-k and top-p; masked tokens "
                            "-inf); prompt logprobs are always raw")
    serve.add_argument("--version-policy", default="recompute", choices=["recompute", "keep", "abort"],
                       help="what a request that names no version_policy does when the weights change while it "
                            "holds KV of older ones: recompute that KV with the new weights (prompt and tokens so "
                            "far), keep decoding over it, or abort (it ends, finish reason abort, with its tokens)")
    serve.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral"],
                       help="the format a chat's tool calls are read in (requests with tools): hermes "
                            "(<tool_call>{json}</tool_call>: Qwen2.5/Qwen3/SmolLM3/Hermes), llama3_json ({\"name\", "
                            "\"parameters\"}: Llama 3.x), mistral ([TOOL_CALLS]); auto: the one the chat template and "
                            "vocabulary say, hermes for a template without tools (pdserve then prompts for Hermes calls)")
    serve.add_argument("--reasoning-parser", default="none", choices=["none", "qwen3", "deepseek_r1"],
                       help="read a chat reply's <think>...</think> as message.reasoning_content (qwen3: when the "
                            "reply or the rendered prompt opens the block; deepseek_r1: every reply begins in it)")
    serve.add_argument("--metrics-host", default="127.0.0.1", help="address of the Prometheus /metrics endpoint")
    serve.add_argument("--metrics-port", type=int, default=9400, help="port of /metrics (0 disables it)")
    edge = serve.add_argument_group("TLS and API key")
    edge.add_argument("--ssl-certfile", default=None, metavar="FILE",
                      help="serve gRPC over TLS with this certificate chain (PEM); plaintext clients get nothing")
    edge.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the certificate's private key (PEM)")
    edge.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                      help="require client certificates signed by these CA certificates (mutual TLS)")
    edge.add_argument("--api-key", default=None,
                      help=f"every RPC but health must send 'authorization: Bearer KEY', else UNAUTHENTICATED "
                           f"(default: ${API_KEY_ENV}; prefer it or --api-key-file, a flag shows in ps)")
    edge.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from this file")
    _role_args(edge)
    edge.add_argument("--metrics-tls", action="store_true", help="serve /metrics over HTTPS with the same certificate")
    edge.add_argument("--health-port", type=int, default=None,
                      help="also serve grpc.health.v1 alone, in plaintext, on this port (probes that cannot do TLS)")


def _role_args(edge) -> None:
    """Roles (router.security): the admin credential control calls need, and where control is served."""
    edge.add_argument("--admin-api-key", default=None,
                      help=f"the admin key: control calls (the Weights service: updates, pause, resume, a trainer's "
                           f"group; HTTP control routes) need 'authorization: Bearer KEY' with it, and the inference "
                           f"key (--api-key) is refused them, PERMISSION_DENIED (default: ${ADMIN_API_KEY_ENV}; prefer "
                           f"it or --admin-api-key-file). It serves inference calls too")
    edge.add_argument("--admin-api-key-file", default=None, metavar="FILE", help="read the admin key from this file")
    edge.add_argument("--admin-client-name", action="append", default=[], metavar="NAME",
                      help="with --ssl-ca-certs (mutual TLS): a client certificate whose common name or DNS name is "
                           "NAME is admin (repeatable)")
    edge.add_argument("--control-port", type=int, default=None,
                      help="serve the Weights service on this port of --control-host only (refused on --port); "
                           "without an admin credential, whoever reaches it may call it")
    edge.add_argument("--control-http-port", type=int, default=None,
                      help="serve the HTTP control routes on this port of --control-host only")
    edge.add_argument("--control-host", default="127.0.0.1",
                      help="address of the control ports: loopback (default) or an internal interface")
    edge.add_argument("--weights-root", default=None, metavar="DIR",
                      help="UpdateWeights reads checkpoints under this directory only (the path and its files, "
                           "symlinks resolved, on every worker); default: the directory that holds --model")


def _pool_args(serve: argparse.ArgumentParser) -> None:
    """The pools: Ray, the mode, each pool's size and parallelism, a worker's resources, cache and batching."""
    serve.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (e.g. 'auto' inside a Ray head pod); default: start a local one")
    serve.add_argument("--router-name", default=None, metavar="NAME",
                       help="router replicas: this router's name among several serving one Ray cluster (needs "
                            "--ray-address; each router its own name; 'auto': the host's name, a pod's own). One owns "
                            "the pools, the others follow it and take over if it dies (router/registry.py)")
    serve.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    serve.add_argument("--prefill-workers", type=worker_range, default=(1, 1), metavar="N|MIN:MAX",
                       help="prefill workers: N, fixed, or MIN:MAX, autoscaled (starts at MIN; see Autoscaling)")
    serve.add_argument("--decode-workers", type=worker_range, default=(1, 1), metavar="N|MIN:MAX",
                       help="decode workers: N, fixed, or MIN:MAX, autoscaled")
    serve.add_argument("--colocated-workers", type=int, default=1, help="workers in colocated mode")
    serve.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="A",
                       help="ranks (devices) per prefill worker (default: --tensor-parallel-size)")
    serve.add_argument("--decode-tensor-parallel-size", type=int, default=None, metavar="B",
                       help="ranks (devices) per decode and fast-lane worker (default: --tensor-parallel-size); "
                            "KV moves between any A and B the model's heads allow")
    serve.add_argument("--prefill-expert-parallel-size", type=int, default=None, metavar="A",
                       help="a mixture of experts: expert-parallel size of each prefill worker, 1 or its rank count "
                            "(default: --expert-parallel-size)")
    serve.add_argument("--decode-expert-parallel-size", type=int, default=None, metavar="B",
                       help="expert-parallel size of each decode and fast-lane worker (default: --expert-parallel-size)")
    serve.add_argument("--tensor-parallel-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="a rank of a worker that has not answered its collective this long is given up, "
                            "and its worker with it (one whose process ends is given up at once)")
    serve.add_argument("--worker-cpus", type=float, default=None,
                       help="Ray CPUs per worker, per rank of a TP worker (default: 0.5 on CPU, 1 with --device cuda, "
                            "1/16 with --load-format sim)")
    serve.add_argument("--worker-gpus", type=float, default=None,
                       help="Ray GPUs per worker, per rank of a TP worker (default: 1 with --device cuda)")
    serve.add_argument("--prefill-resource", action="append", default=[], metavar="NAME=AMOUNT",
                       help="Ray custom resource every prefill worker needs (pins the pool to a node group)")
    serve.add_argument("--decode-resource", action="append", default=[], metavar="NAME=AMOUNT")
    serve.add_argument("--kv-cache-mib", type=int, default=1024,
                       help="KV cache per worker, MiB (per rank of a TP worker: each holds its KV heads)")
    serve.add_argument("--kv-offload-mib", type=int, default=0,
                       help="host memory per worker for KV blocks evicted from its cache, loaded back on a prefix "
                            "hit instead of recomputing (0: off)")
    serve.add_argument("--kv-offload-dir", default=None,
                       help="local directory for blocks the host tier has no room for (a replacement worker with "
                            "the same directory finds them); needs --kv-offload-disk-mib")
    serve.add_argument("--kv-offload-disk-mib", type=int, default=0, help="the disk tier's budget per worker, MiB")
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--prefill-token-budget", type=int, default=2048,
                       help="prompt tokens per prefill step (and per colocated step)")
    serve.add_argument("--max-num-seqs", type=int, default=64,
                       help="running requests per decode worker (and per colocated worker)")
    serve.add_argument("--reservation-headroom-blocks", type=int, default=1,
                       help="free KV blocks a decode worker keeps per running request when it reserves room for "
                            "an incoming request's KV")
    serve.add_argument("--decode-token-budget", type=int, default=2048,
                       help="tokens per decode step: one per running request, and the chunks of a preempted "
                            "request's recompute")
    serve.add_argument("--torch-threads", type=int, default=None,
                       help="torch threads per worker (default on a local CPU cluster: the cores split between the workers)")
    serve.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding on decode and colocated workers, e.g. {"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 5} '
                            '(prompt lookup), or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} '
                            '(a smaller checkpoint of the same tokenizer beside the model); others: not yet. Default: off')
    serve.add_argument("--fast-lane-speculative-config", default=None, metavar="JSON",
                       help="the fast lane's own speculative decoding (default: --speculative-config); '{}' or "
                            "'off' turns it off there")
    serve.add_argument("--peak-flops", type=float, default=None,
                       help="device peak FLOP/s for MFU (default: known GPUs' datasheet, else measured at start)")
    serve.add_argument("--peak-memory-bandwidth", type=float, default=None,
                       help="device peak bytes/s for MBU (default: known GPUs' datasheet, else measured at start)")


def _fault_args(serve: argparse.ArgumentParser) -> None:
    """Transfers, heartbeats, retries and streaming."""
    serve.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds before a KV transfer fails")
    serve.add_argument("--kv-bind-host", default=None,
                       help="address decode workers listen on for KV transfers, and the router for its workers' links "
                            "(default: the node's IP)")
    serve.add_argument("--worker-timeout", type=float, default=30.0,
                       help="seconds without a heartbeat answer before a worker counts as stuck and is replaced")
    serve.add_argument("--pool-wait-timeout", type=float, default=60.0,
                       help="seconds a request waits for a worker when its pool has none alive (a replacement "
                            "starting), then UNAVAILABLE")
    serve.add_argument("--replace-backoff", type=backoff_range, default=(1.0, 30.0), metavar="FIRST:MAX",
                       help="seconds before a replacement that failed to start is tried again: FIRST, then twice as "
                            "long each time, up to MAX")
    serve.add_argument("--kv-checksum", action=argparse.BooleanOptionalAction, default=False,
                       help="checksum every KV transfer with the cluster's key and verify it on the decode worker (a "
                            "mismatch fails the transfer, which is retried); off by default: on a CPU it costs "
                            "15-30%% of a transfer")
    serve.add_argument("--kv-checksum-key-file", default=None, metavar="FILE",
                       help="the cluster's key of the KV checksum (its first line, at least 16 bytes); default: a "
                            "random one the router makes. Router replicas need it: every router the same file")
    serve.add_argument("--max-retries", type=int, default=2, help="re-placements of a request whose worker was lost")
    serve.add_argument("--on-decode-failure", choices=["resume", "fail"], default="resume",
                       help="a lost decode worker's requests resume elsewhere, or end with UNAVAILABLE")
    serve.add_argument("--placement-load-tokens", type=int, default=256, metavar="N",
                       help="placement by where the KV is: a running request on a decode worker weighs as much as "
                            "this many prompt tokens its prefix cache holds (0: decode workers by load alone)")
    serve.add_argument("--local-prefill-max-tokens", type=int, default=512, metavar="N",
                       help="a decode worker that holds a prefix of a prompt (a conversation's earlier turns) and "
                            "lacks at most this many of its tokens computes them itself: no prefill worker, no KV "
                            "hand-off (0: never)")
    serve.add_argument("--prefix-routing", choices=("exact", "estimate", "random"), default="exact",
                       help="what placement knows of the workers' prefix caches: exact (their KV events), estimate "
                            "(the router's record of the prompts it placed on each) or random (nothing: any worker "
                            "with room); docs/serving.md")
    serve.add_argument("--stream-interval", type=int, default=1, metavar="N",
                       help="tokens a streamed message carries (the first and the last excepted): fewer messages "
                            "cost the router less CPU per token; tokens already waiting always go together")


def _scaling_and_tier_args(serve: argparse.ArgumentParser) -> None:
    """Autoscaling and the service tiers."""
    scale = serve.add_argument_group("autoscaling (pools given as MIN:MAX)")
    scale.add_argument("--profile", default=None, metavar="PROFILE.json",
                       help="the cost model pools are sized by: `pdserve profile` of this model on this device")
    scale.add_argument("--gpu", default=None, metavar="NAME",
                       help="or the roofline of this GPU (H100, H200, A100, L40S, L4); simulated workers "
                            "(--load-format sim) default to their own GPU's, slowed by --sim-time-scale")
    scale.add_argument("--slo-ttft-ms", type=float, default=1000.0,
                       help="time to first token the prefill pool is sized for")
    scale.add_argument("--slo-tpot-ms", type=float, default=100.0,
                       help="time per output token the decode pool is sized for")
    scale.add_argument("--scale-down-delay", type=float, default=60.0, metavar="SECONDS",
                       help="a pool shrinks only to the most workers it needed over this long (no flapping)")
    scale.add_argument("--autoscale-interval", type=float, default=2.0, metavar="SECONDS",
                       help="how often the pools' sizes are decided")
    tiers = serve.add_argument_group("service tiers (a request's service_tier: auto, default, priority, flex)")
    tiers.add_argument("--fast-lane-workers", type=lane_range, default=(0, 0), metavar="N|MIN:MAX",
                       help="decode workers beside the decode pool that serve priority requests only, each with a "
                            "small running batch (--fast-lane-max-running): faster tokens at a higher cost per "
                            "token; MIN:MAX autoscales the lane (default 0: no lane)")
    tiers.add_argument("--fast-lane-max-running", type=int, default=4, help="running requests per fast-lane worker")
    tiers.add_argument("--fast-lane-when-full", choices=["wait", "downgrade"], default="wait",
                       help="a priority request that finds the lane full waits (up to --fast-lane-max-wait) or is "
                            "served as default at once; the tier served says which")
    tiers.add_argument("--fast-lane-max-wait", type=float, default=5.0, metavar="SECONDS",
                       help="how long a priority request waits for the lane before it is served as default")
    tiers.add_argument("--flex-max-queued", type=int, default=64,
                       help="flex requests waiting beyond this are refused at once (RESOURCE_EXHAUSTED, HTTP 429)")
    tiers.add_argument("--flex-min-share", type=float, default=0.1,
                       help="flex's floor: this share of the decode slots is flex's whenever flex wants it (it is "
                            "neither preempted nor kept in line below it)")
    tiers.add_argument("--tier-slo", action="append", default=[], metavar="TIER=TTFT_MS:TPOT_MS",
                       help="a tier's SLO (repeatable), for the per-tier goodput metrics and the fast lane's sizing; "
                            "defaults: priority=1000:50, default=4000:150, flex=120000:1000")


def _admission_args(serve: argparse.ArgumentParser) -> None:
    """Admission, drain and the bounds on a request's bytes."""
    serve.add_argument("--max-running", type=int, default=256, help="requests on the workers at once")
    serve.add_argument("--max-queued", type=int, default=1024, help="requests waiting; more get RESOURCE_EXHAUSTED")
    serve.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on shutdown")
    serve.add_argument("--max-request-body-bytes", type=int, default=None, metavar="BYTES",
                       help="the most bytes of one request: an HTTP body (past it 413, before reading on) or a gRPC "
                            "message (RESOURCE_EXHAUSTED); default: what the largest valid request takes in each "
                            "door's encoding, from the 1 Mi-character text limit and the model's context "
                            "(13.25 MiB of JSON, 5.06 MiB of protobuf with an 8k context)")
    serve.add_argument("--request-body-budget-bytes", type=int, default=None, metavar="BYTES",
                       help="the most bytes of HTTP request bodies held at once (being read, or read and not yet "
                            "answered); a request that would pass it gets 503 at once (default: 16 of the largest)")
    conn = serve.add_argument_group("connections (each door's bounds on what one client holds open)")
    conn.add_argument("--max-connections", type=int, default=1024,
                      help="connections each door takes at once (gRPC refuses more; HTTP answers 503 past this many "
                           "connections or requests)")
    conn.add_argument("--max-streams-per-connection", type=int, default=None, metavar="N",
                      help="gRPC calls one connection carries at once (more wait, client-side; default "
                           "--max-running + --max-queued)")
    conn.add_argument("--idle-timeout", type=float, default=300.0, metavar="SECONDS",
                      help="a gRPC connection without a call this long is closed")
    conn.add_argument("--keepalive", type=float, default=60.0, metavar="SECONDS",
                      help="the router pings a gRPC connection silent this long, and closes it if the ping is not "
                           "answered within --keepalive-timeout")
    conn.add_argument("--keepalive-timeout", type=float, default=20.0, metavar="SECONDS")
    conn.add_argument("--min-ping-interval", type=float, default=10.0, metavar="SECONDS",
                      help="a gRPC client that pings more often than this is disconnected (keepalive enforcement)")
    conn.add_argument("--http-read-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="an HTTP request's head, then its body, must arrive within this (else the connection is "
                           "closed, or 408 and the body dropped)")


def worker_range(text: str) -> tuple[int, int]:
    """N (a fixed pool) or MIN:MAX (an autoscaled one)."""
    lo, sep, hi = str(text).partition(":")
    try:
        out = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"workers are N or MIN:MAX, got {text!r}") from None
    if not 1 <= out[0] <= out[1]:
        raise argparse.ArgumentTypeError(f"workers need 1 <= MIN <= MAX, got {text!r}")
    return out


def backoff_range(text: str) -> tuple[float, float]:
    """FIRST:MAX seconds, 0 < FIRST <= MAX."""
    first, _, most = str(text).partition(":")
    try:
        out = (float(first), float(most))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a backoff is FIRST:MAX seconds, got {text!r}") from None
    if not 0 < out[0] <= out[1]:
        raise argparse.ArgumentTypeError(f"a backoff needs 0 < FIRST <= MAX, got {text!r}")
    return out


def lane_range(text: str) -> tuple[int, int]:
    """0 (no fast lane), N or MIN:MAX."""
    if str(text).strip() == "0":
        return (0, 0)
    return worker_range(text)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    import ray

    from router.compose import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster_config = cluster_config_from_args(args)
    router_config = router_config_from_args(args)
    if args.ray_address:  # named actors (router replicas' registry and workers) live in one namespace
        ray.init(address=args.ray_address, namespace="pdserve", log_to_driver=False)
    else:
        if args.router_name:
            raise ValueError("--router-name needs --ray-address: router replicas share a Ray cluster that none of "
                             "them started (a local one ends with the router that started it)")
        from router.pools import init_local_ray

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


def router_config_from_args(args: argparse.Namespace):
    from router.config import RouterConfig

    return RouterConfig(host=args.host, port=args.port, max_running=args.max_running, max_queued=args.max_queued,
                        drain_timeout_s=args.drain_timeout, metrics_host=args.metrics_host,
                        metrics_port=args.metrics_port or None, ssl_certfile=args.ssl_certfile,
                        ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                        api_key=read_api_key(args.api_key, args.api_key_file),
                        admin_api_key=read_api_key(args.admin_api_key, args.admin_api_key_file, ADMIN_API_KEY_ENV),
                        admin_client_names=tuple(args.admin_client_name), control_host=args.control_host,
                        control_port=args.control_port, control_http_port=args.control_http_port,
                        metrics_tls=args.metrics_tls, health_port=args.health_port,
                        http_port=args.http_port or None, served_model_name=args.served_model_name,
                        logprobs_mode=args.logprobs_mode, version_policy=args.version_policy,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        max_request_body_bytes=args.max_request_body_bytes,
                        request_body_budget_bytes=args.request_body_budget_bytes,
                        max_connections=args.max_connections, max_streams_per_connection=args.max_streams_per_connection,
                        idle_timeout_s=args.idle_timeout, keepalive_s=args.keepalive,
                        keepalive_timeout_s=args.keepalive_timeout, min_ping_interval_s=args.min_ping_interval,
                        read_timeout_s=args.http_read_timeout)


def cluster_config_from_args(args: argparse.Namespace):
    from pdserve.config import AutoscaleConfig, ClusterConfig
    from pdserve.tiers import TiersConfig, parse_tier_slos

    engine = _engine_config(args)
    pools = _pool_configs(args, engine.cache)
    tiers = TiersConfig(fast_lane_max_running=args.fast_lane_max_running, fast_lane_when_full=args.fast_lane_when_full,
                        fast_lane_max_wait_s=args.fast_lane_max_wait, flex_max_queued=args.flex_max_queued,
                        flex_min_share=args.flex_min_share, slo=parse_tier_slos(args.tier_slo))
    return ClusterConfig(engine=engine, mode=args.mode, **pools, tiers=tiers,
                         transfer_timeout_s=args.transfer_timeout, bind_host=args.kv_bind_host,
                         worker_timeout_s=args.worker_timeout, pool_wait_timeout_s=args.pool_wait_timeout,
                         replace_backoff_s=args.replace_backoff,
                         kv_checksum=args.kv_checksum, kv_checksum_key=_key_file(args.kv_checksum_key_file),
                         max_retries=args.max_retries, on_decode_failure=args.on_decode_failure,
                         stream_interval=args.stream_interval, placement_load_tokens=args.placement_load_tokens,
                         local_prefill_max_tokens=args.local_prefill_max_tokens, prefix_routing=args.prefix_routing,
                         router_name=socket.gethostname() if args.router_name == "auto" else args.router_name,
                         autoscale=AutoscaleConfig(profile=args.profile, gpu=args.gpu,
                                                   ttft_target_s=args.slo_ttft_ms / 1000,
                                                   tpot_target_s=args.slo_tpot_ms / 1000,
                                                   interval_s=args.autoscale_interval,
                                                   scale_down_delay_s=args.scale_down_delay))


def _parallel_sizes(args: argparse.Namespace) -> tuple[dict[str, int], dict[str, int]]:
    """Each pool's (tensor-parallel, expert-parallel) sizes: a worker's ranks are its tensor-parallel size,
    raised to its expert-parallel size where only that is given."""
    ep = {"prefill": args.prefill_expert_parallel_size or args.expert_parallel_size,
          "decode": args.decode_expert_parallel_size or args.expert_parallel_size,
          "colocated": args.expert_parallel_size}
    given = {"prefill": args.prefill_tensor_parallel_size, "decode": args.decode_tensor_parallel_size, "colocated": None}
    tp = {name: given[name] or (ep[name] if ep[name] > 1 and args.tensor_parallel_size == 1 else args.tensor_parallel_size)
          for name in ep}
    for name in ep:
        if ep[name] > 1 and tp[name] != ep[name]:
            raise ValueError(f"the {name} pool's expert-parallel size {ep[name]} must equal its ranks, its tensor-parallel "
                             f"size ({tp[name]}): experts and attention share the ranks")
    if args.mode == "colocated" and (args.prefill_tensor_parallel_size or args.decode_tensor_parallel_size
                                     or args.prefill_expert_parallel_size or args.decode_expert_parallel_size):
        raise ValueError("a colocated worker has one size: --tensor-parallel-size and --expert-parallel-size")
    return tp, ep


def _pool_configs(args: argparse.Namespace, cache) -> dict:
    """The mode's pools (prefill and decode, or colocated; the fast lane if asked), each batching for its own
    bottleneck: prefill by prompt tokens, decode by running requests."""
    from pdserve.config import PoolConfig, SchedulerConfig
    from pdserve.engine.speculative import SpeculativeConfig

    tp, ep = _parallel_sizes(args)
    gpu = args.device.startswith("cuda")
    # A simulated worker sleeps through its steps: 1/16 of a CPU each, so dozens fit on a small machine.
    cpus = args.worker_cpus if args.worker_cpus is not None else \
        (1.0 if gpu else SIM_WORKER_CPUS if args.load_format == "sim" else 0.5)
    gpus = args.worker_gpus if args.worker_gpus is not None else (1.0 if gpu else 0.0)
    threads = args.torch_threads
    if threads is None and not gpu and not args.ray_address:
        # A local CPU cluster: split the cores between the workers instead of oversubscribing them.
        # Autoscaled pools count at their largest; a TP worker counts each of its ranks.
        ranks = args.colocated_workers * tp["colocated"] if args.mode == "colocated" else \
            args.prefill_workers[1] * tp["prefill"] + (args.decode_workers[1] + args.fast_lane_workers[1]) * tp["decode"]
        threads = max(1, (os.cpu_count() or 1) // ranks)

    spec = SpeculativeConfig.parse(args.speculative_config)
    fast_spec = spec if args.fast_lane_speculative_config is None else \
        SpeculativeConfig.parse(None if args.fast_lane_speculative_config in ("{}", "off") else
                                args.fast_lane_speculative_config)

    def pool(n: int | tuple[int, int], scheduler: SchedulerConfig, resources: list[str], name: str,
             speculative=None) -> PoolConfig:
        lo, hi = (n, n) if isinstance(n, int) else n
        return PoolConfig(num_workers=lo, max_workers=hi if hi > lo else None, num_cpus=cpus, num_gpus=gpus,
                          resources=parse_resources(resources), scheduler=scheduler, cache=cache, torch_threads=threads,
                          tensor_parallel_size=tp[name], expert_parallel_size=ep[name], speculative=speculative)

    prefill = SchedulerConfig(max_num_batched_tokens=args.prefill_token_budget)
    decode = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.decode_token_budget,
                             reservation_headroom_blocks=args.reservation_headroom_blocks)
    colocated = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.prefill_token_budget)
    pools = dict(colocated=pool(args.colocated_workers, colocated, [], "colocated", spec)) if args.mode == "colocated" \
        else dict(prefill=pool(args.prefill_workers, prefill, args.prefill_resource, "prefill"),
                  decode=pool(args.decode_workers, decode, args.decode_resource, "decode", spec))
    if args.fast_lane_workers[0]:
        if args.mode == "colocated":
            raise ValueError("the fast lane (--fast-lane-workers) is a set of decode workers: it needs disaggregated mode")
        pools["fast"] = pool(args.fast_lane_workers, decode, args.decode_resource, "decode", fast_spec)
    return pools


def _engine_config(args: argparse.Namespace):
    """The model, its dtype and device, the default cache, and the peaks MFU and MBU are read against."""
    from pdserve.config import CacheConfig, EngineConfig

    cache = CacheConfig(block_size=args.block_size, memory_bytes=args.kv_cache_mib << 20,
                        offload_bytes=args.kv_offload_mib << 20, offload_dir=args.kv_offload_dir,
                        offload_disk_bytes=args.kv_offload_disk_mib << 20)
    peaks = (args.peak_flops, args.peak_memory_bandwidth)
    if args.load_format == "sim":  # MFU and MBU against the GPU a simulated worker stands for, unless given
        from pdserve.perf.hardware import gpu

        device = gpu(args.sim_gpu)
        peaks = (peaks[0] or device.flops, peaks[1] or device.bytes_per_s)
    engine = EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype,
                          quantization=args.quantization, device=args.device,
                          cuda_graphs=False if args.enforce_eager else None, pipelined_decode=args.pipelined_decode,
                          cache=cache, peak_flops=peaks[0], peak_bytes_per_second=peaks[1],
                          tensor_parallel_size=args.tensor_parallel_size, expert_parallel_size=args.expert_parallel_size,
                          tensor_parallel_timeout_s=args.tensor_parallel_timeout,
                          sim_gpu=args.sim_gpu, sim_kv_scale=args.sim_kv_scale, sim_time_scale=args.sim_time_scale,
                          weights_root=os.path.abspath(args.weights_root) if args.weights_root else None)
    if engine.load_format == "sim":
        import logging

        from pdserve.engine.sim_runner import sim_plan
        from pdserve.model.loader import load_info

        logging.getLogger(__name__).info("every worker is a %s", sim_plan(engine, load_info(engine)).describe())
    return engine


def _key_file(path: str | None) -> bytes | None:
    """A secret's first line, as bytes (None: no file given)."""
    if path is None:
        return None
    with open(path, "rb") as f:
        key = f.readline().strip()
    if not key:
        raise ValueError(f"{path}: the key file is empty")
    return key


def parse_resources(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, amount = item.partition("=")
        if not sep or not name:
            raise ValueError(f"resources are NAME=AMOUNT, got {item!r}")
        out[name] = float(amount)
    return out


def build_parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; for `serve --config FILE`, the file's values are the defaults under the flags."""
    parser, serve = _parsers()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        serve.set_defaults(**load_config(args.config, serve))
        args = parser.parse_args(argv)
    return args


def yaml_load(stream: Any) -> Any:
    """yaml.safe_load, except that 1:4 stays the string "1:4" (YAML 1.1 reads it as the base-60 number
    64, and a pool's range MIN:MAX would silently become 64 workers)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    int_tag = "tag:yaml.org,2002:int"
    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != int_tag]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(int_tag, re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)"
                                                     r"|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
    return yaml.load(stream, Loader=Loader)  # noqa: S506 - a SafeLoader


def load_config(path: str, serve: argparse.ArgumentParser) -> dict[str, Any]:
    """A YAML mapping of `pdserve serve` flags to values, checked and converted as the flags would be."""
    with open(path) as f:
        data = yaml_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file is a mapping of flag names to values")
    actions = {a.dest: a for a in serve._actions if a.dest not in ("help", "config")}
    out: dict[str, Any] = {}
    for key, value in data.items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None:
            raise ValueError(f"{path}: unknown key {key!r}; the keys are the flags of `pdserve serve`: "
                             + ", ".join(sorted(a.option_strings[0][2:] for a in actions.values() if a.option_strings)))
        many = isinstance(action, argparse._AppendAction)
        values = value if many and isinstance(value, list) else [value]
        converted = []
        for v in values:
            if action.nargs == 0:  # a switch
                if not isinstance(v, bool):
                    raise ValueError(f"{path}: {key} is a switch: true or false, got {v!r}")
            elif action.type is not None and v is not None:
                try:
                    v = action.type(v)
                except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                    raise ValueError(f"{path}: {key}: {e}") from None
            if action.choices is not None and v not in action.choices:
                raise ValueError(f"{path}: {key} must be one of {list(action.choices)}, got {v!r}")
            converted.append(v)
        out[action.dest] = converted if many else converted[0]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The whole command line and its `serve` subparser."""
    from pdserve.cli import build_parser as client_parser

    serve: list[argparse.ArgumentParser] = []
    parser = client_parser([lambda sub: serve.append(add_serve_parser(sub))])
    return parser, serve[0]


if __name__ == "__main__":
    sys.exit(main())
