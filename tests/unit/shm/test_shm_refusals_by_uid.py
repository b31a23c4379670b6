"""``status.shm.refused_by_uid``: the refusals over ``shm.max_connections_per_uid``
by the refused peer's uid, for the metric's ``uid`` label; past
``MAX_REFUSED_UIDS`` distinct uids the rest count as ``other``, so the label's
values stay bounded however many users connect.  On a real ``ShmServer`` and
real sockets, the peer's uid rewritten as ``test_shm_connections_per_uid`` does."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.shm import server as shm_server
from inferd.shm.server import ShmServer
from tests.unit.bus.test_shm_requests import refusal_at_accept
from tests.unit.shm.test_shm_connections_per_uid import (  # noqa: F401  (the fixture)
    connect,
    peer_uid,
    running_server,
)


@pytest.fixture
def server(short_tmp_path: Path) -> Iterator[ShmServer]:
    yield from running_server(short_tmp_path, per_uid=1)


def test_refusals_per_uid_are_counted_by_uid_and_past_the_cap_as_other(
    server: ShmServer,
    peer_uid: list[int],  # noqa: F811  (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shm_server, "MAX_REFUSED_UIDS", 2)
    uids = [os.getuid() + 1000 + n for n in range(3)]
    clients: list[socket.socket] = []
    try:
        for uid, refusals in zip(uids, (2, 1, 1), strict=True):
            peer_uid[0] = uid
            clients.append(connect(server))  # its one connection; then refused
            for _ in range(refusals):
                error = refusal_at_accept(str(server._config.socket))
                assert error["code"] == "RESOURCE_EXHAUSTED"
        status = server.status()
        assert status["refused_by_uid"] == {str(uids[0]): 2, str(uids[1]): 1, "other": 1}
        assert status["refused_per_uid"] == 4  # the total, as before
        # A uid counted on its own stays so (its series never moves to "other").
        peer_uid[0] = uids[1]
        refusal_at_accept(str(server._config.socket))
        assert server.status()["refused_by_uid"][str(uids[1])] == 2
    finally:
        for client in clients:
            client.close()
