"""A region the daemon cannot map (``mmap`` fails ``ENOMEM``: its address space or
``vm.max_map_count`` used up) is refused ``RESOURCE_EXHAUSTED`` on its own
connection, which stays open; the daemon goes on serving it and the others.
``mmap`` is made to fail in ``shm.memfd`` only, so the daemon's own error
handling turns the ``OSError`` into the answer."""

from __future__ import annotations

import errno
import mmap
import os
import socket
from types import SimpleNamespace
from typing import Any

import pytest

from inferd.shm import memfd
from inferd_wire import protocol
from tests.unit.bus.test_shm_requests import (  # noqa: F401  (the fixture)
    Setup,
    receive,
    sealed_memfd,
    setup,
)


def register(client: socket.socket, request_id: int, fd: int) -> dict[str, Any]:
    socket.send_fds(client, [protocol.pack({"v": 1, "id": request_id, "op": "register"})], [fd])
    return receive(client)


def test_a_region_mmap_cannot_map_is_refused_and_the_connection_served_on(
    setup: Setup,  # noqa: F811  (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def out_of_mappings(*_args: Any) -> mmap.mmap:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    failing = SimpleNamespace(**{**vars(mmap), "mmap": out_of_mappings})
    monkeypatch.setattr(memfd, "mmap", failing)
    fd = sealed_memfd()
    try:
        with setup.connect() as client:
            reply = register(client, 1, fd)
            assert (reply["id"], reply["ok"]) == (1, False)
            assert reply["error"]["code"] == "RESOURCE_EXHAUSTED"
            message = reply["error"]["message"]
            assert message == "the daemon cannot map the region now: Cannot allocate memory"
            status = setup.status()
            assert status["refused"] == {"RESOURCE_EXHAUSTED": 1}
            assert status["regions"] == [] and status["mapped_bytes"] == 0
            assert status["connections"] == 1  # not closed
            monkeypatch.setattr(memfd, "mmap", mmap)  # mappings free again
            reply = register(client, 2, fd)
            assert (reply["id"], reply["ok"]) == (2, True), reply
            assert len(setup.status()["regions"]) == 1
    finally:
        os.close(fd)
    assert setup.shm.is_alive() and setup.bus.is_alive()
