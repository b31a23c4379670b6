"""What TensorRT daemon builds leave in ``runtime.engine_dir``, as the artifact sets
the builds cap governs (``retention.py``).

A daemon build there writes the engine under the name the ``tensorrt`` runtime
looks up (``inferd.engines.naming``: label, model digest, host tuple, build
config), its ``.sha256`` sidecar, and the summary ``<engine>.<build_id>.build.json``
(``session.py``), ``build_id`` being the daemon's ``b<counter>-<6 hex>`` (``inferd
build`` names its summaries otherwise).  A set is one daemon build: its summary,
and the engine with its sidecar when that build owns them: the newest daemon build
that completed with the digest the sidecar holds.  A rebuild with the same build
config rewrites the file and takes it over, leaving the older summary a set of its
own (superseded); an engine whose digest no daemon build wrote (an operator's file,
even under a daemon build's name) is in no set: never removed, never counted.  Only
the top level is read: ``quarantine/``, the per-host timing caches and
``manifest.json`` are no build's.

Pinned (kept whatever the caps) is an engine the manifest the gate uses trusts
with the sidecar's digest (``runtime.engine_manifest``, else
``<engine_dir>/manifest.json``), unless a newer engine that manifest trusts
supersedes it for the same model, host tuple and build config: the same ONNX
under another label (the runtime reuses an engine of any label), or the same label
built from another ONNX when no configured model has the older ONNX any more (the
gate refuses it for every model; each model's ONNX as the daemon hashed it to load
it, never hashed here).  Only the daemon's own manifest is superseded
that way, and the engine's entry goes with it; a deployment's manifest is its
operator's, and every engine it trusts stays.  A manifest that cannot be read
pins every engine: trust unknown.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from inferd.digest import remembered_sha256
from inferd.engine_build.retention import SUMMARY_NAME as SUMMARY_NAME  # commit_records'
from inferd.engine_build.retention import ArtifactSet, build_order
from inferd.engines.manifest import MANIFEST_NAME, Manifest
from inferd.engines.naming import MODEL_HASH_CHARS, EngineName, parse_engine_name
from inferd.engines.sidecar import read_sidecar, sidecar_path
from inferd.errors import (
    EngineHashMismatchError,
    EngineManifestError,
    EngineSchemaMismatchError,
    EngineSidecarMissingError,
)
from inferd.owned_files import open_own_file, unsafe_owned_dir_reason

log = structlog.get_logger("inferd.builds.retention")

#: A summary larger than this is not read (its engine then stays nobody's).
SUMMARY_MAX_BYTES = 4 * 1024 * 1024
#: Why an owned engine stays (None: superseded), and the manifest entry to drop with it.
_Pin = tuple[str | None, tuple[Path, Path, str] | None]


@dataclass(frozen=True)
class _Summary:
    path: Path
    build_id: str
    engine: Path
    name: EngineName
    size: int
    mtime_ns: int
    #: The engine digest a completed build recorded, else None.
    digest: str | None

    @property
    def order(self) -> tuple[int, int, str]:
        """Which build is newer (``retention.build_order``): by build number, never
        by the summary's mtime first (the wall clock may be 1970 or set back)."""
        return build_order(self.build_id, self.mtime_ns)


@dataclass(frozen=True)
class _Owned:
    summary: _Summary
    digest: str
    mtime_ns: int

    @property
    def order(self) -> tuple[int, int, str]:
        return build_order(self.summary.build_id, self.mtime_ns)


