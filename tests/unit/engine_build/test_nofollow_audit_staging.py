"""``<dir>/staging`` is handled as the daemon's own directory, never through a symlink
(the audit of DESIGN.md entries 54 and 125): the sweep the daemon runs at its start,
at each ``build.start``, after each build and in every ``clean_up`` (build child,
``inferd build``) used to follow a ``staging`` symlink, lock (create ``.lock``) and
remove every file of each digit-named folder of its target, and to sweep an engine
dir that others may write; staging created its folder through such a link; a build
summary listed a symlinked ``quarantine/``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog

from inferd.config import BuildsConfig
from inferd.engine_build.admission import BuildAdmission
from inferd.engine_build.artifacts import (
    STAGING_DIR,
    STAGING_LOCK,
    build_files,
    clean_up,
    stage_engine,
    sweep_staging,
)
from inferd.engines.quarantine import QUARANTINE_DIR
from inferd.errors import UnsafeDirectoryError

SYMLINK = "is a symbolic link"


@pytest.fixture
def engine_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "engines"
    directory.mkdir(mode=0o750)
    return directory


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory that is not the engine dir's, holding a digit-named folder with a
    file, as ``/run/user`` holds one per uid: what a sweep through a link would take."""
    directory = tmp_path / "outside"
    (directory / "4242").mkdir(parents=True)
    (directory / "4242" / "keep.txt").write_bytes(b"not the daemon's")
    return directory


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in (outside / "4242").iterdir()) == ["keep.txt"]
    assert (outside / "4242" / "keep.txt").read_bytes() == b"not the daemon's"
    assert not (outside / "4242" / STAGING_LOCK).exists()
    assert sorted(p.name for p in outside.iterdir()) == ["4242"]


def test_a_symlinked_staging_dir_is_not_swept_and_the_error_names_it(
    engine_dir: Path, outside: Path
) -> None:
    (engine_dir / STAGING_DIR).symlink_to(outside)
    removed, errors = sweep_staging(engine_dir)
    assert removed == []
    (error,) = errors
    assert str(engine_dir / STAGING_DIR) in error and SYMLINK in error
    _untouched(outside)
    assert (engine_dir / STAGING_DIR).is_symlink()


def test_clean_up_fails_naming_a_symlinked_staging_and_removes_nothing_through_it(
    engine_dir: Path, outside: Path
) -> None:
    """The build child's and ``inferd build``'s cleanup sweep too."""
    (engine_dir / STAGING_DIR).symlink_to(outside)
    report = clean_up(engine_dir / "m.engine")
    assert report.status == "failed"
    assert any(SYMLINK in error for error in report.errors), report.errors
    _untouched(outside)


def test_the_daemon_s_sweep_at_start_does_not_follow_it_and_logs_why(
    tmp_path: Path, engine_dir: Path, outside: Path
) -> None:
    """``BuildAdmission.prune`` runs at the daemon's start and after each build, over the
    engine dir and each model's builds folder."""
    build_dir = tmp_path / "builds"
    (build_dir / "demo").mkdir(parents=True)
    (engine_dir / STAGING_DIR).symlink_to(outside)
    (build_dir / "demo" / STAGING_DIR).symlink_to(outside)
    admission = BuildAdmission(build_dir, BuildsConfig(), lambda _kind, _payload: None, list)
    admission.cover_engine_dir(engine_dir, None, {})
    with structlog.testing.capture_logs() as logs:
        admission.prune([], "daemon_start")
    _untouched(outside)
    swept = [entry for entry in logs if entry["event"] == "build_staging_swept"]
    assert sorted(entry["directory"] for entry in swept) == sorted(
        [str(engine_dir), str(build_dir / "demo")]
    )
    assert all(entry["removed"] == [] and SYMLINK in entry["errors"][0] for entry in swept)


def test_an_engine_dir_others_may_write_is_not_swept(tmp_path: Path) -> None:
    """Nothing in such a dir is trusted at load (entry 125); its owner could swap
    ``staging`` for a link between a check and a removal, so nothing there is removed."""
    engine_dir = tmp_path / "shared"
    dead = engine_dir / STAGING_DIR / "4242"
    dead.mkdir(parents=True)
    (dead / "left.engine").write_bytes(b"x")
    engine_dir.chmod(0o777)
    removed, errors = sweep_staging(engine_dir)
    assert removed == [] and (dead / "left.engine").exists()
    (error,) = errors
    assert "others may write" in error and str(engine_dir) in error
    engine_dir.chmod(0o750)
    assert sweep_staging(engine_dir)[0] == [f"{STAGING_DIR}/4242/left.engine"]


def test_staging_refuses_a_symlinked_staging_dir_before_creating_anything_there(
    engine_dir: Path, outside: Path
) -> None:
    (engine_dir / STAGING_DIR).symlink_to(outside)
    with pytest.raises(UnsafeDirectoryError, match=SYMLINK):
        stage_engine(engine_dir / "m.engine", b"built")
    _untouched(outside)
    assert not (outside / str(os.getpid())).exists()


def test_a_build_summary_does_not_list_a_symlinked_quarantine(
    engine_dir: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "m.engine.20260101T000000-1-abcdef").write_bytes(b"someone else's")
    (engine_dir / QUARANTINE_DIR).symlink_to(elsewhere)
    (engine_dir / "m.engine").write_bytes(b"engine")
    listed, omitted = build_files(engine_dir, ("m.",))
    assert listed == [{"path": "m.engine", "bytes": 6}] and omitted == 0
