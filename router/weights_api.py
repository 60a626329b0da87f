"""The gRPC service `pdserve.v1.Weights` over a WeightControl (router.weights): each RPC's message to the
control's terms and back, its failures to status codes. A control service: who may call it is
router.security's (the admin role)."""
from __future__ import annotations

import asyncio
import logging

import grpc
import torch

from pdserve.v1 import generation_pb2 as pb
from router.admission import Malformed, parser
from router.weights import GroupJoinFailed, NoGroup, NotNewer, UpdateResult, WeightControl, WorldChanged, cause_of

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



class WeightsService:
    """The gRPC service `pdserve.v1.Weights` over a WeightControl."""

    def __init__(self, control: WeightControl):
        self.control = control

    async def _answer(self, context: grpc.aio.ServicerContext, work) -> None:
        """Run work(); a failure becomes the RPC's status (the worker's own error where a worker raised it)."""
        try:
            await work
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "requests in flight did not end in time")
        except Exception as e:  # noqa: BLE001 - mapped to a status, the server stays up
            cause = cause_of(e)
            code = (grpc.StatusCode.FAILED_PRECONDITION if isinstance(cause, (NotNewer, WorldChanged, NoGroup))
                    else grpc.StatusCode.INVALID_ARGUMENT if isinstance(cause, (ValueError, FileNotFoundError))
                    else grpc.StatusCode.UNIMPLEMENTED if isinstance(cause, NotImplementedError)
                    else grpc.StatusCode.UNAVAILABLE)
            log.warning("weights: %s: %s", type(cause).__name__, cause)
            # The messages of our own checks say what is wrong; anything else (a worker's crash, a connection's
            # error) may carry internal addresses or paths: its kind only, the details in the router's log.
            ours = isinstance(cause, (ValueError, FileNotFoundError, NotImplementedError, GroupJoinFailed))
            await context.abort(code, f"{type(cause).__name__}: {cause}" if ours else
                                f"the call failed on the cluster ({type(cause).__name__}); the router's log says why")

    async def _versions(self) -> pb.WeightVersions:
        c = self.control
        return pb.WeightVersions(version=c.version, paused=c.paused, workers=[
            pb.WorkerWeightVersion(worker_id=v.worker_id, pool=v.pool, version=v.version, paused=v.paused,
                                   ranks=v.ranks)
            for v in await c.versions()])

    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context) -> pb.UpdateWeightsResponse:
        if not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path is required")
        result: list[UpdateResult] = []

        async def work():
            result.append(await self.control.update(request.path, request.version, request.mode or "pause",
                                                    request.pause_mode or "keep"))

        await self._answer(context, work())
        return _update_response(result[0])

    async def GetWeightVersions(self, request, context) -> pb.WeightVersions:
        return await self._versions()

    async def Pause(self, request: pb.PauseRequest, context) -> pb.WeightVersions:
        timeout = request.timeout_seconds if request.HasField("timeout_seconds") else 600.0
        await self._answer(context, self.control.pause(request.mode or "keep", timeout))
        return await self._versions()

    async def Resume(self, request, context) -> pb.WeightVersions:
        await self._answer(context, self.control.resume())
        return await self._versions()

    async def InitWeightGroup(self, request: pb.InitWeightGroupRequest, context) -> pb.WeightGroupInfo:
        timeout = request.timeout_seconds if request.HasField("timeout_seconds") else 60.0
        ids: list[list[str]] = []

        async def work():
            ids.append(await self.control.init_group(request.host, request.port, request.world_size,
                                                     request.name, timeout))

        await self._answer(context, work())
        return pb.WeightGroupInfo(world_size=request.world_size, worker_ids=ids[0])

    async def BeginWeightUpdate(self, request: pb.BeginWeightUpdateRequest, context) -> pb.BeginWeightUpdateResponse:
        from pdserve.weights.update import TensorMeta

        bad = [m.dtype for m in request.tensors if m.dtype not in DTYPES]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dtype {bad[0]!r} is not one of {', '.join(DTYPES)}")
        metas = [TensorMeta(m.name, tuple(m.shape), DTYPES[m.dtype]) for m in request.tensors]
        await self._answer(context, self.control.begin(metas, request.version, request.bucket_bytes))
        return pb.BeginWeightUpdateResponse()

    async def FinishWeightUpdate(self, request: pb.FinishWeightUpdateRequest, context) -> pb.UpdateWeightsResponse:
        result: list[UpdateResult] = []

        async def work():
            result.append(await self.control.finish(request.version, request.mode or "pause",
                                                    request.pause_mode or "keep"))

        await self._answer(context, work())
        return _update_response(result[0])

    async def DestroyWeightGroup(self, request, context) -> pb.DestroyWeightGroupResponse:
        await self._answer(context, self.control.destroy_group())
        return pb.DestroyWeightGroupResponse()

    def handlers(self) -> dict:
        def unary(fn, req):
            async def call(request, context):
                if isinstance(request, Malformed):  # bytes that are no such message: the caller's error
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
                return await fn(request, context)

            return grpc.unary_unary_rpc_method_handler(call, request_deserializer=parser(req),
                                                       response_serializer=lambda m: m.SerializeToString())

        return {"UpdateWeights": unary(self.UpdateWeights, pb.UpdateWeightsRequest),
                "GetWeightVersions": unary(self.GetWeightVersions, pb.GetWeightVersionsRequest),
                "Pause": unary(self.Pause, pb.PauseRequest),
                "Resume": unary(self.Resume, pb.ResumeRequest),
                "InitWeightGroup": unary(self.InitWeightGroup, pb.InitWeightGroupRequest),
                "BeginWeightUpdate": unary(self.BeginWeightUpdate, pb.BeginWeightUpdateRequest),
                "FinishWeightUpdate": unary(self.FinishWeightUpdate, pb.FinishWeightUpdateRequest),
                "DestroyWeightGroup": unary(self.DestroyWeightGroup, pb.DestroyWeightGroupRequest)}


def _update_response(r: UpdateResult) -> pb.UpdateWeightsResponse:
    return pb.UpdateWeightsResponse(version=r.version, seconds=r.seconds, workers=[
        pb.WorkerWeightUpdate(worker_id=w.worker_id, stage_seconds=w.stage_seconds, commit_seconds=w.commit_seconds,
                              bytes=w.num_bytes) for w in r.workers])


WEIGHTS_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Weights"].full_name
