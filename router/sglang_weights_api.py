"""SGLang's distributed weight-update routes, as the RL frameworks call them: a client's weight group.

`POST /init_weights_update_group`, `POST /update_weights_from_distributed` and
`POST /destroy_weights_update_group` take SGLang's request bodies and answer `{"success", "message"}` (HTTP 200,
or 400 for a request refused, 503 for a group that failed), over router.weights.WeightControl's client-group
calls (pdserve.weights.compat: the clients' rendezvous, each tensor broadcast on its own). Admin routes: they are
served on the router's control routes (router.security decides who may call them).

Bad input is refused before any work with a message naming the field. A trainer broadcasts an update's tensors
whatever the server answers, so a call whose tensors are well described but do not fit the model is still
received (and dropped with the rest of the update under way); one whose description cannot be read leaves the
group out of step with the trainer, so the group is closed (the answer says so).
"""
from __future__ import annotations

import logging
import math

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.weights.compat import BACKENDS, parse_dtype
from pdserve.weights.update import TensorMeta
from router.weights import GroupJoinFailed, UpdateResult, WeightControl, cause_of

log = logging.getLogger(__name__)

MAX_TENSORS = 1 << 16  # tensors announced in one call
MAX_DIMS = 8


class BadRequest(ValueError):
    """A request body that cannot be read: its message names the field."""


def _answer(success: bool, message: str, status: int = 200, **extra) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=status)


def _failed(e: BaseException) -> JSONResponse:
    """A refused or failed call's answer: our own checks' messages as they are (400), anything else by its kind
    only (503; the details, which may name internal addresses, in the router's log)."""
    cause = cause_of(e)
    log.warning("client weight group: %s: %s", type(cause).__name__, cause)
    if isinstance(cause, (ValueError, NotImplementedError)):
        return _answer(False, f"{type(cause).__name__}: {cause}", 400)
    if isinstance(cause, GroupJoinFailed):
        return _answer(False, str(cause), 503)
    return _answer(False, f"the call failed on the cluster ({type(cause).__name__}); the group is closed and the "
                          f"weights served are unchanged; the router's log says why", 503)


async def _body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


# The fields of SGLang's request bodies; any other is refused by name.
INIT_FIELDS = frozenset({"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"})
UPDATE_FIELDS = frozenset({"names", "dtypes", "shapes", "name", "dtype", "shape", "group_name", "flush_cache",
                           "abort_all_requests", "weight_version", "load_format"})


def _known(body: dict, fields: frozenset[str]) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"{unknown[0]} is not a field of this request (its fields: {', '.join(sorted(fields))})")


def _field(body: dict, name: str, kind: type | tuple[type, ...], default=None, required: bool = True):
    value = body.get(name, default)
    if value is None and not required:
        return None
    if value is None:
        raise BadRequest(f"{name} is required")
    if kind is int and isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # SGLang reads "29500" as 29500 (its body models coerce): AReaL sends master_port so
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise BadRequest(f"{name} must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    return value


def announced_metas(body: dict) -> list[TensorMeta]:
    """The tensors a call announces, in broadcast order: names/dtypes/shapes lists, or name/dtype/shape."""
    if "names" in body or "name" not in body:
        names, dtypes, shapes = (_field(body, k, list) for k in ("names", "dtypes", "shapes"))
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"names, dtypes and shapes must have one entry per tensor, got {len(names)}, "
                             f"{len(dtypes)} and {len(shapes)}")
        where = ("names[{i}]", "dtypes[{i}]", "shapes[{i}]")
    else:
        names, dtypes, shapes = [[_field(body, k, list if k == "shape" else str)] for k in ("name", "dtype", "shape")]
        where = ("name", "dtype", "shape")
    if not names:
        raise BadRequest("names must name at least one tensor")
    if len(names) > MAX_TENSORS:
        raise BadRequest(f"at most {MAX_TENSORS} tensors a call, got {len(names)}")
    metas = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        n, d, s = (w.format(i=i) for w in where)
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{n} must be a tensor's name")
        if not isinstance(dtype, str):
            raise BadRequest(f"{d} must be a dtype's name")
        try:
            torch_dtype = parse_dtype(dtype)
        except ValueError as e:
            raise BadRequest(f"{d}: {e}") from None
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 40 for x in shape)):
            raise BadRequest(f"{s} must be a list of at most {MAX_DIMS} non-negative integers")
        if math.prod(shape) >= 1 << 40:
            raise BadRequest(f"{s}: {shape} is too large a tensor")
        metas.append(TensorMeta(name, tuple(shape), torch_dtype))
    return metas


def client_version(value) -> int | None:
    """weight_version as sent (SGLang takes a string): an integer, or a string of one; None if not sent."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise BadRequest(f"weight_version must be a positive integer (or a string of one): pdserve's versions are "
                     f"integers, got {value!r}")


def add_client_group_routes(routes: APIRouter, control: WeightControl) -> None:
    """The three routes over `control`, added to `routes` (the router's HTTP control routes: each route is
    added there itself, since the doors tell control from inference by each route's own path)."""

    @routes.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        try:
            body = await _body(request)
            _known(body, INIT_FIELDS)
            host = _field(body, "master_address", str)
            port, rank_offset, world_size = (_field(body, k, int) for k in ("master_port", "rank_offset",
                                                                             "world_size"))
            name = _field(body, "group_name", str, "weight_update_group")
            backend = _field(body, "backend", str, "gloo")
            if backend not in BACKENDS:
                raise BadRequest(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        except BadRequest as e:
            return _answer(False, str(e), 400)
        try:
            ids = await control.init_client_group(host, port, rank_offset, world_size, name, backend)
        except Exception as e:  # noqa: BLE001 - an answer; the server stays up
            return _failed(e)
        return _answer(True, f"{len(ids)} workers joined weight group {name!r} from rank {rank_offset}")

    @routes.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        try:
            body = await _body(request)
            _known(body, UPDATE_FIELDS)
            metas = announced_metas(body)
            version = client_version(body.get("weight_version"))
            load_format = body.get("load_format")
            if load_format not in (None, "direct"):
                raise BadRequest(f"load_format {load_format!r} is not served: each tensor is received as broadcast "
                                 "(load_format absent)")
            _field(body, "flush_cache", bool, True)
            abort = _field(body, "abort_all_requests", bool, False)
            name = _field(body, "group_name", str, required=False)
            if name is not None and control.client_group and name != control.client_group:
                raise BadRequest(f"group_name {name!r} is not the weight group joined ({control.client_group!r})")
        except BadRequest as e:
            if control.client_group:  # the trainer's broadcasts of this call cannot be received: out of step
                await control.destroy_group()
                return _answer(False, f"{e}; the weight group is closed (its broadcasts could not be received)", 400)
            return _answer(False, str(e), 400)
        if abort:  # the requests in flight end now (finish reason abort): their clients resubmit them
            log.info("weight update: %d requests in flight aborted", control.cluster.abort_all())
        try:
            result: UpdateResult | None = await control.receive_client_update(metas, version)
        except Exception as e:  # noqa: BLE001 - an answer; the server stays up
            return _failed(e)
        # flush_cache: the prefix cache is keyed by weight version, so no cached KV of the old weights is ever
        # reused once the new ones serve: there is nothing to flush.
        if result is None:
            return _answer(True, f"{len(metas)} tensors received; the update commits when the model's last tensor "
                                 f"has arrived (or at /continue_generation)")
        return _answer(True, f"weight version {result.version} serves on {len(result.workers)} workers",
                       weight_version=str(result.version))

    @routes.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        await control.destroy_group()
        return _answer(True, "the weight group is closed")
