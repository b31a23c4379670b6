"""The cap on what daemon builds leave on disk (``builds.max_count``, ``builds.max_bytes``).

Two places hold it.  ``<state_dir>/builds``: each simulated build's artifact set
``<model>/<model>.<build_id>.*`` (the engine, its ``.sha256`` sidecar, the
``.build.json`` summary, and what a cleanup moved to ``<model>/quarantine/``);
every byte under that dir counts.  ``runtime.engine_dir``: each TensorRT daemon
build's summary, with the engine and sidecar it owns (``engine_outputs.py``; the
model there is the engine's label); only those count, never an operator's file.
The inventory is read from the disk each time, never kept only in memory, so the
cap holds across restarts and counts what an earlier daemon left.

A set stays while it belongs to a running build, its engine serves, it is pinned
(an engine the manifest trusts and no newer trusted one supersedes), or it is its
model's newest engine in its directory; every other set is removable (superseded,
or a failed or cancelled build's summary).  Removal goes oldest first until both
caps hold.  Oldest and newest are by build number (``b<N>-``, numerically), never
by the files' times first: the wall clock that stamps them may read 1970 at boot
or be set back mid-run.  The daemon's counter starts past the highest number on
disk (``next_build_number``), so a later build has a higher number across
restarts; equal numbers (left by daemons that restarted at ``b1`` each run) fall
back to the newest mtime, then the id.  Each removed set is a
``build_artifact_removed`` FDR record.  The daemon prunes at start, before a
build starts and after each build ends.  A build starts only when what must
stay, with this build's set and one per running build on top (less the sets they
will supersede), fits ``max_count`` and what is left fits ``max_bytes``
(``over_caps``): between builds both dirs stay within the caps, and a build's own
set is the most a running build adds.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from inferd.engines.manifest import forget_in_manifest
from inferd.engines.quarantine import QUARANTINE_DIR

log = structlog.get_logger("inferd.builds.retention")

REMOVED_RECORD = "build_artifact_removed"
#: The daemon's build ids: ``b<counter>-<6 hex>`` (``BuildManager``).
BUILD_ID = r"b[0-9]+-[0-9a-f]{6}"
_ARTIFACT = re.compile(rf"^(?P<model>[A-Za-z0-9_-]+)\.(?P<build_id>{BUILD_ID})\.")
#: A TensorRT daemon build's summary in the engine dir (``engine_outputs.py``).
SUMMARY_NAME = re.compile(rf"^(?P<engine>.+\.engine)\.(?P<build_id>{BUILD_ID})\.build\.json$")
#: A build number: eleven digits at most.  A stray set with more (files an operator
#: made) orders as the oldest and never moves the counter, whose numbers then stay
#: within what the wire's ids and NAME_MAX hold (10^11 builds is past any vehicle's life).
_NUMBER = re.compile(r"^b([0-9]{1,11})-")

RUNNING, SERVING, NEWEST = "running", "serving", "its model's newest engine"

Record = Callable[[str, Mapping[str, Any]], None]


@dataclass(frozen=True)
class ArtifactSet:
    model: str
    build_id: str
    paths: tuple[Path, ...]
    size: int
    #: The newest modification time of its files.
    mtime_ns: int
    #: The directory it was found in (the builds dir or the engine dir).
    root: Path
    #: Why it stays whatever the caps (an engine the manifest trusts), or None.
    pinned: str | None = None
    #: The engine's build-config hash (engine dir), for ``over_caps``'s projection.
    config: str | None = None
    #: A newer trusted engine supersedes this trusted one (``engine_outputs.py``): not
    #: even its model's newest; ``trust_entry``: its manifest entry, dropped with it.
    superseded: bool = False
    trust_entry: tuple[Path, Path, str] | None = None

    @property
    def has_engine(self) -> bool:
        return any(path.name.endswith(".engine") for path in self.paths)

    @property
    def order(self) -> tuple[int, int, str]:
        """Oldest to newest: ``build_order``."""
        return build_order(self.build_id, self.mtime_ns)


def build_number(build_id: str) -> int:
    """The number of a daemon build id (``b10-…``: 10; none: 0)."""
    match = _NUMBER.match(build_id)
    return int(match[1]) if match else 0


def build_order(build_id: str, mtime_ns: int) -> tuple[int, int, str]:
    """Which build is newer: the build number (numerically, ``b10`` after ``b9``),
    then, for equal numbers (sets of daemons whose counter restarted at 1 each run),
    the files' newest mtime, then the id."""
    return build_number(build_id), mtime_ns, build_id


