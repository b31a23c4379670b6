"""The builds cap and the engine dir's supersession order builds by build number,
never by file times first (review RF, F1 and F2).  A vehicle without an RTC boots
at 1970, or has its clock set back mid-run: the kernel stamps what this run writes
older than what an earlier flight wrote.  ``os.utime`` gives the files exactly the
mtime such a kernel would have stamped; the daemon's counter continues past the
highest build number on disk (``retention.next_build_number``), so a later build
has a higher number across restarts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import structlog

from inferd.config import ModelConfig
from inferd.engine_build import child_process
from inferd.engine_build.retention import BuildsRetention, next_build_number
from inferd.engine_build.supervisor import BuildManager
from inferd.types import Peer
from inferd_wire.protocol import Code, ProtocolError
from tests.unit.engine_build.test_build_limits import Records, artifact, ids
from tests.unit.engine_build.test_engine_dir_retention import Records as EngineDirRecords
from tests.unit.engine_build.test_engine_dir_retention import (
    daemon_build,
    engine_name,
    onnx,
    retention,
    trust,
)

NOW_S = int(time.time())
#: This boot's clock: no RTC, 1970 plus five minutes.
BOOT_1970_S = 300
OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)


def pruned(build_dir: Path, max_count: int) -> tuple[list[str], list[str]]:
    """What the cap's prune after a build removes, and what it leaves."""
    records = Records()
    left = BuildsRetention(build_dir, max_count, 10**9, records).prune(
        keep=(), serving=(), trigger="build finished"
    )
    return [p["build_id"] for _, p in records], [s.build_id for s in left.sets]


def test_a_build_made_at_a_1970_clock_after_a_previous_flight_is_kept(tmp_path: Path) -> None:
    """RF F1: the previous flight (a right clock) left b1 and b2; this boot's build,
    b3 by the counter, is stamped 1970.  Before, it was the oldest and removed."""
    artifact(tmp_path, "demo", "b1-aaaaaa", NOW_S - 7200)
    artifact(tmp_path, "demo", "b2-bbbbbb", NOW_S - 3600)
    artifact(tmp_path, "demo", "b3-cccccc", BOOT_1970_S)
    assert ids(tmp_path) == ["b1-aaaaaa", "b2-bbbbbb", "b3-cccccc"]  # oldest first
    assert pruned(tmp_path, 1) == (["b1-aaaaaa", "b2-bbbbbb"], ["b3-cccccc"])


def test_a_build_after_the_clock_was_set_back_is_kept(tmp_path: Path) -> None:
    """RF F1: b1 built while the clock was an hour ahead, then NTP set it back and
    b2 was built.  Before, b2 (the build that just completed) was removed."""
    artifact(tmp_path, "demo", "b1-aaaaaa", NOW_S + 3600)
    artifact(tmp_path, "demo", "b2-bbbbbb", NOW_S)
    assert pruned(tmp_path, 1) == (["b1-aaaaaa"], ["b2-bbbbbb"])


def test_build_numbers_compare_as_numbers(tmp_path: Path) -> None:
    """``b10`` was built after ``b9``; as strings ``"b10-" < "b9-"``, which decided
    equal mtimes before."""
    artifact(tmp_path, "demo", "b9-000009", 5)
    artifact(tmp_path, "demo", "b10-00000a", 5)
    assert ids(tmp_path) == ["b9-000009", "b10-00000a"]
    assert pruned(tmp_path, 1) == (["b9-000009"], ["b10-00000a"])


def test_equal_numbers_left_by_older_daemons_fall_back_to_the_mtime(tmp_path: Path) -> None:
    """Daemons before this change restarted at b1 each run: their equal numbers are
    told apart by the files' mtime (the newest kept), as before."""
    artifact(tmp_path, "demo", "b1-bbbbbb", 2)
    artifact(tmp_path, "demo", "b1-aaaaaa", 1)
    assert pruned(tmp_path, 1) == (["b1-aaaaaa"], ["b1-bbbbbb"])


