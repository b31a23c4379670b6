"""Artifacts (no-cancel final write, cleanup, quarantine) and the timing-cache policy."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.engine_build import CancellationToken, artifacts
from inferd.engine_build.artifacts import (
    STAGING_DIR,
    STAGING_LOCK,
    TimingCacheManager,
    TimingCacheOutcome,
    clean_up,
    commit_engine,
    inventory,
    stage_engine,
    staged_path,
    sweep_staging,
)
from inferd.engines.sidecar import read_sidecar
from inferd.types import HostTuple, PrecisionMode
from tests.unit.engine_build.conftest import SUMMARY_SCHEMA

HOST = HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.30", PrecisionMode.FP32)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_an_engine_is_staged_then_committed_with_its_sidecar(tmp_path: Path) -> None:
    engine = tmp_path / "e" / "m.engine"
    token = CancellationToken()
    digest, staged = stage_engine(engine, b"engine bytes")
    assert staged == staged_path(engine) and staged.name == engine.name
    assert read_sidecar(staged) == digest and not engine.exists()
    zone = commit_engine(staged, engine, token)
    assert zone is not None
    assert engine.read_bytes() == b"engine bytes"
    assert read_sidecar(engine) == digest
    assert zone["zone"] == "final engine commit" and zone["deferredCancel"] is None
    assert [p.name for p in engine.parent.iterdir() if ".tmp-" in p.name] == []
    assert not (engine.parent / STAGING_DIR).exists()


def test_cancel_during_the_commit_is_deferred_until_rename(tmp_path: Path) -> None:
    engine = tmp_path / "m.engine"
    token = CancellationToken()
    _, staged = stage_engine(engine, b"x" * 1000)
    zone = commit_engine(staged, engine, token, during_write=lambda: token.cancel("ide"))
    assert zone is not None and zone["deferredCancel"] == "ide"
    assert engine.read_bytes() == b"x" * 1000


def test_a_cancel_before_the_commit_commits_nothing_and_clean_up_removes_the_staged_engine(
    tmp_path: Path,
) -> None:
    engine = tmp_path / "m.engine"
    token = CancellationToken()
    _, staged = stage_engine(engine, b"validated bytes")
    token.cancel("control")
    assert commit_engine(staged, engine, token) is None
    assert not engine.exists() and staged.exists()
    report = clean_up(engine)
    assert report.status == "cleaned" and not engine.exists()
    assert not (tmp_path / STAGING_DIR).exists()
    assert sorted(report.removed) == [
        f"{STAGING_DIR}/{os.getpid()}/m.engine",
        f"{STAGING_DIR}/{os.getpid()}/m.engine.sha256",
    ]


def stale_staging(directory: Path, pid: int) -> Path:
    """What a build process killed while validating leaves: its staged engine, sidecar
    and temp file, another engine name's files too, and its (now unheld) lock."""
    folder = directory / STAGING_DIR / str(pid)
    folder.mkdir(parents=True)
    (folder / STAGING_LOCK).touch()
    (folder / "m.engine").write_bytes(b"unvalidated")
    (folder / "m.engine.sha256").write_text("x")
    (folder / f".m.engine.tmp-{pid}-aaaa0001").write_bytes(b"partial")
    (folder / "other.engine").write_bytes(b"another engine's")
    return folder


