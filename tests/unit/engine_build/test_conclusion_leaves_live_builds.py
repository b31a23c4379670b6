"""The start's conclusion of a dead daemon's build (``commit_records._conclude``)
cleans only what dead processes left: another live process's temp file of the same
engine, and the engine at the final path while a live process commits it (its
staging lock held), are left where they are.  And the engine it trusts is hashed
once (the leftovers of DESIGN.md 219 and 223)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

import inferd.digest
from inferd.engine_build import artifacts, commit_records, pipeline
from inferd.engine_build.artifacts import QUARANTINE_DIR, STAGING_DIR, STAGING_LOCK
from inferd.engines.sidecar import read_sidecar, sidecar_path, write_sidecar
from tests.unit.engine_build.test_conclusions import (
    _build,
    _conclude,
    _dead_writer,
    _engine_dir,
    _left,
    _manifest,
)


def _ready(process: subprocess.Popen[str], lock: Path | None) -> None:
    """``process`` holds ``lock`` (or none) once it says so."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(f"{lock if lock is not None else '-'}\n")
    process.stdin.flush()
    assert process.stdout.readline() == "ready\n"


def _quarantined(engine_dir: Path) -> list[str]:
    folder = engine_dir / QUARANTINE_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_live_process_temp_file_of_the_engine_is_left_at_start(
    tmp_path: Path, demo_model: Path, live: subprocess.Popen[str]
) -> None:
    """An ``inferd build`` or another daemon writing the same engine now: its temp file
    is not the dead build's.  Moved to quarantine, that build's rename fails."""
    _ready(live, None)
    engine_dir = _engine_dir(tmp_path)
    engine, record, report = _build(engine_dir, demo_model)
    _left(report.summary_path, record, _dead_writer())  # killed after its commit
    theirs = engine_dir / f".{engine.name}.tmp-{live.pid}-0a0b0c0d"
    theirs.write_bytes(b"another build's engine, being written")
    dead = engine_dir / f".{engine.name}.tmp-{_dead_writer()['pid']}-0a0b0c0e"
    dead.write_bytes(b"a dead build's partial engine")

    (concluded,) = _conclude(engine_dir)

    assert concluded["decision"] == "trusted"
    assert theirs.read_bytes() == b"another build's engine, being written"
    assert _quarantined(engine_dir) == []
    assert not dead.exists(), "a dead process's temp file is still removed"
    assert [item["path"] for item in concluded["cleanup_left"]] == [theirs.name]
    assert str(live.pid) in concluded["cleanup_left"][0]["reason"]
    cleanup = json.loads(report.summary_path.read_text())["cleanup"]
    assert cleanup["left"] == concluded["cleanup_left"] and dead.name in cleanup["removed"]


def _mid_commit(engine: Path, folder: Path, data: bytes) -> None:
    """A live build between its commit's two renames (``commit_engine``): its engine at
    the final path, its sidecar still in its staging folder, the old one at the path."""
    folder.mkdir(parents=True)
    staged = folder / engine.name
    staged.write_bytes(data)
    write_sidecar(staged)
    staged.replace(engine)


def test_an_engine_a_live_process_is_committing_is_left_at_start(
    tmp_path: Path, demo_model: Path, live: subprocess.Popen[str]
) -> None:
    """The dead daemon's build committed; a live build of the same engine, holding its
    staging lock, has renamed its engine over it but not yet its sidecar.  The old
    sidecar does not match: quarantined there, the live build's commit ends with a
    sidecar and no engine."""
    engine_dir = _engine_dir(tmp_path)
    engine, record, report = _build(engine_dir, demo_model)
    _left(report.summary_path, record, _dead_writer())
    folder = engine_dir / STAGING_DIR / str(live.pid)
    _mid_commit(engine, folder, b"the live build's engine")
    _ready(live, folder / STAGING_LOCK)

    (concluded,) = _conclude(engine_dir)

    assert concluded["decision"] == "not_committed"  # its engine is not at the path now
    assert engine.read_bytes() == b"the live build's engine", "the live build's engine moved"
    assert _quarantined(engine_dir) == []
    assert sidecar_path(folder / engine.name).exists(), "its staging swept"
    assert [item["path"] for item in concluded["cleanup_left"]] == [engine.name]
    assert f"process {live.pid} holds the staging lock" in concluded["cleanup_left"][0]["reason"]
    sidecar_path(folder / engine.name).replace(sidecar_path(engine))  # its commit ends
    digest = hashlib.sha256(b"the live build's engine").hexdigest()
    assert read_sidecar(engine) == digest


