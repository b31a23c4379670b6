"""What descriptors clients pass on ``shm.sock`` can make the daemon hold while a
close blocks (DESIGN.md 120), found by a review of the shm path: past the
closer's bound each connection still had one message's worth (up to 253) read
into the daemon's descriptor table, so the descriptors held grew with
``shm.max_connections`` (libzmq aborts the process when an ``ipc://`` accept
meets ``EMFILE``).  On a real ``ShmServer`` and ``BusServer``, with a close that
blocks for real (``tests.conftest.LingeringSocket``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.shm.closer import MAX_WAITING
from inferd_wire import protocol
from tests.conftest import HANG_S, LingeringSocket, wait_until
from tests.unit.bus.test_shm_requests import Setup, infer, receive, running, sealed_memfd

#: Descriptors one flooding message brings (SCM_MAX_FD is 253).
MANY = 200


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    yield from running(Setup(tmp_path, max_in_flight=2), monkeypatch)


def test_past_the_closers_bound_a_connection_brings_no_more_descriptors_in(
    setup: Setup,
) -> None:
    closer = setup.shm.closer
    # Connected before the backlog (new connections are refused during it).
    flooders = [setup.connect() for _ in range(3)]
    registrar = setup.connect()
    lingering = LingeringSocket()
    read, write = os.pipe()
    pipes = [os.pipe() for _ in range(MAX_WAITING + 1)]
    memfd = sealed_memfd()
    try:
        closer.close_later([lingering.detach()])
        wait_until(lambda: closer.status()["blocked_s"] > 0, message="a close under way")
        closer.close_later(end for _, end in pipes)
        assert closer.backed_up
        waiting = closer.status()["waiting"]
        socket.send_fds(flooders[0], [infer(1)], [write] * MANY)
        socket.send_fds(flooders[1], [protocol.pack({"v": 1, "id": 2, "op": "register"})], [write])
        socket.send_fds(flooders[2], [infer(3)], [memfd, write])
        wait_until(lambda: setup.status()["connections"] == 1, HANG_S, message="flooders closed")
        # At most a copy each and its socket: not the descriptors each message brought.
        assert closer.status()["waiting"] - waiting <= 2 * len(flooders)
        for flooder in flooders:
            refusal = receive(flooder)
            assert refusal["id"] is None and refusal["error"]["code"] == "RESOURCE_EXHAUSTED"
            assert "wait to be closed" in refusal["error"]["message"]
            assert flooder.recv(64) == b""  # then the end
        assert setup.status()["closing"]["connections_closed_for_backlog"] == 3
        # A client registering a region is still served meanwhile, and kept.
        socket.send_fds(registrar, [protocol.pack({"v": 1, "id": 4, "op": "register"})], [memfd])
        assert receive(registrar)["ok"] is True
        assert setup.status()["connections"] == 1 and len(setup.status()["regions"]) == 1
    finally:
        wait_until(
            lambda: lingering.drain() or closer.status()["waiting"] == 0,
            message="the stuck close ended and the rest closed",
        )
        lingering.close()
        for descriptor in (read, write, memfd, *(end for end, _ in pipes)):
            os.close(descriptor)
        for client in (*flooders, registrar):
            client.close()