def next_build_number(build_dir: Path, engine_dir: Path | None) -> int:
    """Where the daemon's build counter starts: 1 + the highest build number among
    the sets on disk (the builds dir's, and the engine dir's summaries), so that a
    later build has a higher number than every set an earlier run left, whatever
    the wall clock says.  A directory that does not exist holds none; one that
    could not be listed (``EMFILE``, ``EACCES``) raises its ``OSError``: a count
    without it could restart below the sets it holds."""
    ids = [artifact.build_id for artifact in scan(build_dir, strict=True).sets]
    if engine_dir is not None:
        try:
            names = os.listdir(engine_dir)
        except FileNotFoundError:
            names = []  # no TensorRT build yet
        ids += [match["build_id"] for name in names if (match := SUMMARY_NAME.match(name))]
    return 1 + max(map(build_number, ids), default=0)


@dataclass(frozen=True)
class Inventory:
    #: Oldest first (``build_order``).
    sets: tuple[ArtifactSet, ...]
    #: Every file under the builds dir (shared timing caches too) and the engine
    #: dir's daemon-build sets.
    total_bytes: int


@dataclass(frozen=True)
class Pending:
    """A running build, or one about to start: it adds one set to ``root`` as
    ``model``'s newest (``config``: its engine's build-config hash in the engine dir)."""

    build_id: str
    root: Path
    model: str
    config: str | None = None
    #: The engine it writes, once known: never removed meanwhile.
    engine: Path | None = None


class EngineDirOutputs(Protocol):
    """``engine_outputs.EngineOutputs``: the engine dir's daemon-build sets."""

    directory: Path

    def scan(self) -> tuple[ArtifactSet, ...]: ...


def scan(build_dir: Path, strict: bool = False) -> Inventory:
    """What the builds dir holds now (``strict``: a directory in it that could not be
    listed raises, where the caps' prune goes on with the rest)."""
    files: dict[tuple[str, str], list[tuple[Path, os.stat_result]]] = {}
    total = 0
    for root, _dirs, names in os.walk(build_dir, onerror=_unlisted if strict else None):
        for name in names:
            path = Path(root) / name
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue  # removed meanwhile (a build's own cleanup)
            total += info.st_size
            match = _ARTIFACT.match(name)
            parent = path.parent
            if parent.name == QUARANTINE_DIR:
                parent = parent.parent
            if match is None or parent.parent != build_dir or parent.name != match["model"]:
                continue
            files.setdefault((match["model"], match["build_id"]), []).append((path, info))
    sets = [
        ArtifactSet(
            model=model,
            build_id=build_id,
            paths=tuple(sorted(path for path, _ in entries)),
            size=sum(info.st_size for _, info in entries),
            mtime_ns=max(info.st_mtime_ns for _, info in entries),
            root=build_dir,
        )
        for (model, build_id), entries in files.items()
    ]
    return _inventory(sets, total)


def _unlisted(exc: OSError) -> None:
    """``os.walk``'s error: raised, but for a directory removed meanwhile, or absent."""
    if not isinstance(exc, FileNotFoundError):
        raise exc


def _inventory(sets: list[ArtifactSet], total: int) -> Inventory:
    sets.sort(key=lambda s: s.order)
    return Inventory(tuple(sets), total)