def test_an_unmatched_engine_is_still_quarantined_when_no_live_build_commits_it(
    tmp_path: Path, demo_model: Path, live: subprocess.Popen[str]
) -> None:
    """A live process staging another engine in the same dir does not protect this one:
    the dead build's half commit (its engine renamed, not its sidecar) is quarantined."""
    engine_dir = _engine_dir(tmp_path)
    engine, record, report = _build(engine_dir, demo_model)
    _left(report.summary_path, record, _dead_writer())
    engine.write_bytes(b"the dead build's half commit")
    other = engine_dir / STAGING_DIR / str(live.pid)
    other.mkdir(parents=True)
    (other / "another.engine").write_bytes(b"staged")
    _ready(live, other / STAGING_LOCK)

    (concluded,) = _conclude(engine_dir)

    assert concluded["cleanup_status"] == "quarantined" and concluded["cleanup_left"] == []
    assert not engine.exists()
    assert [name for name in _quarantined(engine_dir) if name.endswith(".reason")] != []
    assert (other / "another.engine").exists()


def test_a_commit_that_ends_while_the_engine_is_checked_is_not_quarantined(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live build's commit that ends between the hash and the lock's check (its lock
    given back, its engine and sidecar both renamed): judged again, it is left."""
    engine_dir = _engine_dir(tmp_path)
    engine, record, report = _build(engine_dir, demo_model)
    _left(report.summary_path, record, _dead_writer())
    engine.write_bytes(b"a half commit")
    holder = artifacts._staging_holder

    def commit_meanwhile(engine_path: Path) -> int | None:
        staged = engine_dir / "elsewhere.engine"
        staged.write_bytes(b"a live build's engine")
        write_sidecar(staged)
        staged.replace(engine_path)
        sidecar_path(staged).replace(sidecar_path(engine_path))
        return holder(engine_path)

    monkeypatch.setattr(artifacts, "_staging_holder", commit_meanwhile)

    (concluded,) = _conclude(engine_dir)

    assert engine.read_bytes() == b"a live build's engine" and _quarantined(engine_dir) == []
    assert "changed while it was checked" in concluded["cleanup_left"][0]["reason"]


def test_an_engine_concluded_and_trusted_at_start_is_hashed_once(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit check, the cleanup's sidecar check and the trust each hashed it:
    about 0.4 s a pass for 256 MB here, before any socket binds."""
    engine_dir = _engine_dir(tmp_path)
    engine, record, report = _build(engine_dir, demo_model)
    _left(report.summary_path, record, _dead_writer())
    hashed: list[Path] = []
    real = inferd.digest.sha256_and_stat

    def counting(path: Path, *, follow: bool = False) -> Any:
        hashed.append(path)
        return real(path, follow=follow)

    monkeypatch.setattr(inferd.digest, "sha256_and_stat", counting)  # sha256_file's
    for module in (commit_records, pipeline, artifacts):
        monkeypatch.setattr(module, "sha256_and_stat", counting, raising=False)

    (concluded,) = _conclude(engine_dir)

    assert concluded["decision"] == "trusted"
    assert _manifest(engine_dir) == {engine.name: read_sidecar(engine)}
    assert hashed == [engine]


def test_an_engine_changed_after_it_was_hashed_is_hashed_again_and_not_trusted(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest is passed on only while the path names the very file hashed: an
    engine rewritten in place after the commit check and the cleanup is hashed again
    by the trust, and not trusted for the dead build's digest."""
    engine_dir = _engine_dir(tmp_path)
    _, record, report = _build(engine_dir, demo_model)
    _left(report.summary_path, record, _dead_writer())
    clean_up = commit_records.clean_up

    def rewritten_after(engine_path: Path, **kwargs: Any) -> Any:
        done = clean_up(engine_path, **kwargs)
        engine_path.write_bytes(b"rewritten in place")
        return done

    monkeypatch.setattr(commit_records, "clean_up", rewritten_after)

    (concluded,) = _conclude(engine_dir)

    assert concluded["decision"] == "not_trusted"
    assert "is not the one the build wrote" in concluded["note"]
    assert _manifest(engine_dir) == {}
