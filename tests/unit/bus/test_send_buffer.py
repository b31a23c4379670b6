"""``inferd_wire.send_buffer``: the kernel send buffer of each ipc:// connection a
ZeroMQ socket accepts or makes is sized as its monitor reports it, a stale
event touches nothing else, and the kernel's cap is reported (DESIGN.md 116).

Each connection's ``SO_SNDBUF`` is read back from the kernel through this
process's descriptors, not from what ``SendBuffer`` says it did."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd_client import InferenceClient
from inferd_wire.endpoints import MAX_SEND_BUFFER_BYTES
from inferd_wire.send_buffer import SendBuffer
from tests.conftest import net_core

ASKED = 2 * 1024 * 1024
WAIT_MS = 10_000


def _connections(path: str) -> dict[str, list[int]]:
    """``SO_SNDBUF`` of this process's connected Unix stream sockets on ``path``:
    those bound to it (accepted) and those connected to it."""
    found: dict[str, list[int]] = {"accepted": [], "connected": []}
    for name in os.listdir("/proc/self/fd"):
        try:
            conn = socket.socket(fileno=int(name))
        except OSError:
            continue
        try:
            if conn.family != socket.AF_UNIX or conn.type != socket.SOCK_STREAM:
                continue
            try:
                local, peer = conn.getsockname(), conn.getpeername()
            except OSError:  # a listener: not connected
                continue
            size = conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            if local == path:
                found["accepted"].append(size)
            elif peer == path:
                found["connected"].append(size)
        finally:
            conn.detach()
    return found


def _sized(send_buffer: SendBuffer, count: int) -> None:
    """Apply the monitor's events as they come until ``count`` connections are sized."""
    assert send_buffer.monitor is not None
    while send_buffer.sized < count:
        assert send_buffer.monitor.poll(WAIT_MS), "no connection event"
        send_buffer.apply()


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "infer.sock")


def _pair(
    context: zmq.Context[Any], path: str, router_bytes: int, dealer_bytes: int
) -> tuple[zmq.Socket[Any], SendBuffer, zmq.Socket[Any], SendBuffer]:
    endpoint = "ipc://" + path
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    router_buffer, dealer_buffer = (
        SendBuffer(endpoint, router_bytes),
        SendBuffer(endpoint, dealer_bytes),
    )
    router_buffer.watch(router)
    router.bind(endpoint)
    dealer_buffer.watch(dealer)
    dealer.connect(endpoint)
    return router, router_buffer, dealer, dealer_buffer


def test_accepted_and_connected_connections_get_the_size_asked(
    context: zmq.Context[Any], path: str
) -> None:
    if net_core("wmem_max") < ASKED:
        pytest.skip("net.core.wmem_max is below 2 MiB here: the cap is tested below")
    router, router_buffer, dealer, dealer_buffer = _pair(context, path, ASKED, ASKED)
    _sized(router_buffer, 1)
    _sized(dealer_buffer, 1)
    # The kernel reports twice what was asked (its bookkeeping), the default as is.
    assert _connections(path) == {"accepted": [2 * ASKED], "connected": [2 * ASKED]}
    for send_buffer in (router_buffer, dealer_buffer):
        assert send_buffer.status() == {
            "bytes": ASKED,
            "sized": 1,
            "capped": 0,
            "effective_bytes": ASKED,
        }
    # Still a working pair.
    dealer.send(b"x" * 1_000_000)
    _routing_id, payload = router.recv_multipart()
    assert len(payload) == 1_000_000


def test_zero_leaves_the_kernels_default_and_watches_nothing(
    context: zmq.Context[Any], path: str
) -> None:
    router, router_buffer, dealer, dealer_buffer = _pair(context, path, 0, 0)
    assert router_buffer.monitor is None and dealer_buffer.monitor is None
    dealer.send(b"ping")
    router.recv_multipart()  # connected both ways
    default = net_core("wmem_default")
    assert _connections(path) == {"accepted": [default], "connected": [default]}
    assert router_buffer.apply() == 0 and router_buffer.status()["sized"] == 0


