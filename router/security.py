"""The router's edge: TLS on its ports and an API key on every RPC except health.

With a certificate and key, the gRPC port speaks TLS only (a plaintext client fails its handshake and
gets nothing); with CA certificates as well, clients must present a certificate that CA signed
(mutual TLS). With an API key, every call must carry `authorization: Bearer KEY`; grpc.health.v1 is
exempt, so that load balancers and probes need no secret. A call without the right key is answered
UNAUTHENTICATED before its request is even parsed.
"""
from __future__ import annotations

import hmac
from pathlib import Path

import grpc
from grpc_health.v1 import health

HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"


def server_credentials(certfile: str, keyfile: str, ca_certs: str | None = None) -> grpc.ServerCredentials:
    """TLS for a gRPC port; with ca_certs, a client certificate signed by them is required."""
    pair = (Path(keyfile).read_bytes(), Path(certfile).read_bytes())
    ca = Path(ca_certs).read_bytes() if ca_certs else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health's unless it carries `authorization: Bearer <key>`."""

    def __init__(self, api_key: str):
        if not api_key:
            raise ValueError("the API key is empty")
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(HEALTH_PREFIX) or self._authorized(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # an unknown method: UNIMPLEMENTED, as without a key
            return None
        # The same kind of handler as the method's (unary or streaming), with no request parsing.
        kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[handler.request_streaming,
                                                                     handler.response_streaming]
        return kind(_refuse)

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return False


async def _refuse(request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong API key: send the metadata 'authorization: Bearer <key>'")
