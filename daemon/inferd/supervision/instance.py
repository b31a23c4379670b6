"""One daemon per runtime dir, and who may reach its ipc:// sockets.

Binding an ``ipc://`` path silently steals it from a running daemon
(zmq_ipc(7)); an ``flock`` on ``<runtime_dir>/inferd.lock``, taken before any
socket is bound, turns a second instance into a clear error (DESIGN.md 5).
Socket files get ``IPC_SOCKET_MODE`` once bound, so the daemon's group may
connect while the runtime dir's own mode guards the rest.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import structlog

#: Mode of ipc:// socket files: the group (e.g. ``inferd`` under systemd, with
#: ``UMask=0027``) may connect.
IPC_SOCKET_MODE = 0o660
LOCK_NAME = "inferd.lock"

log = structlog.get_logger("inferd.instance")


class DaemonAlreadyRunningError(RuntimeError):
    pass


def _ipc_paths(endpoints: Iterable[str]) -> list[Path]:
    return [Path(e.removeprefix("ipc://")) for e in endpoints if e.startswith("ipc://")]


class InstanceLock:
    """The runtime dir's instance lock, held from ``acquire`` to ``release``."""

    def __init__(self, runtime_dir: Path, endpoints: Iterable[str]) -> None:
        self.path = runtime_dir / LOCK_NAME
        self._endpoints = tuple(endpoints)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Create the runtime dir (and the ipc sockets' dirs) and take the lock;
        ``DaemonAlreadyRunningError`` when another daemon holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        for socket_path in _ipc_paths(self._endpoints):
            socket_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DaemonAlreadyRunningError(
                f"another inferd holds {self.path}; refusing to steal its sockets"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_ipc_sockets_to_group(endpoints: Iterable[str]) -> None:
    """Give every bound ipc:// socket file ``IPC_SOCKET_MODE``."""
    for socket_path in _ipc_paths(endpoints):
        try:
            if stat.S_ISSOCK(os.stat(socket_path).st_mode):
                os.chmod(socket_path, IPC_SOCKET_MODE)
        except OSError as exc:
            log.warning("ipc_socket_chmod_failed", path=str(socket_path), error=str(exc))
