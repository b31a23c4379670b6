"""Content hashing with bounded memory (models and engines can be gigabytes).

A symlink at the path is not followed unless the caller says so: a file in one
of the daemon's own directories (engines) is hashed with the default
``follow=False``, and a symlink there is refused with ``open_nofollow``'s "is a
symbolic link" ``OSError``; ``follow=True`` is for an operator's file (a model, a
staged engine), where a symlink is followed by design (DESIGN.md entries 54 and
125).  Either way only a regular file is hashed, checked on the descriptor that
is read; without ``follow`` also only one that no one who may not write its
directory could rewrite in place (``owned_files.open_own_file``).

A model's digest (``model_digest(path).sha256``: what engines are named by and the gate
checks) is its file's SHA-256 when it has no external data, as it always was;
a model that keeps tensors in external data files (``inferd.external_data``) has
the SHA-256 of the lines ``sha256sum`` writes for its file (read from stdin, so
named ``-``) and then for each of those files by its location, in byte order::

    { sha256sum - < m.onnx; (cd "$(dirname m.onnx)" && sha256sum w.bin x.bin); } | sha256sum

so new weights beside an unchanged ``.onnx`` are another model.  A location
outside the model's folder is refused (``ExternalDataEscapeError``, an ``OSError``).

A model hashed to be loaded is remembered with the version of each file hashed
(``sha256_remembered``), so that a later question about it (which model a
configured path has now, asked on the bus thread) is answered without reading
gigabytes there (``remembered_sha256``; DESIGN.md entry 130).
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from inferd.external_data import (
    LOCATION_BYTES,
    external_data_locations,
    mentions_external_data,
    model_directory,
    open_external_file,
)
from inferd.owned_files import open_own_file

_CHUNK_BYTES = 1024 * 1024
#: Files remembered at most (configured models and the staged engines beside them).
_REMEMBERED_MAX = 256
#: What identifies one version of a file: a write, ``touch`` or rename changes the ctime.
FileVersion = tuple[int, int, int, int, int]
#: A model's version, and that of each of its external data files (by path), and its digest.
_Remembered = tuple[FileVersion, tuple[tuple[Path, FileVersion], ...], str]
_remembered: OrderedDict[Path, _Remembered] = OrderedDict()
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


@dataclass(frozen=True)
class ExternalFile:
    """One external data file of a model, as it was hashed: ``location`` as the
    model names it (normalised, relative to the model's folder)."""

    location: str
    sha256: str
    version: FileVersion


@dataclass(frozen=True)
class ModelDigest:
    """A model's digest (``sha256``) and what it was taken over: the model file
    (``file_sha256``, ``version``) and its external data files, by location."""

    sha256: str
    file_sha256: str
    version: FileVersion
    external: tuple[ExternalFile, ...] = ()


def model_digest(path: Path) -> ModelDigest:
    """The model at ``path`` (a symlink followed: an operator's file) hashed, streamed;
    read whole again only when it may name external data (a small ``.onnx`` then)."""
    handle, info = open_own_file(path, follow=True)
    with handle:
        digest = hashlib.sha256()
        tail = b""  # the end of the previous chunk: the key may straddle two
        while chunk := handle.read(_CHUNK_BYTES):
            straddling = tail + chunk[: len(LOCATION_BYTES) - 1]
            if mentions_external_data(straddling) or mentions_external_data(chunk):
                handle.seek(0)
                return model_digest_of(handle.readall(), path, info)
            digest.update(chunk)
            tail = (tail + chunk[1 - len(LOCATION_BYTES) :])[1 - len(LOCATION_BYTES) :]
    file_sha256 = digest.hexdigest()
    return ModelDigest(file_sha256, file_sha256, file_version(info))


def model_digest_of(data: bytes, path: Path, info: os.stat_result) -> ModelDigest:
    """The digest of the model whose bytes are ``data``, read from ``path`` (whose
    folder its external data files are in), a file whose ``fstat`` was ``info``."""
    file_sha256 = hashlib.sha256(data).hexdigest()
    locations = external_data_locations(data)
    if not locations:
        return ModelDigest(file_sha256, file_sha256, file_version(info))
    directory = model_directory(path)
    external = tuple(_external_file(directory, location) for location in locations)
    lines = [f"{file_sha256}  -\n"] + [f"{file.sha256}  {file.location}\n" for file in external]
    combined = hashlib.sha256("".join(lines).encode()).hexdigest()
    return ModelDigest(combined, file_sha256, file_version(info), external)


def _external_file(directory: str, location: str) -> ExternalFile:
    handle, info = open_external_file(directory, location)
    with handle:
        return ExternalFile(location, sha256_handle(handle), file_version(info))


def sha256_remembered(path: Path) -> str:
    """``model_digest(path).sha256`` of an operator's model, remembered with the version of
    each file it read (their descriptors' ``fstat``, taken before reading)."""
    digest = model_digest(path)
    directory = Path(model_directory(path))
    external = tuple((directory / file.location, file.version) for file in digest.external)
    with _remembered_lock:
        _remembered.pop(path, None)
        _remembered[path] = (digest.version, external, digest.sha256)
        while len(_remembered) > _REMEMBERED_MAX:
            _remembered.popitem(last=False)
    return digest.sha256


def remembered_sha256(path: Path) -> str | None:
    """The digest ``sha256_remembered`` took of the model ``path`` names now, or None
    when it was never hashed, it or one of its external data files has changed since,
    or cannot be stat'ed.  Never reads a file: a write during that hash changed the
    ctime, so its digest is not given."""
    with _remembered_lock:
        found = _remembered.get(path)
    if found is None:
        return None
    version, external, digest = found
    try:
        if file_version(os.stat(path)) != version:
            return None
        for file, file_was in external:
            if file_version(os.stat(file, follow_symlinks=False)) != file_was:
                return None
    except OSError:
        return None
    return digest


def file_version(info: os.stat_result) -> FileVersion:
    """What identifies one version of the file ``info`` describes."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
