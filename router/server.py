"""The router's gRPC front door: validation, admission, streaming, health, reflection and drain.

Errors are mapped to status codes here and nowhere else: ValueError from parsing or from the cluster's
own checks is INVALID_ARGUMENT; a full admission queue is RESOURCE_EXHAUSTED at once; a request the
workers failed is UNAVAILABLE; a client deadline or cancel cancels the handler, whose cleanup cancels
the request on every worker.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from pdserve.config import ClusterConfig
from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling import LOGPROBS_MODES, VERSION_POLICIES
from router.metrics import PoolScale, RouterMetrics
from pdserve.tiers import TIERS, ServiceTier, parse_tier
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.admission import Admission, Malformed, Overloaded, RequestFailed, Samples, parse_request, parse_wire
from router.autoscaler import AutoscaleLoop
from router.cluster import Cluster
from router.security import ApiKeyInterceptor, server_credentials
from router.tracking import Timeline
from router.weights import WEIGHTS_SERVICE_NAME, WeightControl, WeightsService

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
           FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED, FinishReason.ERROR: pb.FINISH_REASON_ERROR,
           FinishReason.ABORT: pb.FINISH_REASON_ABORT}


# What the largest valid request can take on the wire, from the limits the router checks a request against
# (router.admission.prepare), so that the doors refuse what no valid request can be before reading it:
# - text: max_input_chars characters of prompt or messages. JSON writes a character as at most 12 bytes (one
#   outside the BMP escaped as a surrogate pair, "\ud83d\ude00", which clients that escape non-ASCII send:
#   Python's json and requests among them); protobuf as at most 4 (UTF-8).
# - per token of the context (max_model_len): a token id as JSON is at most 8 digits and ", " (10 bytes); a
#   chat message, each of which takes at least one token of the template, adds {"role": "", "content": ""},
#   (29 bytes) beside its characters: 32 bytes a token in JSON; in protobuf a varint id or a message's tags
#   and lengths, 8.
# - 1 MiB for every other field (sampling, stop strings, names).
# With the defaults (1 Mi characters) and SmolLM2's 8,192-token context: HTTP 12 MiB + 256 KiB + 1 MiB =
# 13,893,632 bytes; gRPC 4 MiB + 64 KiB + 1 MiB = 5,308,416 (gRPC's own default, 4 MiB, refused a valid
# 1 Mi-character prompt of 4-byte characters). A 128k-token context adds 4 MiB to HTTP's, 1 MiB to gRPC's.
JSON_BYTES_PER_CHAR, JSON_BYTES_PER_TOKEN = 12, 32
PROTO_BYTES_PER_CHAR, PROTO_BYTES_PER_TOKEN = 4, 8
REQUEST_HEADROOM_BYTES = 1 << 20
BODY_BUDGET_REQUESTS = 16  # the HTTP door holds at most this many of the largest bodies at once, by default


def request_size_bounds(max_input_chars: int, max_model_len: int) -> tuple[int, int]:
    """(HTTP body, gRPC message): the bytes the largest valid request can take in each door's encoding."""
    return (JSON_BYTES_PER_CHAR * max_input_chars + JSON_BYTES_PER_TOKEN * max_model_len + REQUEST_HEADROOM_BYTES,
            PROTO_BYTES_PER_CHAR * max_input_chars + PROTO_BYTES_PER_TOKEN * max_model_len + REQUEST_HEADROOM_BYTES)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    max_running: int = 256  # requests on the workers at once
    max_queued: int = 1024  # more wait for admission, in order; past that: RESOURCE_EXHAUSTED
    max_input_chars: int = 1 << 20  # text accepted before tokenizing (prompt or all messages)
    drain_timeout_s: float = 30.0  # graceful shutdown: in-flight requests get this long to finish
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # Prometheus /metrics; None: no endpoint and no recording
    # The edge (router.security): TLS on the gRPC port with this certificate and key; client certificates
    # signed by ssl_ca_certs required if given; an API key every RPC but health must carry.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    api_key: str | None = None
    metrics_tls: bool = False  # /metrics over HTTPS with the same certificate
    health_port: int | None = None  # grpc.health.v1 alone, plaintext, on this port too (for probes)
    http_port: int | None = None  # the OpenAI-compatible HTTP API (router.openai_api) on host:http_port
    served_model_name: str | None = None  # the model's name in the HTTP API; None: its file or directory name
    # The distribution sampled tokens' logprobs come from when a request does not say (either API):
    # "raw" or "processed" (pdserve.engine.sampling.SamplingParams.logprobs_mode).
    logprobs_mode: str = "raw"
    # What a request in flight does when the weights change, when it does not say (router.weights):
    # "recompute", "keep" or "abort" (pdserve.engine.sampling.SamplingParams.version_policy).
    version_policy: str = "recompute"
    # The bytes of one request either door reads, an HTTP body or a gRPC message: past it HTTP answers 413
    # before reading on, gRPC RESOURCE_EXHAUSTED. None: what the largest valid request can take in that door's
    # encoding (request_size_bounds).
    max_request_body_bytes: int | None = None
    # The bytes of HTTP request bodies the door holds at once (being read, or read and not yet answered); a
    # request that would pass it is answered 503 at once. None: BODY_BUDGET_REQUESTS of the largest.
    request_body_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_queued < 0:
            raise ValueError("max_running must be >= 1 and max_queued >= 0")
        if any(n is not None and n < 1 for n in (self.max_request_body_bytes, self.request_body_budget_bytes)):
            raise ValueError("max_request_body_bytes and request_body_budget_bytes must be >= 1")
        if None not in (self.max_request_body_bytes, self.request_body_budget_bytes) \
                and self.request_body_budget_bytes < self.max_request_body_bytes:
            raise ValueError("request_body_budget_bytes must be >= max_request_body_bytes (one body must fit)")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("TLS needs both a certificate (--ssl-certfile) and its key (--ssl-keyfile)")
        if (self.ssl_ca_certs or self.metrics_tls) and not self.ssl_certfile:
            raise ValueError("--ssl-ca-certs and --metrics-tls need --ssl-certfile and --ssl-keyfile")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.version_policy not in VERSION_POLICIES:
            raise ValueError(f"version_policy must be one of {', '.join(VERSION_POLICIES)}, "
                             f"got {self.version_policy!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")
        for path in (self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs):
            if path is not None and not os.path.isfile(path):  # now, not once the pools have loaded the model
                raise FileNotFoundError(f"no such file: {path}")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def request_bounds(self, max_model_len: int) -> tuple[int, int, int]:
        """(HTTP body, gRPC message, HTTP bodies held at once) in bytes, for a model of this context."""
        http, grpc_ = request_size_bounds(self.max_input_chars, max_model_len)
        if self.max_request_body_bytes is not None:
            http = grpc_ = self.max_request_body_bytes
        budget = self.request_body_budget_bytes or BODY_BUDGET_REQUESTS * http
        if budget < http:
            raise ValueError(f"request_body_budget_bytes ({budget}) is below one request body's bound ({http})")
        return http, grpc_, budget


