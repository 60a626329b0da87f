"""The router's edge: TLS on its ports, and who may call what (roles).

With a certificate and key, the gRPC port speaks TLS only (a plaintext client fails its handshake and
gets nothing); with CA certificates as well, clients must present a certificate that CA signed
(mutual TLS). grpc.health.v1 needs no credential, so that load balancers and probes need no secret.

Two roles. Inference (Generate, model info, cluster status, reflection): with an API key, a call must carry
`authorization: Bearer KEY` (the inference key or the admin key), else UNAUTHENTICATED before its request
is even parsed; without one, anyone who reaches the port. Control (the Weights service: updates, pause,
resume, a trainer's group; an HTTP control route): the admin credential alone, an admin key
(`--admin-api-key`) or, with mutual TLS, a client certificate whose name is one of `--admin-client-name`;
a call that carries the inference key, or none, is answered PERMISSION_DENIED. Trainers and operators are a
different party from inference clients: an inference client must not pause the cluster or load weights.
Where no admin credential exists, control is open only where network position stands for one: on the
control port (`--control-port`, bound to loopback or an internal interface by its operator), or, when the
router has no credential of any kind (the local default), to peers on the loopback interface. With a
control port, the public port refuses every control call.

`Access` decides (pure, tested on its own); `Guard` is the gRPC interceptor that applies it, and
router.http_limits.Roles the same for the HTTP door.
"""
from __future__ import annotations

import enum
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health

from pdserve.v1 import generation_pb2 as pb

HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"
CONTROL_PREFIXES = (f"/{pb.DESCRIPTOR.services_by_name['Weights'].full_name}/",)


def server_credentials(certfile: str, keyfile: str, ca_certs: str | None = None) -> grpc.ServerCredentials:
    """TLS for a gRPC port; with ca_certs, a client certificate signed by them is required."""
    pair = (Path(keyfile).read_bytes(), Path(certfile).read_bytes())
    ca = Path(ca_certs).read_bytes() if ca_certs else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


class Role(enum.Enum):
    INFERENCE = "inference"
    ADMIN = "admin"


@dataclass(frozen=True)
class Refusal:
    """A call refused: its status (UNAUTHENTICATED or PERMISSION_DENIED) and what to do about it."""

    code: grpc.StatusCode
    message: str

    @property
    def http_status(self) -> int:
        return 401 if self.code is grpc.StatusCode.UNAUTHENTICATED else 403


NEEDS_PEER = object()  # Access.by_key's answer when only the caller's address or certificate can decide


@dataclass(frozen=True)
class Access:
    """Who may call what on one port. api_key: the inference key (None: inference is open); admin_api_key:
    the admin key; admin_names: client-certificate names (common name or DNS name) that are admin (mutual
    TLS); control_port: this is the dedicated control port; control_elsewhere: this is the public port of a
    router with a control port (control is refused here, whatever the credential)."""

    api_key: str | None = None
    admin_api_key: str | None = None
    admin_names: tuple[str, ...] = ()
    control_port: bool = False
    control_elsewhere: bool = False

    def __post_init__(self) -> None:
        if self.api_key is not None and self.api_key == self.admin_api_key:
            raise ValueError("the admin key must differ from the inference API key")
        if self.control_port and self.control_elsewhere:
            raise ValueError("a port is the control port or the public port of a router that has one, not both")

    @property
    def no_credentials(self) -> bool:
        return self.api_key is None and self.admin_api_key is None and not self.admin_names

    def by_key(self, control: bool, bearer: bytes | None) -> Role | Refusal | object:
        """The role the call has from its `authorization` value alone (a Role that suffices for the call), a
        Refusal, or NEEDS_PEER."""
        if control and self.control_elsewhere:
            return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                           "control RPCs are served on this router's control port only (--control-port)")
        role = self._key_role(bearer)
        if isinstance(role, Refusal):
            return role
        if role is Role.ADMIN or (role is Role.INFERENCE and not control):
            return role
        if self.admin_names or (control and self._open_control_possible):
            return NEEDS_PEER
        return self._refusal(control, role)

    def by_peer(self, control: bool, bearer: bytes | None, peer: str, names: Iterable[bytes]) -> Role | Refusal:
        """The decision by_key left open: from the caller's address (context.peer()) and certificate names."""
        key_role = self._key_role(bearer)
        if isinstance(key_role, Refusal):
            return key_role
        if self.admin_names and any(n.decode(errors="replace") in self.admin_names for n in names):
            return Role.ADMIN
        if control and self._open_control_possible and (self.control_port or is_loopback(peer)):
            return Role.ADMIN
        if key_role is Role.INFERENCE and not control:
            return key_role
        return self._refusal(control, key_role)

    @property
    def _open_control_possible(self) -> bool:
        """Control without an admin credential: none exists, and this is the control port or nothing at all
        is configured (then only for loopback peers)."""
        return self.admin_api_key is None and not self.admin_names and (self.control_port or self.no_credentials)

    def _key_role(self, bearer: bytes | None) -> Role | Refusal | None:
        """The role the bearer key gives: ADMIN, INFERENCE (the inference key, or none needed), None (no key
        the call needs was given), or a Refusal (a key was needed and this one is wrong)."""
        if bearer is not None and self.admin_api_key and _same(bearer, self.admin_api_key):
            return Role.ADMIN
        if self.api_key is None:
            return Role.INFERENCE  # inference is open; a stray key (SDKs send one) means nothing
        if bearer is not None and _same(bearer, self.api_key):
            return Role.INFERENCE
        if bearer is None and self.admin_names:
            return None  # a certificate may still make it an admin call
        return Refusal(grpc.StatusCode.UNAUTHENTICATED,
                       "missing or wrong API key: send the metadata 'authorization: Bearer <key>'")

    def _refusal(self, control: bool, role: Role | None) -> Refusal:
        if not control:
            return Refusal(grpc.StatusCode.UNAUTHENTICATED,
                           "missing or wrong API key: send the metadata 'authorization: Bearer <key>'")
        how = "the admin key (--admin-api-key)" if self.admin_api_key else \
            "an admin client certificate (--admin-client-name)" if self.admin_names else \
            "an admin credential (the router has none: --admin-api-key, or --control-port on an internal address)"
        return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                       f"this is a control call (weights, pause, resume): it needs {how}; "
                       f"{'the inference key' if role is Role.INFERENCE and self.api_key else 'this caller'} "
                       "may not make it")


