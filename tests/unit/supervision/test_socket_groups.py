"""ipc:// socket files get their configured group before their ``0660`` mode, and a
group the daemon cannot give stops it (``supervision/instance.py``)."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.errors import ConfigError
from inferd.supervision import instance
from inferd.supervision.instance import SocketGroupError, open_ipc_sockets_to_group


@pytest.fixture
def bound(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "control.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    os.chmod(path, 0o750)  # what UMask=0027 gives a socket: the group cannot connect yet
    yield path
    sock.close()


def test_the_group_is_given_first_then_the_mode(bound: Path) -> None:
    gid = 54321 if os.geteuid() == 0 else os.getegid()  # root may give any gid
    open_ipc_sockets_to_group([("control", f"ipc://{bound}", gid), ("infer", "tcp://x:1", 7)])
    info = bound.lstat()
    assert info.st_gid == gid and stat.S_IMODE(info.st_mode) == 0o660


def test_without_a_group_only_the_mode_changes(bound: Path) -> None:
    before = bound.lstat().st_gid
    open_ipc_sockets_to_group([("control", f"ipc://{bound}", None)])
    assert bound.lstat().st_gid == before and stat.S_IMODE(bound.lstat().st_mode) == 0o660


def test_a_group_the_daemon_is_not_in_stops_it(
    bound: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(instance.os, "geteuid", lambda: 998)  # not root
    monkeypatch.setattr(instance.os, "getgroups", lambda: [998])
    monkeypatch.setattr(instance.os, "getegid", lambda: 998)
    with pytest.raises(
        SocketGroupError, match=r"security\.control_group \(gid 4242\).*not a member"
    ) as raised:
        open_ipc_sockets_to_group([("control", f"ipc://{bound}", 4242)])
    assert stat.S_IMODE(bound.lstat().st_mode) == 0o750  # never opened to the wrong group
    # A config error: ``inferd run`` exits 2, which the unit does not restart (it
    # failed the same way at every start: exit 1 and five restarts before).
    assert isinstance(raised.value, ConfigError)


def test_a_file_that_is_not_the_socket_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "control.sock"
    plain.write_text("not a socket")
    with pytest.raises(SocketGroupError, match="not the socket the daemon bound"):
        open_ipc_sockets_to_group([("control", f"ipc://{plain}", os.getegid())])
