"""The cap on ``<state_dir>/builds`` (``builds.max_count``, ``builds.max_bytes``).

Every daemon build leaves its artifact set there: ``<model>/<model>.<build_id>.*``
(the engine, its ``.sha256`` sidecar, the ``.build.json`` summary, and what a
cleanup moved to ``<model>/quarantine/``).  The inventory is read from the disk
each time, never kept only in memory, so the cap holds across restarts and
counts what an earlier daemon left.

A set is removable when it is *superseded*: its model has a newer set with an
engine, or it has no engine itself (a failed or cancelled build's summary and
leftovers).  A model's newest engine, a running build's set and an engine that
serves are never removed.  Removal goes oldest first until the directory is
within both caps; each removed set is a ``build_artifact_removed`` FDR record.
The daemon prunes at start, before a build starts (refusing it when what cannot
be removed already fills the caps) and after each build ends, so between builds
the directory stays within its caps and a running build may add one set on top.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from inferd.engines.quarantine import QUARANTINE_DIR

log = structlog.get_logger("inferd.builds.retention")

REMOVED_RECORD = "build_artifact_removed"
#: ``<model>.<build_id>.``: build ids are ``b<counter>-<6 hex>`` (``BuildManager``).
_ARTIFACT = re.compile(r"^(?P<model>[A-Za-z0-9_-]+)\.(?P<build_id>b[0-9]+-[0-9a-f]{6})\.")

Record = Callable[[str, Mapping[str, Any]], None]


@dataclass(frozen=True)
class ArtifactSet:
    model: str
    build_id: str
    paths: tuple[Path, ...]
    size: int
    #: The newest modification time of its files.
    mtime_ns: int

    @property
    def has_engine(self) -> bool:
        return any(path.name.endswith(".engine") for path in self.paths)


@dataclass(frozen=True)
class Inventory:
    #: Oldest first.
    sets: tuple[ArtifactSet, ...]
    #: Every file under the builds dir (shared timing caches too).
    total_bytes: int


def scan(build_dir: Path) -> Inventory:
    """What the builds dir holds now."""
    files: dict[tuple[str, str], list[tuple[Path, os.stat_result]]] = {}
    total = 0
    for root, _dirs, names in os.walk(build_dir):
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
        )
        for (model, build_id), entries in files.items()
    ]
    sets.sort(key=lambda s: (s.mtime_ns, s.build_id))
    return Inventory(tuple(sets), total)


class BuildsRetention:
    def __init__(self, build_dir: Path, max_count: int, max_bytes: int, record: Record) -> None:
        self.build_dir = build_dir
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._record = record
        self._lock = threading.Lock()
        #: Artifact sets removed over this run.
        self.removed = 0

    def prune(self, *, keep: Collection[str], serving: Collection[Path], trigger: str) -> Inventory:
        """Remove the oldest removable sets until within both caps; returns what is
        left.  ``keep``: build ids of running builds; ``serving``: engine files in use."""
        with self._lock:
            inventory = scan(self.build_dir)
            removable = self._removable(inventory, keep, serving)
            sets, total = list(inventory.sets), inventory.total_bytes
            for victim in removable:
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
                    bytes=freed,
                    reason=reason,
                    trigger=trigger,
                )
            return Inventory(tuple(sets), total)

    def over_caps(self, inventory: Inventory) -> str | None:
        """Why ``inventory`` (what pruning left) leaves no room for a build, or None."""
        count, total = len(inventory.sets), inventory.total_bytes
        if count <= self.max_count and total <= self.max_bytes:
            return None
        return (
            f"the builds dir {self.build_dir} holds {count} build(s) and {total} bytes "
            f"(builds.max_count {self.max_count}, builds.max_bytes {self.max_bytes}) and "
            "nothing more can be removed: each remaining build is its model's newest engine, "
            "running or serving"
        )

    def describe(self) -> dict[str, Any]:
        inventory = scan(self.build_dir)
        return {
            "directory": str(self.build_dir),
            "count": len(inventory.sets),
            "bytes": inventory.total_bytes,
            "max_count": self.max_count,
            "max_bytes": self.max_bytes,
            "removed": self.removed,
        }

    @staticmethod
    def _removable(
        inventory: Inventory, keep: Collection[str], serving: Collection[Path]
    ) -> list[ArtifactSet]:
        newest: dict[str, ArtifactSet] = {}
        for artifact in inventory.sets:  # oldest first: the last one wins
            if artifact.has_engine and artifact.build_id not in keep:
                newest[artifact.model] = artifact
        in_use = {Path(path) for path in serving}
        return [
            artifact
            for artifact in inventory.sets
            if artifact.build_id not in keep
            and newest.get(artifact.model) is not artifact
            and not in_use.intersection(artifact.paths)
        ]

    @staticmethod
    def _remove(artifact: ArtifactSet) -> int:
        freed = 0
        for path in artifact.paths:
            try:
                size = path.lstat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            freed += size
        return freed