def _fill_logprob(msg: pb.TokenLogprob, lp: TokenLogprob) -> None:
    msg.token_id, msg.logprob, msg.rank = lp.token_id, lp.logprob, lp.rank
    top = msg.top
    for token_id, logprob in lp.top:
        top.add(token_id=token_id, logprob=logprob)


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, cluster: Cluster, config: RouterConfig, metrics: RouterMetrics | None = None):
        self.cluster = cluster
        self.config = config
        self.metrics = metrics
        self.admission = Admission(config.max_running, config.max_queued)
        tiers = cluster.config.tiers
        self.flex_admission = Admission(config.max_running, tiers.flex_max_queued)
        self._waiting: collections.Counter[ServiceTier] = collections.Counter()  # for admission, by tier
        self.serving = True
        # Autoscaled pools follow the demand seen here (the admission queue included).
        self.autoscaler = AutoscaleLoop(cluster, lambda: self.admitting) if cluster.config.ranges else None
        if metrics is not None:
            metrics.running.set_function(lambda: self.admitted)
            metrics.queued.set_function(lambda: self.admitting)
            metrics.tier_queued(self.queued)

    # -- Generate ---------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest | Malformed, context: grpc.aio.ServicerContext):
        t = Timeline("grpc")
        try:
            async for resp in self._generate(request, context, t):
                yield resp
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            t.code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            t.finish_reason = "cancelled"
            raise
        finally:
            t.record(self.metrics)

    async def _generate(self, request, context, t: Timeline):
        async def abort(code: grpc.StatusCode, message: str) -> None:
            t.code = code.name
            await context.abort(code, message)

        if isinstance(request, Malformed):
            await abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        if not self.serving:
            await abort(grpc.StatusCode.UNAVAILABLE, "the router is draining; retry on another replica")
        try:
            prompt, params = parse_request(request, self.cluster.info, self.config.max_input_chars,
                                           self.config.logprobs_mode, self.config.version_policy)
            tier = parse_tier(request.service_tier)
        except ValueError as e:
            await abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        t.prompt_tokens = len(prompt)
        samples = Samples(params.n)
        try:
            async for out in self.run(prompt, params, request.request_id or None, t, tier):
                last = samples.add(out)
                yield self._response(out, t, samples.completion_tokens if last else None)
        except RequestFailed as e:
            await abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Overloaded as e:
            await abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:  # the cluster's own checks (context length, duplicate request id, ...)
            await abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    @property
    def admitted(self) -> int:
        """Requests admitted to the cluster, every tier's admission together."""
        return self.admission.running + self.flex_admission.running

    @property
    def admitting(self) -> int:
        """Requests waiting for admission, every tier's together."""
        return self.admission.queued + self.flex_admission.queued

    def queued(self, tier: ServiceTier) -> int:
        """Requests of a tier waiting: for admission, or in the cluster's line for workers."""
        return self._waiting[tier] + self.cluster.queued(tier)

    async def run(self, prompt: list[int], params, request_id: str | None, t: Timeline,
                  tier: ServiceTier = ServiceTier.DEFAULT) -> AsyncIterator[RequestOutput]:
        """A checked request through admission and the cluster, for either protocol: its outputs, recorded
        on its timeline as they stream. Raises Overloaded (the admission queue is full, or flex's queue
        is), ValueError (the cluster's own checks: context length, a duplicate request id, ...) or
        RequestFailed (the workers failed it). Closing it early cancels the request on every worker.

        flex has an admission of its own, so flex requests never take the places of the other tiers."""
        t.service_tier = t.served_tier = tier.value
        bound = self.cluster.config.tiers.flex_max_queued
        if tier is ServiceTier.FLEX and self.queued(tier) >= bound:
            raise Overloaded(f"the flex tier's queue is full ({bound} waiting); retry later")
        admission = self.flex_admission if tier is ServiceTier.FLEX else self.admission
        self._waiting[tier] += 1
        waiting = True
        try:
            async with admission.slot():
                self._waiting[tier] -= 1
                waiting = False
                t.admitted = time.monotonic()
                async with contextlib.aclosing(self.cluster.generate(prompt, params, request_id, tier)) as outs:
                    async for out in outs:
                        t.served_tier = out.service_tier
                        if out.finish_reason is FinishReason.ERROR:
                            t.finish_reason = "error"
                            raise RequestFailed(out.error or "the request failed on a worker")
                        t.tokens(len(out.new_token_ids))
                        t.token_versions += out.weight_versions
                        if out.finish_reason is not None:
                            t.finish_reason = out.finish_reason.value
                        yield out
        finally:
            if waiting:
                self._waiting[tier] -= 1

    @staticmethod
    def _response(out: RequestOutput, t: Timeline, completion_tokens: int | None = None) -> pb.GenerateResponse:
        """The message of one output (one sample's tokens). completion_tokens: given on the stream's last message
        only (every sample's output tokens), which alone carries the usage, timings and tier served: with n > 1
        a client then reads them once, as with n = 1, and sums nothing."""
        resp = pb.GenerateResponse(request_id=out.request_id, text=out.new_text, token_ids=out.new_token_ids,
                                   index=out.index, weight_versions=out.weight_versions)
        if out.finish_reason is not None:
            resp.finish_reason = _FINISH[out.finish_reason]
        if completion_tokens is not None:
            resp.service_tier = out.service_tier
            resp.usage.CopyFrom(pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=completion_tokens,
                                         cached_prompt_tokens=out.num_cached_tokens))
            resp.timings.CopyFrom(pb.Timings(queue_seconds=t.admitted - t.arrived,
                                             time_to_first_token_seconds=t.token_times[0] - t.arrived,
                                             end_to_end_seconds=t.token_times[-1] - t.arrived,
                                             prefill_worker=out.placement[0] if out.placement else "",
                                             decode_worker=out.placement[-1] if out.placement else ""))
        # Both are None unless the request asked for them: without logprobs a message costs these two checks.
        if out.logprobs is not None:
            for lp in out.logprobs:
                _fill_logprob(resp.logprobs.add(), lp)
        if out.prompt_logprobs is not None:
            for lp in out.prompt_logprobs:
                entry = resp.prompt_logprobs.add()
                if lp is not None:  # the prompt's first token: listed, with no logprob
                    _fill_logprob(entry.token, lp)
        return resp

    # -- info and status --------------------------------------------------------------------------
    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        info = self.cluster.info
        c = info.config
        return pb.ModelInfo(name=info.path, architecture=c.architecture, vocab_size=c.vocab_size,
                            max_model_len=info.max_model_len, num_layers=c.num_layers, hidden_size=c.hidden_size,
                            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, num_params=c.num_params,
                            dtype=self.cluster.config.engine.dtype,
                            has_chat_template=bool(info.tokenizer and info.tokenizer.has_chat_template),
                            eos_token_ids=list(info.eos_token_ids))

    def pool_scale(self) -> list[PoolScale]:
        """Each pool's size by state, its target and range, its scale events and start-up times."""
        pools, out = self.cluster.scaling, []
        for name, pc in self.cluster.config.pools.items():
            lo, hi = pc.num_workers, max(pc.num_workers, pc.max_workers or 0)
            desired = self.autoscaler.desired(name) if self.autoscaler is not None else None
            events = {(d, r): n for (p, d, r), n in pools.scale_events.items() if p == name}
            out.append(PoolScale(name, len(pools.by_name[name]), len(pools.starting[name]),
                                 sum(w.pool == name for w in pools.draining),
                                 desired if desired is not None else pools.size(name) if lo < hi else lo,
                                 lo, hi, tuple(pools.start_seconds[name]), events,
                                 self.cluster.config.engine_for(pc).tensor_parallel_size))
        return out

    async def GetClusterStatus(self, request, context) -> pb.ClusterStatus:
        stats = {s.worker_id: s for s in await self.cluster.stats()}
        pools = self.cluster.scaling
        out = pb.ClusterStatus(mode=self.cluster.config.mode,
                               requests_running=self.admitted, requests_queued=self.admitting,
                               queue_capacity=self.config.max_queued, serving=self.serving,
                               queued_by_service_tier={t.value: self.queued(t) for t in TIERS})
        for scale in self.pool_scale():
            name = scale.pool
            members = pools.starting[name] + pools.by_name[name] + [w for w in pools.draining if w.pool == name]
            workers, ws = [], []
            for w in members:
                s = stats.get(w.worker_id)
                if s is None:  # starting: nothing to report yet
                    workers.append(pb.WorkerStatus(worker_id=w.worker_id, pool=name, state=w.state))
                    continue
                ws.append(s)
                workers.append(pb.WorkerStatus(worker_id=s.worker_id, pool=s.pool, waiting_requests=s.waiting,
                                               waiting_tokens=s.waiting_tokens, running_requests=s.running,
                                               kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
                                               busy_fraction=s.busy_fraction, steps=s.steps,
                                               tokens_processed=s.tokens_processed, state=w.state,
                                               prompt_tokens_requested=s.prompt_tokens_requested,
                                               prompt_tokens_computed=s.prompt_tokens_computed,
                                               weight_version=s.weight_version))
            total = sum(s.kv_blocks_total for s in ws)
            out.pools.append(pb.PoolStatus(name=name, workers=workers, waiting_requests=sum(s.waiting for s in ws),
                                           kv_usage=sum(s.kv_blocks_used for s in ws) / total if total else 0.0,
                                           busy_fraction=sum(s.busy_fraction for s in ws) / len(ws) if ws else 0.0,
                                           current_workers=scale.ready + scale.starting,
                                           desired_workers=scale.desired, min_workers=scale.min_workers,
                                           max_workers=scale.max_workers,
                                           tensor_parallel_size=scale.tensor_parallel_size))
        return out


