"""``ERRNO=`` carries an OS error number, whichever error holds it: an ``OSError``,
a ``zmq.ZMQError`` (no ``OSError``: a bind on a taken port), a
``ProcessLimitError``'s ``errno_code``; never libzmq's own numbers, which systemd
could only print as "Unknown error"."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest
import zmq

from inferd.errors import MapCountLimitError, OpenFilesLimitError
from inferd.supervision.notify import Notifier, errno_of


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (OSError(errno.EACCES, "Permission denied"), errno.EACCES),
        (zmq.ZMQError(errno.EADDRINUSE), errno.EADDRINUSE),
        (OpenFilesLimitError("low", limit=1500, needed=2450), errno.EMFILE),
        (MapCountLimitError("low", limit=65530, needed=82252), errno.ENOMEM),
        (zmq.ZMQError(zmq.ETERM), None),  # 156384765: libzmq's, no errno
        (OSError("no number"), None),
        (KeyError("x"), None),
    ],
)
def test_errno_of(error: BaseException, expected: int | None) -> None:
    assert errno_of(error) == expected


def test_failed_sends_no_number_the_os_does_not_name(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    try:
        notifier = Notifier(str(tmp_path / "notify.sock"))
        assert notifier.failed("cannot start: x", zmq.ETERM)
        assert notifier.failed("cannot start: y", errno.EADDRINUSE)
        assert sock.recv(4096) == b"STATUS=cannot start: x"
        assert sock.recv(4096) == b"STATUS=cannot start: y\nERRNO=98"
    finally:
        sock.close()
