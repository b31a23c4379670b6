"""``shm.max_connections_per_uid``: one local user could hold every one of the
``shm.max_connections`` slots with idle connections and lock every other user
out of shared memory.  On a real ``ShmServer`` and real sockets; the peer's uid
is the kernel's (``SO_PEERCRED``), rewritten for the connections a test makes
as another user."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import ShmConfig
from inferd.shm.server import AdmitPeer, ShmServer
from tests.conftest import HANG_S, wait_until
from tests.unit.bus.test_shm_requests import refusal_at_accept

OTHER_UID = os.getuid() + 1000


def running_server(
    directory: Path, per_uid: int, admit: AdmitPeer | None = None
) -> Iterator[ShmServer]:
    """A started ``ShmServer`` of four connections, ``per_uid`` a uid (``admit``:
    ``security.infer_allow``'s check; None admits all), stopped after."""
    config = ShmConfig(
        socket=directory / "shm.sock", max_connections=4, max_connections_per_uid=per_uid
    )
    made = ShmServer(config) if admit is None else ShmServer(config, admit=admit)
    made.start()
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture
def server(short_tmp_path: Path) -> Iterator[ShmServer]:
    yield from running_server(short_tmp_path, per_uid=2)


@pytest.fixture
def peer_uid(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The uid ``SO_PEERCRED`` reports for the next connection accepted: set
    ``peer_uid[0]`` before connecting (the real one to begin with)."""
    uid = [os.getuid()]
    real = socket.socket.getsockopt

    def as_peer_uid(sock: socket.socket, *args: Any) -> Any:
        value = real(sock, *args)
        if args[:2] == (socket.SOL_SOCKET, socket.SO_PEERCRED):
            pid, _uid, gid = struct.unpack("iII", value)
            return struct.pack("iII", pid, uid[0], gid)
        return value

    monkeypatch.setattr(socket.socket, "getsockopt", as_peer_uid)
    return uid


def connect(server: ShmServer) -> socket.socket:
    """A connection the server accepted."""
    count = len(server.connections)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.settimeout(HANG_S)
    client.connect(str(server._config.socket))
    wait_until(lambda: len(server.connections) > count, message="the connection accepted")
    return client


def read_the_end(server: ShmServer) -> None:
    """Read a closed connection's end as whoever serves requests does (the engine
    worker or the bus thread, ``bus.shm_requests``): the connection is closed."""
    entry = wait_until(server.connections.ready, message="the connection's end readable")
    message = entry.receive()
    assert message is not None and message.closed
    server.connections.end_of_input(entry)


def test_a_uid_at_its_bound_is_refused_while_another_uid_still_connects(
    server: ShmServer, peer_uid: list[int]
) -> None:
    uid = os.getuid()
    clients = [connect(server), connect(server)]  # this uid's; then another's, its again
    try:
        with capture_logs() as logs:
            error = refusal_at_accept(str(server._config.socket))
        assert error["code"] == "RESOURCE_EXHAUSTED"
        assert error["message"] == (
            f"uid {uid} holds 2 shm connections already (shm.max_connections_per_uid); "
            "close one first"
        )
        [line] = [line for line in logs if line["event"] == "shm_connection_refused"]
        assert line["uid"] == uid and "shm.max_connections_per_uid" in line["reason"]
        # Two slots of the four are free: another user still gets one.
        peer_uid[0] = OTHER_UID
        clients.append(connect(server))
        status = server.status()
        assert status["connections_by_uid"] == {str(uid): 2, str(OTHER_UID): 1}
        assert status["max_connections_per_uid"] == 2
        assert status["refused_per_uid"] == 1
        assert status["refused"] == {"RESOURCE_EXHAUSTED": 1}
        # A connection that closes gives its uid's slot back.
        clients.pop(0).close()
        read_the_end(server)
        assert server.connections.held_by(uid) == 1
        peer_uid[0] = uid
        clients.append(connect(server))
        assert server.status()["connections_by_uid"] == {str(uid): 2, str(OTHER_UID): 1}
    finally:
        for client in clients:
            client.close()
