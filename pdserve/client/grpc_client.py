"""Python clients of the pdserve gRPC API (sync and asyncio).

    with Client("127.0.0.1:50051") as c:
        for r in c.generate("Once upon a time", max_tokens=32):
            print(r.text, end="", flush=True)
        print(c.complete(messages=[{"role": "user", "content": "Hi"}]).text)
        for s in c.complete("Once upon a time", n=4, seed=7).choices:  # 4 samples of one prompt
            print(s.index, s.text)

A router started with TLS and an API key (`pdserve serve --ssl-certfile ... --api-key-file ...`) takes
the same options here: Client(target, api_key=KEY, ssl_ca_certs="ca.pem") verifies the server against
that CA and sends `authorization: Bearer KEY` with every call; ssl_certfile/ssl_keyfile add a client
certificate (mutual TLS); tls=True alone uses the system's trusted CAs. api_key None reads
$PDSERVE_API_KEY.
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
API_KEY_ENV = "PDSERVE_API_KEY"
ADMIN_API_KEY_ENV = "PDSERVE_ADMIN_API_KEY"  # the admin key (control calls: weights, pause, resume)
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_CANCELLED: "cancelled", pb.FINISH_REASON_ERROR: "error",
                  pb.FINISH_REASON_ABORT: "abort"}


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability at one position (pdserve.v1.TokenLogprob as plain values)."""

    token_id: int
    logprob: float  # -inf where the processed distribution masked the token out
    rank: int  # 1 + the number of tokens with a strictly higher logprob
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (token id, logprob), most likely first

    @classmethod
    def of(cls, m: pb.TokenLogprob) -> TokenLogprob:
        return cls(m.token_id, m.logprob, m.rank, tuple((t.token_id, t.logprob) for t in m.top))


@dataclass
class Sample:
    """One completion of a request's prompt: with n > 1 the request has n, by index."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "" until this sample has finished
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with logprobs=k: one per token of token_ids
    weight_versions: list[int] = field(default_factory=list)  # one per token of token_ids: the weights' version
    # With return_routed_experts: entry p is the token at position p's experts, [moe layers][top_k] (the
    # prompt's positions, then the output's but its last: GenerateResponse.routed_experts).
    routed_experts: list[list[list[int]]] = field(default_factory=list)


@dataclass
class Completion:
    """A request's answer, gathered from its stream (add() per message). choices: its samples by index, one
    unless the request asked for n; text, token_ids, finish_reason and logprobs are the first one's, so
    that a request of one sample reads them directly. usage (prompt tokens once, completion tokens of every
    sample), timings and service_tier are the request's, from the stream's last message."""

    request_id: str = ""
    choices: list[Sample] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float | str] = field(default_factory=dict)
    service_tier: str = ""  # the tier served (last message)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # with prompt_logprobs=k: the first None

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids if self.choices else []

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason if self.choices else ""

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.choices[0].logprobs if self.choices else []

    def add(self, r: pb.GenerateResponse) -> None:
        self.request_id = r.request_id
        while len(self.choices) <= r.index:  # samples' first messages come in any order
            self.choices.append(Sample(len(self.choices)))
        sample = self.choices[r.index]
        sample.text += r.text
        sample.token_ids.extend(r.token_ids)
        sample.weight_versions.extend(r.weight_versions)
        if r.logprobs:
            sample.logprobs.extend(map(TokenLogprob.of, r.logprobs))
        if r.HasField("routed_experts"):
            e = r.routed_experts
            if e.start != len(sample.routed_experts):
                raise ValueError(f"routed experts of position {e.start} after {len(sample.routed_experts)} positions")
            per = e.num_layers * e.top_k
            sample.routed_experts += [[list(e.expert_ids[a + layer * e.top_k:a + (layer + 1) * e.top_k])
                                       for layer in range(e.num_layers)] for a in range(0, len(e.expert_ids), per)]
        if r.prompt_logprobs:
            self.prompt_logprobs = [TokenLogprob.of(p.token) if p.HasField("token") else None
                                    for p in r.prompt_logprobs]
        if r.finish_reason:
            sample.finish_reason = FINISH_REASONS[r.finish_reason]
        if r.HasField("usage"):  # the stream's last message
            self.usage = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                          "cached_prompt_tokens": r.usage.cached_prompt_tokens}
            t = r.timings
            self.timings = {"queue_seconds": t.queue_seconds,
                            "time_to_first_token_seconds": t.time_to_first_token_seconds,
                            "end_to_end_seconds": t.end_to_end_seconds, "prefill_worker": t.prefill_worker,
                            "decode_worker": t.decode_worker}
            self.service_tier = r.service_tier


def build_request(prompt: str | None = None, *, messages: Sequence[dict[str, str]] | None = None,
                  token_ids: Sequence[int] | None = None, max_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, request_id: str = "", service_tier: str = "",
                  presence_penalty: float | None = None, frequency_penalty: float | None = None,
                  repetition_penalty: float | None = None, min_tokens: int | None = None,
                  logprobs: int | None = None, prompt_logprobs: int | None = None,
                  logprobs_mode: str = "", n: int | None = None, version_policy: str = "",
                  max_staleness: int | None = None, session_id: str = "", min_p: float | None = None,
                  include_stop_str_in_output: bool = False, skip_special_tokens: bool | None = None,
                  structured_output: pb.StructuredOutput | None = None,
                  return_routed_experts: bool = False) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one of prompt, messages or token_ids; None leaves the server default.
    service_tier: auto (or empty), default, priority or flex (pdserve.tiers). logprobs / prompt_logprobs: k
    in [0, 20], the top k beside each generated / prompt token's own logprob; logprobs_mode: raw, processed
    or empty (the server's). n: samples of the prompt, in [1, 128] (sample i seeded seed + i). version_policy:
    recompute, keep, abort or empty (the server's), max_staleness keep's bound, if the weights change while the
    request runs. session_id: a conversation's key, the same on each of its turns (placement keeps a session where
    its KV is). structured_output: what the text must match (unset: free text). return_routed_experts: every
    token's experts (a mixture-of-experts model; Sample.routed_experts). The fields' meanings are the
    .proto's (GenerateRequest, SamplingParams, StructuredOutput)."""
    if sum(x is not None for x in (prompt, messages, token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages or token_ids")
    req = pb.GenerateRequest(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                             request_id=request_id, service_tier=service_tier, session_id=session_id,
                             include_stop_str_in_output=include_stop_str_in_output,
                             return_routed_experts=return_routed_experts)
    if skip_special_tokens is not None:
        req.skip_special_tokens = skip_special_tokens
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                                        for m in messages]))
    else:
        req.token_ids.CopyFrom(pb.TokenIds(ids=list(token_ids)))
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if logprobs is not None:
        req.logprobs = logprobs
    if prompt_logprobs is not None:
        req.prompt_logprobs = prompt_logprobs
    if n is not None:
        req.n = n
    req.logprobs_mode = logprobs_mode
    req.version_policy = version_policy
    if max_staleness is not None:
        req.max_staleness = max_staleness
    if structured_output is not None:
        req.structured_output.CopyFrom(structured_output)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed),
                        ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty), ("min_tokens", min_tokens), ("min_p", min_p)):
        if value is not None:
            setattr(req.sampling, name, value)
    return req


