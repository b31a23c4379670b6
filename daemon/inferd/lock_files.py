"""A lock file in a directory of the daemon's own, ``flock``-ed: opened without following
a symlink, checked on its descriptor to be this user's regular file with one name
before it is locked, never truncated before the lock is held, then holding the
holder's pid (or empty).  One daemon per runtime dir and socket directory
(``inferd.lock``: ``supervision/instance.py``, DESIGN.md 5, 289, 291) and one recorder
per flight data recorder directory (``fdr.lock``: ``fdr/segments.py``, DESIGN.md 357,
362) take one."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from inferd.errors import UnsafeDirectoryError
from inferd.owned_files import open_nofollow

LOCK_NAME = "inferd.lock"
#: The lock file's mode: the daemon's alone.  ``flock`` needs only a descriptor, so
#: with ``0640`` any member of the daemon's group (its clients, under the shipped
#: units) could hold the lock through a read-only one and keep every start from
#: taking it; a file an older inferd made ``0640`` is narrowed when opened.
LOCK_FILE_MODE = 0o600
#: ``O_NONBLOCK``: a FIFO there is refused, never waited on (POSIX leaves ``O_RDWR``
#: on a FIFO undefined; Linux opens it, then ``ftruncate`` fails with ``EINVAL``);
#: ``O_NOCTTY``: a terminal there never becomes the daemon's controlling terminal.
#: Neither changes anything for the regular file it is meant to be.
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY
#: What ``open`` of the lock file fails with when something else is at its path: a
#: symlink (``ELOOP``), a directory (``EISDIR``), a socket (``ENXIO``), a file of
#: another user's this uid may not write (``EACCES``).  ``lstat`` then says which.
_PLANTED_ERRNOS = frozenset({errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EACCES, errno.EPERM})
_FILE_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class UnsafeLockFileError(UnsafeDirectoryError):
    """What is at ``inferd.lock`` in a directory ``ensure_owned_dir`` accepted is not
    the daemon's own regular file.  Only this uid or root could have put it there,
    and a restart meets it again: exit 2, as for an unsafe directory (DESIGN.md 289, 291)."""


def lock_owned_file(path: Path, note_pid: bool = True) -> int | None:
    """The descriptor of ``path`` (made ``LOCK_FILE_MODE`` when missing), locked and
    holding this pid (``note_pid``; else left empty, no block of a full disk taken);
    None when another process holds its lock; ``UnsafeLockFileError`` when what is
    there is not this user's regular file."""
    fd = _open_lock_file(path)
    try:
        # Checked on the descriptor, before the lock and the truncation: the
        # file checked is the file written, and nothing refused is changed.
        info = os.fstat(fd)
        _refuse_unsafe(path, info)
        if stat.S_IMODE(info.st_mode) & ~LOCK_FILE_MODE:
            os.fchmod(fd, LOCK_FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if note_pid:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_lock_file(path: Path) -> int:
    """``path`` opened (created ``LOCK_FILE_MODE`` when missing) without following a
    symlink; ``UnsafeLockFileError`` when the open failed on something planted there."""
    try:
        return open_nofollow(path, _LOCK_FLAGS, LOCK_FILE_MODE)
    except OSError as exc:
        if exc.errno not in _PLANTED_ERRNOS:
            raise
        try:
            info = os.lstat(path)
        except OSError:
            raise exc from None  # gone meanwhile: the open's own error says it
        _refuse_unsafe(path, info)
        raise  # this uid's own regular file it may not open (mode 0400): as the open said


def _refuse_unsafe(path: Path, info: os.stat_result) -> None:
    """``UnsafeLockFileError`` unless ``info`` is a regular file of this euid's with
    one name.  A second name (a hard link) would make the truncation empty that
    other file, which root may be made to do to any file it owns.  Group or others'
    bits are not refused but taken away (``LOCK_FILE_MODE``): the file is still
    the daemon's own, only readable by more than it should be."""
    euid = os.geteuid()
    if not stat.S_ISREG(info.st_mode):
        kinds = [f"is {kind}, not" for is_kind, kind in _FILE_KINDS if is_kind(info.st_mode)]
        reason = f"{(kinds or ['is not'])[0]} a regular file"
    elif info.st_uid != euid:
        reason = f"is owned by uid {info.st_uid}, not by uid {euid}"
    elif info.st_nlink != 1:
        reason = f"has {info.st_nlink} hard links, not 1"
    else:
        return
    raise UnsafeLockFileError(
        f"{path} {reason}: inferd locks only a regular file of its own user's (uid {euid}), "
        "which it creates when missing; a restart would meet the same, so remove what is "
        "there and start inferd again"
    )
