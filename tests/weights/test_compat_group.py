"""pdserve.weights.compat: a worker rank in a client's weight group, made and fed by the clients' own recipe (the
trainer, another process, runs tests/weights/compat_trainer.py's functions: the RL frameworks' sender written with
plain torch.distributed as their source does it). No Ray, no model: the group's wire and its all-or-nothing keep."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest
import torch

from pdserve import processes
from pdserve.weights.compat import Announced, CompatAddress, CompatGroup, parse_dtype
from pdserve.weights.group import GroupAddress, WeightGroup, WeightGroupError, free_port
from pdserve.weights.update import TensorMeta


def _trainer(port: int, name: str, commands: mp.Queue, done: mp.Queue) -> None:
    import torch.distributed as dist

    from compat_trainer import init_custom_process_group

    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", timedelta(seconds=60), 2, 0, name)
    done.put("joined")
    while True:
        command, tensors, stop_after = commands.get()
        if command == "exit":
            return
        for i, t in enumerate(tensors):
            if i == stop_after:
                done.put("dying")
                os._exit(3)  # a trainer that vanishes mid-update: its sockets close
            dist.broadcast(t, src=0, group=pg)
        done.put("sent")


class Trainer:
    def __init__(self, name: str):
        ctx = processes.context()
        self.port, self.commands, self.done = free_port(), ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_trainer, args=(self.port, name, self.commands, self.done), daemon=True)
        self.process.start()

    def send(self, tensors, stop_after: int | None = None) -> None:
        self.commands.put(("send", list(tensors), stop_after))

    def close(self) -> None:
        if self.process.is_alive():
            self.commands.put(("exit", None, None))
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture
def pair(request):
    """A trainer process and this process as rank 1 of a client's group of two."""
    name = f"compat-{request.node.name}"
    trainer = Trainer(name)
    group = CompatGroup.join(CompatAddress("127.0.0.1", trainer.port, 2, name, "gloo", timeout_s=30), 1,
                             timeout_s=60)
    assert trainer.done.get(timeout=60) == "joined"
    yield trainer, group
    group.close()
    trainer.close()


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(7, 5, generator=g)),
            ("b.weight", torch.randn(300, generator=g).to(torch.bfloat16)),
            ("c.bias", torch.randn(3, generator=g).to(torch.float16))]


def _metas(named, **kw) -> Announced:
    return Announced([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named], **kw)


def test_a_whole_update_arrives_bit_exact_only_when_it_is_the_last_call(pair):
    trainer, group = pair
    named = _tensors(1)
    trainer.send([t for _, t in named])
    assert list(group.receive(_metas(named))) == [] and group.kept == [n for n, _ in named]
    assert trainer.done.get(timeout=30) == "sent"
    # One tensor a call (SkyRL-train): kept as it comes; a tensor sent again keeps its last value.
    again = [("a.weight", torch.full((7, 5), 2.0))]
    trainer.send([t for _, t in again])
    got = dict(group.receive(_metas(again, last=True)))
    assert trainer.done.get(timeout=30) == "sent"
    assert list(got) == ["b.weight", "c.bias", "a.weight"] and group.kept == []
    for name, t in named[1:] + again:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    # An empty last call (a client that continued generation) yields nothing kept: nothing was.
    assert list(group.receive(Announced([], last=True))) == []


def test_a_refused_call_is_still_received_and_drops_the_update_under_way(pair):
    trainer, group = pair
    first, refused, after = _tensors(1), _tensors(2), _tensors(3)
    trainer.send([t for _, t in first])
    assert list(group.receive(_metas(first))) == []
    trainer.send([t for _, t in refused])
    assert list(group.receive(_metas(refused, discard=True))) == [] and group.kept == []
    # The group is in step with the trainer: the next update arrives whole and alone.
    trainer.send([t for _, t in after])
    got = dict(group.receive(_metas(after, last=True)))
    assert [trainer.done.get(timeout=30) for _ in range(3)] == ["sent"] * 3
    assert list(got) == [n for n, _ in after] and all(torch.equal(got[n], t) for n, t in after)


def test_a_trainer_that_vanishes_mid_update_fails_the_receive_and_closes_the_group(pair):
    trainer, group = pair
    named = _tensors(4)
    trainer.send([t for _, t in named], stop_after=2)
    start = time.monotonic()
    with pytest.raises(WeightGroupError, match="receiving 3 tensors failed"):
        list(group.receive(_metas(named, last=True)))
    assert time.monotonic() - start < 25, "a closed socket must fail the broadcast before the group's timeout"
    assert group.broken and group.kept == []
    with pytest.raises(WeightGroupError, match="broken"):
        group.receive(_metas(named))


def test_weight_group_join_hands_a_client_address_to_the_client_group():
    trainer = Trainer("compat-dispatch")
    try:
        group = WeightGroup.join(CompatAddress("127.0.0.1", trainer.port, 2, "compat-dispatch"), 1, 60)
        assert isinstance(group, CompatGroup) and group.rank == 1
        group.close()
        group.close()  # idempotent
    finally:
        trainer.close()


def test_arguments_are_checked():
    assert parse_dtype("torch.bfloat16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    assert parse_dtype("int32") is torch.int32  # read, to be received and refused by the model's check
    with pytest.raises(ValueError, match="complex64"):
        parse_dtype("complex64")
    with pytest.raises(ValueError, match="world_size"):
        CompatAddress("127.0.0.1", 1234, 1, "g")
    with pytest.raises(ValueError, match="backend"):
        CompatAddress("127.0.0.1", 1234, 2, "g", "mpi")
    with pytest.raises(ValueError, match="rank 0"):
        CompatGroup.join(CompatAddress("127.0.0.1", 1234, 2, "g"), 0)
    with pytest.raises(WeightGroupError, match="could not join"):  # nobody hosts the store
        CompatGroup.join(CompatAddress("127.0.0.1", free_port(), 2, "g", timeout_s=2), 1, 2)
    assert isinstance(GroupAddress("127.0.0.1", 1234, 2, "g"), GroupAddress)


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    """free_port picks from below the kernel's ephemeral range (where outgoing connections take their ports),
    above Ray's worker ports, and the port it gives can be bound."""
    import socket

    from pdserve.weights.group import PORTS_FROM, _ephemeral_low

    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert PORTS_FROM <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
