"""The TP control channel's messages (pdserve.engine.tp_wire, #47 finding 10): JSON of the types rank 0 sends,
decoded into exactly those; a peer's bytes are never unpickled."""
from __future__ import annotations

import pickle

import pytest
import torch

from pdserve.engine import tp_wire
from pdserve.engine.chunk import Chunk
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.structured import StructuredOutput
from pdserve.weights.group import GroupAddress
from pdserve.weights.update import TensorMeta


def test_what_rank_0_sends_comes_back_as_it_was():
    chunks = [Chunk([1, 2], 0, [3], SamplingParams(stop=("a",), top_k=4, logprobs=2), 5, 1, None, [1, 2], (2,),
                    (3, [4, 5]), 2),
              Chunk([7], 2, [3, 4], None)]
    assert tp_wire.decode(tp_wire.encode(chunks)) == chunks
    for command in ({"join": (GroupAddress("10.0.0.1", 29500, 3, "g"), 1, 5.0)},
                    {"receive": ([TensorMeta("model.norm.weight", (64,), torch.bfloat16)], 1 << 20)},
                    {"stage": "/models/v2"}, {"commit": True}, {"drop": True}, {"leave": True}):
        assert tp_wire.decode(tp_wire.encode(command)) == command


def test_a_structured_output_goes_without_its_mask():
    """Rank 0 alone samples: a structured request's params cross, its step's mask stays on rank 0."""
    params = SamplingParams(structured=StructuredOutput("regex", "a+"))
    chunk = Chunk([1], 0, [3], params, mask=torch.full((4,), -1, dtype=torch.int32))
    assert tp_wire.decode(tp_wire.encode([chunk])) == [chunk._replace(mask=None)]


class _Boom:
    def __reduce__(self):  # what an unpickled peer message could run
        return (exec, ("raise SystemExit('ran a peer's code')",))


def test_anything_else_is_refused_unrun():
    with pytest.raises(ValueError):
        tp_wire.decode(pickle.dumps(_Boom()))
    for bad in (b'{"$": "os.system", "v": "true"}', b'{"a": 1}', b'{"$": "dtype", "v": "int64"}'):
        with pytest.raises(ValueError):
            tp_wire.decode(bad)
    with pytest.raises(TypeError):
        tp_wire.encode({"x": object()})
    with pytest.raises(ValueError, match="top_k"):  # a record's own checks run as it is built
        tp_wire.decode(b'{"$": "sampling", "v": {"top_k": -2}}')
