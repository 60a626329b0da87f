"""The router's own settings (RouterConfig: its doors, admission, the edge's TLS and key, the bounds on a
request's bytes) and the bounds derived from the model's context."""
from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve.engine.sampling import LOGPROBS_MODES, MAX_N, VERSION_POLICIES

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


# What a request may ask of the work it sizes, derived from the model as the byte bounds above are (#47):
# - top_k: at most the vocabulary (a larger k keeps every token: nothing to ask for beyond it).
# - messages: at most the context's tokens (each takes at least one token of the chat template), so that a
#   body of half a million empty messages is refused before the template renders it.
# - logprobs: a request's logprob entries (per generated token of each of its n samples, the token's and the k
#   most likely: n x max_tokens x (logprobs + 1); per prompt token, prompt_logprobs + 1) at most the tokens the
#   largest request without logprobs carries, MAX_N samples of the whole context: logprobs never make a
#   request bigger than one already allowed.
# - request ids: 1 to 128 characters of [A-Za-z0-9._:-]; the router builds worker-side ids from them
#   ("<router>/<id>#<attempt>", "<id>~<sample>"), logs them and echoes them.
REQUEST_ID_CHARS = 128
# - prompts: a completions request's list of prompts, at most MAX_PROMPTS (as many as the samples n may ask for),
#   each admitted and run as a request of its own; together they share one request's logprob entries (each
#   prompt's bound is the request's divided by the number of prompts), so a list never makes a response larger
#   than one prompt's could be.
MAX_PROMPTS = MAX_N


@dataclass(frozen=True)
class FieldBounds:
    vocab_size: int
    max_model_len: int
    max_input_chars: int  # RouterConfig.max_input_chars

    @property
    def max_top_k(self) -> int:
        return self.vocab_size

    @property
    def max_messages(self) -> int:
        return self.max_model_len

    @property
    def max_logprob_entries(self) -> int:
        return MAX_N * self.max_model_len


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
    # Roles (router.security): control calls (the Weights service, HTTP control routes) need the admin
    # credential, an admin key or (mutual TLS) a client certificate carrying one of admin_client_names; the
    # inference key is refused them. With control_port (and control_http_port), control is served there only,
    # on control_host (loopback by default, or an internal interface), and refused on the public ports.
    admin_api_key: str | None = None
    admin_client_names: tuple[str, ...] = ()
    control_host: str = "127.0.0.1"
    control_port: int | None = None  # 0: any free port
    control_http_port: int | None = None
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
    # Connections (#47): what one client can hold open. gRPC: connections beyond max_connections are refused;
    # one connection carries at most max_streams_per_connection calls at once (more wait, client-side; None:
    # max_running + max_queued, all that admission could hold); a connection without a call for
    # idle_timeout_s is closed (GOAWAY); the router pings a connection after keepalive_s without data and
    # closes it if no answer comes in keepalive_timeout_s (a client gone without a word); a client that pings
    # more often than every min_ping_interval_s is disconnected. HTTP: at most max_connections connections and
    # requests at once (503 past it); a request's head must arrive within read_timeout_s of its connection's
    # opening (or of the response before it), and its body within read_timeout_s of its head: a stalled
    # upload is answered 408, its bytes dropped.
    max_connections: int = 1024
    max_streams_per_connection: int | None = None
    idle_timeout_s: float = 300.0
    keepalive_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    min_ping_interval_s: float = 10.0
    read_timeout_s: float = 30.0

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
        if self.max_connections < 1 or (self.max_streams_per_connection is not None
                                         and self.max_streams_per_connection < 1):
            raise ValueError("max_connections and max_streams_per_connection must be >= 1")
        for name in ("idle_timeout_s", "keepalive_s", "keepalive_timeout_s", "min_ping_interval_s", "read_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.version_policy not in VERSION_POLICIES:
            raise ValueError(f"version_policy must be one of {', '.join(VERSION_POLICIES)}, "
                             f"got {self.version_policy!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")
        if self.admin_api_key is not None and not self.admin_api_key:
            raise ValueError("the admin API key is empty")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("the admin API key must differ from the inference API key (--api-key)")
        object.__setattr__(self, "admin_client_names", tuple(self.admin_client_names))
        if self.admin_client_names and not self.ssl_ca_certs:
            raise ValueError("--admin-client-name needs client certificates: --ssl-ca-certs (mutual TLS)")
        if self.control_http_port is not None and self.http_port is None:
            raise ValueError("--control-http-port needs the HTTP API (--http-port)")
        for path in (self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs):
            if path is not None and not os.path.isfile(path):  # now, not once the pools have loaded the model
                raise FileNotFoundError(f"no such file: {path}")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def grpc_options(self) -> list[tuple[str, int]]:
        """The gRPC server's bounds on its connections (the fields above, in grpc's channel arguments)."""
        ms = lambda seconds: int(seconds * 1000)  # noqa: E731
        return [("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.max_concurrent_streams", self.max_streams_per_connection or self.max_running + self.max_queued),
                ("grpc.max_connection_idle_ms", ms(self.idle_timeout_s)),
                ("grpc.keepalive_time_ms", ms(self.keepalive_s)),
                ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
                # grpc 1.85 waits for a ping's answer this long whatever keepalive_timeout_ms says (measured: a
                # peer that never answers a keepalive ping was kept past 15 s without it)
                ("grpc.http2.ping_timeout_ms", ms(self.keepalive_timeout_s)),
                ("grpc.keepalive_permit_without_calls", 1),  # the router's own pings, on an idle connection too
                ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_ping_interval_s)),
                ("grpc.http2.max_ping_strikes", 2)]

    def request_bounds(self, max_model_len: int) -> tuple[int, int, int]:
        """(HTTP body, gRPC message, HTTP bodies held at once) in bytes, for a model of this context."""
        http, grpc_ = request_size_bounds(self.max_input_chars, max_model_len)
        if self.max_request_body_bytes is not None:
            http = grpc_ = self.max_request_body_bytes
        budget = self.request_body_budget_bytes or BODY_BUDGET_REQUESTS * http
        if budget < http:
            raise ValueError(f"request_body_budget_bytes ({budget}) is below one request body's bound ({http})")
        return http, grpc_, budget
