"""Content hashing with bounded memory (models and engines can be gigabytes).

A symlink at the path is not followed unless the caller says so: a file in one
of the daemon's own directories (engines) is hashed with the default
``follow=False``, and a symlink there is refused with ``open_nofollow``'s "is a
symbolic link" ``OSError``; ``follow=True`` is for an operator's file (a model, a
staged engine), where a symlink is followed by design (DESIGN.md entries 54 and
125).  Either way only a regular file is hashed, checked on the descriptor that
is read.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

from inferd.owned_files import open_regular_file

_CHUNK_BYTES = 1024 * 1024


def sha256_file(path: Path, *, follow: bool = False) -> str:
    """The SHA-256 of the regular file at ``path``; ``OSError`` when it cannot be
    opened, is not a regular file, or (``follow=False``) is a symlink."""
    return sha256_and_stat(path, follow=follow)[0]


def sha256_and_stat(path: Path, *, follow: bool = False) -> tuple[str, os.stat_result]:
    """``sha256_file``'s digest and the ``fstat`` of the descriptor it hashed: the
    size and identity of the very file hashed, not of whatever the path names later."""
    handle, info = open_regular_file(path, follow=follow)
    with handle:
        return sha256_handle(handle), info


def sha256_handle(handle: io.RawIOBase) -> str:
    """The SHA-256 of what ``handle`` reads from its position to its end, streamed."""
    digest = hashlib.sha256()
    while chunk := handle.read(_CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()
