"""Content hashing with bounded memory (models and engines can be gigabytes).

A symlink at the path is not followed unless the caller says so: a file in one
of the daemon's own directories (engines) is hashed with the default
``follow=False``, and a symlink there is refused with ``open_nofollow``'s "is a
symbolic link" ``OSError``; ``follow=True`` is for an operator's file (a model, a
staged engine), where a symlink is followed by design (DESIGN.md entries 54 and
125).  Either way only a regular file is hashed, checked on the descriptor that
is read; without ``follow`` also only one that no one who may not write its
directory could rewrite in place (``owned_files.open_own_file``).

An operator's file hashed to be loaded (a model) is remembered with the version
of the file hashed (``sha256_remembered``), so that a later question about it
(which ONNX a configured model has now, asked on the bus thread) is answered
without reading gigabytes there (``remembered_sha256``; DESIGN.md entry 130).
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections import OrderedDict
from pathlib import Path

from inferd.owned_files import open_own_file

_CHUNK_BYTES = 1024 * 1024
#: Files remembered at most (configured models and the staged engines beside them).
_REMEMBERED_MAX = 256
#: What identifies one version of a file: a write or ``touch`` changes the ctime.
_Version = tuple[int, int, int, int, int]
_remembered: OrderedDict[Path, tuple[_Version, str]] = OrderedDict()
_remembered_lock = threading.Lock()


def sha256_file(path: Path, *, follow: bool = False) -> str:
    """The SHA-256 of the regular file at ``path``; ``OSError`` when it cannot be
    opened, is not a regular file, or (``follow=False``) is a symlink or a file others
    could rewrite (``open_own_file``)."""
    return sha256_and_stat(path, follow=follow)[0]


def sha256_and_stat(path: Path, *, follow: bool = False) -> tuple[str, os.stat_result]:
    """``sha256_file``'s digest and the ``fstat`` of the descriptor it hashed: the
    size and identity of the very file hashed, not of whatever the path names later."""
    handle, info = open_own_file(path, follow=follow)
    with handle:
        return sha256_handle(handle), info


def sha256_handle(handle: io.RawIOBase) -> str:
    """The SHA-256 of what ``handle`` reads from its position to its end, streamed."""
    digest = hashlib.sha256()
    while chunk := handle.read(_CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def sha256_remembered(path: Path) -> str:
    """``sha256_file(path, follow=True)`` for an operator's file, remembered with the
    version of the file it read (its descriptor's ``fstat``, taken before reading)."""
    digest, info = sha256_and_stat(path, follow=True)
    with _remembered_lock:
        _remembered.pop(path, None)
        _remembered[path] = (_version(info), digest)
        while len(_remembered) > _REMEMBERED_MAX:
            _remembered.popitem(last=False)
    return digest


def remembered_sha256(path: Path) -> str | None:
    """The digest ``sha256_remembered`` took of the file ``path`` names now, or None
    when it was never hashed, has changed since, or cannot be stat'ed.  Never reads
    the file: a write during that hash changed the ctime, so its digest is not given."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    with _remembered_lock:
        found = _remembered.get(path)
    return found[1] if found is not None and found[0] == _version(info) else None


def _version(info: os.stat_result) -> _Version:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
