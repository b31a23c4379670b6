"""The one quarantine convention for engine-dir files whose state is unclear.

A file is moved to ``<dir>/quarantine/<name>.<timestamp>-<pid>`` with
``<same>.reason`` beside it (one line: why): an operator can inspect what was
refused.  Its ``.sha256`` sidecar, if any, moves with it.  A quarantine keeps
the newest ``QUARANTINE_MAX_ITEMS`` files (each may be a whole engine, and builds
that fail validation add one each); older ones go, with their sidecar and reason,
logged (DESIGN.md entry 138).
Used by engine location (an engine file that fails the gate's steps 1-4), by
build cleanup (a temp file or an engine whose write was interrupted, an engine
that failed validation) and by the timing-cache policy (an unreadable cache).
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path

import structlog

from inferd.durable import atomic_write_text, fsync_directory
from inferd.engines.sidecar import sidecar_path
from inferd.owned_files import ensure_owned_dir

QUARANTINE_DIR = "quarantine"
#: Files a quarantine keeps (with their ``.sha256`` and ``.reason``), newest first.
QUARANTINE_MAX_ITEMS = 16
_COMPANIONS = (".sha256", ".reason")

log = structlog.get_logger("inferd.engines")


def quarantine(path: Path, reason: str, *, directory: Path | None = None) -> Path:
    """Move ``path`` (and its sidecar) into ``<directory>/quarantine/`` (default: its
    own directory's; a staged engine goes to its engine dir's); returns the new path."""
    target_dir = (path.parent if directory is None else directory) / QUARANTINE_DIR
    ensure_owned_dir(target_dir, what="the quarantine directory")
    target = target_dir / f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    os.replace(path, target)
    sidecar = sidecar_path(path)
    if sidecar.exists():
        os.replace(sidecar, sidecar_path(target))
    atomic_write_text(target.with_name(target.name + ".reason"), reason.rstrip() + "\n")
    fsync_directory(path.parent)
    _prune(target_dir, keep=target)
    return target


def _prune(directory: Path, keep: Path) -> None:
    """Remove the oldest files (by the ctime their move set) beyond
    ``QUARANTINE_MAX_ITEMS``, each with its companions; never ``keep``."""
    items: list[tuple[int, str]] = []
    for entry in os.scandir(directory):
        if entry.name.endswith(_COMPANIONS):
            continue
        with contextlib.suppress(FileNotFoundError):
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode):
                items.append((info.st_ctime_ns, entry.name))
    items.sort(reverse=True)
    removed = []
    for _, name in items[QUARANTINE_MAX_ITEMS:]:
        if name == keep.name:
            continue
        for suffix in ("", *_COMPANIONS):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / (name + suffix))
        removed.append(name)
    if removed:
        fsync_directory(directory)
        log.info("quarantine_pruned", directory=str(directory), removed=removed)
