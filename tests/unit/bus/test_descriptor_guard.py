"""The descriptor guard (``bus/descriptor_guard.py``, DESIGN.md 128): its limits
derived from the soft limit, when it looks and ends connections, an episode
logged once, and ``end_extra_connections`` on real accepted sockets: each peer's
past the bound shut down, nothing else touched.  The flood against a real daemon
is ``tests/integration/test_descriptor_flood.py``."""

from __future__ import annotations

import os
import select
import socket
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

from inferd.bus.descriptor_guard import (
    QUIET_S,
    DescriptorGuard,
    GuardLimits,
    lowest_free_descriptor,
)
from inferd.bus.descriptor_scan import SocketPeer, end_extra_connections
from inferd.bus.endpoint_connections import EndpointConnections
from tests.conftest import HANG_S, wait_until


def test_the_limits_are_derived_from_the_soft_limit() -> None:
    """An eighth of the limit; the period lets four looks fit while a flood at
    50,000 connections a second fills the other seven eighths (0.1 s at most)."""
    assert GuardLimits.of(65536) == GuardLimits(65536, 8192, 0.1, 7168)
    assert GuardLimits.of(4096) == GuardLimits(4096, 512, 3584 / 50_000 / 4, 448)
    assert GuardLimits.of(64).period_s == 0.001


def test_the_lowest_free_descriptor_is_the_number_the_next_one_gets() -> None:
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(4)]
    try:
        top = lowest_free_descriptor(held[0])
        os.close(held.pop(1))  # a hole below the others
        hole = lowest_free_descriptor(held[0])
        assert hole < top
        held.append(os.open("/dev/null", os.O_RDONLY))
        assert held[-1] == hole  # the kernel gives the lowest free number
    finally:
        for fd in held:
            os.close(fd)


class Trims:
    """A stand-in for ``end_extra_connections``: returns what the test queued."""

    def __init__(self) -> None:
        self.calls = 0
        self.results: list[Counter[SocketPeer]] = []

    def __call__(
        self, sockets: Mapping[str, EndpointConnections], keep: int
    ) -> Counter[SocketPeer]:
        self.calls += 1
        return self.results.pop(0) if self.results else Counter()


def test_the_guard_ends_connections_past_the_threshold_and_logs_each_flood_once() -> None:
    now = [0.0]
    trims = Trims()
    limits = GuardLimits.of(4096)
    threshold, step = limits.threshold, limits.rescan_step  # 512, 448
    guard = DescriptorGuard({}, 64, limits, trim=trims, clock=lambda: now[0])
    with capture_logs() as logs:
        guard.look(threshold - 1)
        assert trims.calls == 0  # below the threshold: nothing to do
        trims.results = [Counter({("infer", 0): 700}), Counter({("infer", 0): 50})]
        guard.look(threshold)
        assert guard._flooded  # it ended some: the next look comes at once
        guard.look(threshold + 100)  # still past it: the flood goes on
        guard.look(threshold + 200)
        assert trims.calls == 3 and not guard._flooded
        guard.look(threshold + 200 + step - 1)  # that pass ended nothing: wait a step
        assert trims.calls == 3
        guard.look(threshold + 200 + step)
        assert trims.calls == 4
        now[0] = 1.0
        guard.look(100)  # below: the flood is over once it stays so for QUIET_S
        now[0] = 1.0 + QUIET_S - 0.1
        guard.look(100)
        assert [log["event"] for log in logs] == ["descriptor_flood_trimmed"]
        now[0] = 1.0 + QUIET_S
        guard.look(100)
        trims.results = [Counter({("control", "10.0.0.9"): 3})]
        guard.look(threshold)  # a second flood: logged again
    assert [log["event"] for log in logs] == [
        "descriptor_flood_trimmed",
        "descriptor_flood_ended",
        "descriptor_flood_trimmed",
    ]
    first, ended, second = logs
    assert (first["log_level"], first["ended"], first["limit"], first["threshold"]) == (
        "warning",
        700,
        4096,
        threshold,
    )
    assert first["peers"] == [{"socket": "infer", "uid": 0, "ended": 700}]
    assert (ended["log_level"], ended["ended"]) == ("info", 750)
    assert second["peers"] == [{"socket": "control", "address": "10.0.0.9", "ended": 3}]
    assert guard.describe() == {
        "limit": 4096,
        "threshold": threshold,
        "period_s": round(limits.period_s, 4),
        "episodes": 2,
        "connections_ended": 753,
    }