def _same(bearer: bytes, key: str) -> bool:
    return hmac.compare_digest(bearer, f"Bearer {key}".encode())


def is_loopback(peer: str) -> bool:
    """Whether a gRPC peer ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") or a bare host is this host."""
    if peer.startswith("unix:"):
        return True
    host = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    host = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") else host
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bearer(metadata) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value.encode() if isinstance(value, str) else value
    return None


def _cert_names(context: grpc.aio.ServicerContext) -> list[bytes]:
    auth = context.auth_context() or {}
    return [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]


_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
          (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


class Guard(grpc.aio.ServerInterceptor):
    """Applies a port's Access to every call but health's: a refusal decided from the key is answered before
    the request is parsed; one that needs the caller's address or certificate, first thing in the handler."""

    def __init__(self, access: Access):
        self.access = access

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        method = details.method
        if method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        control = method.startswith(CONTROL_PREFIXES)
        bearer = _bearer(details.invocation_metadata)
        verdict = self.access.by_key(control, bearer)
        handler = await continuation(details)
        if handler is None and control and isinstance(verdict, Refusal):
            # The Weights service lives on the control port: say so here (its calls are all unary).
            return grpc.unary_unary_rpc_method_handler(_refuse(verdict, False))
        if handler is None or isinstance(verdict, Role):  # unknown methods stay UNIMPLEMENTED
            return handler
        kind = _KINDS[handler.request_streaming, handler.response_streaming]
        if isinstance(verdict, Refusal):
            return kind(_refuse(verdict, handler.response_streaming))  # no deserializer: nothing is parsed

        async def check(context) -> None:
            decided = self.access.by_peer(control, bearer, context.peer(), _cert_names(context))
            if isinstance(decided, Refusal):
                await context.abort(decided.code, decided.message)

        return _checked(handler, kind, check)


def _refuse(refusal: Refusal, streaming: bool) -> Callable:
    if streaming:
        async def refuse_stream(request, context):
            await context.abort(refusal.code, refusal.message)
            yield  # pragma: no cover - abort raises

        return refuse_stream

    async def refuse(request, context):
        await context.abort(refusal.code, refusal.message)

    return refuse


def _checked(handler, kind, check: Callable[[grpc.aio.ServicerContext], Awaitable[None]]):
    """The handler with `check` run first (it aborts the call if the caller may not make it)."""
    inner = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
             (True, False): handler.stream_unary, (True, True): handler.stream_stream}[
        handler.request_streaming, handler.response_streaming]
    if handler.response_streaming:
        async def stream(request, context):
            await check(context)
            async for item in inner(request, context):
                yield item

        behaviour = stream
    else:
        async def unary(request, context):
            await check(context)
            return await inner(request, context)

        behaviour = unary
    return kind(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