@dataclass(frozen=True)
class Connection:
    """How to reach a router: its address, TLS (CA to trust, optional client certificate) and API key."""

    target: str = DEFAULT_TARGET
    api_key: str | None = None  # None: $PDSERVE_API_KEY, if set
    ssl_ca_certs: str | None = None  # PEM file of the CA that signed the router's certificate
    ssl_certfile: str | None = None  # a client certificate and its key, for a router that asks for one
    ssl_keyfile: str | None = None
    tls: bool = False  # TLS with the system's CAs (implied by any ssl_* option)
    server_name: str | None = None  # the name to check the certificate against, if not the target's host

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls or self.ssl_ca_certs or self.ssl_certfile):
            return None
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("a client certificate needs both ssl_certfile and ssl_keyfile")
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.ssl_ca_certs), read(self.ssl_keyfile), read(self.ssl_certfile))

    def options(self) -> list[tuple[str, str | int]]:
        # No bound on a response's size: the message carrying prompt_logprobs grows with the prompt (up to about
        # 240 bytes a prompt token at k=20) and can pass grpc's default 4 MiB from about 17k prompt tokens.
        limit = [("grpc.max_receive_message_length", -1)]
        return limit + ([("grpc.ssl_target_name_override", self.server_name)] if self.server_name else [])

    def metadata(self) -> tuple[tuple[str, str], ...]:
        key = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV)
        return (("authorization", f"Bearer {key}"),) if key else ()


