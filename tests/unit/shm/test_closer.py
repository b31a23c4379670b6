"""Closing what clients hand the daemon on a thread of its own (DESIGN.md 120): a
close that blocks holds up nothing else, and what waits behind it is bounded.

A close that blocks is made for real (``tests.conftest.LingeringSocket``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.config import ShmConfig
from inferd.shm.closer import DescriptorCloser
from inferd.shm.connections import Message, ShmConnections
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from tests.conftest import HANG_S, LingeringSocket, wait_until

ME = PeerCredentials(os.getpid(), os.getuid(), os.getgid())


@pytest.fixture
def lingering() -> Iterator[LingeringSocket]:
    blocked = LingeringSocket()
    yield blocked
    blocked.close()


def test_a_close_that_blocks_holds_up_only_the_closer_and_what_waits_behind_it(
    lingering: LingeringSocket,
) -> None:
    closer = DescriptorCloser()
    closer.start()
    read, write = os.pipe()
    try:
        closer.close_later([lingering.detach(), write])
        wait_until(lambda: closer.status()["blocked_s"] > 0, message="the close under way")
        # The caller went on at once; the pipe's end waits behind the blocked close.
        assert closer.status()["waiting"] == 1 and closer.status()["closed"] == 0
        os.write(write, b"still open")
        wait_until(
            lambda: lingering.drain() or closer.status()["closed"] == 2,
            message="both closed once the peer reads",
        )
        assert os.read(read, 64) == b"still open"
        assert os.read(read, 64) == b""  # the write end was closed
        assert closer.status() == {"waiting": 0, "closed": 2, "blocked_s": 0.0}
    finally:
        closer.stop(HANG_S)
        os.close(read)
    assert not closer.is_alive()


def test_it_is_backed_up_past_its_bound_and_stop_closes_what_waits() -> None:
    closer = DescriptorCloser(max_waiting=2)  # not started: nothing is closed yet
    pipes = [os.pipe() for _ in range(3)]
    closer.close_later(write for _, write in pipes[:2])
    assert not closer.backed_up
    closer.close_later([pipes[2][1]])
    assert closer.backed_up
    closer.start()
    closer.stop(HANG_S)
    assert not closer.is_alive() and closer.status()["closed"] == 3
    for read, _ in pipes:
        assert os.read(read, 1) == b""  # each write end is closed
        os.close(read)


def test_a_connection_bringing_descriptors_past_the_bound_is_closed() -> None:
    """While a close blocks, descriptors pile up behind it: past the bound the
    connection that brought more is closed (its socket queued to be closed too)."""
    config = ShmConfig(socket=Path("/run/inferd/shm.sock"))
    table = RegionTable(config)
    closer = DescriptorCloser(max_waiting=4)  # not started: as if its close blocked
    connections = ShmConnections(table, 8, closer)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    entry = connections.add(ours, Connection(1, ME))
    pipes = [os.pipe() for _ in range(3)]
    try:
        message = Message(b"x", [read for read, _ in pipes], 0)
        connections.discard_fds(entry, message)
        assert message.fds == [] and not entry.closed  # 3 wait: within the bound
        connections.discard_fds(entry, Message(b"x", [write for _, write in pipes], 0))
        assert entry.closed and len(connections) == 0
        closing = connections.status()["closing"]
        assert closing["connections_closed_for_backlog"] == 1
        assert closing["waiting"] == 7  # six pipe ends and the connection's socket
        closer.start()
        closer.stop(HANG_S)
        assert theirs.recv(1) == b""  # the daemon's end of the connection is closed
    finally:
        theirs.close()
