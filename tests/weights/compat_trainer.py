"""A trainer that pushes weights the way the RL frameworks push them into an SGLang server, for the tests of
pdserve.weights.compat and its routes (tests/weights/test_compat_group*.py).

Neither AReaL nor SkyRL-train installs here beside torch 2.13.0+cpu without replacing it, so this is their
sender written with plain torch.distributed exactly as their source does it: the group made with torch's
tcp:// rendezvous, a PrefixStore of the group's name and torch's process-group helper with no global ranks
(their `init_custom_process_group`, as SGLang's); the HTTP call that announces an update (names, dtypes,
shapes; or one tensor a call, SkyRL-train's sglang backend) sent at the same time as the broadcasts, one
`dist.broadcast(tensor, src=0, group=group)` per tensor in the announced order; then the call's answer read.

Run as a script: python compat_trainer.py URL CHECKPOINT MODE VERSION [GROUP_NAME]; MODE is "list" (one call),
"single" (one call a tensor) or "die" (one call; the process prints "sent" once half the tensors are on the
wire and waits to be killed). It prints each answer as a JSON line.
"""
from __future__ import annotations

import functools
import json
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist


def init_custom_process_group(backend, init_method, timeout, world_size, rank, group_name):
    """The clients' group: rendezvous, PrefixStore(group_name), the helper with no global ranks."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout, group_desc=group_name)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).split("torch.")[1]  # as the clients send it


class Call(threading.Thread):
    """An HTTP POST in a thread, as the clients make it beside their broadcasts; .answer once joined."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body, self.answer = url, body, None

    def run(self) -> None:
        r = _client().post(self.url, json=self.body, timeout=600)
        self.answer = {"status": r.status_code, **r.json()}


@functools.cache
def _client():
    """One HTTP client for every call (thread-safe): a client a call made an SSL context each time (22 ms of CPU;
    SkyRL's one call a tensor over SmolLM2 is 272 calls)."""
    import httpx

    return httpx.Client()


def init_group(base: str, world_size: int, port: int, name: str, rank_offset: int = 1):
    call = Call(f"{base}/init_weights_update_group", dict(master_address="127.0.0.1", master_port=port,
                                                          rank_offset=rank_offset, world_size=world_size,
                                                          group_name=name, backend="gloo"))
    call.start()
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", timedelta(seconds=120), world_size, 0, name)
    call.join()
    return pg, call.answer


def push(base: str, pg, named: list[tuple[str, torch.Tensor]], version: int | None = None,
         after: int | None = None, **extra) -> dict:
    """One call announcing `named` and their broadcasts; after: a callback's index (print "sent", wait)."""
    body = dict(names=[n for n, _ in named], dtypes=[dtype_name(t) for _, t in named],
                shapes=[list(t.shape) for _, t in named], flush_cache=True, **extra)
    if version is not None:
        body["weight_version"] = str(version)
    call = Call(f"{base}/update_weights_from_distributed", body)
    call.start()
    for i, (_, t) in enumerate(named):
        if after is not None and i == after:
            print("sent", flush=True)
            threading.Event().wait()  # until killed
        dist.broadcast(t, src=0, group=pg)
    call.join()
    return call.answer


def main(base: str, checkpoint: str, mode: str, version: int, name: str, port: int, world_size: int) -> None:
    from safetensors.torch import load_file
    from pathlib import Path

    named = [(k, v) for f in sorted(Path(checkpoint).glob("*.safetensors")) for k, v in load_file(str(f)).items()]
    pg, answer = init_group(base, world_size, port, name)
    print(json.dumps(answer), flush=True)
    if mode == "single":
        for i, item in enumerate(named):
            print(json.dumps(push(base, pg, [item], version)), flush=True)
    else:
        print(json.dumps(push(base, pg, named, version, after=len(named) // 2 if mode == "die" else None)),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]), int(sys.argv[7]))
