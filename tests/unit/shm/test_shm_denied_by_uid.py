"""``status.shm.denied_by_uid``: the connections ``security.infer_allow`` refuses at
accept (``PERMISSION_DENIED``) by the peer's uid (``SO_PEERCRED``), each of the
first ``MAX_REFUSED_UIDS`` uids on its own and the rest as ``other``, as the
refusals over ``shm.max_connections_per_uid`` are (``refused_by_uid``); exported
in the same per-uid family, told apart by ``code``.  They were exported by code
alone (``inferd_shm_refused_total``).  On a real ``ShmServer`` and real sockets,
the peer's uid rewritten as ``test_shm_connections_per_uid`` does."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.shm import server as shm_server
from inferd.shm.server import ShmServer
from tests.unit.bus.test_shm_requests import refusal_at_accept
from tests.unit.metrics.test_families import scrape, status
from tests.unit.shm.test_shm_connections_per_uid import (  # noqa: F401  (the fixture)
    connect,
    peer_uid,
    running_server,
)

ALLOWED = os.getuid()


def infer_allow(uid: int, _gid: int, _pid: int) -> str | None:
    """``security.infer_allow`` naming this process's uid alone."""
    return None if uid == ALLOWED else f"uid {uid} is not in security.infer_allow"


@pytest.fixture
def server(short_tmp_path: Path) -> Iterator[ShmServer]:
    yield from running_server(short_tmp_path, per_uid=1, admit=infer_allow)


def test_refusals_by_the_allow_list_are_counted_by_uid_and_past_the_cap_as_other(
    server: ShmServer,
    peer_uid: list[int],  # noqa: F811  (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shm_server, "MAX_REFUSED_UIDS", 2)
    denied = [ALLOWED + 1000 + n for n in range(3)]
    path = str(server._config.socket)
    for uid, refusals in zip(denied, (2, 1, 1), strict=True):
        peer_uid[0] = uid
        for _ in range(refusals):
            error = refusal_at_accept(path)
            assert error["code"] == "PERMISSION_DENIED"
            assert f"uid {uid} is not in security.infer_allow" in error["message"]
    # The per-uid bound's refusals stay apart, with a cap of their own.
    peer_uid[0] = ALLOWED
    client: socket.socket = connect(server)
    try:
        assert refusal_at_accept(path)["code"] == "RESOURCE_EXHAUSTED"
        shm = server.status()
        assert shm["denied_by_uid"] == {str(denied[0]): 2, str(denied[1]): 1, "other": 1}
        assert shm["refused_by_uid"] == {str(ALLOWED): 1} and shm["refused_per_uid"] == 1
        assert shm["refused"] == {"PERMISSION_DENIED": 4, "RESOURCE_EXHAUSTED": 1}
        # A uid counted on its own stays so (its series never moves to "other").
        peer_uid[0] = denied[1]
        refusal_at_accept(path)
        shm = server.status()
        assert shm["denied_by_uid"][str(denied[1])] == 2
        document = status()
        document["shm"] = shm
        exported = {
            tuple(sorted(dict(labels).items())): value
            for (name, labels), value in scrape(document).items()
            if name == "inferd_shm_connections_refused_per_uid_total"
        }
        assert exported == {
            (("code", "PERMISSION_DENIED"), ("uid", str(denied[0]))): 2,
            (("code", "PERMISSION_DENIED"), ("uid", str(denied[1]))): 2,
            (("code", "PERMISSION_DENIED"), ("uid", "other")): 1,
            (("code", "RESOURCE_EXHAUSTED"), ("uid", str(ALLOWED))): 1,
        }
    finally:
        client.close()
