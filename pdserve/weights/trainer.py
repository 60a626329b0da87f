"""The trainer's side of pushing weights into a running pdserve cluster: what an RL trainer imports.

    from pdserve.weights.trainer import WeightSync

    with WeightSync("127.0.0.1:50051") as sync:      # joins the cluster's workers in a weight group
        for step in range(steps):
            ...                                        # rollouts through pdserve, rewards, a gradient step
            sync.push(model.state_dict(), version=step + 1)

The trainer is rank 0 of a gloo group (pdserve.weights.group) whose other ranks are the cluster's workers; the
router's Weights service (proto/pdserve/v1/generation.proto) sets them up. `push` sends the tensors' names,
full shapes and dtypes first (the router checks them against the model: a bad one is refused with nothing
sent), then broadcasts the tensors in buckets, then has every worker switch to the new version (a pause at a
step boundary by default, or rolling). If the trainer dies mid-broadcast the workers keep the version they
serve and leave the group; a new WeightSync makes a new one.
"""
from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Mapping

import grpc
import torch

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from pdserve.weights.group import GroupAddress, WeightGroup, free_port

DEFAULT_BUCKET_BYTES = 64 << 20
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class WeightSync:
    def __init__(self, target: str | None = None, *, channel: grpc.Channel | None = None,
                 metadata: tuple[tuple[str, str], ...] = (), host: str = "127.0.0.1", port: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 60.0):
        """target: the router's gRPC address (plaintext), or channel (+ metadata, e.g. an API key): one made with
        TLS (pdserve.client.Client(...).channel and .metadata). host: this process's address as the workers reach
        it; port: the group store's (default: a free one). timeout_s bounds the join and every collective."""
        if (target is None) == (channel is None):
            raise ValueError("give the router's target or a channel to it")
        self._own_channel = channel is None
        self.channel = channel if channel is not None else grpc.insecure_channel(target)
        self.metadata = metadata
        self.stub = pb_grpc.WeightsStub(self.channel)
        self.host, self.port = host, port
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group: WeightGroup | None = None
        self.worker_ids: list[str] = []

    def connect(self) -> None:
        """Make the group: this process joins as rank 0 while the router has every worker join."""
        self.close_group()
        versions = self.stub.GetWeightVersions(pb.GetWeightVersionsRequest(), metadata=self.metadata,
                                               timeout=self.timeout_s)
        world = 1 + sum(max(w.ranks, 1) for w in versions.workers)
        address = GroupAddress(self.host, self.port or free_port(), world, f"pdserve-weights-{uuid.uuid4().hex}")
        joined: list[WeightGroup | BaseException] = []

        def join() -> None:
            try:
                joined.append(WeightGroup.join(address, 0, self.timeout_s))
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                joined.append(e)

        t = threading.Thread(target=join, name="weight-group-join", daemon=True)
        t.start()
        try:
            info = self.stub.InitWeightGroup(
                pb.InitWeightGroupRequest(host=address.host, port=address.port, world_size=world, name=address.name,
                                          timeout_seconds=self.timeout_s),
                metadata=self.metadata, timeout=self.timeout_s + 30)
        finally:
            t.join(self.timeout_s + 30)
        if not joined or isinstance(joined[0], BaseException):
            raise joined[0] if joined else TimeoutError("the weight group's join did not end")
        self.group, self.worker_ids = joined[0], list(info.worker_ids)

    def push(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int,
             mode: str = "pause", pause_mode: str = "keep") -> pb.UpdateWeightsResponse:
        """Every worker serves `tensors` (Hugging Face names, full tensors: all or some of the model's) as weight
        `version`, greater than the one served. Raises grpc.RpcError (INVALID_ARGUMENT for a tensor the model
        has no place for, nothing sent) or pdserve.weights.group.WeightGroupError (the broadcast failed: the
        group is gone, nothing applied)."""
        if self.group is None:
            self.connect()
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        named = [(name, t.detach().to("cpu").contiguous()) for name, t in items]
        metas = []
        for name, t in named:
            if t.dtype not in _DTYPE_NAMES:
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} is not one of float32, bfloat16, float16")
            metas.append(pb.TensorMeta(name=name, shape=list(t.shape), dtype=_DTYPE_NAMES[t.dtype]))
        self.stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(version=version, tensors=metas,
                                                                bucket_bytes=self.bucket_bytes),
                                    metadata=self.metadata, timeout=self.timeout_s)
        try:
            self.group.send(named, self.bucket_bytes)
        except BaseException:
            self.group = None  # closed by its failure; the workers leave it too
            raise
        return self.stub.FinishWeightUpdate(pb.FinishWeightUpdateRequest(version=version, mode=mode,
                                                                         pause_mode=pause_mode),
                                            metadata=self.metadata, timeout=None)

    def close_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            try:
                self.stub.DestroyWeightGroup(pb.DestroyWeightGroupRequest(), metadata=self.metadata,
                                             timeout=self.timeout_s)
            except grpc.RpcError:
                pass  # the router is gone: its workers' groups end with the broken connections
            group.close()

    def close(self) -> None:
        self.close_group()
        if self._own_channel:
            self.channel.close()

    def __enter__(self) -> WeightSync:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
