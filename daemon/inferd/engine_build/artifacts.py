"""Build artifacts: staging, validation's verdict, the commit, leftovers
cleanup/quarantine, inventory.  The timing-cache policy per host tuple
(``TimingCacheOutcome``, ``TimingCacheManager``) is ``timing_cache_policy``'s,
re-exported here.

The engine is first staged: written (temp + fsync + rename, ``inferd.durable``)
with its ``.sha256`` sidecar under ``<dir>/staging/<pid>/`` with its final file
name (the gate's name rule holds while it is validated), where no locator looks.
Only an engine that passed validation (or was not validated: ``pending``) is
committed: renamed to its final path with its sidecar, the directory fsynced, in
the token's no-cancel zone; one that failed validation is quarantined.  So a
file at the final path with a matching sidecar is always a committed build's
(``locate_engine`` reuses it).  The staging process holds an ``flock`` on its
folder's ``.lock`` until its engine is committed, quarantined or cleaned up (its
exit releases it), so a staging folder is live exactly while that lock is held,
whatever process its pid number names now.  After a cancel, a failure or a dead
build process, ``clean_up`` removes that process's temp files (of its engine,
sidecar, summaries, calibration and timing caches) and staged files and all of
each dead process's staging folder (``sweep_staging``; the daemon sweeps too, at
start and each ``build.start``), and quarantines (moves to ``quarantine/`` with a
``.reason``) an engine at the final path without a matching sidecar.  A live
process's temp is another build's, left to it (``left``), and so is the final
path while a live process staging that engine holds its lock: mid-commit
(``commit_engine``) its engine is renamed before its sidecar.  ``<dir>/staging``
is the daemon's own directory like the engine dir: a symlink there, or one
another user owns or may write (or that lies in such a directory), is neither
staged in nor swept, so nothing outside it is created or removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from inferd.digest import file_version, sha256_and_stat
from inferd.durable import atomic_write_bytes, atomic_write_text, fsync_directory
from inferd.engine_build.build_listing import LISTED_MAX as LISTED_MAX
from inferd.engine_build.build_listing import build_files as build_files
from inferd.engine_build.build_listing import inventory as inventory
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.timing_cache_policy import TimingCacheManager as TimingCacheManager
from inferd.engine_build.timing_cache_policy import TimingCacheOutcome as TimingCacheOutcome
from inferd.engines.engine_dir import engine_dir_lock
from inferd.engines.quarantine import QUARANTINE_DIR as QUARANTINE_DIR
from inferd.engines.quarantine import quarantine
from inferd.engines.sidecar import (
    about_the_file,
    read_sidecar,
    sidecar_path,
    unchecked_engine,
    write_sidecar,
)
from inferd.engines.timing_cache import TIMING_CACHE_SUFFIX
from inferd.errors import UncheckedEngineError
from inferd.owned_files import ensure_owned_dir, open_nofollow, unsafe_owned_dir_reason

_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")
#: Engines being validated: ``<dir>/staging/<pid>/<engine name>`` and its sidecar.
STAGING_DIR = "staging"
#: In each staging folder: locked by the process staging there (see the module doc).
STAGING_LOCK = ".lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True  # PermissionError: alive, another user's


#: A file's SHA-256 and the ``fstat`` of the descriptor hashed (``sha256_and_stat``).
Hashed = tuple[str, os.stat_result]
#: The sidecar's digest, the engine as hashed, why they do not match (None: they do).
_Verdict = tuple[str | None, Hashed | None, str | None]


def still(hashed: Hashed | None, path: Path) -> TypeGuard[Hashed]:
    """Whether ``path`` still names the file hashed (a write changes its ctime)."""
    with contextlib.suppress(OSError):
        return hashed is not None and file_version(os.lstat(path)) == file_version(hashed[1])
    return False


@dataclass
class CleanupReport:
    status: str = "cleaned"  # cleaned | quarantined | failed
    removed: list[str] = field(default_factory=list)
    quarantined: list[dict[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    left: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)  # status, removed, quarantined, errors, left (copies)


def clean_up(
    engine_path: Path,
    *,
    own_pid: int | None = None,
    hashed: Hashed | None = None,
) -> CleanupReport:
    """Leave no partial or unvalidated file: remove the temp files of a build of
    ``engine_path`` (``_a_builds_file``) written by this process (``own_pid``: the build
    process, when a supervisor cleans after it) or a dead one, its staged files and
    dead processes' staging; quarantine an engine at the final path whose sidecar is
    missing or does not match; leave a live process's temp, and an engine it is
    committing (``left``, the module doc), and one that could not be read for a reason
    not about the file (``EMFILE``: ``left``, naming the errno; never a verdict).
    ``hashed``: the engine as the caller hashed it; by default, as this process
    committed it (``commit_engine``), so a completed build's is not read whole again."""
    own_pid = os.getpid() if own_pid is None else own_pid
    with _held_lock:
        committed = _committed.pop(engine_path, None)
    hashed = committed if hashed is None else hashed
    report = CleanupReport()
    directory = engine_path.parent
    if not directory.is_dir():
        return report
    for entry in sorted(directory.iterdir()):
        match = _TEMP.match(entry.name)
        if match is None or not _a_builds_file(match["name"], engine_path):
            continue
        pid = int(match["pid"])
        try:
            if pid == own_pid or not _pid_alive(pid):
                entry.unlink()
                report.removed.append(entry.name)
            else:
                why = f"temp file of live process {pid}: another build's, left to it"
                report.left.append({"path": entry.name, "reason": why})
        except OSError as exc:
            report.errors.append(f"{entry.name}: {exc}")
    _remove_staged(engine_path, report)
    if os.path.lexists(engine_path):
        try:
            sidecar, known, reason = _unmatched(engine_path, hashed)
            left = None if reason is None else _being_committed(engine_path, sidecar, known)
        except UncheckedEngineError as exc:  # no verdict: the engine may well be intact
            name = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
            left = f"could not be checked ({name}: {os.strerror(exc.errno)}): left in place"
        if left is not None:
            report.left.append({"path": engine_path.name, "reason": left})
            reason = None
        if reason is not None:
            try:
                moved = quarantine(engine_path, reason)
                report.quarantined.append({"path": str(moved), "reason": reason})
                with contextlib.suppress(FileNotFoundError):
                    sidecar_path(engine_path).unlink()
            except OSError as exc:
                report.errors.append(f"{engine_path.name}: {exc}")
    with contextlib.suppress(OSError):
        fsync_directory(directory)
    if report.errors:
        report.status = "failed"
    elif report.quarantined:
        report.status = "quarantined"
    return report