def add_connection_args(p, admin: bool = False) -> None:
    """The command-line options that say how to reach a router (pdserve generate / status / bench); admin: for
    control calls (pdserve weights), whose key is the admin key."""
    p.add_argument("--target", default=DEFAULT_TARGET, help="router address (HOST:PORT)" +
                   (": its API port, or its control port (--control-port)" if admin else ""))
    g = p.add_argument_group("TLS and API key (for a router started with them)")
    env = ADMIN_API_KEY_ENV if admin else API_KEY_ENV
    g.add_argument("--api-key", default=None, help=f"sent as 'authorization: Bearer KEY' (default: ${env}; "
                                                   "prefer the variable or --api-key-file: a flag shows in ps)" +
                   ("; the router's admin key (--admin-api-key): control calls refuse the inference key" if admin
                    else ""))
    g.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from this file")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="CA certificates (PEM) to verify the router")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="client certificate (PEM), for mutual TLS")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the client certificate's key (PEM)")
    g.add_argument("--tls", action="store_true", help="use TLS with the system's CAs (implied by the --ssl-* options)")
    g.add_argument("--server-name", default=None, help="the name the router's certificate must carry, if not the "
                                                       "target's host")


def connection_from_args(args, admin: bool = False) -> Connection:
    """admin: the key defaults to $PDSERVE_ADMIN_API_KEY (and no key is sent without one)."""
    key = read_api_key(args.api_key, args.api_key_file, ADMIN_API_KEY_ENV if admin else API_KEY_ENV)
    return Connection(args.target, "" if admin and key is None else key, args.ssl_ca_certs,
                      args.ssl_certfile, args.ssl_keyfile, args.tls, args.server_name)


def read_api_key(key: str | None, key_file: str | None, env: str = API_KEY_ENV) -> str | None:
    """The key given, else the first line of key_file, else $env (None if there is none)."""
    if key is None and key_file is not None:
        key = Path(key_file).read_text().strip()
        if not key:
            raise ValueError(f"{key_file}: the API key file is empty")
    return key if key is not None else (os.environ.get(env) or None)


def _channel(grpc_module, conn: Connection):
    creds = conn.credentials()
    if creds is None:
        return grpc_module.insecure_channel(conn.target, options=conn.options())
    return grpc_module.secure_channel(conn.target, creds, options=conn.options())


class Client:
    def __init__(self, target: str | Connection = DEFAULT_TARGET, **security):
        """security: the other fields of Connection (api_key, ssl_ca_certs, ssl_certfile, ssl_keyfile, tls,
        server_name)."""
        self.connection = target if isinstance(target, Connection) else Connection(target, **security)
        self.channel = _channel(grpc, self.connection)
        self.metadata = self.connection.metadata()
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.weights = pb_grpc.WeightsStub(self.channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kwargs) -> Iterator[pb.GenerateResponse]:
        """Stream responses; breaking out of the loop cancels the request on the server."""
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Completion:
        out = Completion()
        for r in self.generate(prompt, timeout=timeout, **kwargs):
            out.add(r)
        return out

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def cluster_status(self, timeout: float | None = None) -> pb.ClusterStatus:
        return self.stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=timeout, metadata=self.metadata)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        r = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                           timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    # -- weights (the router's Weights service) ------------------------------------------------------
    def update_weights(self, path: str, version: int, mode: str = "pause", pause_mode: str = "keep",
                       timeout: float | None = None) -> pb.UpdateWeightsResponse:
        """Load checkpoint `path` (readable by every worker) as weight version `version` on every worker."""
        return self.weights.UpdateWeights(pb.UpdateWeightsRequest(path=path, version=version, mode=mode,
                                                                  pause_mode=pause_mode),
                                          timeout=timeout, metadata=self.metadata)

    def weight_versions(self, timeout: float | None = None) -> pb.WeightVersions:
        return self.weights.GetWeightVersions(pb.GetWeightVersionsRequest(), timeout=timeout, metadata=self.metadata)

    def pause(self, mode: str = "keep", timeout: float | None = None,
              wait_timeout_s: float | None = None) -> pb.WeightVersions:
        """New requests wait until resume(); those in flight: keep (stay where they are), wait (end first) or
        abort (end now, finish reason abort)."""
        req = pb.PauseRequest(mode=mode)
        if wait_timeout_s is not None:
            req.timeout_seconds = wait_timeout_s
        return self.weights.Pause(req, timeout=timeout, metadata=self.metadata)

    def resume(self, timeout: float | None = None) -> pb.WeightVersions:
        return self.weights.Resume(pb.ResumeRequest(), timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    def __init__(self, target: str | Connection = DEFAULT_TARGET, **security):
        """security: as Client's."""
        self.connection = target if isinstance(target, Connection) else Connection(target, **security)
        self.channel = _channel(grpc.aio, self.connection)
        self.metadata = self.connection.metadata()
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **kwargs) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)
        try:
            async for r in call:
                yield r
        finally:
            call.cancel()

    async def complete(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Completion:
        out = Completion()
        async for r in self.generate(prompt, timeout=timeout, **kwargs):
            out.add(r)
        return out

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    async def cluster_status(self, timeout: float | None = None) -> pb.ClusterStatus:
        return await self.stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=timeout, metadata=self.metadata)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        r = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
