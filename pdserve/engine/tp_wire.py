"""What rank 0 of a tensor-parallel worker broadcasts to its other ranks on the worker's control group, as
JSON: a step's chunks (pdserve.engine.chunk.Chunk, their SamplingParams), a weight command (dicts of a
trainer's GroupAddress, TensorMetas, paths, flags).

Decoding builds exactly those types and nothing else: the control group's bytes come from a peer, and
unpickling them (as this channel did) runs whatever a process that reached the group's store put there.
Every value is tagged with its type where JSON alone would lose it (a tuple, a dict, a dtype)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from pdserve.engine.chunk import Chunk
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.structured import StructuredOutput
from pdserve.weights.group import GroupAddress
from pdserve.weights.update import TensorMeta

_RECORDS = {"sampling": SamplingParams, "structured": StructuredOutput, "group": GroupAddress, "meta": TensorMeta}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def encode(value: Any) -> bytes:
    return json.dumps(_encode(value), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The value encode() was given; ValueError for anything else."""
    return _decode(json.loads(data))


def _encode(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, Chunk):  # rank 0 alone samples: a structured output's mask stays there
        return {"$": "chunk", "v": [_encode(x) for x in v._replace(mask=None)]}
    if isinstance(v, torch.dtype):
        return {"$": "dtype", "v": str(v).removeprefix("torch.")}
    for tag, cls in _RECORDS.items():
        if isinstance(v, cls):
            return {"$": tag, "v": {f.name: _encode(getattr(v, f.name)) for f in dataclasses.fields(cls)}}
    if isinstance(v, tuple):
        return {"$": "tuple", "v": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"$": "dict", "v": {k: _encode(x) for k, x in v.items()}}
    raise TypeError(f"the TP control channel does not carry {type(v).__name__}")


def _decode(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if not isinstance(v, dict) or set(v) != {"$", "v"}:
        raise ValueError("not a message of the TP control channel")
    tag, body = v["$"], v["v"]
    if tag == "chunk" and isinstance(body, list):
        return Chunk(*(_decode(x) for x in body))
    if tag == "dtype" and body in _DTYPES:
        return _DTYPES[body]
    if tag == "tuple" and isinstance(body, list):
        return tuple(_decode(x) for x in body)
    if tag == "dict" and isinstance(body, dict):
        return {k: _decode(x) for k, x in body.items()}
    if tag in _RECORDS and isinstance(body, dict):
        return _RECORDS[tag](**{k: _decode(x) for k, x in body.items()})
    raise ValueError(f"not a message of the TP control channel (tag {tag!r})")
