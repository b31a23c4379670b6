"""Something planted at ``inferd.lock`` in a directory that is safely the daemon's
(a symlink, a FIFO, a directory, a socket, another user's file, a second name of
another file) is refused with ``UnsafeLockFileError``, an ``UnsafeDirectoryError``
(``inferd run`` exits 2: a restart meets it again), whose message names the path and
what is wrong; nothing there is written, and no descriptor is left open.  Before,
each was an ``OSError`` (exit 1, restarted), and a FIFO was locked, then failed the
truncation with a bare ``[Errno 22] Invalid argument`` that named nothing."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from inferd.errors import UnsafeDirectoryError
from inferd.supervision.instance import (
    LOCK_FILE_MODE,
    LOCK_NAME,
    InstanceLock,
    UnsafeLockFileError,
)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)  # safely the daemon's: ensure_owned_dir accepts it
    return run


def _refused(run: Path) -> str:
    """``acquire`` on ``run``'s planted lock: the refusal's message; no descriptor
    left behind (the refused file's, or a lock taken before it)."""
    before = _open_fds()
    lock = InstanceLock(run, [])
    with pytest.raises(UnsafeLockFileError) as refused:
        lock.acquire()
    assert isinstance(refused.value, UnsafeDirectoryError)  # inferd run: exit 2
    assert _open_fds() == before
    return str(refused.value)


def _symlink(path: Path) -> None:
    victim = path.parent.parent / "victim"
    victim.write_text("keep\n")
    path.symlink_to(victim)


def _dangling_symlink(path: Path) -> None:
    path.symlink_to(path.parent.parent / "nothing")  # O_CREAT would make it


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        (_symlink, "is a symbolic link, not a regular file"),
        (_dangling_symlink, "is a symbolic link, not a regular file"),
        (os.mkfifo, "is a FIFO, not a regular file"),
        (lambda path: path.mkdir(), "is a directory, not a regular file"),
    ],
    ids=["symlink", "dangling-symlink", "fifo", "directory"],
)
def test_a_planted_lock_path_is_refused_by_name(
    tmp_path: Path, plant: Callable[[Path], None], said: str
) -> None:
    run = _run_dir(tmp_path)
    path = run / LOCK_NAME
    plant(path)
    kind = stat.S_IFMT(os.lstat(path).st_mode)
    message = _refused(run)
    assert message.startswith(f"{path} {said}: ")
    assert "remove what is there" in message
    assert stat.S_IFMT(os.lstat(path).st_mode) == kind  # left as found
    assert not (tmp_path / "nothing").exists()  # the dangling symlink was not followed
    if (tmp_path / "victim").exists():
        assert (tmp_path / "victim").read_text() == "keep\n"


def test_a_fifo_is_refused_before_it_is_locked(tmp_path: Path) -> None:
    """The FIFO was opened (``O_RDWR`` does not block on Linux) and locked: its
    refusal must not leave it locked, or the next start would read another daemon."""
    import fcntl

    run = _run_dir(tmp_path)
    os.mkfifo(run / LOCK_NAME)
    _refused(run)
    fd = os.open(run / LOCK_NAME, os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if still held
    finally:
        os.close(fd)


def test_a_socket_at_the_lock_path_is_refused(short_tmp_path: Path) -> None:
    run = _run_dir(short_tmp_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(run / LOCK_NAME))
    assert _refused(run).startswith(f"{run / LOCK_NAME} is a socket, not a regular file: ")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_another_users_lock_file_is_refused_and_not_written(tmp_path: Path) -> None:
    """Root may open any file: before, it locked and rewrote this one."""
    run = _run_dir(tmp_path)
    path = run / LOCK_NAME
    path.write_text("theirs\n")
    os.chown(path, 65534, 65534)
    message = _refused(run)
    assert message.startswith(f"{path} is owned by uid 65534, not by uid 0: ")
    assert path.read_text() == "theirs\n"


def test_a_lock_file_that_is_a_second_name_of_another_file_is_not_emptied(
    tmp_path: Path,
) -> None:
    """A hard link: the truncation would empty the file it also names."""
    run = _run_dir(tmp_path)
    other = tmp_path / "precious"
    other.write_text("keep\n")
    os.link(other, run / LOCK_NAME)
    assert _refused(run).startswith(f"{run / LOCK_NAME} has 2 hard links, not 1: ")
    assert other.read_text() == "keep\n"


def test_a_refused_lock_releases_the_locks_taken_before_it(short_tmp_path: Path) -> None:
    """The runtime dir's lock is taken, the socket dir's lock path is a FIFO: the
    first is let go (another start may take it), not held by a daemon that failed."""
    run, sockets = _run_dir(short_tmp_path), short_tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    os.mkfifo(sockets / LOCK_NAME)
    before = _open_fds()
    lock = InstanceLock(run, [f"ipc://{sockets}/infer.sock"])
    with pytest.raises(UnsafeLockFileError, match="is a FIFO"):
        lock.acquire()
    assert _open_fds() == before
    again = InstanceLock(run, [])
    again.acquire()
    again.release()


def test_the_daemons_own_lock_file_is_taken_whatever_its_mode_and_made_its_alone(
    tmp_path: Path,
) -> None:
    """The control: a regular file of this uid's with one name is locked and gets the
    pid, a group- or world-readable one too, narrowed to ``0600``: ``flock`` needs
    only a descriptor, so a group member able to read it could hold the lock."""
    run = _run_dir(tmp_path)
    path = run / LOCK_NAME
    path.write_text("stale\n")
    os.chmod(path, 0o666)
    lock = InstanceLock(run, [])
    lock.acquire()
    try:
        assert path.read_text() == f"{os.getpid()}\n"
        assert stat.S_IMODE(path.stat().st_mode) == LOCK_FILE_MODE == 0o600
    finally:
        lock.release()


def test_a_new_lock_file_is_the_daemons_alone(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    lock = InstanceLock(run, [])
    lock.acquire()
    try:
        assert stat.S_IMODE((run / LOCK_NAME).stat().st_mode) == 0o600
    finally:
        lock.release()
