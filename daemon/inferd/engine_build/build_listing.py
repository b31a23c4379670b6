"""The files a build's summary and ``inferd selftest`` list: every regular file of an
engine dir (``inventory``), or one build's files there and in its ``quarantine/``,
bounded (``build_files``).  Symlinks are neither followed nor listed.  Re-exported by
``artifacts``, whose module this was part of."""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Any

from inferd.engines.quarantine import QUARANTINE_DIR


def inventory(directory: Path) -> list[dict[str, Any]]:
    """Every regular file under ``directory`` (relative path, size), sorted.  Symlinks
    are neither followed nor listed (``lstat``): the engine dir is the daemon's own."""
    files: list[dict[str, Any]] = []
    for path in sorted(directory.rglob("*")):
        try:
            info = path.lstat()
        except FileNotFoundError:  # removed meanwhile
            continue
        if stat.S_ISREG(info.st_mode):
            files.append({"path": str(path.relative_to(directory)), "bytes": info.st_size})
    return files


#: Files a build summary lists in ``artifacts.before`` and ``after``, each at most.
LISTED_MAX = 32


def build_files(
    directory: Path, names: Collection[str], skip: Collection[str] = ()
) -> tuple[list[dict[str, Any]], int]:
    """One build's files in ``directory`` and its ``quarantine/`` (relative path, size),
    sorted: those named after ``names`` (its engine's stem, its timing cache's name),
    temp files too, but for the names in ``skip`` (its own summary, being replaced); at
    most ``LISTED_MAX``, and how many more there were.  What a build summary lists:
    never the whole directory, which grows with every build."""
    found: list[dict[str, Any]] = []
    quarantined = directory / QUARANTINE_DIR
    # A symlink there is not the daemon's quarantine: nothing it points at is listed.
    for folder in (directory,) if quarantined.is_symlink() else (directory, quarantined):
        try:
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if not entry.name.lstrip(".").startswith(tuple(names)) or entry.name in skip:
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile
                continue
            if stat.S_ISREG(info.st_mode):
                path = str(Path(entry.path).relative_to(directory))
                found.append({"path": path, "bytes": info.st_size})
    found.sort(key=lambda item: item["path"])
    return found[:LISTED_MAX], max(0, len(found) - LISTED_MAX)
