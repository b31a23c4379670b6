"""``ShmServer`` when one of its threads cannot start (the process's thread
limit, DESIGN.md 166): its ``stop``, which the daemon runs after the failed
start, releases what the start took.  Before, a stop whose ``inferd-shm`` never
started did nothing (it looked at that thread's ``is_alive()``): the closer
thread ran on, and the listener stayed open and its socket file in place until
the object was collected."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from inferd.config import ShmConfig
from inferd.shm.server import ShmServer
from tests.thread_limit import REFUSAL, refuse_start


def _connect(path: Path) -> None:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        client.connect(str(path))
    finally:
        client.close()


@pytest.mark.parametrize("refused", ["inferd-shm", "inferd-shm-closer"])
def test_a_thread_that_cannot_start_leaves_nothing_after_the_stop(
    refused: str, short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = short_tmp_path / "shm.sock"
    server = ShmServer(ShmConfig(socket=path))
    refuse_start(monkeypatch, refused)
    with pytest.raises(RuntimeError, match=REFUSAL):
        server.start()
    monkeypatch.undo()
    _connect(path)  # bound and listening: what the stop must release
    server.stop()
    assert not server.closer.is_alive()  # inferd-shm-closer ran on
    assert not path.exists()
    with pytest.raises(FileNotFoundError):
        _connect(path)
    assert server._listener is not None and server._listener.fileno() == -1
    assert server._waker.fileno() == -1 and server._wakee.fileno() == -1
    server.stop()  # again (a stop step run twice): nothing left to release, nothing raised


def test_a_server_never_started_releases_its_descriptors_at_the_stop(
    short_tmp_path: Path,
) -> None:
    """A failed start before ``shm.start`` (an earlier step): the wake-up pair
    was held until the object was collected; the socket file is not the
    server's to remove (it never bound it)."""
    path = short_tmp_path / "shm.sock"
    path.write_bytes(b"")  # whatever is there: not this server's
    server = ShmServer(ShmConfig(socket=path))
    server.stop()
    assert server._waker.fileno() == -1 and server._wakee.fileno() == -1
    assert path.exists()
