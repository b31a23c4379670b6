"""The one quarantine convention for engine-dir files whose state is unclear.

A file is moved to ``<dir>/quarantine/<name>.<timestamp>-<pid>-<random>`` with
``<same>.reason`` beside it (one line: why): an operator can inspect what was
refused.  Its ``.sha256`` sidecar, if any, moves with it.  The name is taken
exclusively (a hard link that fails if it exists), so a second quarantine of the
same name in the same second never replaces the first (a build's failed engine,
then its final path's mismatched one).  A quarantine keeps the newest files while
there are at most ``QUARANTINE_MAX_ITEMS`` of them totalling at most
``QUARANTINE_MAX_BYTES`` (each may be a whole engine, and builds that fail
validation add one each; the builds caps do not count this directory); older
ones go, with their sidecar and reason, logged (DESIGN.md entry 138).
Used by engine location (an engine file that fails the gate's steps 1-4), by
build cleanup (a temp file or an engine whose write was interrupted, an engine
that failed validation) and by the timing-cache policy (an unreadable cache).
"""

from __future__ import annotations

import contextlib
import os
import secrets
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
#: Bytes those files may total (the one just moved is kept whatever its size).
QUARANTINE_MAX_BYTES = 1024**3
_COMPANIONS = (".sha256", ".reason")

log = structlog.get_logger("inferd.engines")


def quarantine(path: Path, reason: str, *, directory: Path | None = None) -> Path:
    """Move ``path`` (and its sidecar) into ``<directory>/quarantine/`` (default: its
    own directory's; a staged engine goes to its engine dir's); returns the new path."""
    target_dir = (path.parent if directory is None else directory) / QUARANTINE_DIR
    ensure_owned_dir(target_dir, what="the quarantine directory")
    target = _move_exclusively(path, target_dir)
    sidecar = sidecar_path(path)
    if sidecar.exists():
        os.replace(sidecar, sidecar_path(target))
    atomic_write_text(target.with_name(target.name + ".reason"), reason.rstrip() + "\n")
    fsync_directory(path.parent)
    _prune(target_dir, keep=target)
    return target


def _move_exclusively(path: Path, target_dir: Path) -> Path:
    """Move ``path`` into ``target_dir`` under a new name, never over an existing entry:
    linked there (``EEXIST`` when taken: another name is drawn), then unlinked here.
    A symlink is moved as itself, not followed."""
    stamp = f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    while True:
        target = target_dir / f"{stamp}-{secrets.token_hex(3)}"
        try:
            os.link(path, target, follow_symlinks=False)
        except FileExistsError:
            continue
        os.unlink(path)
        return target


def _prune(directory: Path, keep: Path) -> None:
    """Keep the newest files (by the ctime their move set) while there are at most
    ``QUARANTINE_MAX_ITEMS`` totalling at most ``QUARANTINE_MAX_BYTES``; remove the
    older ones, each with its companions.  ``keep`` (just moved) always stays and
    counts first."""
    items: list[tuple[int, int, str]] = []
    for entry in os.scandir(directory):
        if entry.name.endswith(_COMPANIONS):
            continue
        with contextlib.suppress(FileNotFoundError):
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode):
                items.append((info.st_ctime_ns, info.st_size, entry.name))
    items.sort(reverse=True)
    kept = [(size, name) for _, size, name in items if name == keep.name]
    count, total = len(kept), sum(size for size, _ in kept)
    removed = []
    full = False
    for _, size, name in items:
        if name == keep.name:
            continue
        full = full or count >= QUARANTINE_MAX_ITEMS or total + size > QUARANTINE_MAX_BYTES
        if not full:  # newest first: once one does not fit, every older one goes too
            count, total = count + 1, total + size
            continue
        for suffix in ("", *_COMPANIONS):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / (name + suffix))
        removed.append(name)
    if removed:
        fsync_directory(directory)
        log.info("quarantine_pruned", directory=str(directory), removed=removed, kept_bytes=total)
