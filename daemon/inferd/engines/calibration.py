"""INT8 calibration cache trust: reuse a cache only for the data set that produced it.

TensorRT's implicit INT8 quantisation (``IInt8EntropyCalibrator2``, TensorRT 10)
derives per-tensor scales from a calibration data set and can write them to a
cache so later builds skip calibration.  A cache computed from another data set
(or a damaged one) silently produces a badly quantised engine, so a cache
``X.calib_cache`` is trusted only together with two sidecars:

``X.calib_cache.sha256``
    integrity: the cache's SHA-256 in ``sha256sum`` format (``<hex>  <name>``).
``X.calib_cache.dataset_sha256``
    provenance: one line, the SHA-256 content hash of the calibration data set
    (``dataset_sha256``) the cache was computed from.

``CalibrationCacheStore.load`` decides, in this order:

====================================  ===========================================
situation                             result
====================================  ===========================================
no cache file                         ``absent``: calibrate
a sidecar exists but is malformed     ``CalibrationCacheError`` (never overwritten)
integrity or data-set sidecar absent  ``untrusted``: calibrate, then replace
data-set hash differs                 ``dataset_changed``: calibrate, then replace
cache bytes differ from the sidecar   ``CalibrationCacheError`` (corrupt or
                                      tampered: an operator must look)
both agree                            ``reused``: the cache bytes
====================================  ===========================================

``store`` writes the cache and both sidecars atomically (temp + fsync +
rename), removing the data-set sidecar first: a crash part-way leaves a cache
without provenance, which reads as ``untrusted`` (recalibrate), never as a
trusted cache for the wrong data.  It refuses (``CalibrationCacheError``) to
replace a malformed sidecar: corruption is reported, not papered over.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from inferd.durable import atomic_write_bytes, atomic_write_text, fsync_directory
from inferd.engines.naming import ENGINE_SUFFIX
from inferd.errors import CalibrationCacheError
from inferd.owned_files import ensure_owned_dir, open_own_file, open_regular_file

CACHE_SUFFIX = ".calib_cache"
INTEGRITY_SUFFIX = ".sha256"
DATASET_SUFFIX = ".dataset_sha256"
#: A calibration cache holds one scale per tensor: kilobytes to a few MiB.
CACHE_MAX_BYTES = 64 * 1024 * 1024
SIDECAR_MAX_BYTES = 4096
_CHUNK = 1024 * 1024
_HEX64 = re.compile(r"[0-9a-f]{64}")
_INTEGRITY_LINE = re.compile(r"([0-9a-fA-F]{64})(?:[ \t]+\*?(\S.*))?")

Status = Literal["reused", "absent", "untrusted", "dataset_changed"]


def calibration_cache_path(engine_path: Path) -> Path:
    """``<engine stem>.calib_cache`` next to the engine: one cache per model, host
    tuple, precision and build config (the engine name encodes all of them)."""
    name = engine_path.name
    stem = name[: -len(ENGINE_SUFFIX)] if name.endswith(ENGINE_SUFFIX) else name
    return engine_path.with_name(stem + CACHE_SUFFIX)


def integrity_sidecar_path(cache: Path) -> Path:
    return cache.with_name(cache.name + INTEGRITY_SUFFIX)


def dataset_sidecar_path(cache: Path) -> Path:
    return cache.with_name(cache.name + DATASET_SUFFIX)


def _files(root: Path) -> list[tuple[str, Path]]:
    if root.is_file():
        return [(root.name, root)]
    if not root.is_dir():
        raise CalibrationCacheError(f"calibration data set {root} does not exist")
    found: list[tuple[str, Path]] = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories.sort()
        for name in names:
            path = Path(directory) / name
            if path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def dataset_sha256(root: Path | Iterable[Path]) -> str:
    """Content hash of a calibration data set: a file, a directory (recursively,
    every regular file) or an explicit list of files.

    Each file contributes its relative name, its size and its bytes (streamed,
    bounded memory), in sorted name order, so renaming, adding, removing or
    editing any file changes the hash and nothing else does."""
    entries = _files(root) if isinstance(root, Path) else sorted((path.name, path) for path in root)
    if not entries:
        raise CalibrationCacheError(f"calibration data set {root} holds no files")
    digest = hashlib.sha256(b"inferd.calibration_dataset/1\0")
    for name, path in entries:
        encoded = name.encode("utf-8", "surrogateescape")
        try:
            # The operator's file (a symlink followed); a FIFO swapped in after the
            # listing is refused, not waited on, and the size is the file's read.
            handle, info = open_regular_file(path, follow=True)
            size = info.st_size
            digest.update(len(encoded).to_bytes(4, "big") + encoded + size.to_bytes(8, "big"))
            with handle:
                while chunk := handle.read(_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise CalibrationCacheError(f"cannot read calibration data {path}: {exc}") from exc
    return digest.hexdigest()


@dataclass(frozen=True)
class CalibrationLookup:
    """What ``load`` found: ``data`` is the trusted cache (``status == "reused"``)
    or None (calibrate); ``reason`` says why in a sentence."""

    status: Status
    reason: str
    data: bytes | None = None


def _read_small(path: Path, limit: int, what: str) -> bytes | None:
    """The file's bytes, None when it does not exist; CalibrationCacheError when it
    cannot be read or is larger than ``limit``."""
    try:
        with open_own_file(path)[0] as handle:
            data = handle.read(limit + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise CalibrationCacheError(f"{what} {path} cannot be read: {exc}") from exc
    if len(data) > limit:
        raise CalibrationCacheError(f"{what} {path} is malformed: larger than {limit} bytes")
    return data


class CalibrationCacheStore:
    """The trusted calibration cache at ``path`` for the data set hashing to
    ``dataset_digest``."""

    def __init__(self, path: Path, dataset_digest: str) -> None:
        digest = dataset_digest.lower()
        if not _HEX64.fullmatch(digest):
            raise ValueError(
                f"dataset digest must be a 64-digit hex SHA-256, got {dataset_digest!r}"
            )
        self.path = path
        self.dataset_digest = digest
        self.integrity_path = integrity_sidecar_path(path)
        self.dataset_path = dataset_sidecar_path(path)

    # -- sidecars -----------------------------------------------------------------------

    def _integrity(self) -> str | None:
        data = _read_small(self.integrity_path, SIDECAR_MAX_BYTES, "calibration integrity sidecar")
        if data is None:
            return None
        corrupt = CalibrationCacheError(
            f"calibration integrity sidecar {self.integrity_path} is corrupt: expected one "
            f"'<sha256>  {self.path.name}' line; it is left in place for inspection (move it "
            "and the cache aside to recalibrate)"
        )
        try:
            lines = [line.strip() for line in data.decode("ascii").splitlines() if line.strip()]
        except UnicodeDecodeError:
            raise corrupt from None
        match = _INTEGRITY_LINE.fullmatch(lines[0]) if len(lines) == 1 else None
        if match is None or (match.group(2) is not None and match.group(2) != self.path.name):
            raise corrupt
        return match.group(1).lower()

    def _dataset(self) -> str | None:
        data = _read_small(self.dataset_path, SIDECAR_MAX_BYTES, "calibration data-set sidecar")
        if data is None:
            return None
        try:
            text = data.decode("ascii").strip()
        except UnicodeDecodeError:
            text = ""
        if not _HEX64.fullmatch(text.lower()):
            raise CalibrationCacheError(
                f"calibration data-set sidecar {self.dataset_path} is corrupt: expected one "
                "64-digit hex SHA-256; it is left in place for inspection (move it and the "
                "cache aside to recalibrate)"
            )
        return text.lower()

    # -- the decision -------------------------------------------------------------------

    def load(self) -> CalibrationLookup:
        """The cache if both sidecars vouch for it (see the module doc for the rules)."""
        integrity = self._integrity()  # malformed sidecars raise before anything else
        dataset = self._dataset()
        cache = _read_small(self.path, CACHE_MAX_BYTES, "calibration cache")
        if cache is None:
            return CalibrationLookup("absent", f"no calibration cache at {self.path}")
        if integrity is None or dataset is None:
            missing = self.integrity_path if integrity is None else self.dataset_path
            return CalibrationLookup(
                "untrusted",
                f"calibration cache {self.path.name} has no {missing.name} sidecar: recalibrating",
            )
        if dataset != self.dataset_digest:
            return CalibrationLookup(
                "dataset_changed",
                f"calibration cache {self.path.name} was computed from data set {dataset[:16]}, "
                f"the data set is now {self.dataset_digest[:16]}: recalibrating",
            )
        actual = hashlib.sha256(cache).hexdigest()
        if actual != integrity:
            raise CalibrationCacheError(
                f"calibration cache {self.path} does not match its integrity sidecar (sha256 "
                f"{actual}, sidecar {integrity}): it is corrupt or was altered; it is left in "
                "place for inspection (move it aside to recalibrate)"
            )
        return CalibrationLookup(
            "reused", f"calibration cache {self.path.name} matches data set and digest", cache
        )

    def store(self, data: bytes) -> None:
        """Replace cache and sidecars (atomically each; provenance written last)."""
        if len(data) > CACHE_MAX_BYTES:
            raise CalibrationCacheError(
                f"calibration cache of {len(data)} bytes exceeds {CACHE_MAX_BYTES} bytes"
            )
        self._integrity()  # refuse to overwrite a corrupt sidecar silently
        self._dataset()
        try:
            ensure_owned_dir(self.path.parent, what="the calibration cache's directory")
            if self.dataset_path.exists():
                self.dataset_path.unlink()
                fsync_directory(self.path.parent)
            atomic_write_bytes(self.path, data)
            atomic_write_text(
                self.integrity_path, f"{hashlib.sha256(data).hexdigest()}  {self.path.name}\n"
            )
            atomic_write_text(self.dataset_path, f"{self.dataset_digest}\n")
        except OSError as exc:
            raise CalibrationCacheError(
                f"cannot write calibration cache {self.path}: {exc}"
            ) from exc
