"""The peer's credentials as ``shm.sock`` reads them (``SO_PEERCRED``), found by a
review of the shm path: ``struct ucred``'s uid and gid are unsigned (``uid_t``,
``gid_t``), and read as signed ints a uid past 2**31 (Linux allows up to
2**32 - 2) became a negative number, unlike the same user's uid on the infer
socket (libzmq prints it unsigned, ``bus.access``): its regions were another
uid's to its own requests there, and an allow-list naming it refused it here."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.bus.test_shm_requests import Setup, receive, running, sealed_memfd

#: A uid and gid past 2**31 (as a directory service may hand out).
LARGE = 3_000_000_000


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    yield from running(Setup(tmp_path, max_in_flight=2), monkeypatch)


def test_a_peer_with_a_uid_past_2_31_is_known_by_that_uid(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    admitted: list[tuple[int, int]] = []
    monkeypatch.setattr(
        setup.shm, "_admit", lambda uid, gid, _pid: admitted.append((uid, gid)) or None
    )
    real = socket.socket.getsockopt

    def as_a_large_uid(sock: socket.socket, *args: Any) -> Any:
        value = real(sock, *args)
        if args[:2] == (socket.SOL_SOCKET, socket.SO_PEERCRED):
            # struct ucred { pid_t pid; uid_t uid; gid_t gid; }, as the kernel fills it.
            (pid,) = struct.unpack_from("i", value)
            return struct.pack("iII", pid, LARGE, LARGE)
        return value

    monkeypatch.setattr(socket.socket, "getsockopt", as_a_large_uid)
    memfd = sealed_memfd()
    try:
        with setup.connect() as client:
            socket.send_fds(client, [b"\x83\xa1v\x01\xa2id\x01\xa2op\xa8register"], [memfd])
            assert receive(client)["ok"] is True
            status = setup.status()
            assert admitted == [(LARGE, LARGE)]
            assert status["mapped_bytes_by_uid"] == {str(LARGE): os.sysconf("SC_PAGE_SIZE")}
            [region] = status["regions"]
            assert region["owner"]["uid"] == LARGE and region["owner"]["gid"] == LARGE
    finally:
        os.close(memfd)
