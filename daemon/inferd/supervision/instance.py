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

import os
import stat
from collections.abc import Iterable
from pathlib import Path

import structlog

from inferd.errors import ConfigError
from inferd.lock_files import LOCK_FILE_MODE, LOCK_NAME, UnsafeLockFileError, lock_owned_file
from inferd.owned_files import ensure_owned_dir

#: Mode of ipc:// socket files: the group (e.g. ``inferd`` under systemd, with
#: ``UMask=0027``) may connect.
IPC_SOCKET_MODE = 0o660

log = structlog.get_logger("inferd.instance")


class DaemonAlreadyRunningError(RuntimeError):
    pass


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
        fd = lock_owned_file(path)
        if fd is None:
            raise DaemonAlreadyRunningError(
                f"another inferd holds {path}; refusing to steal its sockets"
            )
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


__all__ = [
    "LOCK_FILE_MODE",
    "LOCK_NAME",
    "DaemonAlreadyRunningError",
    "InstanceLock",
    "SocketGroupError",
    "SocketGroupMembershipError",
    "UnsafeLockFileError",
    "open_ipc_sockets_to_group",
]
