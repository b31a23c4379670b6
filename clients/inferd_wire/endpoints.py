"""Where the daemon's sockets live by default, and when a socket directory can be
trusted; shared by daemon and clients.

A directory that another user created or may write lets that user put a
symlink where the daemon writes (root writing a file of their choice) or a
socket of their own where a client connects (a forged reply).  One rule,
``unsafe_directory_reason``, decides for both sides: a real directory (not a
symlink), owned by the expected uid, writable by neither its group nor others.
The daemon applies it to every directory it creates files or sockets in; a
client applies it to the per-uid fallback ``$TMPDIR/inferd-<uid>`` (which must be
its own) and refuses any ipc:// socket in a directory others may write.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: A Unix socket path is limited to 107 bytes (sun_path); ``ipc://`` adds 6.
MAX_IPC_PATH_BYTES = 107

#: The kernel send buffer a client and the daemon ask for on each connection of
#: the infer socket (``send_buffer.SendBuffer``): a 0.6 MB frame in one write.
DEFAULT_SEND_BUFFER_BYTES = 2 * 1024 * 1024
#: The most either may ask for (each connection may hold this much in the kernel).
MAX_SEND_BUFFER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Endpoints:
    infer: str
    control: str
    events: str


def default_runtime_dir() -> Path:
    """Per-user directory for sockets: ``$INFERD_RUNTIME_DIR``, systemd's
    ``$RUNTIME_DIRECTORY``, ``$XDG_RUNTIME_DIR/inferd``, else ``fallback_runtime_dir``."""
    return runtime_dir_and_origin()[0]


def runtime_dir_and_origin() -> tuple[Path, str]:
    """The default runtime dir and what chose it, for messages (``$XDG_RUNTIME_DIR``...)."""
    for variable in ("INFERD_RUNTIME_DIR", "RUNTIME_DIRECTORY"):
        value = os.environ.get(variable)
        if value:
            return Path(value.split(":")[0]), f"${variable}"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "inferd", "$XDG_RUNTIME_DIR/inferd"
    return fallback_runtime_dir(), "the fallback (no $XDG_RUNTIME_DIR)"


def fallback_runtime_dir() -> Path:
    """``inferd-<uid>`` in the temp dir (``$TMPDIR``, else ``/tmp``): this uid's own, or
    nobody's to trust (``check_client_endpoint``)."""
    return Path(tempfile.gettempdir()) / f"inferd-{os.getuid()}"


def default_endpoints(runtime_dir: Path | None = None) -> Endpoints:
    base = runtime_dir if runtime_dir is not None else default_runtime_dir()
    return Endpoints(
        infer=f"ipc://{base / 'infer.sock'}",
        control=f"ipc://{base / 'control.sock'}",
        events=f"ipc://{base / 'events.sock'}",
    )


class EndpointError(Exception):
    """An endpoint a client cannot connect to as it is written."""


class UnsafeEndpointError(EndpointError):
    """An ipc:// endpoint lives in a directory that others could have tampered with."""


class UncheckedEndpointError(EndpointError):
    """An ipc:// endpoint whose directory could not be checked, for a reason that says
    nothing about who may write it (``EMFILE``, ``ENFILE``, ``ENOMEM``, ``EINTR``,
    ``EIO``...): a state of this process or system, not a sign of another user's
    socket.  Not connected to, as an unsafe one is not."""


#: The ``open(2)`` or ``stat(2)`` failures that say something about a directory or
#: the path to it: what is there (a symlink, not a directory, nothing: an ancestor
#: removed meanwhile), that this user may not enter it (a directory someone else
#: keeps closed), a path too long.  Any other errno (``EMFILE``, ``ENOMEM``, ``EIO``...)
#: is this process's or system's state at the time, reported as what it is.
_DIRECTORY_ERRNOS = frozenset(
    {errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENAMETOOLONG}
)


def ipc_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a Unix socket's address (it is too long), or None."""
    size = len(path.encode())
    if size > MAX_IPC_PATH_BYTES:
        return f"ipc path is {size} bytes; Unix sockets allow {MAX_IPC_PATH_BYTES}"
    return None