class BuildsRetention:
    def __init__(
        self,
        build_dir: Path,
        max_count: int,
        max_bytes: int,
        record: Record,
        engine_outputs: EngineDirOutputs | None = None,
    ) -> None:
        self.build_dir = build_dir
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._record = record
        #: The engine dir's daemon-build sets, when it is covered too.
        self.engine_outputs = engine_outputs
        self._lock = threading.Lock()
        #: Artifact sets removed over this run.
        self.removed = 0

    def scan(self) -> Inventory:
        """Both directories' sets, oldest first."""
        inventory = scan(self.build_dir)
        if self.engine_outputs is None:
            return inventory
        engine_sets = self.engine_outputs.scan()
        return _inventory(
            [*inventory.sets, *engine_sets],
            inventory.total_bytes + sum(s.size for s in engine_sets),
        )

    def prune(
        self, *, keep: Collection[Pending | str], serving: Collection[Path], trigger: str
    ) -> Inventory:
        """Remove the oldest removable sets until within both caps; returns what is
        left.  ``keep``: the running builds (or their ids); ``serving``: engine files in use."""
        with self._lock:
            inventory = self.scan()
            protected = _protected(inventory, keep, serving)
            sets, total = list(inventory.sets), inventory.total_bytes
            for victim in [s for s in inventory.sets if s not in protected]:
                if len(sets) <= self.max_count and total <= self.max_bytes:
                    break
                reason = "max_count" if len(sets) > self.max_count else "max_bytes"
                freed = self._remove(victim)
                sets.remove(victim)
                total -= freed
                self.removed += 1
                self._record(
                    REMOVED_RECORD,
                    {
                        "model": victim.model,
                        "build_id": victim.build_id,
                        "directory": str(victim.root),
                        "files": [str(path) for path in victim.paths],
                        "bytes": freed,
                        "reason": reason,
                        "trigger": trigger,
                        "remaining_count": len(sets),
                        "remaining_bytes": total,
                        "max_count": self.max_count,
                        "max_bytes": self.max_bytes,
                    },
                )
                log.info(
                    "build_artifacts_removed",
                    model=victim.model,
                    build_id=victim.build_id,
                    directory=str(victim.root),
                    bytes=freed,
                    reason=reason,
                    trigger=trigger,
                )
            return Inventory(tuple(sets), total)

    def over_caps(
        self,
        inventory: Inventory,
        pending: Collection[Pending] = (),
        serving: Collection[Path] = (),
    ) -> str | None:
        """Why ``inventory`` (what pruning left) leaves no room for the ``pending``
        builds' sets (the one to start and the running ones), or None.

        What must stay now, plus a set per pending build not yet on disk, less the
        sets each pending build supersedes when it ends (its model's newest engine
        in its directory, and an engine of the same model and build config, which
        it rewrites), must fit ``max_count``; what is left must fit ``max_bytes``."""
        protected = _protected(inventory, pending, serving)
        on_disk = {s.build_id for s in inventory.sets}
        replaced: set[ArtifactSet] = set()
        for build in pending:
            for artifact, why in protected.items():
                if artifact.build_id == build.build_id or (artifact.root, artifact.model) != (
                    build.root,
                    build.model,
                ):
                    continue
                rewritten = build.config is not None and build.config == artifact.config
                if why == NEWEST or (rewritten and why != RUNNING):
                    replaced.add(artifact)
        arriving = sum(1 for build in pending if build.build_id not in on_disk)
        count = len(protected) - len(replaced) + arriving
        total = inventory.total_bytes
        if count <= self.max_count and total <= self.max_bytes:
            return None
        reasons: dict[str, int] = {}
        for why in protected.values():
            reasons[why] = reasons.get(why, 0) + 1
        kept = ", ".join(f"{why} ({n})" for why, n in sorted(reasons.items())) or "none"
        where = str(self.build_dir)
        if self.engine_outputs is not None:
            where += f" and the engine dir {self.engine_outputs.directory}"
        return (
            f"daemon builds hold {len(inventory.sets)} build(s) and {total} bytes in {where} "
            f"(builds.max_count {self.max_count}, builds.max_bytes {self.max_bytes}) and "
            f"nothing more can be removed to make room for a new build; what stays: {kept}. "
            "Remove engines no longer needed (with their .sha256 sidecar and manifest "
            "entry) or raise the caps"
        )

    def describe(self) -> dict[str, Any]:
        inventory = self.scan()
        return {
            "directory": str(self.build_dir),
            "engine_dir": str(outputs.directory) if (outputs := self.engine_outputs) else None,
            "count": len(inventory.sets),
            "bytes": inventory.total_bytes,
            "max_count": self.max_count,
            "max_bytes": self.max_bytes,
            "removed": self.removed,
        }

    @staticmethod
    def _remove(artifact: ArtifactSet) -> int:
        if artifact.trust_entry is not None:
            manifest, engine, digest = artifact.trust_entry
            forget_in_manifest(manifest, engine, digest)  # no trust left for a missing file
        freed = 0
        for path in artifact.paths:
            try:
                size = path.lstat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            freed += size
        return freed


def _protected(
    inventory: Inventory, keep: Collection[Pending | str], serving: Collection[Path]
) -> dict[ArtifactSet, str]:
    """Each set that must stay, and why (the others are removable, oldest first)."""
    running = {item if isinstance(item, str) else item.build_id for item in keep}
    targets = {item.engine for item in keep if isinstance(item, Pending) and item.engine}
    in_use = {Path(path) for path in serving}
    newest: dict[tuple[Path, str], ArtifactSet] = {}
    for artifact in inventory.sets:  # oldest first: the last one wins
        if artifact.has_engine and artifact.build_id not in running and not artifact.superseded:
            newest[(artifact.root, artifact.model)] = artifact
    protected: dict[ArtifactSet, str] = {}
    for artifact in inventory.sets:
        if artifact.build_id in running or targets.intersection(artifact.paths):
            protected[artifact] = RUNNING
        elif in_use.intersection(artifact.paths):
            protected[artifact] = SERVING
        elif artifact.pinned is not None:
            protected[artifact] = artifact.pinned
        elif newest.get((artifact.root, artifact.model)) is artifact:
            protected[artifact] = NEWEST
    return protected