class EngineOutputs:
    """The engine dir's daemon-build sets, read from the disk at each ``scan``."""

    def __init__(
        self,
        directory: Path,
        engine_manifest: Path | None = None,
        models: Callable[[], Collection[Path]] = tuple,
    ) -> None:
        self.directory = directory
        #: ``runtime.engine_manifest``: the deployment's (never written), else None.
        self._configured = engine_manifest
        #: The configured models' ONNX files (which ONNX an engine may still serve).
        self._models = models

    def scan(self) -> tuple[ArtifactSet, ...]:
        if unsafe_owned_dir_reason(self.directory) is not None:
            return ()  # missing, or not safely the daemon's: no build writes there
        by_engine: dict[Path, list[_Summary]] = {}
        for summary in self._summaries():
            by_engine.setdefault(summary.engine, []).append(summary)
        found: list[tuple[_Summary, tuple[Path, ...], int, int]] = []
        owned: list[_Owned] = []
        for engine, group in by_engine.items():
            digest, files = _engine_files(engine)
            owner = max(
                (s for s in group if digest is not None and s.digest == digest),
                key=lambda s: s.order,
                default=None,
            )
            for summary in group:
                paths, size, mtime = [summary.path], summary.size, summary.mtime_ns
                if summary is owner and digest is not None:
                    paths += [path for path, _ in files]
                    size += sum(info.st_size for _, info in files)
                    mtime = max([mtime, *(info.st_mtime_ns for _, info in files)])
                    owned.append(_Owned(summary, digest, mtime))
                found.append((summary, tuple(sorted(paths)), size, mtime))
        pins = self._pins(owned)
        sets = []
        for summary, files_of_set, size, mtime in found:
            pinned, entry = pins.get(summary.path, (None, None))
            sets.append(
                ArtifactSet(
                    model=summary.name.label,
                    build_id=summary.build_id,
                    paths=files_of_set,
                    size=size,
                    mtime_ns=mtime,
                    root=self.directory,
                    pinned=pinned,
                    config=summary.name.build_config_hash,
                    superseded=entry is not None,
                    trust_entry=entry,
                )
            )
        return tuple(sets)

    def _summaries(self) -> list[_Summary]:
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            match = SUMMARY_NAME.match(entry.name)
            if match is None:
                continue
            try:
                name = parse_engine_name(match["engine"])
                info = entry.stat(follow_symlinks=False)
            except (EngineSchemaMismatchError, FileNotFoundError):
                continue
            if not stat.S_ISREG(info.st_mode):
                continue  # the daemon writes no symlink: not its file
            path = Path(entry.path)
            found.append(
                _Summary(
                    path=path,
                    build_id=match["build_id"],
                    engine=self.directory / match["engine"],
                    name=name,
                    size=info.st_size,
                    mtime_ns=info.st_mtime_ns,
                    digest=_completed_digest(path),
                )
            )
        return found

    def _pins(self, owned: list[_Owned]) -> dict[Path, _Pin]:
        """Per summary path of an owned engine the manifest trusts: why it stays
        (None when superseded) and the daemon manifest's entry to drop with it."""
        if not owned:
            return {}
        manifest_path = self._configured or self.directory / MANIFEST_NAME
        try:
            if self._configured is None and not os.path.lexists(manifest_path):
                return {}
            # The deployment's may be a symlink (an operator's file); the daemon's not.
            manifest = Manifest.load(manifest_path, follow=self._configured is not None)
        except EngineManifestError as exc:
            log.warning("build_outputs_trust_unknown", manifest=str(manifest_path), error=str(exc))
            why = f"an engine whose trust is unknown ({manifest_path} cannot be read)"
            return {item.summary.path: (why, None) for item in owned}
        trusted = [item for item in owned if _trusts(manifest, item)]
        why = f"an engine {manifest_path} trusts"
        pins: dict[Path, _Pin] = {}
        for item in trusted:
            if self._configured is None and self._superseded(item, trusted):
                entry = (manifest_path, item.summary.engine, item.digest)
                pins[item.summary.path] = (None, entry)
            else:
                pins[item.summary.path] = (why, None)
        return pins

    def _superseded(self, item: _Owned, trusted: list[_Owned]) -> bool:
        name = item.summary.name
        for newer in trusted:
            other = newer.summary.name
            if newer.order <= item.order:
                continue  # built before it, by build number: the older one
            if (other.host, other.build_config_hash) != (name.host, name.build_config_hash):
                continue
            if other.model_sha256_prefix == name.model_sha256_prefix:
                return True  # the same engine under another label
            if other.label == name.label:
                configured = self._configured_digests()
                if configured is not None and name.model_sha256_prefix not in configured:
                    return True  # built from an ONNX no configured model has any more
        return False

    def _configured_digests(self) -> set[str] | None:
        """The configured models' ONNX digest prefixes, as the daemon hashed them to load
        them, or None when one is not known (never hashed here, or changed since): then
        nothing is superseded by model.  This runs on the bus thread, where hashing a
        multi-GB model would stall every request (DESIGN.md entry 130)."""
        prefixes = set()
        for path in self._models():
            digest = remembered_sha256(path)
            if digest is None:
                return None
            prefixes.add(digest[:MODEL_HASH_CHARS])
        return prefixes


def _trusts(manifest: Manifest, item: _Owned) -> bool:
    try:
        return manifest.get(item.summary.engine) == item.digest
    except EngineHashMismatchError:
        return True  # listed twice with different digests: not the daemon's to decide


def _engine_files(engine: Path) -> tuple[str | None, list[tuple[Path, os.stat_result]]]:
    """The digest the engine's sidecar holds and the two files, or (None, [])."""
    try:
        files = [(path, path.lstat()) for path in (engine, sidecar_path(engine))]
        if not all(stat.S_ISREG(info.st_mode) for _, info in files):
            return None, []
        return read_sidecar(engine), files
    except (OSError, EngineHashMismatchError, EngineSidecarMissingError):
        return None, []  # not a pair a daemon build wrote


def read_summary(path: Path) -> dict[str, Any] | None:
    """The build summary at ``path`` (the daemon's own regular file, never through a
    symlink, at most ``SUMMARY_MAX_BYTES``), or None when there is none or it cannot
    be read.  Trusted as a build's report (``child_exit``): ``open_own_file``."""
    try:
        handle, _info = open_own_file(path)
        with handle:
            data = handle.read(SUMMARY_MAX_BYTES + 1)
        if len(data) > SUMMARY_MAX_BYTES:
            return None
        document = json.loads(data)
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _completed_digest(path: Path) -> str | None:
    """The engine digest ``path``'s build recorded, when it committed a real engine."""
    document = read_summary(path)
    if document is None or document.get("outcome") != "completed":
        return None
    if document.get("validationStatus") == "fail":
        return None  # quarantined, never committed: the engine there is not this build's
    if document.get("simulated") is not False:
        return None
    digest = (document.get("baseline") or {}).get("engineSha256")
    return digest.lower() if isinstance(digest, str) else None
