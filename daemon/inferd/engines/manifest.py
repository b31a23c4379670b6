"""The deployment manifest: the trusted SHA-256 of every engine a vehicle may load.

JSON, written by the deployment pipeline (or ``write_manifest``)::

    {"version": 1,
     "engines": {"demo_m3f2a..._b1a2b3c4d5e6f.engine": "<sha256>",
                 "/var/lib/inferd/engines/other_....engine": "<sha256>"}}

A key containing ``/`` is a path (a relative one is relative to the manifest's
directory) and matches that file only; a key without ``/`` is a file name and
matches an engine of that name in any directory.  The digest binds the content
either way.  Loading is strict: unknown top-level keys, another version,
duplicate keys, bad digests or a file over 16 MiB raise
``EngineManifestError``.  Looking up an engine that is not listed raises
``EngineHashMismatchError(stage="manifest")``, never ``KeyError``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from inferd.durable import atomic_write_text
from inferd.engines.engine_dir import untrusted_engine_dir
from inferd.errors import EngineHashMismatchError, EngineManifestError
from inferd.owned_files import ensure_owned_dir, open_own_file

MANIFEST_VERSION = 1
MANIFEST_MAX_BYTES = 16 * 1024 * 1024
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise EngineManifestError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _spellable(key: str) -> bool:
    """Whether ``key`` names a file at all: a JSON escape can give a lone surrogate,
    which no path has (``os.fsencode`` refuses it with ``UnicodeEncodeError``)."""
    try:
        os.fsencode(key)
    except UnicodeEncodeError:
        return False
    return True


def _absolute(path: Path) -> Path:
    # Lexical normalisation plus symlink resolution of what exists; never raises:
    # ``realpath`` leaves a symlink loop unresolved, where ``Path.resolve`` raises
    # RuntimeError before Python 3.13 (a looping link named like an engine broke
    # ``locate_engine`` and ``explain`` instead of being refused at step 4).
    return Path(os.path.realpath(os.path.expanduser(path)))


class Manifest:
    """Trusted digests by engine path / file name.  Immutable once built."""

    def __init__(
        self,
        entries: Mapping[str, str],
        *,
        base_dir: Path | None = None,
        source: str = "<memory>",
    ) -> None:
        self.source = source
        self._base_dir = base_dir
        self._by_path: dict[Path, tuple[str, str]] = {}
        self._by_name: dict[str, str] = {}
        for key, digest in entries.items():
            self._add(key, digest)

    def _fail(self, reason: str) -> EngineManifestError:
        return EngineManifestError(f"deployment manifest {self.source} is malformed: {reason}")

    def _add(self, key: str, digest: Any) -> None:
        if not isinstance(key, str) or not key.strip() or "\x00" in key or not _spellable(key):
            raise self._fail(f"engine key {key!r} must be a non-empty path or file name")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise self._fail(f"digest for {key!r} must be 64 hex digits, got {digest!r}")
        value = digest.lower()
        if "/" not in key:
            self._by_name[key] = value
            return
        path = Path(key)
        if not path.is_absolute():
            path = (self._base_dir or Path.cwd()) / path
        absolute = _absolute(path)
        previous = self._by_path.get(absolute)
        if previous is not None and previous[1] != value:
            raise self._fail(
                f"keys {previous[0]!r} and {key!r} name the same file with different digests"
            )
        self._by_path[absolute] = (key, value)

    @classmethod
    def empty(cls, source: str = "<none>") -> Manifest:
        return cls({}, source=source)

    @classmethod
    def from_json(cls, text: str, *, base_dir: Path | None = None, source: str) -> Manifest:
        try:
            document = json.loads(text, object_pairs_hook=_no_duplicates)
        except EngineManifestError as exc:
            raise EngineManifestError(f"deployment manifest {source} is malformed: {exc}") from None
        except RecursionError:  # the decoder's, on arrays or objects nested thousands deep
            raise EngineManifestError(
                f"deployment manifest {source} is malformed: it is nested too deeply"
            ) from None
        except ValueError as exc:  # JSONDecodeError
            raise EngineManifestError(
                f"deployment manifest {source} is not valid JSON: {exc}"
            ) from None
        if not isinstance(document, dict):
            raise EngineManifestError(
                f"deployment manifest {source} is malformed: the top level must be an object "
                '{"version": 1, "engines": {...}}'
            )
        unknown = sorted(set(document) - {"version", "engines"})
        if unknown:
            raise EngineManifestError(
                f"deployment manifest {source} is malformed: unknown key(s) {unknown}"
            )
        version = document.get("version")
        if type(version) is not int or version != MANIFEST_VERSION:
            raise EngineManifestError(
                f"deployment manifest {source} has version {version!r}; this inferd reads "
                f"version {MANIFEST_VERSION}"
            )
        engines = document.get("engines")
        if not isinstance(engines, dict):
            raise EngineManifestError(
                f"deployment manifest {source} is malformed: 'engines' must be an object "
                "mapping engine paths or names to SHA-256 digests"
            )
        return cls(engines, base_dir=base_dir, source=source)

    @classmethod
    def load(cls, path: Path, *, follow: bool = False) -> Manifest:
        """Read a manifest file; ``EngineManifestError`` if unreadable or malformed.
        A symlink, or a file others could rewrite (``open_own_file``), is refused unless
        ``follow`` (a deployment's ``runtime.engine_manifest``, an operator's file; the
        daemon-written one in the engine dir is not followed); a FIFO is refused either way."""
        try:
            with open_own_file(path, follow=follow)[0] as handle:
                data = handle.read(MANIFEST_MAX_BYTES + 1)
        except OSError as exc:
            raise EngineManifestError(f"deployment manifest {path} cannot be read: {exc}") from exc
        if len(data) > MANIFEST_MAX_BYTES:
            raise EngineManifestError(
                f"deployment manifest {path} is larger than {MANIFEST_MAX_BYTES} bytes"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EngineManifestError(f"deployment manifest {path} is not UTF-8: {exc}") from None
        return cls.from_json(text, base_dir=_absolute(path).parent, source=str(path))

    def __len__(self) -> int:
        return len(self._by_path) + len(self._by_name)

    def get(self, engine: Path) -> str | None:
        """The trusted digest for ``engine``, or None when it is not listed.

        ``EngineHashMismatchError(stage="manifest")`` if a path entry and a name entry
        both match with different digests (ambiguous: refused)."""
        by_path = self._by_path.get(_absolute(engine))
        by_name = self._by_name.get(engine.name)
        if by_path is not None and by_name is not None and by_path[1] != by_name:
            raise EngineHashMismatchError(
                f"deployment manifest {self.source} lists {engine.name!r} twice with different "
                f"digests (as {by_path[0]!r} and by name)",
                stage="manifest",
            )
        if by_path is not None:
            return by_path[1]
        return by_name

    def lookup(self, engine: Path) -> str:
        """The trusted digest for ``engine``; ``EngineHashMismatchError(stage="manifest")``
        when the manifest does not list it."""
        digest = self.get(engine)
        if digest is None:
            raise EngineHashMismatchError(
                f"engine {engine.name!r} is not listed in the deployment manifest "
                f"{self.source}: only listed engines are trusted",
                stage="manifest",
            )
        return digest

    def keys_naming(self, engine: Path) -> list[str]:
        """The keys, as written, that name ``engine``: a path that resolves to it, and
        its file name."""
        keys = []
        if (by_path := self._by_path.get(_absolute(engine))) is not None:
            keys.append(by_path[0])
        if engine.name in self._by_name:
            keys.append(engine.name)
        return keys

    def entries(self) -> dict[str, str]:
        """The entries as they were keyed (for writing back)."""
        return {
            **{key: digest for key, digest in self._by_path.values()},
            **self._by_name,
        }


def deployment_manifest(configured: Path | None, engine_dir: Path) -> Manifest:
    """The manifest the engine gate trusts: ``runtime.engine_manifest`` when set (an
    operator's file: a symlink is followed), else ``<engine_dir>/manifest.json`` if it
    exists (the daemon's own: not followed) and the engine dir is safely the daemon's
    own (``untrusted_engine_dir``), else an empty manifest (which refuses every engine
    at the gate's step 5, its source saying why).  ``UncheckedDirectoryError`` when the
    engine dir could not be checked: an empty manifest would refuse an engine it lists
    as unlisted, a verdict on the engine for a state of this process."""
    if configured is not None:
        return Manifest.load(configured, follow=True)
    default = engine_dir / MANIFEST_NAME
    distrust = untrusted_engine_dir(engine_dir)
    if distrust is not None:
        return Manifest.empty(source=f"<none: {default} is not trusted: {distrust}>")
    if os.path.lexists(default):
        return Manifest.load(default)
    return Manifest.empty(source=f"<none: no {default}>")


def manifest_json(entries: Mapping[str, str]) -> str:
    for key, digest in entries.items():
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ValueError(f"digest for {key!r} must be 64 hex digits, got {digest!r}")
    document = {
        "version": MANIFEST_VERSION,
        "engines": {key: entries[key].lower() for key in sorted(entries)},
    }
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write_manifest(path: Path, entries: Mapping[str, str]) -> None:
    """Write a manifest atomically (temp + fsync + rename)."""
    atomic_write_text(path, manifest_json(entries))


#: The daemon-managed manifest in the engine dir, used when no deployment
#: manifest (``runtime.engine_manifest``) is configured.
MANIFEST_NAME = "manifest.json"

_RECORD_LOCK = threading.Lock()


@contextlib.contextmanager
def _one_writer(directory: Path) -> Iterator[None]:
    """One read-change-write of a manifest in ``directory`` at a time: among this
    process's threads (``_RECORD_LOCK``) and among processes (the daemon recording a
    build while ``inferd build --manifest`` records another): an ``flock`` on the
    directory itself, so no lock file is left beside the engines."""
    with _RECORD_LOCK:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # gives the flock back


def record_in_manifest(path: Path, engine_name: str, sha256: str) -> None:
    """Add (or replace) ``engine_name``'s trusted digest in the manifest at ``path``,
    keeping every other entry: the one way an engine becomes trusted (``inferd
    build --manifest``, and a daemon build that passed validation)."""
    ensure_owned_dir(path.parent, what="the manifest's directory")
    with _one_writer(path.parent):
        entries = Manifest.load(path).entries() if path.exists() else {}
        entries[engine_name] = sha256
        write_manifest(path, entries)


def forget_in_manifest(path: Path, engine: Path, sha256: str) -> bool:
    """Drop the entries of the manifest at ``path`` that trust ``engine`` with exactly
    ``sha256`` (keyed by its file name, or by a path that names it), keeping every
    other entry (the daemon's builds cap removing an engine it built: a trusted
    name with no file would only grow the manifest).  Whether one was dropped; a
    missing manifest drops nothing."""
    if not path.exists():
        return False
    with _one_writer(path.parent):
        if not path.exists():
            return False
        manifest = Manifest.load(path)
        entries = manifest.entries()
        keys = [key for key in manifest.keys_naming(engine) if entries[key] == sha256.lower()]
        for key in keys:
            del entries[key]
        if keys:
            write_manifest(path, entries)
        return bool(keys)
