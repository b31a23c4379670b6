"""The ipc:// socket files go with the daemon (DESIGN.md 271): libzmq leaves them
when its sockets close, and a client then waited out its timeout on a file nobody
listened on.  ``InstanceLock.release(remove_sockets=True)`` removes them, only with
every lock held (each file is this daemon's) and only sockets (never a symlink or
another kind of file).  A real daemon's stop: ``tests/integration/test_socket_files_removed.py``."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from inferd.supervision.instance import DaemonAlreadyRunningError, InstanceLock


def _bound_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))  # the file stays after the close, as libzmq leaves it


def test_release_removes_the_socket_files_it_guarded_and_nothing_else(
    short_tmp_path: Path,
) -> None:
    run = short_tmp_path / "run"
    run.mkdir(mode=0o700)
    infer, control, other = run / "infer.sock", run / "control.sock", run / "other.sock"
    lock = InstanceLock(run, [f"ipc://{infer}", f"ipc://{control}", "tcp://127.0.0.1:5555"])
    lock.acquire()
    _bound_socket(infer)
    _bound_socket(other)
    control.symlink_to(other)  # never followed, never removed
    lock.release()  # a plain release (a failed start's) leaves them
    assert infer.exists() and control.is_symlink()
    lock.acquire()
    lock.release(remove_sockets=True)
    assert not infer.exists()
    assert control.is_symlink() and other.exists()


def test_a_daemon_refused_its_locks_removes_no_socket_of_the_one_that_holds_them(
    short_tmp_path: Path,
) -> None:
    run, shared = short_tmp_path / "run", short_tmp_path / "shared"
    run.mkdir(mode=0o700)
    shared.mkdir(mode=0o700)
    theirs = shared / "infer.sock"
    holder = InstanceLock(shared, [f"ipc://{theirs}"])
    holder.acquire()
    _bound_socket(theirs)
    second = InstanceLock(run, [f"ipc://{theirs}"])
    with pytest.raises(DaemonAlreadyRunningError):
        second.acquire()
    second.release(remove_sockets=True)  # holds no lock: touches nothing
    assert theirs.exists()
    holder.release()
