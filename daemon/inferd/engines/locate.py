"""Where a model's TensorRT engine is, or will be built: the first step of the
engine pipeline (locate -> compile -> validate -> record trust -> load).

An engine's file name encodes the model hash, host tuple and build-config hash
(``inferd.engines.naming``), so the engine for (model, host, config) has one
path per label.  The model hash is the model's digest (``inferd.digest``): its
file's SHA-256, or, for a model with external data files, one over the file and
each of them, so an engine is never reused for other weights beside the same
``.onnx``; a model naming a file outside its folder is refused
(``EngineBuildError`` from ``ExternalDataEscapeError``).  ``locate_engine``
reuses an intact engine for this host under any label (the gate's steps 1-4:
name, host tuple, sidecar, digest); the manifest (step 5) is the loader's
business, since rebuilding cannot make an engine trusted.  But a loader that
passes the manifest it will load with gets an engine that manifest trusts when
there is one: an intact engine awaiting approval (a ``build.start`` under the
ONNX stem) must not hide a trusted one under another label.  A file at the
target path that fails steps 1-4 is quarantined (``inferd.engines.quarantine``)
so a build can take its place: that file and no other.  Its entry is held open
(``O_PATH``) from before the judgement until the move, and only a file with its
identity is moved; one that took the path meanwhile (an engine a build of the
daemon's own committed there) is left and judged in turn.  A build's commit renames
its engine, then its sidecar, under ``engine_dir_lock``; the move takes that lock and
looks at the sidecar again first: one renamed in since the judgement (the file judged
was a fresh engine, judged by the sidecar it replaces) has it judged again, not moved.

Nothing is trusted, and nothing moved, in an engine dir that is not safely the
daemon's own (``inferd.engines.engine_dir``): the plan is then ``to_build`` with
``untrusted`` saying why, as when no intact engine exists; one that could not be
checked (no descriptor left, an I/O error) raises ``UncheckedDirectoryError``: no
verdict, so no plan (a build would rebuild an engine that may be there).  Engines there are
examined without following a symlink (the gate's default): a symlink at the
target path is refused, naming it, and quarantined.  An engine or sidecar the gate could
not read for a reason not about the file (``EMFILE``, ``ENOMEM``), or an engine
dir that could not be listed so when the target path holds no intact engine, raises
``UncheckedEngineError`` in the same way: no verdict, nothing moved aside, no plan.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import structlog

from inferd.digest import FileVersion, file_version, sha256_remembered
from inferd.engines.engine_dir import engine_dir_lock, untrusted_engine_dir
from inferd.engines.gate import STEP_MANIFEST_DIGEST, explain
from inferd.engines.manifest import Manifest
from inferd.engines.naming import EngineName, engine_name_for
from inferd.engines.quarantine import NotTheJudgedFileError, quarantine
from inferd.engines.sidecar import sidecar_path, unchecked_engine
from inferd.errors import EngineBuildError, EngineHashMismatchError, UncheckedEngineError
from inferd.owned_files import ABOUT_THE_DIRECTORY
from inferd.types import BuildConfig, EngineCacheEntry, HostTuple

#: The runtime label of entries for TensorRT engine files.
TENSORRT_LABEL = "tensorrt"
#: Judgements of the target path per location: each after the file judged before was
#: replaced before it could be moved (a build committing there); then it is left.
_JUDGEMENTS = 3

log = structlog.get_logger("inferd.engines.locate")


#: What a model path is when it is not a regular file (``stat.S_IFMT``).
_NOT_A_FILE = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def examined(path: Path, *, follow: bool = True) -> os.stat_result | str:
    """``path``'s ``stat`` (``lstat`` unless ``follow``), or why there is none in the
    words the daemon and ``check-config`` say it: "does not exist" (``ENOENT``,
    ``ENOTDIR``) or "cannot be examined (<strerror>)" (``EACCES``, ``ENAMETOOLONG``...)."""
    try:
        return os.stat(path) if follow else os.lstat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return "does not exist"
        return f"cannot be examined ({exc.strerror})"


def model_file_problem(path: Path) -> str | None:
    """Why the operator's model at ``path`` cannot be read as a model file ("does not
    exist", "is a FIFO, not a regular file", ...), or None when it is a regular file
    (a symlink followed).  A ``stat``: never opens it, so a FIFO there is named, not
    waited on.  The digest's read checks its descriptor again (``open_own_file``)."""
    info = examined(path)
    if isinstance(info, str):
        return info
    if stat.S_ISREG(info.st_mode):
        return None
    kind = _NOT_A_FILE.get(stat.S_IFMT(info.st_mode))
    return "is not a regular file" if kind is None else f"is {kind}, not a regular file"


