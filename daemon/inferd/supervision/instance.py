"""One daemon per runtime dir, and who may reach its ipc:// sockets.

Binding an ``ipc://`` path silently steals it from a running daemon
(zmq_ipc(7)); an ``flock`` on ``inferd.lock`` in the runtime dir and in every
ipc:// socket's directory, taken before any socket is bound, turns a second
instance into a clear error (DESIGN.md 5).  Each of those directories must be
the daemon's own (``inferd.owned_files``), and so must its lock file: anything
else planted there (a symlink, a FIFO, another user's file) is refused as an
unsafe directory is, exit 2 (DESIGN.md 289, 291).
Socket files get ``IPC_SOCKET_MODE`` once bound, so the daemon's group may
connect while the runtime dir's own mode guards the rest; a socket with its own
group (``security.<socket>_group``) is given that group first, and the daemon
does not start when it cannot (DESIGN.md 62).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import structlog

from inferd.errors import ConfigError, UnsafeDirectoryError
from inferd.owned_files import ensure_owned_dir, open_nofollow

#: Mode of ipc:// socket files: the group (e.g. ``inferd`` under systemd, with
#: ``UMask=0027``) may connect.
IPC_SOCKET_MODE = 0o660
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

log = structlog.get_logger("inferd.instance")


class DaemonAlreadyRunningError(RuntimeError):
    pass


class UnsafeLockFileError(UnsafeDirectoryError):
    """What is at ``inferd.lock`` in a directory ``ensure_owned_dir`` accepted is not
    the daemon's own regular file.  Only this uid or root could have put it there,
    and a restart meets it again: exit 2, as for an unsafe directory (DESIGN.md 289, 291)."""


class SocketGroupError(RuntimeError):
    """A socket's configured group cannot be given to its file."""


class SocketGroupMembershipError(SocketGroupError, ConfigError):
    """The daemon's user is not in a socket's configured group: a deployment that
    fails the same way at every start, so ``inferd run`` exits 2 (a config error,
    ``RestartPreventExitStatus=2``) rather than 1 and a restart loop."""


def _ipc_paths(endpoints: Iterable[str]) -> list[Path]:
    return [Path(e.removeprefix("ipc://")) for e in endpoints if e.startswith("ipc://")]


class InstanceLock:
    """The instance locks of the runtime dir and of every ipc:// socket's directory,
    held from ``acquire`` to ``release``.

    Each directory is the daemon's own (``ensure_owned_dir``: another user's, or one
    others may write, is refused) and gets an ``flock``-ed ``inferd.lock``, opened
    without following a symlink and never truncated before the lock is held.  A
    second daemon whose endpoint points into another daemon's directory fails on
    that directory's lock instead of stealing the socket."""

    def __init__(self, runtime_dir: Path, endpoints: Iterable[str]) -> None:
        self.path = runtime_dir / LOCK_NAME
        directories = [runtime_dir, *(path.parent for path in _ipc_paths(endpoints))]
        self._directories = list(dict.fromkeys(directories))
        self._sockets = _ipc_paths(endpoints)
        self._fds: list[int] = []

    def acquire(self) -> None:
        """Check (or create) each directory and take its lock;
        ``DaemonAlreadyRunningError`` when another daemon holds one."""
        try:
            for index, directory in enumerate(self._directories):
                what = "daemon.runtime_dir" if index == 0 else "the directory of an ipc:// endpoint"
                self._fds.append(self._lock(ensure_owned_dir(directory, what=what) / LOCK_NAME))
        except BaseException:
            self.release()
            raise

    @staticmethod
    def _lock(path: Path) -> int:
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
                raise DaemonAlreadyRunningError(
                    f"another inferd holds {path}; refusing to steal its sockets"
                ) from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self, *, remove_sockets: bool = False) -> None:
        """Let go of the locks.  ``remove_sockets`` (the end of a daemon's stop): first
        remove the ipc:// socket files, which libzmq leaves behind: a client would
        then wait out its whole timeout on a file nobody listens on, where a missing
        one fails at once ("is inferd running?").  Only with every lock held, so
        each file is this daemon's (no other could bind in these directories), and
        only a socket of this user's (``lstat``: a symlink is never followed)."""
        if remove_sockets and self._fds and len(self._fds) == len(self._directories):
            for path in self._sockets:
                _remove_socket_file(path)
        while self._fds:
            os.close(self._fds.pop())


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


def _remove_socket_file(path: Path) -> None:
    try:
        info = os.lstat(path)
        if stat.S_ISSOCK(info.st_mode) and info.st_uid == os.geteuid():
            os.unlink(path)
    except FileNotFoundError:
        pass  # removed already (shm.sock by its server)
    except OSError as exc:
        log.warning("ipc_socket_remove_failed", path=str(path), error=str(exc))


def open_ipc_sockets_to_group(sockets: Iterable[tuple[str, str, int | None]]) -> None:
    """Give every bound ipc:// socket file of ``(name, endpoint, gid)`` its group (when
    ``gid`` is set: first, so it is never ``0660`` to the daemon's own group) and
    ``IPC_SOCKET_MODE``.  Until then the file has the umask's mode, which lets no
    one but the daemon's user connect (no group write bit)."""
    for name, endpoint, gid in sockets:
        if not endpoint.startswith("ipc://"):
            continue
        socket_path = Path(endpoint.removeprefix("ipc://"))
        if gid is not None:
            _give_group(name, socket_path, gid)
        try:
            if stat.S_ISSOCK(os.lstat(socket_path).st_mode):
                os.chmod(socket_path, IPC_SOCKET_MODE)
        except OSError as exc:
            log.warning("ipc_socket_chmod_failed", path=str(socket_path), error=str(exc))


def _give_group(name: str, socket_path: Path, gid: int) -> None:
    key = f"security.{name}_group"
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise SocketGroupMembershipError(
            f"{key} (gid {gid}): the daemon's user (uid {os.geteuid()}) is not a member, so "
            f"it cannot give {socket_path} to that group; add the group to the daemon's user "
            "(SupplementaryGroups= in the systemd unit, docs/SECURITY.md)"
        )
    try:
        if not stat.S_ISSOCK(os.lstat(socket_path).st_mode):
            raise SocketGroupError(f"{socket_path} is not the socket the daemon bound")
        os.chown(socket_path, -1, gid, follow_symlinks=False)
    except OSError as exc:
        raise SocketGroupError(f"{key}: cannot give {socket_path} to gid {gid}: {exc}") from None