def unsafe_directory_reason(
    path: Path, owner_uid: int | None, *, raise_unchecked: bool = False
) -> str | None:
    """Why ``path`` is not a directory to trust, or None: it must be a real directory
    (a symlink is not followed), owned by ``owner_uid`` (None: any owner) and
    writable by neither its group nor others.  An ``open`` that fails for a reason
    not about the directory (``EMFILE``...) is "cannot be opened" too, so a caller
    that asks no more refuses what it could not check; ``raise_unchecked`` raises
    that ``OSError`` instead, for a caller that says what it is (a client, and the
    daemon through ``owned_files.checked_owned_dir_reason``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symbolic link" if os.path.islink(path) else "not a directory"
            return f"is {kind}"
        if raise_unchecked and exc.errno not in _DIRECTORY_ERRNOS:
            raise
        return f"cannot be opened ({exc.strerror})"
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if owner_uid is not None and info.st_uid != owner_uid:
        return f"is owned by uid {info.st_uid}, not by uid {owner_uid}"
    writable = [
        who
        for who, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH))
        if info.st_mode & bit
    ]
    if writable:
        return f"is writable by {' and '.join(writable)} (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def unsafe_ancestor_reason(path: Path, *, raise_unchecked: bool = False) -> str | None:
    """Why a directory above ``path`` (after resolving symlinks) would let another
    user swap ``path`` for their own, or None: each must be owned by root or by this
    uid, and writable by others only with the sticky bit (``/tmp``), which keeps
    them from renaming what is not theirs.  An ancestor whose ``stat`` fails "cannot
    be examined"; ``raise_unchecked``: unless the errno is about that ancestor
    (``EACCES``, ``ENOENT``...), the ``OSError`` (its ``filename`` the ancestor) is
    raised instead, as ``unsafe_directory_reason`` raises its open's."""
    for ancestor in Path(os.path.realpath(path)).parents:
        try:
            info = os.stat(ancestor)
        except OSError as exc:
            if raise_unchecked and exc.errno not in _DIRECTORY_ERRNOS:
                raise
            return f"has an ancestor {ancestor} that cannot be examined ({exc.strerror})"
        if info.st_uid not in (0, os.geteuid()):
            return f"is inside {ancestor}, which uid {info.st_uid} owns"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            return (
                f"is inside {ancestor}, which others may write "
                f"(mode {stat.S_IMODE(info.st_mode):04o}, no sticky bit)"
            )
    return None


def check_client_endpoint(endpoint: str) -> str:
    """``endpoint``, when a client may connect to it; ``UnsafeEndpointError`` when it
    is an ipc:// socket in a directory another user could have replaced it in,
    ``UncheckedEndpointError`` when that directory could not be checked (a
    descriptor limit), ``EndpointError`` when its path is longer than a socket
    address holds."""
    if not endpoint.startswith("ipc://"):
        return endpoint
    path = endpoint.removeprefix("ipc://")
    problem = ipc_path_problem(path)
    if problem is not None:
        raise EndpointError(f"cannot connect to {endpoint}: {problem}")
    directory = Path(path).parent
    owner = os.getuid() if directory == fallback_runtime_dir() else None
    try:
        reason = unsafe_directory_reason(directory, owner, raise_unchecked=True)
    except OSError as exc:  # the open's EMFILE..., or the fstat's EIO...
        # Telling an operator at the descriptor limit that another user could have
        # put a socket there would send them hunting for an attacker.
        name = errno.errorcode.get(exc.errno, f"errno {exc.errno}") if exc.errno else "OSError"
        raise UncheckedEndpointError(
            f"not connecting to {endpoint}: its directory {directory} could not be checked "
            f"({name}: {exc.strerror}), a limit or failure of this process or system, not "
            "a sign of another user's socket"
        ) from None
    if reason is not None and reason != "does not exist":
        raise UnsafeEndpointError(
            f"not connecting to {endpoint}: its directory {directory} {reason}, so another "
            "user could have put their own socket there; use a directory only the daemon's "
            "user can write (INFERD_RUNTIME_DIR, or the daemon's runtime_dir)"
        )
    return endpoint


def wants_ipv6(endpoint: str) -> bool:
    """Whether a socket for ``endpoint`` needs ``ZMQ_IPV6`` (libzmq's tcp sockets are
    IPv4 only without it, and an IPv6 literal, ``tcp://[::1]:5555``, then fails to
    bind or connect).  Only for such a literal: a wildcard or host name stays IPv4, so
    the addresses the access lists see stay what they were."""
    return endpoint.startswith("tcp://[") or ";[" in endpoint
