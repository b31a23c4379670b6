"""The daemon's own directories, and opening files in them without following symlinks.

A directory another user created or may write lets them plant a symlink where
the daemon writes (root then overwrites a file of their choice) or replace
what it reads.  So every directory the daemon creates files or sockets in is
made with ``ensure_owned_dir``: created ``0750`` when missing, and otherwise
accepted only when ``inferd_wire.endpoints.unsafe_directory_reason`` finds
nothing wrong (a real directory, owned by this uid, writable by neither group
nor others) and ``unsafe_ancestor_reason`` finds no directory above it that
another user could swap it out of; and every file in them is opened with ``O_NOFOLLOW | O_CLOEXEC``
(``open_nofollow``, ``open_for_reading``); a file whose content the daemon trusts
(engines, sidecars, ``manifest.json``, timing and calibration caches) is opened with
``open_own_file``, which also refuses what is not a regular file and a file someone
who may not write its directory could rewrite in place.  ``OWNED_UMASK`` is the systemd
unit's ``UMask=0027``, applied by the command line outside systemd too, so
files the daemon and its builds create are never world-readable.  Files
operators point the daemon at (models, configs, calibration data, staged
engines, a deployment manifest, system files) are theirs, and symlinks there are
followed: ``open_for_reading(path, follow=True)`` (DESIGN.md entries 54, 125).
A directory the daemon only reads its own files from (the engine dir at load)
is trusted only when ``unsafe_owned_dir_reason`` finds nothing wrong; one it could
not check (``checked_owned_dir_reason``: no descriptor left, an I/O error) is
``UncheckedDirectoryError``, no verdict: not used this time, checked again the next.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from pathlib import Path

from inferd.durable import fsync_directory
from inferd.errors import UncheckedDirectoryError, UnsafeDirectoryError
from inferd_wire.endpoints import unsafe_ancestor_reason, unsafe_directory_reason

#: The systemd unit's ``UMask=``: group may read, others nothing.
OWNED_UMASK = 0o027
DIR_MODE = 0o750
FILE_MODE = 0o640


def apply_owned_umask() -> None:
    """Make files this process creates at most ``0750``/``0640`` (the unit's umask)."""
    os.umask(OWNED_UMASK)


def unsafe_owned_dir_reason(path: Path, *, raise_unchecked: bool = False) -> str | None:
    """Why ``path`` is not safely this process's own directory (``unsafe_directory_reason``
    for this uid, then ``unsafe_ancestor_reason``), or None.  "does not exist" when
    it is missing.  For a directory the daemon reads its own files from without
    creating it (``ensure_owned_dir`` is the check where it writes).
    ``raise_unchecked``: the ``OSError`` of an open, ``fstat`` or an ancestor's
    ``stat`` that failed for a reason not about the directory (``EMFILE``, ``EIO``...)
    is raised, not given as a reason (``checked_owned_dir_reason`` says what it is)."""
    return unsafe_directory_reason(
        path, os.geteuid(), raise_unchecked=raise_unchecked
    ) or unsafe_ancestor_reason(path, raise_unchecked=raise_unchecked)


def checked_owned_dir_reason(path: Path, *, what: str) -> str | None:
    """``unsafe_owned_dir_reason``, with a check that could not be made for a reason
    not about the directory or its ancestors (no descriptor left, an I/O error) raised
    as ``UncheckedDirectoryError`` naming ``what``: no verdict on the directory, so
    its caller does not use it this time, and says why, without sending an operator
    to fix an owner or a mode (DESIGN.md entry 309)."""
    try:
        return unsafe_owned_dir_reason(path, raise_unchecked=True)
    except OSError as exc:  # the open's EMFILE..., the fstat's or an ancestor's EIO...
        raise _unchecked(what, path, "checked", exc) from None


#: What a failed ``mkdir`` says about the directory or where it would be (its
#: owner, its mode, the file system's); any other errno (``EMFILE``, ``ENOSPC``,
#: ``EIO``, ``ENOMEM``...) is this process's or the system's state at the time.
#: Also how ``bus.curve_keys`` sorts a failed open of a key file or its directory.
ABOUT_THE_DIRECTORY = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EEXIST,  # a file, or a dangling symlink, where a directory is to be made
        errno.ENOENT,
        errno.ENOTDIR,
        errno.ELOOP,
        errno.EROFS,
        errno.ENAMETOOLONG,
    }
)