def _a_builds_file(name: str, engine_path: Path) -> bool:
    """Whether ``name`` is a file a build of ``engine_path`` writes: its engine, or one
    named after its stem (sidecar, summaries, calibration cache), or a timing cache."""
    stem = engine_path.name.removesuffix(".engine") + "."
    timing = name.startswith("timing_") and name.endswith(TIMING_CACHE_SUFFIX)
    return name == engine_path.name or name.startswith(stem) or timing


def _unmatched(engine_path: Path, hashed: Hashed | None) -> _Verdict:
    """Whether the engine at ``engine_path`` is a committed one (``_Verdict``);
    ``UncheckedEngineError`` when it or its sidecar could not be read for a reason that
    is not the file's (``sidecar.about_the_file``: the gate's rule, DESIGN.md 336)."""
    try:
        sidecar = read_sidecar(engine_path, raise_unchecked=True)
    except UncheckedEngineError:
        raise
    except Exception as exc:
        return None, None, f"engine without a valid sidecar: {exc}"
    try:  # not following a symlink: refused with the reason naming it
        known = hashed if still(hashed, engine_path) else sha256_and_stat(engine_path)
    except OSError as exc:
        if not about_the_file(exc):
            raise unchecked_engine(f"engine {engine_path}", "read", exc) from exc
        return sidecar, None, f"engine cannot be read: {exc}"
    if sidecar != known[0]:
        return sidecar, known, "engine does not match its sidecar digest (partial or foreign write)"
    return sidecar, known, None


def _being_committed(engine_path: Path, sidecar: str | None, known: Hashed | None) -> str | None:
    """Why the unmatched engine may be a live build's commit, or None.  Checked after the
    hash, then what was judged again: a commit that ended meanwhile changed the inode or
    the sidecar, and one that begins after the check must first stage its engine."""
    holder = _staging_holder(engine_path)
    if holder is not None:
        return f"process {holder} holds the staging lock of this engine (committing it?)"
    try:
        sidecar_now: str | None = read_sidecar(engine_path, raise_unchecked=True)
    except UncheckedEngineError:
        raise  # no second look: no verdict either
    except Exception:
        sidecar_now = None
    if sidecar_now != sidecar or (known is not None and not still(known, engine_path)):
        return "the engine or its sidecar changed while it was checked (a commit meanwhile?)"
    return None


