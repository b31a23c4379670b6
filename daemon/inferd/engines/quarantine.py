"""The one quarantine convention for engine-dir files whose state is unclear.

A file is moved to ``<dir>/quarantine/<name>.<seq>.<timestamp>-<pid>-<random>``
with ``<same>.reason`` beside it (one line: why): an operator can inspect what was
refused.  Its ``.sha256`` sidecar, if any, moves with it.  ``seq`` (eight digits
or more) is 1 + the highest in that quarantine: it orders what was moved there,
where the timestamp (for people) and the files' ctime come from the wall clock,
which may read 1970 at boot or be set back.  The name is taken exclusively (a
hard link that fails if it exists), so a second quarantine of the same name in
the same second never replaces the first (a build's failed engine, then its
final path's mismatched one).  A quarantine keeps the newest files (the highest
``seq``; a name without one, moved by an older daemon, is older than every one
with, and those go by ctime) while there are at most ``QUARANTINE_MAX_ITEMS`` of
them totalling at most ``QUARANTINE_MAX_BYTES`` (each may be a whole engine, and
builds that fail validation add one each; the builds caps do not count this
directory); older ones go, with their sidecar and reason, logged (DESIGN.md
entry 138).
Used by engine location (an engine file that fails the gate's steps 1-4), by
build cleanup (a temp file or an engine whose write was interrupted, an engine
that failed validation) and by the timing-cache policy (an unreadable cache).

An engine that failed while serving was loaded minutes or days before: its path
may name another file by then (rebuilt or installed there since).
``quarantine_loaded`` moves the file that was loaded and nothing else: it opens
the path without following a symlink and compares the descriptor's device and
inode and its SHA-256 with those the gate recorded at load (``EngineFile``);
another file is left where it is (``NotTheLoadedEngineError``).  The descriptor
stays open until the move is done, so the inode cannot be freed and reused
meanwhile; the move is a ``rename`` onto a name reserved in the quarantine, and
what it moved is checked again: a file swapped in at the path between the last
check and the ``rename`` (a few microseconds) is put back, never lost
(DESIGN.md, "A failover quarantines the engine it loaded").  ``quarantine``
given ``judged`` (the identity of the file a caller judged, e.g. engine location
refusing it at the gate) moves that file alone in the same way: an engine a build
committed at the path since is left there with its sidecar.

Once the file itself is moved, the rest is best effort: the move stands and the
file is reported moved (the new path returned), whatever fails after it.  A ``.reason``
that cannot be written (a full disk) is logged (``quarantine_reason_not_written``);
the sidecar's move, the directory's fsync and the pruning failing (no descriptor left,
EIO) are logged in one ``quarantine_cleanup_failed`` line (the sidecar then stays at the
old path, beside no engine, and the quarantine is pruned at its next move).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from inferd.digest import sha256_handle
from inferd.durable import atomic_write_text, fsync_directory
from inferd.engines.sidecar import SIDECAR_MAX_BYTES, parse_sidecar, sidecar_path
from inferd.errors import EngineHashMismatchError
from inferd.owned_files import ensure_owned_dir, open_nofollow, open_regular_file
from inferd.types import EngineFile

QUARANTINE_DIR = "quarantine"
#: Files a quarantine keeps (with their ``.sha256`` and ``.reason``), newest first
#: (by the ``seq`` in their names).
QUARANTINE_MAX_ITEMS = 16
#: Bytes those files may total (the one just moved is kept whatever its size).
QUARANTINE_MAX_BYTES = 1024**3
_COMPANIONS = (".sha256", ".reason")
#: ``<name>.<seq>.<timestamp>-<pid>-<6 hex>``: the ``seq`` of a quarantined name.  Eleven
#: digits at most: a stray name with more reads as unsequenced (pruned first), never
#: as a ``seq`` whose successor makes every later name too long to create.
_SEQUENCED = re.compile(r"\.(?P<seq>[0-9]{8,11})\.[^./]*-[0-9]+-[0-9a-f]{6}$")
#: Held from reading the highest ``seq`` to taking the name: no two of this process's
#: quarantines take the same (another process's may; then ctime, then the name order).
_NAMING = threading.Lock()

log = structlog.get_logger("inferd.engines")


def quarantine(
    path: Path,
    reason: str,
    *,
    directory: Path | None = None,
    judged: os.stat_result | None = None,
) -> Path:
    """Move ``path`` (and its sidecar) into ``<directory>/quarantine/`` (default: its
    own directory's; a staged engine goes to its engine dir's); returns the new path.

    ``judged``: the ``stat`` of the file the caller judged (its entry, a symlink not
    followed; a descriptor the caller holds open, so that the inode cannot be reused
    meanwhile): only that file is moved, with the sidecar beside it as it is moved.
    Another file at ``path`` now (an engine committed there since the judgement) is
    left there with its sidecar: ``NotTheJudgedFileError``, nothing moved."""
    target_dir = (path.parent if directory is None else directory) / QUARANTINE_DIR
    ensure_owned_dir(target_dir, what="the quarantine directory")
    if judged is not None:
        target, move_sidecar = _move_judged(path, target_dir, judged)
        return _finish(path, target, reason, move_sidecar)
    target = _move_exclusively(path, target_dir)
    return _finish(path, target, reason, lambda: _move_sidecar_along(path, target))


class NotTheJudgedFileError(Exception):
    """The path names another file than the one judged: left where it is, with its
    sidecar (the message says what became of it)."""


class NotTheLoadedEngineError(Exception):
    """The file an engine's path names is not the engine that was loaded from it:
    left where it is (the message says how it differs)."""


def quarantine_loaded(path: Path, loaded: EngineFile, reason: str) -> Path:
    """Move the engine file that was loaded from ``path`` (and its sidecar, when it
    holds that engine's digest) into ``<its dir>/quarantine/`` as ``quarantine``
    does, and only that file; returns the new path.  ``NotTheLoadedEngineError``
    when ``path`` names another file now (nothing moved); ``OSError`` when it cannot
    be read or moved, ``UnsafeDirectoryError`` for a quarantine not safely ours."""
    try:
        handle, info = open_regular_file(path)  # a symlink is never followed here
    except FileNotFoundError:
        raise NotTheLoadedEngineError(
            f"nothing is at {path} now: removed or renamed since it was loaded"
        ) from None
    with handle:  # open until the move is checked: the inode cannot be reused meanwhile
        if (info.st_dev, info.st_ino) != (loaded.device, loaded.inode):
            raise NotTheLoadedEngineError(
                f"{path} is another file now (inode {info.st_ino}, the engine loaded was "
                f"inode {loaded.inode}): rebuilt or installed there since it was loaded"
            )
        digest = sha256_handle(handle)
        if digest != loaded.sha256:
            raise NotTheLoadedEngineError(
                f"{path} holds other bytes now (sha256 {digest}, the engine loaded had "
                f"{loaded.sha256}): rewritten in place since it was loaded"
            )
        target_dir = ensure_owned_dir(path.parent / QUARANTINE_DIR, what="the quarantine directory")
        target = _reserve_name(path, target_dir)
        not_moved = _move_if_same(path, target, info)
        if not_moved is not None:
            raise NotTheLoadedEngineError(
                f"{path} was replaced by another file while it was being moved: {not_moved}"
            )
    return _finish(path, target, reason, lambda: _move_sidecar(path, target, loaded.sha256))


def _finish(path: Path, target: Path, reason: str, move_sidecar: Callable[[], None]) -> Path:
    """What follows the move of ``path`` to ``target``, best effort (the module doc): its
    sidecar's move, the ``.reason``, the fsync of the directory it left, the pruning.
    An ``OSError`` there is logged (one line for all) and ``target`` still returned:
    raised, it made the callers report as not moved a file that is in the quarantine."""
    failed: dict[str, str] = {}
    steps: tuple[tuple[str, Callable[[], object]], ...] = (
        ("sidecar", move_sidecar),
        ("reason", lambda: _write_reason(path, target, reason)),  # logs its own failure
        ("fsync", lambda: fsync_directory(path.parent)),
        ("prune", lambda: _prune(target.parent, keep=target)),
    )
    for step, action in steps:
        try:
            action()
        except OSError as exc:
            failed[step] = str(exc)
    if failed:
        log.warning(
            "quarantine_cleanup_failed",
            path=str(path),
            moved_to=str(target),
            step=", ".join(failed),
            error="; ".join(f"{step}: {error}" for step, error in failed.items()),
        )
    return target


def _move_judged(
    path: Path, target_dir: Path, judged: os.stat_result
) -> tuple[Path, Callable[[], None]]:
    """``quarantine``'s move of the file ``judged`` describes: where it went, and the
    move of the sidecar that was beside it (run once the engine moved).  The sidecar is
    looked at before the engine is moved: a build's commit renames its engine before
    its sidecar, so a sidecar that is still the one seen then after the engine moved
    belongs to the engine moved, and one renamed in since (the sidecar of the engine
    committed in its place) stays."""
    sidecar = sidecar_path(path)
    try:
        beside: os.stat_result | None = os.lstat(sidecar)
    except FileNotFoundError:
        beside = None
    target = _reserve_name(path, target_dir)
    try:
        not_moved = _move_if_same(path, target, judged)
    except FileNotFoundError:
        not_moved = "nothing is there now"
    if not_moved is not None:
        raise NotTheJudgedFileError(f"{path} is not the file judged any more: {not_moved}")

    def move_sidecar() -> None:
        if beside is not None:
            with contextlib.suppress(FileNotFoundError):  # removed since: nothing to move
                _move_if_same(sidecar, sidecar_path(target), beside)

    return target, move_sidecar


def _move_sidecar_along(path: Path, moved: Path) -> None:
    """``path``'s sidecar, if any, moved beside ``moved`` (``quarantine`` not given
    the file judged: a build's own file, or a cleanup's)."""
    sidecar = sidecar_path(path)
    if sidecar.exists():
        os.replace(sidecar, sidecar_path(moved))


def _write_reason(path: Path, target: Path, reason: str) -> None:
    """``<target>.reason``, beside a file already moved: when it cannot be written
    (ENOSPC), the move still stands and is reported as done, the reason logged."""
    try:
        atomic_write_text(target.with_name(target.name + ".reason"), reason.rstrip() + "\n")
    except OSError as exc:
        log.warning(
            "quarantine_reason_not_written",
            path=str(path),
            moved_to=str(target),
            reason=reason,
            error=str(exc),
        )


def _sequence(name: str) -> int:
    """The ``seq`` of a quarantined file's name; 0 for one without (an older daemon's)."""
    match = _SEQUENCED.search(name)
    return int(match["seq"]) if match else 0


def _stem(path: Path, target_dir: Path) -> str:
    """``<name>.<seq>.<timestamp>-<pid>`` for ``path`` moved into ``target_dir`` now:
    ``seq`` is 1 + the highest there (called under ``_NAMING``)."""
    highest = max(map(_sequence, os.listdir(target_dir)), default=0)
    return f"{path.name}.{highest + 1:08d}.{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


def _reserve_name(path: Path, target_dir: Path) -> Path:
    """A new name in ``target_dir`` for ``path``, taken by an empty file made there
    exclusively: a ``rename`` onto it then replaces nothing but that placeholder."""
    with _NAMING:
        stem = _stem(path, target_dir)
        while True:
            target = target_dir / f"{stem}-{secrets.token_hex(3)}"
            try:
                os.close(open_nofollow(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            return target


def _move_if_same(source: Path, target: Path, info: os.stat_result) -> str | None:
    """Rename ``source`` onto ``target`` (a name no one else uses: a placeholder this
    process reserved, or that name's companion) if it still is the file ``info``
    describes (the ``fstat`` of a descriptor the caller holds open).  None when
    moved; else what became of the other file that ``source`` names: left there, or
    (swapped in between the last look and the ``rename``) moved back, never over a
    file that took its place meanwhile.  A placeholder left unused is removed."""
    same = (info.st_dev, info.st_ino)
    try:
        now = os.lstat(source)
        if (now.st_dev, now.st_ino) != same:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            return "that file was left there"
        os.rename(source, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(target)
        raise
    moved = os.lstat(target)
    if (moved.st_dev, moved.st_ino) == same:
        return None
    try:
        os.link(target, source, follow_symlinks=False)
    except FileExistsError:  # yet another file took its place: never replaced
        log.error("quarantine_moved_another_file", path=str(source), kept_at=str(target))
        return f"that file was moved to {target} and cannot go back (move it back by hand)"
    os.unlink(target)
    return "that file was moved back"


def _move_sidecar(engine: Path, moved: Path, sha256: str) -> None:
    """Move ``engine``'s sidecar beside ``moved`` when it holds ``sha256`` (the digest
    of the engine moved); one that holds another digest (the sidecar of an engine
    installed since), is malformed or is missing stays where it is."""
    source = sidecar_path(engine)
    try:
        handle, info = open_regular_file(source)
    except FileNotFoundError:
        return
    with handle:
        data = handle.read(SIDECAR_MAX_BYTES + 1)
        try:
            digest = parse_sidecar(data.decode("ascii"), engine_name=engine.name)
        except (UnicodeDecodeError, EngineHashMismatchError):
            return
        if digest == sha256:
            _move_if_same(source, sidecar_path(moved), info)


def _move_exclusively(path: Path, target_dir: Path) -> Path:
    """Move ``path`` into ``target_dir`` under a new name, never over an existing entry:
    linked there (``EEXIST`` when taken: another name is drawn), then unlinked here.
    A symlink is moved as itself, not followed."""
    with _NAMING:
        stem = _stem(path, target_dir)
        while True:
            target = target_dir / f"{stem}-{secrets.token_hex(3)}"
            try:
                os.link(path, target, follow_symlinks=False)
            except FileExistsError:
                continue
            break
    os.unlink(path)
    return target


def _prune(directory: Path, keep: Path) -> None:
    """Keep the newest files (the highest ``seq`` in their names; for names without
    one, older than all with, the ctime their move set) while there are at most
    ``QUARANTINE_MAX_ITEMS`` totalling at most ``QUARANTINE_MAX_BYTES``; remove the
    older ones, each with its companions.  ``keep`` (just moved) always stays and
    counts first.  Never by ctime first: the wall clock stamps it."""
    items: list[tuple[int, int, int, str]] = []
    for entry in os.scandir(directory):
        if entry.name.endswith(_COMPANIONS):
            continue
        with contextlib.suppress(FileNotFoundError):
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode):
                items.append((_sequence(entry.name), info.st_ctime_ns, info.st_size, entry.name))
    items.sort(reverse=True)
    kept = [(size, name) for _, _, size, name in items if name == keep.name]
    count, total = len(kept), sum(size for size, _ in kept)
    removed = []
    full = False
    for _, _, size, name in items:
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