def ensure_owned_dir(path: Path, *, what: str) -> Path:
    """``path`` as a directory this process owns and only it may write; created
    (with missing parents) when absent.  ``UnsafeDirectoryError`` names ``what``
    (e.g. ``daemon.state_dir``), the reason and the fix; ``UncheckedDirectoryError``
    (a kind of it) when it could not be made or checked for a reason that is not
    the directory's, naming the errno."""
    try:
        _make_durably(path)
    except OSError as exc:
        if exc.errno in ABOUT_THE_DIRECTORY or exc.errno is None:
            raise UnsafeDirectoryError(f"{what} {path} cannot be created: {exc.strerror}") from None
        raise _unchecked(what, path, "created", exc) from None
    reason = checked_owned_dir_reason(path, what=what)
    if reason is not None:
        raise UnsafeDirectoryError(
            f"{what} {path} {reason}: inferd creates files and sockets only in a directory "
            f"its own user (uid {os.geteuid()}) owns and no one else may write; fix its owner "
            "and mode (chown, chmod go-w) or point the key at another directory"
        )
    return path


def _unchecked(what: str, path: Path, done: str, exc: OSError) -> UncheckedDirectoryError:
    code = exc.errno or 0
    name = errno.errorcode.get(code, f"errno {code}")
    # The ancestor whose stat failed, the parent a mkdir -p was making: named.
    where = exc.filename
    elsewhere = isinstance(where, str | os.PathLike) and os.fspath(where) != os.fspath(path)
    at = f", at {os.fspath(where)}" if elsewhere else ""
    return UncheckedDirectoryError(
        f"{what} {path} could not be {done} ({name}: {exc.strerror}{at}), a limit or failure "
        "of this process or system at the time, not a fault of the directory",
        errno_code=code,
    )


def _make_durably(path: Path) -> None:
    """``mkdir -p path`` (mode ``DIR_MODE``, a symlink followed as ``Path.mkdir`` does),
    each directory made fsynced into its parent: a file written durably in it is then
    reachable after a power cut too."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:
            if not directory.is_dir():
                raise
            continue  # made meanwhile by someone else, who makes it durable
        with contextlib.suppress(PermissionError):  # a parent it may write but not read
            fsync_directory(directory.parent)


def open_nofollow(path: Path, flags: int, mode: int = FILE_MODE) -> int:
    """``os.open`` that never follows a symlink at ``path`` (its last component)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(
                errno.ELOOP,
                "is a symbolic link, which inferd does not follow in its own directories",
                str(path),
            ) from None
        raise


def open_for_reading(path: Path, *, follow: bool = False) -> io.FileIO:
    """``path`` opened for binary reading without following a symlink; unbuffered
    (``readinto`` fills the caller's buffer directly; ``read(n)`` may return less
    than ``n`` only at the end of the file, since these are regular files).
    ``follow=True`` only for an operator's file (a staged engine and its sidecar, a
    deployment manifest, a model): a symlink there is followed by design."""
    return _file(_open_read_only(path, 0, follow=follow))


def open_regular_file(path: Path, *, follow: bool = False) -> tuple[io.FileIO, os.stat_result]:
    """``path`` opened as ``open_for_reading`` does, with its ``fstat``: ``OSError``
    unless it is a regular file.  The check is made on the descriptor that is then
    read, so the file checked is the file read (no ``stat`` of the path before an
    ``open`` of it); opened ``O_NONBLOCK`` so that a FIFO there is refused instead
    of blocking the open (the flag changes nothing for a regular file)."""
    fd = _open_read_only(path, os.O_NONBLOCK, follow=follow)
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "is not a regular file", str(path))
    return _file(fd), info


def open_own_file(path: Path, *, follow: bool = False) -> tuple[io.FileIO, os.stat_result]:
    """A file whose content the daemon trusts, opened as ``open_regular_file`` opens it
    (so a FIFO is refused, never waited on).  Unless ``follow`` (an operator's file,
    trusted by its digest only), also ``OSError(EPERM)`` when someone who may not write
    its directory could rewrite it in place: another owner than root, this uid or the
    directory's owner, or writable by its group or others (DESIGN.md entry 125)."""
    handle, info = open_regular_file(path, follow=follow)
    try:
        reason = None if follow else _rewritable_reason(path, info)
        if reason is not None:
            raise OSError(errno.EPERM, reason, str(path))
    except BaseException:
        handle.close()
        raise
    return handle, info


def _rewritable_reason(path: Path, info: os.stat_result) -> str | None:
    mode = stat.S_IMODE(info.st_mode)
    bits = (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH))
    writable = [who for who, bit in bits if mode & bit]
    if writable:
        return f"is writable by {' and '.join(writable)} (mode {mode:04o})"
    if info.st_uid in (0, os.geteuid()) or info.st_uid == os.stat(path.parent).st_uid:
        return None
    return (
        f"is owned by uid {info.st_uid}, neither root, uid {os.geteuid()} nor its directory's owner"
    )


def _open_read_only(path: Path, flags: int, *, follow: bool) -> int:
    if follow:
        return os.open(path, os.O_RDONLY | flags | os.O_CLOEXEC)
    return open_nofollow(path, os.O_RDONLY | flags)


def _file(fd: int) -> io.FileIO:
    """``fd`` as an unbuffered binary file that closes it; closed here if that fails
    (``FileIO`` refuses a directory and then leaves a descriptor it was given open)."""
    try:
        return io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise
