"""Every cleanup after a build leaves what another live build of the same engine
writes or commits (``clean_up``'s ``left``, as the start's conclusion of
DESIGN.md 234 does): the build's own cleanup (``session.run_build``, the daemon's
child and ``inferd build``), the daemon's after a build child exited
(``child_exit.clean_after``) and ``inferd build``'s on a second Ctrl-C.  Two builds
of one engine at once (an ``inferd build`` beside the daemon's ``build.start``) no
longer break each other: before, the first to finish quarantined the other's temp
file and, between its commit's two renames, its engine."""

from __future__ import annotations

import io
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import structlog

from inferd.cli import build as cli_build
from inferd.cli.build_progress import BuildProgress
from inferd.engine_build import session
from inferd.engine_build.artifacts import STAGING_DIR, STAGING_LOCK, CleanupReport
from inferd.engine_build.child_exit import clean_after
from inferd.engines.sidecar import read_sidecar, sidecar_path
from tests.unit.engine_build.test_commit_record import _killed_child
from tests.unit.engine_build.test_conclusion_leaves_live_builds import (
    _mid_commit,
    _quarantined,
    _ready,
)
from tests.unit.engine_build.test_conclusions import _build, _engine_dir

_THEIRS = b"the live build's engine"


def _meanwhile(engine: Path, process: subprocess.Popen[str]) -> tuple[Path, Path]:
    """``process`` writes a temp file of ``engine`` beside it and is between its
    commit's two renames (its engine at the final path, its sidecar still staged, its
    staging lock held).  Returns (its temp file, its staged sidecar)."""
    temp = engine.parent / f".{engine.name}.tmp-{process.pid}-0a0b0c0d"
    temp.write_bytes(b"another build's engine, being written")
    folder = engine.parent / STAGING_DIR / str(process.pid)
    _mid_commit(engine, folder, _THEIRS)
    _ready(process, folder / STAGING_LOCK)
    return temp, sidecar_path(folder / engine.name)


def _assert_left(engine: Path, temp: Path, staged_sidecar: Path, left: list[Any]) -> None:
    """Nothing of the live build moved, both listed in ``left``; its commit then ends
    with its engine and its sidecar at the final path."""
    assert _quarantined(engine.parent) == [], "a live build's file was quarantined"
    assert temp.read_bytes() == b"another build's engine, being written"
    assert engine.read_bytes() == _THEIRS and staged_sidecar.exists()
    assert sorted(item["path"] for item in left) == sorted([temp.name, engine.name])
    pid = staged_sidecar.parent.name
    reasons = {item["path"]: item["reason"] for item in left}
    assert f"process {pid} holds the staging lock" in reasons[engine.name]
    assert f"live process {pid}" in reasons[temp.name]
    staged_sidecar.replace(sidecar_path(engine))  # its second rename
    assert read_sidecar(engine) is not None and engine.read_bytes() == _THEIRS


def test_a_build_s_own_cleanup_leaves_a_live_build_of_the_same_engine(
    tmp_path: Path,
    demo_model: Path,
    live: subprocess.Popen[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This build committed; another live build of its engine renamed its engine over
    it before this build's cleanup ran (``run_build``: the daemon's child, ``inferd
    build``)."""
    engine_dir = _engine_dir(tmp_path)
    engine = engine_dir / "demo.engine"
    seen: dict[str, Path] = {}
    real = session.clean_up

    def other_commits_first(engine_path: Path, **kwargs: Any) -> CleanupReport:
        seen["temp"], seen["sidecar"] = _meanwhile(engine_path, live)
        return real(engine_path, **kwargs)

    monkeypatch.setattr(session, "clean_up", other_commits_first)

    _, _, report = _build(engine_dir, demo_model)

    assert report.summary["outcome"] == "completed"
    assert report.summary["cleanupStatus"] == "cleaned"
    _assert_left(engine, seen["temp"], seen["sidecar"], report.summary["cleanup"]["left"])


def test_the_daemon_s_cleanup_after_a_child_leaves_a_live_build_of_the_same_engine(
    tmp_path: Path, demo_model: Path, live: subprocess.Popen[str]
) -> None:
    """A daemon build's child was killed; an ``inferd build`` of the same engine is
    between its two renames as the daemon cleans after the child."""
    engine_dir = _engine_dir(tmp_path)
    engine, _, _ = _build(engine_dir, demo_model)
    temp, staged_sidecar = _meanwhile(engine, live)

    with structlog.testing.capture_logs() as logs:
        cleanup = clean_after(_killed_child(engine))

    assert cleanup["status"] == "cleaned"
    _assert_left(engine, temp, staged_sidecar, cleanup["left"])
    (line,) = [line for line in logs if line["event"] == "build_cleaned_after_child"]
    assert sorted(line["left"]) == sorted([temp.name, engine.name])


def test_inferd_build_s_forced_exit_leaves_a_live_build_of_the_same_engine(
    tmp_path: Path, demo_model: Path, live: subprocess.Popen[str]
) -> None:
    """A second Ctrl-C on an ``inferd build`` while the daemon's build of the same
    engine is between its two renames."""
    engine_dir = _engine_dir(tmp_path)
    engine, _, _ = _build(engine_dir, demo_model)
    temp, staged_sidecar = _meanwhile(engine, live)
    err = io.StringIO()
    exited: list[int] = []

    class Exited(BaseException):
        pass

    def no_exit(code: int) -> None:
        exited.append(code)
        raise Exited

    json_log = tmp_path / "build.jsonl"
    progress = BuildProgress(io.StringIO(), "t", json_log)
    handler = signal.getsignal(signal.SIGINT)  # _forced_exit ignores SIGINT from then on
    patch = pytest.MonkeyPatch()
    patch.setattr(cli_build.os, "_exit", no_exit)
    try:
        with pytest.raises(Exited):
            cli_build._forced_exit(engine, "b1", progress, err)
    finally:
        patch.undo()
        signal.signal(signal.SIGINT, handler)

    assert exited == [cli_build.EXIT_FORCED]
    assert "partial files cleaned" in err.getvalue() and "left to a live build" in err.getvalue()
    (event,) = [json.loads(line) for line in json_log.read_text().splitlines()]
    cleanup = event["detail"]["cleanup"]
    assert cleanup["status"] == "cleaned" and cleanup["quarantined"] == []
    _assert_left(engine, temp, staged_sidecar, cleanup["left"])
