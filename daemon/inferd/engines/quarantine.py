"""The one quarantine convention for engine-dir files whose state is unclear.

A file is moved to ``<dir>/quarantine/<name>.<timestamp>-<pid>`` with
``<same>.reason`` beside it (one line: why), never deleted: an operator can
inspect what was refused.  Its ``.sha256`` sidecar, if any, moves with it.
Used by engine location (an engine file that fails the gate's steps 1-4), by
build cleanup (a temp file or an engine whose write was interrupted, an engine
that failed validation) and by the timing-cache policy (an unreadable cache).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from inferd.durable import atomic_write_text, fsync_directory
from inferd.engines.sidecar import sidecar_path
from inferd.owned_files import ensure_owned_dir

QUARANTINE_DIR = "quarantine"


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
    return target
