"""The servers of one router: its ports bound at start, drained at stop.

The gRPC port (the Generation and Weights services, health, reflection), a plaintext health port for
probes, the HTTP door (uvicorn on this event loop, beside gRPC: one admission, one cluster), the Prometheus
/metrics endpoint and, if configured, the control ports: the Weights service (gRPC) and the HTTP control
routes on an address of their own (RouterConfig.control_host), refused on the public ports. Who may call
what on each port is router.security's. What they serve is built by the composition root (router.compose);
this module only binds, starts and stops them.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from pdserve.v1 import generation_pb2 as pb
from router.admission import parse_wire
from router.config import RouterConfig
from router.frontend import Frontend
from router.grpc_api import SERVICE_NAME, GenerationService
from router.security import Access, Guard, server_credentials
from router.weights import WeightControl
from router.weights_api import WEIGHTS_SERVICE_NAME, WeightsService

log = logging.getLogger(__name__)


class Router:
    """A router's servers over its front and weight control: start(), then stop() drains them (the cluster
    stays up)."""

    def __init__(self, front: Frontend, weights: WeightControl, config: RouterConfig):
        self.front = front
        self.cluster = front.cluster
        self.config = config
        self.metrics = front.metrics
        self.weights = weights
        self.service = GenerationService(front)
        self.weights_service = WeightsService(weights)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_server = None
        self._health_server: grpc.aio.Server | None = None
        self.http_port: int | None = None
        self.http_app = None
        self._http: list[tuple] = []  # (uvicorn server, its task): the HTTP door, and the HTTP control port's
        self.control_port: int | None = None
        self._control_server: grpc.aio.Server | None = None
        self.control_http_port: int | None = None
        # The HTTP control routes: admin only, served on the HTTP door or on the control HTTP port; whoever adds
        # one adds it here, before start(). SGLang's and vLLM's RL routes (router.sglang_api, router.vllm_api).
        from fastapi import APIRouter

        from router import sglang_api, sglang_weights_api, vllm_api, vllm_weights_api

        self.http_control = APIRouter()
        sglang_api.add_control_routes(self.http_control, front, weights)
        vllm_api.add_control_routes(self.http_control, weights)
        sglang_weights_api.add_client_group_routes(self.http_control, weights)  # a client's weight group
        vllm_weights_api.add_weight_transfer_routes(self.http_control, weights)  # vLLM's checkpoint-path form
        # Request bytes each door reads (RouterConfig.max_request_body_bytes) and the HTTP door's budget; at start.
        self.max_request_body_bytes = self.grpc_max_receive_bytes = self.request_body_budget_bytes = 0

    def access(self, control_port: bool = False) -> Access:
        """Who may call what on the public ports, or on the control ports (router.security)."""
        c = self.config
        if control_port:  # only control is served there: the inference key means nothing
            return Access(None, c.admin_api_key, c.admin_client_names, control_port=True)
        return Access(c.api_key, c.admin_api_key, c.admin_client_names,
                      control_elsewhere=c.control_port is not None)

    async def start(self) -> int:
        c = self.config
        self.max_request_body_bytes, self.grpc_max_receive_bytes, self.request_body_budget_bytes = \
            c.request_bounds(self.front.info.max_model_len)
        address = await self._start_grpc()
        if c.health_port is not None:
            self._health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            self.health_port = self._health_server.add_insecure_port(f"{c.host}:{c.health_port}")
            if self.health_port == 0:
                raise OSError(f"could not bind {c.host}:{c.health_port}")
            await self._health_server.start()
        if c.control_port is not None:
            await self._start_control()
        if c.http_port is not None:
            await self._start_http()
        if self.metrics is not None:
            tls = dict(certfile=c.ssl_certfile, keyfile=c.ssl_keyfile) if c.metrics_tls else {}
            self._metrics_server, _ = start_http_server(c.metrics_port, c.metrics_host, registry=self.metrics.registry,
                                                        **tls)
            self.metrics_port = self._metrics_server.server_port
            log.info("metrics on %s://%s:%d/metrics", "https" if c.metrics_tls else "http", c.metrics_host,
                     self.metrics_port)
        self.front.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        keys = "API key required" if c.api_key else "no API key"
        log.info("pdserve listening on %s (%s mode; %s; %s; control: %s)", address.rsplit(":", 1)[0] + f":{self.port}",
                 self.cluster.config.mode, "TLS" + (" with client certificates" if c.ssl_ca_certs else "")
                 if c.tls else "plaintext", keys, self._control_said())
        return self.port

    def _control_said(self) -> str:
        c = self.config
        where = f"port {self.control_port} on {c.control_host}" if self.control_port else "the API port"
        who = "admin key" if c.admin_api_key else "admin certificates" if c.admin_client_names else \
            "callers of the control port" if self.control_port else \
            "loopback peers only" if self.access().no_credentials else "nobody (no admin credential)"
        return f"{where}, {who}"

    def _grpc_server(self, control_port: bool) -> grpc.aio.Server:
        # A gRPC message over the bound is refused by grpc itself (RESOURCE_EXHAUSTED), from its length
        # prefix, before it is read.
        return grpc.aio.server(interceptors=[Guard(self.access(control_port))],
                               options=[("grpc.max_receive_message_length", self.grpc_max_receive_bytes),
                                        *self.config.grpc_options()])

    def _bind(self, server: grpc.aio.Server, host: str, port: int) -> int:
        c = self.config
        address = f"{host}:{port}"
        bound = server.add_secure_port(address, server_credentials(c.ssl_certfile, c.ssl_keyfile, c.ssl_ca_certs)) \
            if c.tls else server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"could not bind {address}")
        return bound

    async def _start_grpc(self) -> str:
        c = self.config
        server = self._grpc_server(control_port=False)
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
        services = [grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)]
        if c.control_port is None:  # else on the control port only (the Guard refuses control calls here)
            services.append(grpc.method_handlers_generic_handler(WEIGHTS_SERVICE_NAME, self.weights_service.handlers()))
        server.add_generic_rpc_handlers(tuple(services))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, WEIGHTS_SERVICE_NAME, health.SERVICE_NAME,
                                             reflection.SERVICE_NAME), server)
        self.port = self._bind(server, c.host, c.port)
        await server.start()
        self.server = server
        return f"{c.host}:{c.port}"

    async def _start_control(self) -> None:
        """The Weights service alone on control_host:control_port (TLS as the API port's)."""
        c = self.config
        server = self._grpc_server(control_port=True)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(WEIGHTS_SERVICE_NAME,
                                                                              self.weights_service.handlers()),))
        self.control_port = self._bind(server, c.control_host, c.control_port)
        await server.start()
        self._control_server = server
        log.info("control (the Weights service) on %s:%d", c.control_host, self.control_port)

    async def _start_http(self) -> None:
        from router.openai_api import build_app, build_control_app

        c = self.config
        name = c.served_model_name or Path(self.front.info.path).name
        separate = c.control_http_port is not None
        app = build_app(self.front, name, self.access(), self.max_request_body_bytes, self.request_body_budget_bytes,
                        None if separate else self.http_control, c.read_timeout_s)
        from router import sglang_api, vllm_api

        app.include_router(sglang_api.generate_routes(self.front))  # SGLang's /generate, the inference role
        app.include_router(vllm_api.generate_routes(self.front, {name, self.front.info.path}))
        self.http_app = app
        self.http_port = await self._serve_http(app, c.host, c.http_port)
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1 (model %r)", "https" if c.tls else "http", c.host,
                 self.http_port, name)
        if separate:
            control = build_control_app(self.http_control, self.access(control_port=True), self.front.metrics,
                                        self.max_request_body_bytes, self.request_body_budget_bytes, c.read_timeout_s)
            self.control_http_port = await self._serve_http(control, c.control_host, c.control_http_port)
            log.info("HTTP control routes on %s:%d", c.control_host, self.control_http_port)

    async def _serve_http(self, app, host: str, port: int) -> int:
        """Serve an app with uvicorn on this event loop (TLS as the API port's); the port bound."""
        import uvicorn

        from router.http_limits import head_deadline

        c = self.config
        tls = {}
        if c.tls:
            tls = dict(ssl_certfile=c.ssl_certfile, ssl_keyfile=c.ssl_keyfile, ssl_ca_certs=c.ssl_ca_certs,
                       ssl_cert_reqs=ssl.CERT_REQUIRED if c.ssl_ca_certs else ssl.CERT_NONE)
        # Its drain runs beside gRPC's (the front stops serving for both); what is still open when stop()
        # reaches it gets the drain timeout again, at most.
        # Bounds on connections (RouterConfig: max_connections, read_timeout_s): uvicorn's own limit, and its
        # HTTP/1.1 protocol with a deadline on each request's head (router.http_limits.head_deadline).
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, lifespan="off", log_level="warning",
                                               access_log=False, timeout_graceful_shutdown=c.drain_timeout_s,
                                               limit_concurrency=c.max_connections,
                                               http=head_deadline(c.read_timeout_s), **tls))
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():  # it could not bind: say why
                task.result()
                raise OSError(f"the HTTP server on {host}:{port} did not start")
            await asyncio.sleep(0.01)
        self._http.append((server, task))
        return server.servers[0].sockets[0].getsockname()[1]

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new requests and let in-flight ones finish within the grace period (the cluster stays up)."""
        await self.front.drain()
        await self.health.enter_graceful_shutdown()
        grace = self.config.drain_timeout_s if grace is None else grace
        for server in (self.server, self._control_server):
            if server is not None:
                await server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(0)
        for server, _ in self._http:
            server.should_exit = True  # after the gRPC drain: in-flight HTTP streams had it too
        for _, task in self._http:
            await task
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.front.close()
        self.weights.close()