def test_one_side_sized_leaves_the_other_alone(context: zmq.Context[Any], path: str) -> None:
    router, router_buffer, dealer, _dealer_buffer = _pair(context, path, 1024 * 1024, 0)
    _sized(router_buffer, 1)
    dealer.send(b"ping")
    router.recv_multipart()
    effective = min(1024 * 1024, net_core("wmem_max"))
    default = net_core("wmem_default")
    assert _connections(path) == {"accepted": [2 * effective], "connected": [default]}


def test_every_connection_of_the_endpoint_is_sized(context: zmq.Context[Any], path: str) -> None:
    endpoint = "ipc://" + path
    router = context.socket(zmq.ROUTER)
    send_buffer = SendBuffer(endpoint, 1024 * 1024)
    send_buffer.watch(router)
    router.bind(endpoint)
    dealers = [context.socket(zmq.DEALER) for _ in range(3)]
    for dealer in dealers:
        dealer.connect(endpoint)
    _sized(send_buffer, 3)
    effective = min(1024 * 1024, net_core("wmem_max"))
    assert _connections(path)["accepted"] == [2 * effective] * 3


def test_a_size_over_the_kernels_cap_is_counted_as_capped(
    context: zmq.Context[Any], path: str
) -> None:
    wmem_max = net_core("wmem_max")
    _router, router_buffer, _dealer, _ = _pair(context, path, MAX_SEND_BUFFER_BYTES, 0)
    _sized(router_buffer, 1)
    got = min(MAX_SEND_BUFFER_BYTES, wmem_max)
    assert router_buffer.effective_bytes == got
    assert router_buffer.capped == (1 if wmem_max < MAX_SEND_BUFFER_BYTES else 0)
    assert _connections(path)["accepted"] == [2 * got]


def test_a_stale_descriptor_is_left_alone(path: str, tmp_path: Path) -> None:
    """A number that no longer names one of the endpoint's connections: a pipe, a
    listener, a connection of another path."""
    send_buffer = SendBuffer("ipc://" + path, ASKED)
    read_end, write_end = os.pipe()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    elsewhere = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other = str(tmp_path / "other.sock")
    other_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other_listener.bind(other)
    other_listener.listen()
    elsewhere.connect(other)
    try:
        before = elsewhere.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        for fd in (read_end, listener.fileno(), elsewhere.fileno(), 10_000):
            assert not send_buffer.size(fd)
        assert elsewhere.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == before
        assert send_buffer.sized == 0
        # ... while one of the endpoint's own connections is sized.
        mine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mine.connect(path)
        assert send_buffer.size(mine.fileno())
        assert mine.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * min(
            ASKED, net_core("wmem_max")
        )
        mine.close()
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        for sock in (listener, elsewhere, other_listener):
            sock.close()


def test_tcp_is_left_to_the_kernels_tuning(context: zmq.Context[Any]) -> None:
    router = context.socket(zmq.ROUTER)
    send_buffer = SendBuffer("tcp://127.0.0.1:*", ASKED)
    send_buffer.watch(router)
    assert send_buffer.monitor is None
    assert router.getsockopt(zmq.SNDBUF) == -1  # libzmq's "the OS default"


@pytest.mark.parametrize("nbytes", [-1, MAX_SEND_BUFFER_BYTES + 1])
def test_a_size_out_of_range_is_refused(nbytes: int, tmp_path: Path) -> None:
    message = f"send_buffer_bytes must be 0..{MAX_SEND_BUFFER_BYTES}, got {nbytes}"
    with pytest.raises(ValueError, match=message):
        SendBuffer("ipc:///run/inferd/infer.sock", nbytes)
    # The client refuses it at construction, with the same words.
    with pytest.raises(ValueError, match=message):
        InferenceClient("ipc://" + str(tmp_path / "infer.sock"), send_buffer_bytes=nbytes)


def test_close_stops_the_monitor_and_leaves_the_socket_working(
    context: zmq.Context[Any], path: str
) -> None:
    router, router_buffer, dealer, dealer_buffer = _pair(context, path, ASKED, ASKED)
    _sized(router_buffer, 1)
    monitor = router_buffer.monitor
    assert monitor is not None
    router_buffer.close()
    dealer_buffer.close()
    assert router_buffer.monitor is None and monitor.closed
    router_buffer.close()  # twice is harmless
    dealer.send(b"after")
    assert router.recv_multipart()[1] == b"after"