def _staging_holder(engine_path: Path) -> int | None:
    """The pid of another process staging or committing ``engine_path`` now: its
    staging folder holds that engine or its sidecar (or a temp file of one) and its
    lock is held (``commit_engine`` gives it back after both renames), or None."""
    staging = engine_path.parent / STAGING_DIR
    names = {engine_path.name, sidecar_path(engine_path).name}
    if unsafe_owned_dir_reason(staging) is not None:
        return None  # missing, or not the daemon's own: nothing is staged there
    for folder in sorted(staging.iterdir()) if staging.is_dir() else []:
        try:
            digits = folder.name.isdigit() and not folder.is_symlink()  # a staging's
            entries = os.listdir(folder) if digits else []
        except OSError:  # removed meanwhile, or not a folder: no one stages there
            continue
        if names.isdisjoint(entries + [m["name"] for m in map(_TEMP.match, entries) if m]):
            continue
        try:  # after the sweep, a folder left is a live process's (or one made since)
            fd = _lock_staging(folder, wait=False)
        except OSError:
            return int(folder.name)  # a lock that cannot be checked: taken as held
        if fd is not None:
            os.close(fd)  # gives back a lock just taken: no one was staging there
        elif folder.is_dir():
            return int(folder.name)
    return None


def _remove_staged(engine_path: Path, report: CleanupReport) -> None:
    """Remove ``engine_path``'s staged engine, sidecar and their temp files of this
    process (never validated: nothing to keep), then every dead process's staging
    (``sweep_staging``).  Another engine this process stages meanwhile is its own."""
    folder = engine_path.parent / STAGING_DIR / str(os.getpid())
    with _held_lock:
        mine = folder in _held
    if mine:
        names = {engine_path.name, sidecar_path(engine_path).name}
        for entry in sorted(folder.iterdir()):
            match = _TEMP.match(entry.name)
            if entry.name not in names and (match is None or match["name"] not in names):
                continue
            try:
                entry.unlink()
                report.removed.append(str(entry.relative_to(engine_path.parent)))
            except OSError as exc:
                report.errors.append(f"{entry.name}: {exc}")
        _release_staging(folder / engine_path.name)
    removed, errors = sweep_staging(engine_path.parent)
    report.removed, report.errors = report.removed + removed, report.errors + errors


def sweep_staging(directory: Path) -> tuple[list[str], list[str]]:
    """Remove every file of each staging folder under ``directory`` whose lock no live
    process holds (a killed build's, whatever engine it staged; one without a lock),
    and the folder: (removed paths relative to ``directory``, errors).  The lock is
    held while removing, so a process starting to stage there waits and retries."""
    staging = directory / STAGING_DIR
    # Checked as the daemon's own before anything is listed: through a symlink here
    # (or in a directory another user could swap it in) the sweep would lock and
    # remove files in whatever digit-named folders the target holds.
    unsafe = unsafe_owned_dir_reason(staging)
    if unsafe == "does not exist":
        return [], []
    if unsafe is not None:
        return [], [f"{staging} {unsafe}: not swept (inferd removes files only in its own)"]
    try:
        folders = sorted(staging.iterdir())
    except FileNotFoundError:  # removed meanwhile
        return [], []
    removed: list[str] = []
    errors: list[str] = []
    for folder in folders:
        if not folder.name.isdigit() or folder.is_symlink():
            continue  # not a staging process's folder
        try:
            fd = _lock_staging(folder, wait=False)
        except OSError as exc:  # not a folder, or its .lock a symlink: left, reported
            errors.append(f"{folder.name}: {exc}")
            continue
        if fd is None:  # a live process's, or removed meanwhile
            continue
        try:
            for entry in sorted(os.scandir(folder), key=lambda item: item.name):
                try:
                    os.unlink(entry.path)
                except OSError as exc:
                    errors.append(f"{entry.name}: {exc}")
                    continue
                if entry.name != STAGING_LOCK:
                    removed.append(str(Path(entry.path).relative_to(directory)))
            with contextlib.suppress(OSError):
                folder.rmdir()
        finally:
            os.close(fd)
    with contextlib.suppress(OSError):  # not empty: a live build's
        staging.rmdir()
    return removed, errors


