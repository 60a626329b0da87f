"""Python clients of the pdserve gRPC API, sync and asyncio.

    from pdserve.client import Client
    with Client("127.0.0.1:50051") as c:
        for r in c.generate("Once upon a time", max_tokens=32):
            print(r.text, end="")

grpc_client.py  Client, AsyncClient, request building, connection flags (TLS, API key)

Imports only the generated stubs (pdserve.v1) and grpc: a client needs no torch.
"""
from pdserve.client.grpc_client import (
    API_KEY_ENV,
    AsyncClient,
    Client,
    Completion,
    Connection,
    Sample,
    build_request,
)

__all__ = ["API_KEY_ENV", "AsyncClient", "Client", "Completion", "Connection", "Sample", "build_request"]