@contextlib.contextmanager
def held_lock(folder: Path) -> Iterator[None]:
    """``folder``'s lock held as its live staging process holds it (an ``flock`` on
    another open file conflicts even within one process)."""
    fd = os.open(folder / STAGING_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_clean_up_removes_all_of_a_dead_process_staging_whatever_engine_it_staged(
    tmp_path: Path,
) -> None:
    """What a killed build left while its engine was validated never stays, though no
    later build is of its engine name; a running build's staging (locked) is its own."""
    engine = tmp_path / "m2.engine"
    dead, live = stale_staging(tmp_path, dead_pid()), stale_staging(tmp_path, os.getppid())
    with held_lock(live):
        report = clean_up(engine)
        assert report.status == "cleaned" and not dead.exists()
        temp = f".m.engine.tmp-{dead.name}-aaaa0001"
        assert sorted(report.removed) == sorted(
            f"{STAGING_DIR}/{dead.name}/{name}"
            for name in ("m.engine", "m.engine.sha256", "other.engine", temp)
        )
        assert len(list(live.iterdir())) == 5
    clean_up(engine, own_pid=int(live.name))  # a supervisor cleaning after its dead child
    assert not (tmp_path / STAGING_DIR).exists()


def test_a_staging_folder_is_live_by_its_lock_not_by_its_pid_number(tmp_path: Path) -> None:
    """After a power loss the dead build's staging stays; after the reboot its pid
    number names another live process (pid 1 here): still dead, since no one holds
    its lock (or it has none: a build of before the lock)."""
    locked, unlocked = stale_staging(tmp_path, 1), tmp_path / STAGING_DIR / "2"
    unlocked.mkdir()
    (unlocked / "m.engine").write_bytes(b"unvalidated")
    clean_up(tmp_path / "m.engine")
    assert not locked.exists() and not unlocked.exists()


def test_a_staged_engine_s_folder_stays_locked_until_its_commit(tmp_path: Path) -> None:
    engine = tmp_path / "m.engine"
    _, staged = stage_engine(engine, b"being validated")
    fd = os.open(staged.parent / STAGING_LOCK, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert sweep_staging(tmp_path) == ([], []) and staged.exists()
    clean_up(tmp_path / "other.engine")  # another build's cleanup in this process
    assert staged.exists()
    assert commit_engine(staged, engine, CancellationToken()) is not None
    assert not (tmp_path / STAGING_DIR).exists()


def test_staging_where_a_sweep_removed_the_lock_meanwhile_locks_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead namesake's folder (same pid number, before a reboot): a sweep holding its
    lock removes it while this process waits for the lock, so the lock it then gets
    guards nothing; it locks the folder again instead."""
    folder = stale_staging(tmp_path, os.getpid())
    real_flock = fcntl.flock
    calls = []

    def sweep_first(fd: int, operation: int) -> None:
        calls.append(operation)
        if len(calls) == 1:
            assert sweep_staging(tmp_path)[1] == []  # the sweep that held the lock
        real_flock(fd, operation)

    monkeypatch.setattr(artifacts.fcntl, "flock", sweep_first)
    _, staged = stage_engine(tmp_path / "m.engine", b"new")
    monkeypatch.setattr(artifacts.fcntl, "flock", real_flock)
    exclusive = fcntl.LOCK_EX
    assert calls == [exclusive, exclusive | fcntl.LOCK_NB, exclusive] and staged.parent == folder
    assert sorted(p.name for p in folder.iterdir()) == [STAGING_LOCK, "m.engine", "m.engine.sha256"]
    fd = os.open(folder / STAGING_LOCK, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    clean_up(tmp_path / "m.engine")
    assert not (tmp_path / STAGING_DIR).exists()


def test_clean_up_removes_own_and_dead_temps_leaves_a_live_one_and_quarantines_the_engine(
    tmp_path: Path,
) -> None:
    engine = tmp_path / "m.engine"
    own = tmp_path / f".m.engine.tmp-{os.getpid()}-aaaa0001"
    dead = tmp_path / f".m.engine.tmp-{dead_pid()}-aaaa0002"
    live = tmp_path / f".m.engine.tmp-{os.getppid()}-aaaa0003"
    other = tmp_path / f".other.engine.tmp-{os.getpid()}-aaaa0004"
    for path in (own, dead, live, other):
        path.write_bytes(b"partial")
    engine.write_bytes(b"partial engine at the final path")
    report = clean_up(engine)
    assert sorted(report.removed) == sorted([own.name, dead.name])
    assert other.exists()  # not ours
    assert live.read_bytes() == b"partial"  # another live build's: left to it
    assert [item["path"] for item in report.left] == [live.name]
    assert "live process" in report.left[0]["reason"]
    assert not engine.exists()  # no live build commits it: unclear, quarantined
    (item,) = report.quarantined
    assert Path(item["path"]).name.startswith("m.engine")
    assert "sidecar" in item["reason"]
    assert Path(item["path"]).is_file()
    assert Path(item["path"] + ".reason").read_text().strip() == item["reason"]
    assert report.status == "quarantined"


def test_clean_up_keeps_a_complete_engine(tmp_path: Path) -> None:
    engine = tmp_path / "m.engine"
    _, staged = stage_engine(engine, b"complete")
    commit_engine(staged, engine, CancellationToken())
    report = clean_up(engine)
    assert report.status == "cleaned" and engine.exists()


def test_inventory_lists_files(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"12")
    assert inventory(tmp_path) == [{"path": "a", "bytes": 2}]
    assert inventory(tmp_path / "missing") == []


def test_timing_cache_cold_then_saved_then_reused_then_updated(tmp_path: Path) -> None:
    first = TimingCacheManager(tmp_path, HOST)
    assert first.load() is None and first.decision == "cold"
    assert first.finish(True, b"cache-1") == "cold" and first.saved
    second = TimingCacheManager(tmp_path, HOST)
    assert second.load() == b"cache-1" and second.decision == "reused"
    assert second.finish(True, b"cache-1") == "reused" and not second.saved
    third = TimingCacheManager(tmp_path, HOST)
    third.load()
    assert third.finish(True, b"cache-2") == "updated"
    assert third.path.read_bytes() == b"cache-2"


def test_cancelled_or_failed_build_discards_its_cache(tmp_path: Path) -> None:
    manager = TimingCacheManager(tmp_path, HOST)
    manager.load()
    assert manager.finish(False, b"in-memory cache") == "discarded"
    assert not manager.path.exists() and not manager.saved


def test_unloadable_or_refused_cache_is_quarantined(tmp_path: Path) -> None:
    manager = TimingCacheManager(tmp_path, HOST)
    manager.path.write_bytes(b"")
    assert manager.load() is None and manager.decision == "quarantined"
    assert manager.quarantined_to is not None
    assert Path(manager.quarantined_to + ".reason").is_file()
    refused = TimingCacheManager(tmp_path, HOST)
    refused.path.write_bytes(b"from another GPU")
    assert refused.load() == b"from another GPU"
    refused.quarantine("TensorRT refused it")
    assert not refused.path.exists() and refused.decision == "quarantined"
    # Quarantine stays the decision even when the build later fails.
    assert refused.finish(False, None) == "quarantined"


def test_a_cache_that_cannot_be_saved_is_discarded_and_the_stored_one_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Discarded has one meaning: this build's cache was not kept (not completed, or
    its save failed); the stored file is exactly as it was.  A failed save is an
    outcome of the build, never an exception out of the session."""
    TimingCacheManager(tmp_path, HOST).finish(True, b"cache-1")
    manager = TimingCacheManager(tmp_path, HOST)
    assert manager.load() == b"cache-1"

    def full_disk(data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manager.store, "store", full_disk)
    assert manager.finish(True, b"cache-2") == TimingCacheOutcome.DISCARDED
    assert not manager.saved and manager.path.read_bytes() == b"cache-1"
    assert manager.reason is not None and "could not be saved" in manager.reason
    assert manager.as_dict()["decision"] == "discarded"


def test_the_summary_schema_lists_exactly_the_timing_cache_outcomes() -> None:
    outcomes = sorted(outcome.value for outcome in TimingCacheOutcome)
    properties = SUMMARY_SCHEMA["properties"]
    assert sorted(properties["timingCacheMode"]["enum"]) == outcomes
    assert sorted(properties["timingCache"]["properties"]["decision"]["enum"]) == outcomes


def test_host_tuples_have_separate_caches(tmp_path: Path) -> None:
    other = HostTuple((8, 7), "orin-nx", "r36.4.0", "10.3.0.30", PrecisionMode.FP32)
    assert TimingCacheManager(tmp_path, HOST).path != TimingCacheManager(tmp_path, other).path
