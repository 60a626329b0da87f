"""Python clients of the pdserve gRPC API (sync and asyncio).

    with Client("127.0.0.1:50051") as c:
        for r in c.generate("Once upon a time", max_tokens=32):
            print(r.text, end="", flush=True)
        print(c.complete(messages=[{"role": "user", "content": "Hi"}]).text)
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_CANCELLED: "cancelled", pb.FINISH_REASON_ERROR: "error"}


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float | str] = field(default_factory=dict)

    def add(self, r: pb.GenerateResponse) -> None:
        self.request_id = r.request_id
        self.text += r.text
        self.token_ids.extend(r.token_ids)
        if r.finish_reason:
            self.finish_reason = FINISH_REASONS[r.finish_reason]
            self.usage = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                          "cached_prompt_tokens": r.usage.cached_prompt_tokens}
            t = r.timings
            self.timings = {"queue_seconds": t.queue_seconds, "time_to_first_token_seconds": t.time_to_first_token_seconds,
                            "end_to_end_seconds": t.end_to_end_seconds, "prefill_worker": t.prefill_worker,
                            "decode_worker": t.decode_worker}


def build_request(prompt: str | None = None, *, messages: Sequence[dict[str, str]] | None = None,
                  token_ids: Sequence[int] | None = None, max_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, request_id: str = "") -> pb.GenerateRequest:
    """A GenerateRequest from exactly one of prompt, messages or token_ids; None leaves the server default."""
    if sum(x is not None for x in (prompt, messages, token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages or token_ids")
    req = pb.GenerateRequest(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                             request_id=request_id)
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                                        for m in messages]))
    else:
        req.token_ids.CopyFrom(pb.TokenIds(ids=list(token_ids)))
    if max_tokens is not None:
        req.max_tokens = max_tokens
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(req.sampling, name, value)
    return req


class Client:
    def __init__(self, target: str = DEFAULT_TARGET):
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Iterator[pb.GenerateResponse]:
        """Stream responses; breaking out of the loop cancels the request on the server."""
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout)
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
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)

    def cluster_status(self, timeout: float | None = None) -> pb.ClusterStatus:
        return self.stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=timeout)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        r = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    def __init__(self, target: str = DEFAULT_TARGET):
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **kwargs) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout)
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
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)

    async def cluster_status(self, timeout: float | None = None) -> pb.ClusterStatus:
        return await self.stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=timeout)

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
