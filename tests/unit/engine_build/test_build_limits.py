"""The builds-dir cap (``retention.py``), the rate of ``build.start`` per peer
(``inferd.peer_rate_limit``) and the two together (``admission.py``)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from inferd.config import BuildsConfig
from inferd.engine_build.admission import BuildAdmission
from inferd.engine_build.artifacts import STAGING_DIR, clean_up, stage_engine
from inferd.engine_build.retention import REMOVED_RECORD, BuildsRetention, scan
from inferd.peer_rate_limit import PeerRateLimiter
from inferd.types import Peer
from inferd_wire.protocol import Code, ProtocolError

ENGINE = 1000


class Records(list[tuple[str, dict[str, Any]]]):
    def __call__(self, kind: str, payload: Any) -> None:
        self.append((kind, dict(payload)))


def artifact(
    build_dir: Path, model: str, build_id: str, age: int, *, engine: bool = True
) -> list[Path]:
    """What a build leaves: engine + sidecar + summary (or only the summary), dated ``age``."""
    directory = build_dir / model
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{model}.{build_id}.simulated.engine"
    files = {f"{stem}.{build_id}.build.json": 100}
    if engine:
        files |= {stem: ENGINE, f"{stem}.sha256": 98}
    paths = []
    for name, size in files.items():
        path = directory / name
        path.write_bytes(b"x" * size)
        os.utime(path, ns=(age * 10**9, age * 10**9))
        paths.append(path)
    return paths


def ids(build_dir: Path) -> list[str]:
    return [s.build_id for s in scan(build_dir).sets]


def test_scan_groups_each_builds_files_and_counts_every_byte(tmp_path: Path) -> None:
    artifact(tmp_path, "demo", "b1-aaaaaa", 1)
    artifact(tmp_path, "demo", "b2-bbbbbb", 2, engine=False)
    quarantine = tmp_path / "demo" / "quarantine"
    quarantine.mkdir()
    (quarantine / "demo.b2-bbbbbb.simulated.engine.20260101T000000-1").write_bytes(b"q" * 10)
    (tmp_path / "demo" / "timing_cc8.7.cache").write_bytes(b"t" * 7)  # shared, never a set
    (tmp_path / "demo" / "other.b3-cccccc.x").write_bytes(b"o")  # another model's name
    inventory = scan(tmp_path)
    assert [(s.build_id, s.has_engine, s.size) for s in inventory.sets] == [
        ("b1-aaaaaa", True, ENGINE + 198),
        ("b2-bbbbbb", False, 110),
    ]
    assert inventory.total_bytes == ENGINE + 198 + 110 + 7 + 1


def test_oldest_superseded_sets_go_first_and_each_is_recorded(tmp_path: Path) -> None:
    for index in range(1, 5):
        artifact(tmp_path, "demo", f"b{index}-00000{index}", index)
    records = Records()
    left = BuildsRetention(tmp_path, 2, 10**9, records).prune(keep=(), serving=(), trigger="t")
    assert [s.build_id for s in left.sets] == ids(tmp_path) == ["b3-000003", "b4-000004"]
    assert [(k, p["build_id"], p["reason"], p["remaining_count"]) for k, p in records] == [
        (REMOVED_RECORD, "b1-000001", "max_count", 3),
        (REMOVED_RECORD, "b2-000002", "max_count", 2),
    ]
    assert records[0][1]["bytes"] == ENGINE + 198 and len(records[0][1]["files"]) == 3


def test_the_newest_engine_running_and_serving_builds_are_never_removed(tmp_path: Path) -> None:
    artifact(tmp_path, "demo", "b1-000001", 1)  # serving
    artifact(tmp_path, "demo", "b2-000002", 2)  # superseded, removable
    artifact(tmp_path, "demo", "b3-000003", 3)  # newest engine of demo
    artifact(tmp_path, "demo", "b4-000004", 4, engine=False)  # running (its summary so far)
    artifact(tmp_path, "other", "b5-000005", 5)  # newest engine of other
    records = Records()
    retention = BuildsRetention(tmp_path, 1, 10**9, records)
    serving = [tmp_path / "demo" / "demo.b1-000001.simulated.engine"]
    left = retention.prune(keep=["b4-000004"], serving=serving, trigger="t")
    assert ids(tmp_path) == ["b1-000001", "b3-000003", "b4-000004", "b5-000005"]
    assert [p["build_id"] for _, p in records] == ["b2-000002"]
    assert retention.over_caps(left) is not None and "nothing more can be removed" in str(
        retention.over_caps(left)
    )


def test_failed_builds_leftovers_go_before_engines_they_did_not_supersede(tmp_path: Path) -> None:
    artifact(tmp_path, "demo", "b1-000001", 1)
    artifact(tmp_path, "demo", "b2-000002", 2, engine=False)  # a failed build: no engine
    records = Records()
    BuildsRetention(tmp_path, 1, 10**9, records).prune(keep=(), serving=(), trigger="t")
    assert ids(tmp_path) == ["b1-000001"]  # the failed build did not supersede it


def test_the_bytes_cap_removes_until_the_dir_fits(tmp_path: Path) -> None:
    for index in range(1, 4):
        artifact(tmp_path, "demo", f"b{index}-00000{index}", index)
    records = Records()
    retention = BuildsRetention(tmp_path, 100, 2 * (ENGINE + 198), records)
    left = retention.prune(keep=(), serving=(), trigger="t")
    assert [p["reason"] for _, p in records] == ["max_bytes"]
    assert left.total_bytes == 2 * (ENGINE + 198) and retention.over_caps(left) is None


def test_the_rate_is_a_bucket_per_peer() -> None:
    now = [100.0]
    limiter = PeerRateLimiter("build.start", 2, 10.0, keys="k", clock=lambda: now[0])
    for _ in range(2):
        assert limiter.retry_after("uid:1") is None
        limiter.take("uid:1")
    assert limiter.retry_after("uid:1") == pytest.approx(10.0)
    assert limiter.retry_after("uid:2") is None  # another peer keeps its share
    now[0] += 4.0
    assert limiter.retry_after("uid:1") == pytest.approx(6.0)
    now[0] += 6.0
    assert limiter.retry_after("uid:1") is None
    assert limiter.refused == 2


def test_admission_refuses_with_retry_after_and_takes_nothing_when_refused(
    tmp_path: Path,
) -> None:
    admission = BuildAdmission(tmp_path, BuildsConfig(start_burst=1), Records(), lambda: [])
    peer = Peer("ipc", uid=1001, gid=1001, pid=5, user="alice", operator=True)
    admission.admit(peer, [])
    with pytest.raises(ProtocolError) as refused:
        admission.admit(peer, [])
    assert refused.value.code is Code.RESOURCE_EXHAUSTED
    assert re.fullmatch(  # as before the limiter was shared with runtime.switch
        r"build\.start rate limit for uid 1001 \(alice\) pid 5: 1 at once, then one every 20 s "
        r"\(builds\.start_burst, builds\.start_refill_s\); retry after \d+\.\d s",
        refused.value.message,
    )
    admission.admit(Peer.internal(0, 1), [])  # the daemon's own rebuilds are not rate limited
    assert admission.describe()["start_limit"]["refused"] == 1


def test_admission_refuses_when_what_stays_fills_the_caps(tmp_path: Path) -> None:
    artifact(tmp_path, "a", "b1-000001", 1)
    artifact(tmp_path, "b", "b2-000002", 2)
    admission = BuildAdmission(tmp_path, BuildsConfig(max_count=1), Records(), lambda: [])
    operator = Peer("ipc", uid=1000, gid=1000, pid=7, operator=True)
    with pytest.raises(ProtocolError, match=r"builds\.max_count 1") as refused:
        admission.admit(operator, [])
    assert refused.value.code is Code.RESOURCE_EXHAUSTED


def test_admission_sweeps_dead_build_processes_staging_before_it_counts(tmp_path: Path) -> None:
    """At the daemon's start and each build.start: what build processes killed while
    validating staged (in the engine dir, or a model's builds folder for a simulated
    build) goes, whatever engine it was; a live build's (locked) stays."""
    build_dir, engine_dir = tmp_path / "builds", tmp_path / "engines"
    dead = [build_dir / "demo" / STAGING_DIR / "1", engine_dir / STAGING_DIR / "2"]
    for folder in dead:
        folder.mkdir(parents=True)
        (folder / "gone.engine").write_bytes(b"x" * ENGINE)
    live = engine_dir / STAGING_DIR / str(os.getpid())
    _, staged = stage_engine(engine_dir / "running.engine", b"being validated")
    admission = BuildAdmission(build_dir, BuildsConfig(), Records(), lambda: [])
    admission.cover_engine_dir(engine_dir, None, {})
    admission.prune([], "daemon_start")
    assert not any(folder.exists() for folder in dead) and staged.parent == live
    assert staged.exists()
    (folder := dead[1]).mkdir()
    (folder / "gone.engine").write_bytes(b"x")
    admission.admit(Peer("ipc", uid=1000, gid=1000, pid=7, operator=True), [])
    assert not folder.exists() and staged.exists()
    clean_up(engine_dir / "running.engine")