def _lock_staging(folder: Path, *, wait: bool) -> int | None:
    """A descriptor holding the lock of ``folder`` (its ``.lock`` created if missing),
    or None: the folder is gone, the lock file was removed while this waited (it
    guards nothing then), or (``wait`` False) another process holds it."""
    lock = folder / STAGING_LOCK
    try:
        fd = open_nofollow(lock, os.O_RDWR | os.O_CREAT)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        held, now = os.fstat(fd), os.lstat(lock)
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    if (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):
        os.close(fd)
        return None
    return fd


#: This process's staging folders: the descriptor holding each one's lock, and the
#: engines staged there (the lock goes with the last of them).
_held: dict[Path, tuple[int, set[str]]] = {}
_held_lock = threading.Lock()
#: The digest of each engine this process staged, then (``commit_engine``) each it
#: committed as ``Hashed``, its ``lstat`` taken under the engine dir's lock: what
#: ``clean_up`` trusts while the path still names that version (``still``).
_staged: dict[Path, str] = {}
_committed: dict[Path, Hashed] = {}


def _hold_staging(staged: Path) -> None:
    """Lock ``staged``'s folder for this process (once) before anything is staged in it."""
    folder = staged.parent
    with _held_lock:
        while folder not in _held:  # retried when a sweep removed a dead namesake's folder
            ensure_owned_dir(folder.parent, what="the engine staging directory")  # no symlink
            ensure_owned_dir(folder, what="the engine staging directory")
            fd = _lock_staging(folder, wait=True)
            if fd is not None:
                _held[folder] = (fd, set())
        _held[folder][1].add(staged.name)


def _release_staging(staged: Path) -> None:
    """``staged`` was committed, quarantined or removed: once nothing else is staged in
    its folder, remove the lock and the folder (and ``staging/`` when empty)."""
    folder = staged.parent
    with _held_lock:
        _staged.pop(staged, None)
        fd, names = _held.get(folder, (None, set()))
        names.discard(staged.name)
        if fd is None or names:  # not this process's folder, or still in use
            return
        del _held[folder]
        with contextlib.suppress(OSError):
            (folder / STAGING_LOCK).unlink()
        os.close(fd)
    with contextlib.suppress(OSError):
        folder.rmdir()
        folder.parent.rmdir()


def staged_path(engine_path: Path) -> Path:
    """Where this process stages ``engine_path`` until it passed validation."""
    return engine_path.parent / STAGING_DIR / str(os.getpid()) / engine_path.name


def stage_engine(engine_path: Path, data: bytes) -> tuple[str, Path]:
    """Write the built engine and its sidecar to its staged path (durable, atomic), its
    folder locked; returns (sha256, staged path).  Nothing at the final path changes."""
    staged = staged_path(engine_path)
    _hold_staging(staged)
    atomic_write_bytes(staged, data)
    digest = hashlib.sha256(data).hexdigest()
    write_sidecar(staged, digest)
    with _held_lock:
        _staged[staged] = digest
    return digest, staged


def quarantine_staged(staged: Path, engine_path: Path, reason: str) -> Path:
    """An engine that failed validation: never at its final path, kept for analysis
    in the engine dir's ``quarantine/`` (with its sidecar and a ``.reason``)."""
    moved = quarantine(staged, reason, directory=engine_path.parent)
    _release_staging(staged)
    return moved


def commit_engine(
    staged: Path,
    engine_path: Path,
    token: CancellationToken,
    *,
    during_write: Callable[[], None] | None = None,
) -> dict[str, Any] | None:
    """The last step of a build, in the no-cancel zone: the staged engine and its
    sidecar renamed to their final paths, the directory fsynced.  Returns the zone
    record, or None when a cancel came first (nothing committed: the caller's
    ``clean_up`` removes the staged files)."""
    with token.no_cancel_zone("final engine commit") as entered:
        if not entered:
            return None
        if during_write is not None:
            during_write()
        with engine_dir_lock(engine_path.parent):  # no location moves it aside in between
            os.replace(staged, engine_path)
            os.replace(sidecar_path(staged), sidecar_path(engine_path))
            with _held_lock, contextlib.suppress(OSError):  # no record: clean_up reads it
                digest = _staged.pop(staged, None)
                if digest is not None:  # its version now: a rename changes the ctime
                    _committed[engine_path] = (digest, os.lstat(engine_path))
        fsync_directory(engine_path.parent)
    _release_staging(staged)
    return token.zone_log[-1]


def write_json(path: Path, document: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(document, indent=2, sort_keys=True) + "\n")
