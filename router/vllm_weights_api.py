"""vLLM's weight-transfer routes in their checkpoint-path form, and its weight version, as admin routes.

A trainer that drives a vLLM server whose weight-transfer backend reads checkpoints from a shared disk (vLLM's
"disk" backend) makes one update in four calls; pdserve answers them the same way:

- POST /init_weight_transfer_engine {"init_info": {}}: nothing to join (the checkpoint is read from disk).
- POST /start_weight_update ({"is_checkpoint_format": true} or no body): an update begins.
- POST /update_weights {"update_info": {"path": "/abs/checkpoint"}}: its checkpoint, one per update, a directory
  of safetensors under the weights root (checked here at once, and again by each worker on its filesystem).
- POST /finish_weight_update {"weight_version": "N" or null}: every worker reads and converts the checkpoint,
  then all switch to it together (router.weights.WeightControl.update: a checkpoint one worker refuses is applied
  nowhere) as version N (pdserve's versions are integers; null: the version served + 1). The update ends here
  whether it was applied or refused.

GET /weight_info answers {"weight_version": "N"}, the version served. POST /update_weight_version (a new label
for the weights served) is refused with 501: a version is data on every KV block and token here, so it changes
with the weights only. The other forms of these routes (vLLM's NCCL and IPC backends: init_info with a
rendezvous, update_info with names, dtype_names, shapes) are refused by field: a trainer's broadcast group is
served by SGLang's routes (router.sglang_weights_api).

Out of order calls (an update started twice, a checkpoint before start, finish without one) are a 409 saying what
is expected; bad input a 400 naming the field; both before any work.
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request

from pdserve.weights.update import WeightError, checkpoint_path, default_weights_root
from router.openai_schema import HTTPError
from router.weights import WeightControl

log = logging.getLogger(__name__)


def _refused(status: int, message: str, param: str | None = None) -> HTTPError:
    return HTTPError(status, message, param=param,
                     grpc_code="FAILED_PRECONDITION" if status == 409 else "INVALID_ARGUMENT")


async def _object(request: Request, required: bool = True) -> dict:
    """The request body, a JSON object ({} when there is none and none is required)."""
    raw = await request.body()
    if not raw.strip() and not required:
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise _refused(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise _refused(400, "the request body must be a JSON object")
    return body


def _only(body: dict, fields: set[str], where: str = "") -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        name = f"{where}.{unknown[0]}" if where else unknown[0]
        also = ("; pdserve serves the checkpoint-path form (init_info {}, update_info {\"path\"}); a trainer's "
                "broadcast group is served by /init_weights_update_group") if where else ""
        raise _refused(400, f"{name} is not taken here{also}", param=name)


def _version(value) -> int | None:
    """finish_weight_update's weight_version: an integer or a string of one (pdserve's versions are), or None."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str) and value.strip().isdigit() and int(value) > 0:
        return int(value)
    raise _refused(400, f"weight_version must be a positive integer or a string of one (pdserve's versions are "
                        f"integers), got {value!r}", param="weight_version")


class CheckpointUpdate:
    """One router's state of vLLM's update sequence: initialised, an update begun, its checkpoint."""

    def __init__(self, weights: WeightControl):
        self.weights = weights
        self.initialized = False
        self.started = False
        self.path: str | None = None
        self._lock = asyncio.Lock()  # one call of the sequence at a time

    def _under_way(self) -> None:
        if not self.started:
            raise _refused(409, "no weight update is under way: /start_weight_update first")

    def root(self) -> str:
        c = self.weights.cluster
        return c.config.engine.weights_root or default_weights_root(c.info.path)

    async def init(self, body: dict) -> dict:
        _only(body, {"init_info"})
        info = body.get("init_info")
        if not isinstance(info, dict):
            raise _refused(400, "init_info is required: an object ({} for the checkpoint-path form)",
                           param="init_info")
        _only(info, set(), "init_info")
        self.initialized = True
        return {"message": "Weight transfer initialized"}

    async def start(self, body: dict) -> dict:
        _only(body, {"is_checkpoint_format"})
        if body.get("is_checkpoint_format", True) is not True:
            raise _refused(400, "is_checkpoint_format: only checkpoints are read here (true)",
                           param="is_checkpoint_format")
        async with self._lock:
            if not self.initialized:
                raise _refused(409, "no weight transfer is initialized: /init_weight_transfer_engine first")
            if self.started:
                raise _refused(409, "a weight update is already under way: /finish_weight_update first")
            self.started, self.path = True, None
        return {"message": "Weight update started"}

    async def update(self, body: dict) -> dict:
        self._under_way()
        _only(body, {"update_info"})
        info = body.get("update_info")
        if not isinstance(info, dict):
            raise _refused(400, "update_info is required: {\"path\": a checkpoint directory}", param="update_info")
        _only(info, {"path"}, "update_info")
        path = info.get("path")
        if not isinstance(path, str) or not path:
            raise _refused(400, "update_info.path must be a checkpoint directory's absolute path",
                           param="update_info.path")
        try:
            path = checkpoint_path(path, self.root())
        except WeightError as e:
            raise _refused(400, f"update_info.path: {e}", param="update_info.path") from None
        async with self._lock:
            self._under_way()
            if self.path is not None:
                raise _refused(409, "this update has its checkpoint already (one per update): "
                                    "/finish_weight_update, then start another")
            self.path = path
        return {"message": "Checkpoint accepted: it is read and switched to at /finish_weight_update"}

    async def finish(self, body: dict) -> dict:
        _only(body, {"weight_version"})
        version = _version(body.get("weight_version"))
        async with self._lock:
            self._under_way()
            path, self.started, self.path = self.path, False, None
            if path is None:
                raise _refused(409, "no checkpoint was given in this update (/update_weights); it has ended")
            try:
                result = await self.weights.update(path, version if version is not None else self.weights.version + 1)
            except (ValueError, FileNotFoundError) as e:  # nothing applied anywhere
                raise _refused(400, f"the checkpoint was not applied: {e}") from None
        log.info("vLLM's weight transfer: version %d from %s", result.version, path)
        return {"message": "Weight update finished", "weight_version": str(result.version)}


def _handler(call, required: bool):
    async def handle(request: Request):
        return await call(await _object(request, required))

    return handle


def add_weight_transfer_routes(control: APIRouter, weights: WeightControl) -> None:
    """The routes above on the router's http_control (admin only)."""
    state = CheckpointUpdate(weights)

    # route, the state's call, whether a body is required
    for route, call, required in (("/init_weight_transfer_engine", state.init, True),
                                  ("/start_weight_update", state.start, False),
                                  ("/update_weights", state.update, True),
                                  ("/finish_weight_update", state.finish, False)):
        control.add_api_route(route, _handler(call, required), methods=["POST"])

    @control.get("/weight_info")
    async def weight_info():
        return {"weight_version": str(weights.version)}

    @control.post("/update_weight_version")
    async def update_weight_version():
        raise HTTPError(501, "a weight version is not relabelled here: pdserve's versions are data on every KV "
                             "block and token and change with the weights only (give weight_version to "
                             "/finish_weight_update)", kind="not_implemented", grpc_code="UNIMPLEMENTED")
