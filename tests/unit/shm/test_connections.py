"""The clients' ``shm.sock`` connections (``inferd.shm.connections``): the end of a
client's input, replies to a connection that is draining, and what is handed to
the closer (DESIGN.md 120, 121).  Real ``SOCK_SEQPACKET`` pairs throughout."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from inferd.config import ShmConfig
from inferd.shm.closer import DescriptorCloser
from inferd.shm.connections import Message, ShmConnection, ShmConnections
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from inferd_wire import protocol
from tests.conftest import HANG_S, make_memfd

ME = PeerCredentials(os.getpid(), os.getuid(), os.getgid())


@dataclass
class Setup:
    connections: ShmConnections
    closer: DescriptorCloser
    entry: ShmConnection
    client: socket.socket


@pytest.fixture
def setup() -> Iterator[Setup]:
    """One connection; the closer is not started, as if a close blocked it."""
    closer = DescriptorCloser()
    table = RegionTable(ShmConfig(socket=Path("/run/inferd/shm.sock")))
    connections = ShmConnections(table, 8, closer)
    ours, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.settimeout(HANG_S)
    entry = connections.add(ours, Connection(1, ME))
    yield Setup(connections, closer, entry, client)
    connections.close_all()
    table.close_all()
    closer.start()
    closer.stop(HANG_S)
    client.close()


class PausingLock:
    """A lock whose next taker, once ``arm``-ed, stops before taking it until ``go``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed = False
        self.paused, self.go = threading.Event(), threading.Event()

    def arm(self) -> None:
        self._armed = True

    def __enter__(self) -> None:
        if self._armed:
            self._armed = False
            self.paused.set()
            assert self.go.wait(HANG_S)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_closed_connections_client_sees_its_end_at_once_whatever_the_closer_does(
    setup: Setup,
) -> None:
    setup.connections.close(setup.entry)
    assert setup.closer.status()["waiting"] == 1  # the socket waits to be closed...
    assert setup.client.recv(64) == b""  # ...and its client sees the end already


def test_a_registered_memfd_is_closed_at_once_not_behind_the_closer(setup: Setup) -> None:
    fd = make_memfd(4096, seals=0x0002)  # F_SEAL_SHRINK
    message = Message(protocol.pack({"v": 1, "id": 1, "op": "register"}), [fd], 0)
    setup.connections.answer(setup.entry, message, protocol.unpack_header(message.data))
    assert protocol.unpack_header(setup.client.recv(1024))["ok"] is True
    assert message.fds == []  # taken: its mapping holds the file
    with pytest.raises(OSError):
        os.fstat(fd)  # closed here, on the reader
    assert setup.closer.status()["waiting"] == 0


@pytest.mark.parametrize(
    ("in_flight", "client_end", "closed"),
    [
        (1, lambda client: client.shutdown(socket.SHUT_WR), False),
        (0, lambda client: client.shutdown(socket.SHUT_WR), True),
        (1, lambda client: client.close(), True),
    ],
    ids=["half-closed-in-flight", "half-closed-idle", "gone"],
)
def test_the_end_of_input_closes_at_once_unless_a_reader_waits_for_replies(
    setup: Setup, in_flight: int, client_end: Callable[[socket.socket], Any], closed: bool
) -> None:
    for _ in range(in_flight):
        setup.connections.admit(setup.entry)
    client_end(setup.client)
    setup.connections.end_of_input(setup.entry)
    assert setup.entry.closed is closed and setup.entry.draining is not closed


def test_the_reply_that_empties_a_draining_connection_is_the_last_sent_on_it(
    setup: Setup,
) -> None:
    connections, entry = setup.connections, setup.entry
    connections.admit(entry)
    connections.admit(entry)
    setup.client.shutdown(socket.SHUT_WR)
    connections.end_of_input(entry)
    assert entry.draining
    entry.lock = PausingLock()  # type: ignore[assignment]
    entry.lock.arm()
    # The first reply stops just before it takes the connection's lock, the second
    # goes all the way: the first must still be sent, then the connection closed.
    first = threading.Thread(target=connections.reply, args=(entry.route, b"reply-1"))
    first.start()
    assert entry.lock.paused.wait(HANG_S)
    connections.reply(entry.route, b"reply-2")
    assert not entry.closed  # one reply is still due
    entry.lock.go.set()
    first.join(HANG_S)
    assert [setup.client.recv(64) for _ in range(3)] == [b"reply-2", b"reply-1", b""]
    assert entry.closed and connections.status()["unroutable_replies"] == 0


def test_an_empty_message_is_a_message_and_the_end_of_input_is_the_end(setup: Setup) -> None:
    """Both read as zero bytes: only ``poll`` tells the client's end from a message
    that carries nothing (which is refused as such, and the connection read on)."""
    setup.client.send(b"")
    empty = setup.entry.receive()
    assert empty is not None and empty.data == b"" and not empty.closed
    setup.client.shutdown(socket.SHUT_WR)
    end = setup.entry.receive()
    assert end is not None and end.closed