@dataclass(frozen=True)
class EnginePlan:
    """``reused``: ``entry.artifact_path`` is an intact engine for this host;
    ``to_build``: the path a build must write (``quarantined``: what was moved
    out of the way first; ``untrusted``: why nothing in the engine dir was
    trusted, when it is not safely the daemon's own)."""

    entry: EngineCacheEntry
    engine_name: EngineName
    status: Literal["reused", "to_build"]
    host: HostTuple
    quarantined: Path | None = None
    untrusted: str | None = None


def locate_engine(
    model_path: Path,
    build_config: BuildConfig,
    *,
    engine_dir: Path,
    host: HostTuple,
    label: str | None = None,
    force: bool = False,
    manifest: Callable[[], Manifest] | None = None,
) -> EnginePlan:
    """The plan for ``model_path``'s engine (``force``: always ``to_build``).  With
    ``manifest`` (the loader's, read once the engine dir is found safe), an intact
    engine it trusts is reused before others.  ``UncheckedDirectoryError`` (an
    ``UncheckedEngineError`` too) when the engine dir or an engine's files could not
    be checked: nothing is moved aside and no plan made."""
    problem = model_file_problem(model_path)
    if problem is not None:
        raise EngineBuildError(f"model file {model_path} {problem}")
    try:
        model_sha256 = sha256_remembered(model_path)  # an operator's, external data too
    except OSError as exc:
        raise EngineBuildError(f"cannot read model {model_path}: {exc}") from exc
    name = engine_name_for(
        label=label or model_path.stem,
        model_sha256=model_sha256,
        host=host,
        build_config=build_config,
    )
    path = engine_dir / name.format()
    entry = EngineCacheEntry(
        runtime_label=TENSORRT_LABEL,
        artifact_path=path,
        model_path=model_path,
        model_sha256=model_sha256,
        build_config=build_config,
    )
    quarantined: Path | None = None
    untrusted = untrusted_engine_dir(engine_dir)
    if untrusted is not None:
        return EnginePlan(entry, name, "to_build", host, untrusted=untrusted)
    if not force:
        trusted = manifest() if manifest is not None else Manifest.empty()
        for _ in range(_JUDGEMENTS):
            with _held(path) as judged:
                seen = _sidecar_version(path)  # before the judgement reads it
                found, refusal = _find_intact(path, host, model_sha256, build_config, trusted)
                if found is not None:
                    log.info("engine_reused", engine=str(found), model=str(model_path))
                    return EnginePlan(replace(entry, artifact_path=found), name, "reused", host)
                if refusal is None:
                    break
                quarantined = _move_aside(path, refusal, judged, seen)
            if quarantined is not None:
                break
    return EnginePlan(entry, name, "to_build", host, quarantined)


@contextlib.contextmanager
def _held(path: Path) -> Iterator[os.stat_result | None]:
    """The identity of the entry at ``path`` (a symlink itself), held open (``O_PATH``:
    nothing read, a FIFO not waited on) until the block ends, so that its inode cannot
    be freed and reused by another file meanwhile; None when nothing is there (then
    nothing judged there is moved).  ``EngineBuildError`` when it cannot be opened."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    except OSError as exc:  # no descriptor left (EMFILE): no judgement to stand by
        raise EngineBuildError(f"engine {path.name} cannot be looked at: {exc}") from exc
    if fd is None:
        yield None
        return
    try:
        yield os.fstat(fd)
    finally:
        os.close(fd)


def _sidecar_version(path: Path) -> FileVersion | None:
    """The version of ``path``'s sidecar (None: none there); ``EngineBuildError`` when
    it cannot be looked at."""
    try:
        return file_version(os.lstat(sidecar_path(path)))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EngineBuildError(f"sidecar of engine {path.name} cannot be looked at: {exc}") from exc


def _still_there(path: Path, judged: os.stat_result) -> bool:
    """Whether ``path`` names the file ``judged`` (else ``quarantine`` says what it is)."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (judged.st_dev, judged.st_ino)