def _build_ids(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The build ids ``BuildManager.start`` gives its children; none is started (the
    spawn fails, so the start is refused ``INTERNAL`` after the id was taken)."""
    started: list[str] = []

    def no_process(spec: dict[str, Any]) -> Any:
        started.append(spec["build_id"])
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(child_process, "spawn", no_process)
    return started


def _state_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A model ``demo`` (an empty file) and a daemon state dir with its builds and
    engine dirs, as the daemon makes them."""
    model = tmp_path / "demo.onnx"
    model.write_bytes(b"")
    state = tmp_path / "state"
    for folder in (state, state / "builds", state / "builds" / "demo", state / "engines"):
        folder.mkdir(mode=0o700)
    return model, state


def _manager(state: Path, model: Path) -> BuildManager:
    return BuildManager(
        {"demo": ModelConfig("demo", model)},
        build_dir=state / "builds",
        engine_dir=state / "engines",
        publish=lambda _topic, _payload: None,
        record=lambda _kind, _payload: None,
        grace_s=1.0,
        tensorrt_available=lambda: False,
    )


def _start(builds: BuildManager) -> None:
    with pytest.raises(ProtocolError) as refused:
        builds.start({"model": "demo", "builder": "simulated"}, OPERATOR)
    assert refused.value.code == Code.INTERNAL


def test_a_restarted_daemon_continues_the_build_counter_past_what_is_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counter starts at 1 + the highest build number of the builds dir's sets and
    the engine dir's summaries (before: at 1 on every run)."""
    started = _build_ids(monkeypatch)
    model, state = _state_dir(tmp_path)
    artifact(state / "builds", "demo", "b9-000009", NOW_S)
    summary = f"{engine_name(onnx(tmp_path))}.b12-00000c.build.json"
    (state / "engines" / summary).write_text(json.dumps({"outcome": "failed"}))
    (state / "engines" / "other.engine.b99-0000ff.build.json.tmp").write_text("")  # no summary
    builds = _manager(state, model)
    _start(builds)
    _start(builds)
    # The restart: b14 left a set on disk.
    artifact(state / "builds", "demo", "b14-00000e", BOOT_1970_S)
    _start(_manager(state, model))
    assert [build_id.split("-")[0] for build_id in started] == ["b13", "b14", "b15"]


def test_a_new_engine_built_at_a_1970_clock_supersedes_the_previous_flights(
    tmp_path: Path,
) -> None:
    """RF F2, model updated: last flight's engine of onnx-1 and this boot's of onnx-2,
    the only ONNX configured now, both trusted.  Before, nothing was superseded (the
    new one looked older), both stayed pinned, and the next build.start was refused."""
    engine_dir = tmp_path / "engines"
    engine_dir.mkdir(mode=0o700)
    old_onnx, new_onnx = onnx(tmp_path, content=b"onnx-1"), onnx(tmp_path, content=b"onnx-2")
    old = daemon_build(engine_dir, engine_name(old_onnx), "b1-aaaaaa", NOW_S - 86400)
    new = daemon_build(engine_dir, engine_name(new_onnx), "b2-bbbbbb", BOOT_1970_S)
    manifest = trust(engine_dir, old["engine"], new["engine"])
    records = EngineDirRecords()
    cap = retention(engine_dir, tmp_path, records, max_count=1, models=(new_onnx,))
    kept = cap.prune(keep=(), serving=(), trigger="t")
    assert [p["build_id"] for _, p in records] == ["b1-aaaaaa"]
    assert not old["engine"].exists() and new["engine"].exists()
    assert sorted(json.loads(manifest.read_text())["engines"]) == [new["engine"].name]
    assert cap.over_caps(kept) is None


def test_the_same_onnx_relabelled_at_a_1970_clock_keeps_the_new_engine(tmp_path: Path) -> None:
    """RF F2, relabelled: this boot's engine of the same ONNX under label ``renamed``.
    Before, the new engine was taken as superseded: its files and trust were dropped."""
    engine_dir = tmp_path / "engines"
    engine_dir.mkdir(mode=0o700)
    model = onnx(tmp_path)
    old = daemon_build(engine_dir, engine_name(model), "b1-aaaaaa", NOW_S - 86400)
    new = daemon_build(
        engine_dir,
        engine_name(model, label="renamed"),
        "b2-bbbbbb",
        BOOT_1970_S,
        content=old["engine"].read_bytes(),
    )
    manifest = trust(engine_dir, old["engine"], new["engine"])
    records = EngineDirRecords()
    retention(engine_dir, tmp_path, records, max_count=1, models=(model,)).prune(
        keep=(), serving=(), trigger="t"
    )
    assert [(p["model"], p["build_id"]) for _, p in records] == [("demo", "b1-aaaaaa")]
    assert new["engine"].exists() and not old["engine"].exists()
    assert sorted(json.loads(manifest.read_text())["engines"]) == [new["engine"].name]


def test_a_count_that_could_not_list_the_builds_dir_is_taken_again_at_the_next_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ``EMFILE`` listing the builds dir as the daemon started made the counter
    start at 1, silently: the build that then completed was ``b1``, the oldest, and
    the caps removed it for the previous flight's ``b7`` (review R1 of entry 343,
    finding 1).  Now the count is said (``build_counter_unchecked``) and taken again
    at the next build."""
    started = _build_ids(monkeypatch)
    model, state = _state_dir(tmp_path)
    artifact(state / "builds", "demo", "b7-000007", NOW_S)
    real_scandir = os.scandir
    failures = [OSError(24, "Too many open files", str(state / "builds"))]

    def scandir(path: Any = ".") -> Any:
        if failures and Path(path) == state / "builds":
            raise failures.pop()
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with structlog.testing.capture_logs() as logs:
        builds = _manager(state, model)
    (said,) = [e for e in logs if e["event"] == "build_counter_unchecked"]
    assert "Too many open files" in said["error"] and said["log_level"] == "warning"
    _start(builds)
    assert [build_id.split("-")[0] for build_id in started] == ["b8"]  # not b1


def test_a_stray_set_with_an_overlong_number_is_the_oldest_and_moves_no_counter(
    tmp_path: Path,
) -> None:
    """``b<200 digits>-…`` (a stray file) pushed the counter to ids the wire refuses
    (64 characters) and names NAME_MAX refuses (review R1 of entry 343, finding 4); a
    12-digit one made the daemon's own numbers 13 digits, which its own patterns did
    not read (review R3, F4).  Past eleven digits a number is a stray's: the set orders
    as the oldest (pruned first) and the counter never sees it."""
    for folder in (tmp_path / "builds", tmp_path / "builds" / "demo"):
        folder.mkdir(mode=0o700)
    artifact(tmp_path / "builds", "demo", "b7-000007", NOW_S)
    for digits in (12, 200):
        stray = tmp_path / "builds" / "demo" / f"demo.b{'9' * digits}-00000{digits % 10}.engine"
        stray.write_bytes(b"")
    assert next_build_number(tmp_path / "builds", tmp_path / "none") == 8
    assert ids(tmp_path / "builds")[-1] == "b7-000007"  # the newest
    assert len(ids(tmp_path / "builds")) == 3
    assert pruned(tmp_path / "builds", 1)[1] == ["b7-000007"]
