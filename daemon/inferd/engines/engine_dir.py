"""Whether the engine dir can be trusted when engines are loaded from it.

Builds write the engine dir only after ``ensure_owned_dir`` accepted it; loading
only reads it, and used to trust whatever it held.  Anyone who may write it can
swap an engine, its sidecar *and* the daemon-written ``manifest.json`` that
vouches for it, so before anything there is trusted (an engine located there,
that manifest) the directory must be safely the daemon's own
(``inferd.owned_files.unsafe_owned_dir_reason``: a real directory owned by this
uid, writable by neither group nor others, in no directory another user could
swap it out of).  When it is not, nothing in it is trusted: the model behaves
as when no trusted engine exists (DESIGN.md entry 125).  When that could not be
checked (no descriptor left, an I/O error: ``UncheckedDirectoryError``), there is
no verdict: nothing in it is used this time, and the next look checks it again.

``engine_dir_lock``: a build's commit (its engine renamed to its path, then its
sidecar) and engine location's move of a refused engine to quarantine exclude each
other, across processes (the daemon, its build child, ``inferd build``): a location
never judges a fresh engine by the sidecar it replaces and moves it aside.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import structlog

from inferd.owned_files import checked_owned_dir_reason

log = structlog.get_logger("inferd.engines.engine_dir")


def untrusted_engine_dir(engine_dir: Path) -> str | None:
    """Why nothing in ``engine_dir`` may be trusted (a sentence naming the directory,
    the reason and the fix; also logged as ``engine_dir_untrusted``), or None when it
    is safely this process's own.  A missing directory holds nothing to trust: None.
    ``UncheckedDirectoryError`` (an ``UnsafeDirectoryError``, so refused wherever an
    untrusted dir is, but no verdict of untrust and no ``engine_dir_untrusted``) when
    it could not be checked for want of descriptors or memory, or an I/O error."""
    reason = checked_owned_dir_reason(engine_dir, what="the engine dir")
    if reason is None or reason == "does not exist":
        return None
    log.warning("engine_dir_untrusted", engine_dir=str(engine_dir), reason=reason)
    return (
        f"the engine dir {engine_dir} {reason}: inferd trusts no engine and no manifest.json "
        f"in a directory that is not safely its own user's (uid {os.geteuid()}, writable by "
        "neither group nor others); fix its owner and mode (chown, chmod go-w) or point "
        "runtime.engine_dir at another directory"
    )


@contextlib.contextmanager
def engine_dir_lock(engine_dir: Path) -> Iterator[None]:
    """Held around a commit's two renames and around a location's last look at a
    refused engine and its move (the module doc): an ``flock`` on the directory itself,
    as the manifest's writers take (``manifest._one_writer``), so no lock file lies
    beside the engines for anything that lists them to trip over.  A manifest write
    waits for it too, for milliseconds; none of the three takes another lock inside.
    An ``OSError`` when the directory cannot be opened (no descriptor left)."""
    fd = os.open(engine_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a process's exit gives it back
        yield
    finally:
        os.close(fd)