def _find_intact(
    path: Path, host: HostTuple, model_sha256: str, build_config: BuildConfig, manifest: Manifest
) -> tuple[Path | None, str | None]:
    """An intact engine for this model/host/config (any label; one ``manifest`` trusts
    first), and why the file at ``path`` itself was unusable (None if it was usable or
    absent).  Only engines the manifest lists are looked at before the first intact one
    is taken, so no more engines are hashed than before when it lists none.  A file the
    gate could not read (``EMFILE``) raises ``UncheckedEngineError``: no verdict; so does
    a directory that could not be listed, unless the engine at ``path`` is intact."""
    names, unlisted = _names_beside(path)
    rest = "_" + path.name.split("_", 1)[1]  # the same model, host and config
    candidates = [path] if path.name in names else []
    others = (name for name in names if name.endswith(rest) and name != path.name)
    candidates += sorted(path.parent / name for name in others)
    listed = [candidate for candidate in candidates if _listed(manifest, candidate)]
    refusal: str | None = None
    intact: Path | None = None
    for candidate in listed + [other for other in candidates if other not in listed]:
        if intact is not None and candidate not in listed:
            break  # nothing unlisted is trusted: the first intact one it is
        verdicts = explain(
            candidate,
            host=host,
            manifest=manifest,
            model_sha256=model_sha256,
            build_config=build_config,
            raise_unchecked=True,  # a passing EMFILE is no refusal: nothing moved
        )
        failed = [v for v in verdicts if v.step != STEP_MANIFEST_DIGEST and not v.passed]
        if not failed and all(v.passed for v in verdicts):
            return candidate, None  # trusted too
        if not failed:
            intact = intact or candidate
        elif candidate == path:
            refusal = f"step {failed[0].number} ({failed[0].step}): {failed[0].message}"
    if intact is None and unlisted is not None:
        raise unlisted  # an intact engine under another label may be there: no plan
    return intact, None if intact is not None else refusal


def _names_beside(path: Path) -> tuple[set[str], UncheckedEngineError | None]:
    """The names in ``path``'s directory; when it cannot be listed, ``path``'s alone if
    it is there, as before, and, when that was not about the directory (``EMFILE``),
    the ``UncheckedEngineError`` to raise if ``path`` holds no intact engine: one under
    another label may be there, and a build would then be asked for nothing."""
    try:
        return set(os.listdir(path.parent)), None
    except OSError as exc:
        unlisted = None
        if exc.errno not in ABOUT_THE_DIRECTORY:  # a directory's rule: its EIO is no verdict
            what = f"the engines in {path.parent}"
            unlisted = unchecked_engine(what, "listed", exc, fault="the directory")
            unlisted.__cause__ = exc
    return {path.name} if os.path.lexists(path) else set(), unlisted


def _listed(manifest: Manifest, engine: Path) -> bool:
    try:
        return manifest.get(engine) is not None
    except EngineHashMismatchError:  # listed twice, differently: the gate refuses it
        return True


def _move_aside(
    path: Path, reason: str, judged: os.stat_result | None, seen: FileVersion | None
) -> Path | None:
    """The refused file at ``path`` moved to quarantine, if it still is the one
    ``judged`` and its sidecar the one ``seen`` before the judgement; None when another
    file took its place, or another sidecar (a build's commit: judged again)."""
    try:
        if judged is None:  # nothing was held before the judgement: one came since
            raise NotTheJudgedFileError(f"{path} was not there before it was judged")
        with engine_dir_lock(path.parent):  # no commit between its two renames now
            if _still_there(path, judged) and _sidecar_version(path) != seen:
                raise NotTheJudgedFileError(
                    f"the sidecar of {path} changed since the file was judged "
                    "(a build committed an engine there?)"
                )
            target = quarantine(path, f"engine refused by the gate: {reason}", judged=judged)
    except NotTheJudgedFileError as exc:
        log.info("engine_replaced_while_judged", engine=str(path), reason=reason, detail=str(exc))
        return None
    except OSError as exc:
        raise EngineBuildError(
            f"engine {path.name} is unusable ({reason}) and cannot be moved aside: {exc}"
        ) from exc
    log.warning("engine_quarantined", engine=str(path), moved_to=str(target), reason=reason)
    return target