def test_the_guard_thread_looks_until_stopped_and_is_joined() -> None:
    looked = threading.Event()

    def trim(sockets: Mapping[str, EndpointConnections], keep: int) -> Counter[SocketPeer]:
        looked.set()
        return Counter()

    # Threshold 0: every look passes over the descriptors.
    guard = DescriptorGuard({}, 1, GuardLimits(1024, 0, 0.001, 1), trim=trim)
    guard.start()
    assert guard.name == "inferd-fd-guard"
    assert looked.wait(HANG_S)
    guard.stop()
    guard.join(HANG_S)
    assert not guard.is_alive()


@pytest.fixture
def listeners(short_tmp_path: Path) -> Iterator[dict[str, socket.socket]]:
    """Unix stream listeners on a path ("a") and an abstract name ("b"), and a TCP
    one ("t") on loopback."""
    made: dict[str, socket.socket] = {}
    for name, address in (("a", str(short_tmp_path / "a.sock")), ("b", f"\0{short_tmp_path.name}")):
        made[name] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        made[name].bind(address)
    made["t"] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    made["t"].bind(("127.0.0.1", 0))
    for sock in made.values():
        sock.listen(64)
    yield made
    for sock in made.values():
        sock.close()


def _endpoint(listener: socket.socket) -> str:
    address = listener.getsockname()
    if isinstance(address, bytes):  # abstract: ipc://@name
        return f"ipc://@{address[1:].decode()}"
    if isinstance(address, str):
        return f"ipc://{address}"
    host, port = address
    return f"tcp://{host}:{port}"


def _at_end(sock: socket.socket) -> bool:
    """Whether ``sock`` reads its end (its peer shut it down), waiting at most HANG_S."""
    readable, _, _ = select.select([sock], [], [], HANG_S)
    return bool(readable) and sock.recv(1) == b""


def test_each_peers_connections_past_the_bound_are_shut_down_and_nothing_else(
    listeners: dict[str, socket.socket],
) -> None:
    """Accepted sockets this test holds stand for libzmq's: those past ``keep`` of
    each peer of a bound socket are shut down (their clients read the end), those
    within it, another socket's within it, the listeners and the clients' own
    sockets are not; a connection already ended is not counted again."""
    counts = {"a": 5, "b": 3, "t": 4}
    sockets = {name: EndpointConnections(_endpoint(sock)) for name, sock in listeners.items()}
    with ExitStack() as stack:
        pairs: dict[str, list[tuple[socket.socket, socket.socket]]] = {}
        for name, count in counts.items():
            pairs[name] = []
            for _ in range(count):
                client = socket.socket(listeners[name].family, socket.SOCK_STREAM)
                stack.callback(client.close)
                client.connect(listeners[name].getsockname())
                accepted, _ = listeners[name].accept()
                stack.callback(accepted.close)
                pairs[name].append((client, accepted))
        ended = end_extra_connections(sockets, 2)
        me = os.geteuid()
        assert ended == Counter({("a", me): 3, ("b", me): 1, ("t", "127.0.0.1"): 2})
        # In descriptor order: each peer keeps its first two.
        for name in counts:
            for index, (client, _accepted) in enumerate(pairs[name]):
                if index < 2:
                    client.setblocking(False)
                    with pytest.raises(BlockingIOError):
                        client.recv(1)  # open, nothing to read
                else:
                    assert _at_end(client), f"{name}'s connection {index} was not shut down"
        # The ended ones stay open here (libzmq would close them): not counted again.
        assert end_extra_connections(sockets, 2) == Counter()
        assert [sockets[name].count() for name in counts] == [5, 3, 4]
        assert listeners["a"].getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)


def test_libzmq_closes_a_connection_the_guard_shut_down(short_tmp_path: Path) -> None:
    """What the guard relies on: a shut down connection that never greeted is
    closed by libzmq itself, its descriptor given back."""
    context: zmq.Context[Any] = zmq.Context()
    server = context.socket(zmq.ROUTER)
    endpoint = f"ipc://{short_tmp_path}/infer.sock"
    server.bind(endpoint)
    connections = EndpointConnections(endpoint)
    try:
        with ExitStack() as stack:
            for _ in range(3):
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                stack.callback(client.close)
                client.connect(endpoint[len("ipc://") :])
            wait_until(lambda: connections.count() == 3, message="three accepted")
            assert end_extra_connections({"infer": connections}, 1).total() == 2
            # count() also counts a connection shut down but not closed yet.
            wait_until(lambda: connections.count() == 1, message="libzmq closed two")
    finally:
        server.close(linger=0)
        context.term()
