"""Rendezvous stores listen on the address they are given, and only there (#47, finding 10): torch's
TCPStore made for 127.0.0.1 listened on every interface. pdserve.transfer.store.bound_store, as the decode
worker's KV store (StoreServer), the TP ranks' store and a trainer's weight-group store use it."""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from pdserve.transfer.channel import StoreServer
from pdserve.transfer.store import bound_store

from conftest import other_address


def reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def elsewhere() -> str:
    address = other_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    return address


def test_torch_alone_listens_everywhere(elsewhere):
    """Why bound_store exists: the finding, on this machine's torch."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    assert reachable(elsewhere, store.port)


def test_a_bound_store_listens_on_its_address_alone(elsewhere):
    store = bound_store("127.0.0.1", 0, 5.0)
    assert reachable("127.0.0.1", store.port) and not reachable(elsewhere, store.port)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"
    server = StoreServer("127.0.0.1")  # the decode worker's KV rendezvous
    assert reachable("127.0.0.1", server.port) and not reachable(elsewhere, server.port)
    server.close()
    mine = bound_store(elsewhere, 0, 5.0)  # a pod's own address: not loopback
    assert reachable(elsewhere, mine.port) and not reachable("127.0.0.1", mine.port)