class Router:
    """The gRPC server over a started Cluster: start(), then stop() drains and shuts the pools down."""

    def __init__(self, cluster: Cluster, config: RouterConfig):
        self.cluster = cluster
        self.config = config
        doors = ("grpc", "http") if config.http_port is not None else ("grpc",)  # their series exist from the start
        self.metrics = RouterMetrics(cluster.worker_stats, lambda: (dict(cluster.restarts), dict(cluster.retries)),
                                     lambda: self.service.pool_scale(), cluster.config.tiers.slo,
                                     lambda: cluster.downgrades, doors, lambda: self.weights.version,
                                     ) if config.metrics_port is not None else None
        self.service = GenerationService(cluster, config, self.metrics)
        self.weights = WeightControl(cluster)  # updates, pause and resume (router.weights)
        self.weights_service = WeightsService(self.weights)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_server = None
        self._health_server: grpc.aio.Server | None = None
        self.http_port: int | None = None
        self.http_app = None
        self._http_server = None
        self._http_task: asyncio.Task | None = None
        # Request bytes each door reads (RouterConfig.max_request_body_bytes) and the HTTP door's budget; at start.
        self.max_request_body_bytes = self.grpc_max_receive_bytes = self.request_body_budget_bytes = 0

    async def start(self) -> int:
        c = self.config
        self.max_request_body_bytes, self.grpc_max_receive_bytes, self.request_body_budget_bytes = \
            c.request_bounds(self.cluster.info.max_model_len)
        # A gRPC message over the bound is refused by grpc itself (RESOURCE_EXHAUSTED), from its length
        # prefix, before it is read.
        server = grpc.aio.server(interceptors=[ApiKeyInterceptor(c.api_key)] if c.api_key else None,
                                 options=[("grpc.max_receive_message_length", self.grpc_max_receive_bytes)])
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.service.Generate, request_deserializer=parse_wire,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.service.GetModelInfo, request_deserializer=pb.GetModelInfoRequest.FromString,
                response_serializer=pb.ModelInfo.SerializeToString),
            "GetClusterStatus": grpc.unary_unary_rpc_method_handler(
                self.service.GetClusterStatus, request_deserializer=pb.GetClusterStatusRequest.FromString,
                response_serializer=pb.ClusterStatus.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),
                                         grpc.method_handlers_generic_handler(WEIGHTS_SERVICE_NAME,
                                                                              self.weights_service.handlers())))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, WEIGHTS_SERVICE_NAME, health.SERVICE_NAME,
                                             reflection.SERVICE_NAME), server)
        address = f"{c.host}:{c.port}"
        self.port = server.add_secure_port(address, server_credentials(c.ssl_certfile, c.ssl_keyfile, c.ssl_ca_certs)) \
            if c.tls else server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        await server.start()
        self.server = server
        if c.health_port is not None:
            self._health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            self.health_port = self._health_server.add_insecure_port(f"{c.host}:{c.health_port}")
            if self.health_port == 0:
                raise OSError(f"could not bind {c.host}:{c.health_port}")
            await self._health_server.start()
        if c.http_port is not None:
            await self._start_http()
        if self.metrics is not None:
            tls = dict(certfile=c.ssl_certfile, keyfile=c.ssl_keyfile) if c.metrics_tls else {}
            self._metrics_server, _ = start_http_server(c.metrics_port, c.metrics_host, registry=self.metrics.registry,
                                                        **tls)
            self.metrics_port = self._metrics_server.server_port
            log.info("metrics on %s://%s:%d/metrics", "https" if c.metrics_tls else "http", c.metrics_host,
                     self.metrics_port)
        if self.service.autoscaler is not None:
            self.service.autoscaler.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("pdserve listening on %s (%s mode; %s; %s)", address.rsplit(":", 1)[0] + f":{self.port}",
                 self.cluster.config.mode, "TLS" + (" with client certificates" if c.ssl_ca_certs else "")
                 if c.tls else "plaintext", "API key required" if c.api_key else "no API key")
        return self.port

    async def _start_http(self) -> None:
        import uvicorn

        from router.openai_api import build_app

        c = self.config
        name = c.served_model_name or Path(self.cluster.info.path).name
        app = build_app(self.service, name, c.api_key, self.max_request_body_bytes, self.request_body_budget_bytes)
        self.http_app = app
        tls = {}
        if c.tls:
            tls = dict(ssl_certfile=c.ssl_certfile, ssl_keyfile=c.ssl_keyfile, ssl_ca_certs=c.ssl_ca_certs,
                       ssl_cert_reqs=ssl.CERT_REQUIRED if c.ssl_ca_certs else ssl.CERT_NONE)
        # On this event loop, beside gRPC: one admission, one cluster.
        # Its drain runs beside gRPC's (service.serving turns False for both); what is still open when
        # stop() reaches it gets the drain timeout again, at most.
        server = uvicorn.Server(uvicorn.Config(app, host=c.host, port=c.http_port, lifespan="off",
                                               log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=c.drain_timeout_s, **tls))
        self._http_task = asyncio.create_task(server.serve())
        while not server.started:
            if self._http_task.done():  # it could not bind: say why
                self._http_task.result()
                raise OSError(f"the HTTP server on {c.host}:{c.http_port} did not start")
            await asyncio.sleep(0.01)
        self._http_server = server
        self.http_port = server.servers[0].sockets[0].getsockname()[1]
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1 (model %r)", "https" if c.tls else "http", c.host,
                 self.http_port, name)

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new requests and let in-flight ones finish within the grace period (the cluster stays up)."""
        self.service.serving = False
        if self.service.autoscaler is not None:  # the pools keep their size while the router drains
            await self.service.autoscaler.stop()
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(self.config.drain_timeout_s if grace is None else grace)
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._http_server is not None:
            self._http_server.should_exit = True  # after the gRPC drain: in-flight HTTP streams had it too
            await self._http_task
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.weights.close()


async def serve(cluster_config: ClusterConfig, router_config: RouterConfig, stop: asyncio.Event) -> None:
    """Start the pools and the router, serve until `stop` is set, then drain."""
    cluster = Cluster(cluster_config)
    await cluster.start()
    router = Router(cluster, router_config)
    await router.start()
    await stop.wait()
    log.info("draining (up to %.0fs)", router_config.drain_timeout_s)
    await router.stop()
    await cluster.shutdown()
