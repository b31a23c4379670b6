"""Durable file writes, shared by every component that persists state.

``atomic_write_bytes``: temp file in the same directory, fsync, rename, fsync
the directory: a reader sees the old file or the new one, never a torn one,
and after a power cut the new name points at complete data (sidecars,
manifests, timing caches, engines, the demo model, the metrics textfile).
``atomic_output`` is the same for a file written piece by piece (``inferd fdr
export --mcap``).  ``write_all`` and ``fsync_directory`` are the pieces the
flight data recorder's append path uses.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte is written (a write may be partial)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: Path, *, mode: int = 0o640) -> Iterator[BinaryIO]:
    """A file to write ``path``'s new content to: on a clean exit it is fsynced and
    renamed over ``path`` (then the directory fsynced); on an exception it is
    removed and ``path`` is left as it was."""
    directory = path.parent
    temp = directory / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    # O_EXCL never follows a symlink at ``temp``; O_NOFOLLOW says so explicitly.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    fsync_directory(directory)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o640) -> None:
    """Write ``data`` to ``path`` atomically (temp + fsync + rename + directory fsync)."""
    with atomic_output(path, mode=mode) as handle:
        handle.write(data)


def atomic_write_text(path: Path, text: str, *, mode: int = 0o640) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)
