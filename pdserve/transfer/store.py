"""TCPStores that listen on the address they are given, and only there.

torch's TCPStore binds every interface whatever host it is given (measured: a master store made for
127.0.0.1 listened on 0.0.0.0), so a store meant for loopback (a tensor-parallel worker's ranks) or for a
pod's own address (a decode worker's KV rendezvous, a trainer's weight group) answered on every network the
node is on, and any peer there could join a rendezvous or read and write its keys. Here the listening socket
is made and bound first, to the address given, and handed to the store (master_listen_fd), which owns it
from then on (and closes it).
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def bound_store(host: str, port: int, timeout_s: float, world_size: int | None = None) -> dist.TCPStore:
    """A master TCPStore listening on host:port (port 0: one the OS picks; the store's .port says which)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        bound = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(host, bound, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())
