"""An audit of the stop sources of a build against real build processes (simulated
builder; no sleeps: each test waits for the point it names).  After each, every file
left under the state dir's builds directory is listed.

Gaps it found (each test failed before its fix):

* A build child killed while it wrote its timing cache or its commit record (the OOM
  killer, the grace's SIGKILL) left that half-written temp file for ever: the
  daemon's cleanup removed only the engine's and its sidecar's.
* A build child killed after the cancel grace left its open phases ``running`` in
  ``build.status`` (its ``activePath`` naming them) while the build said ``cancelled``.

What holds, shown here: the daemon killed by SIGKILL mid-build (its child sees its
control pipe close, cancels cooperatively with source ``sigterm``, cleans up and
records it in its summary); SIGTERM to ``inferd build``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from inferd.engine_build.build_record import describe, fdr_record
from tests.conftest import HANG_S, DaemonFactory, wait_until
from tests.integration.test_build_cli import _start as start_cli
from tests.integration.test_build_cli import _summaries, _wait_for_event
from tests.integration.test_daemon_builds import (
    _in_the_child,
    build_status,
    events_until,
    start_build,
    subscribe,
)
from tests.integration.test_review2_build_supervisor import _gone, _manager, _start, _stepping
from tests.integration.test_schemas import assert_valid

pytestmark = pytest.mark.integration

# In the child only: the fsync of a temp file whose name has $INFERD_TEST_SLOW marks
# $INFERD_TEST_MARK and waits there (a large file on a slow disk) to be killed.
SLOW_WRITE = """
import os, time
from pathlib import Path
_fsync = os.fsync
def _slow(fd):
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        name = ""
    if os.environ["INFERD_TEST_SLOW"] in name and ".tmp-" in name:
        Path(os.environ["INFERD_TEST_MARK"]).touch()
        time.sleep(120)
    return _fsync(fd)
os.fsync = _slow
"""


def _every_file(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _running_phases(tree: dict[str, Any]) -> list[str]:
    """The names of the phases ``tree`` (a snapshot) says are running."""
    running: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        if node["status"] == "running":
            running.append(node["name"])
        for child in node["children"]:
            walk(child)

    for root in tree["roots"]:
        walk(root)
    return running


def _killed_while_writing(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch, slow: str
) -> tuple[Any, Path]:
    _in_the_child(tmp_path, monkeypatch, SLOW_WRITE)
    mark = tmp_path / "mark"
    monkeypatch.setenv("INFERD_TEST_SLOW", slow)
    monkeypatch.setenv("INFERD_TEST_MARK", str(mark))
    manager = _manager(tmp_path, demo_model)
    build = _start(manager, {"step_s": 0})
    wait_until(mark.exists, timeout=60, message=f"the child writing its {slow}")
    os.kill(build.process.pid, signal.SIGKILL)  # the OOM killer
    assert build.done.wait(HANG_S)
    return build, tmp_path / "state" / "builds" / "demo"


def test_a_child_killed_while_it_saves_its_timing_cache_leaves_no_temp_file(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build, folder = _killed_while_writing(tmp_path, demo_model, monkeypatch, ".timing_")
    name = build.engine_path.name
    assert build.state == "completed" and build.killed_after_commit  # saved after its commit
    assert _every_file(folder) == sorted(
        [name, f"{name}.sha256", f"{name}.{build.build_id}.build.json"]
    ), "a killed build's half-written timing cache left"
    record = fdr_record(build)
    assert record["timing_cache"] == "unknown" and record["cleanup_status"] == "cleaned"
    assert any(".timing_" in path for path in record["cleanup"]["removed"])


def test_a_child_killed_while_it_writes_its_commit_record_leaves_no_file(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build, folder = _killed_while_writing(tmp_path, demo_model, monkeypatch, ".build.json")
    assert build.state == "failed" and not build.killed_after_commit
    assert _every_file(folder) == [], "a killed build's half-written commit record left"
    record = fdr_record(build)
    assert record["timing_cache"] == "discarded" and record["cleanup_status"] == "cleaned"


def test_a_child_killed_after_the_grace_shows_no_phase_running(
    tmp_path: Path, demo_model: Path
) -> None:
    published: list[dict[str, Any]] = []
    manager = _manager(tmp_path, demo_model, published=published)
    build = _start(manager, {"step_s": 0.1, "ignore_cancel": True})
    _stepping(build)
    assert _running_phases(describe(build)["phase_tree"])  # the control: it was running
    assert manager.cancel({"build_id": build.build_id}, build.peer)["accepted"] is True
    assert build.done.wait(HANG_S)
    status = describe(build)
    assert_valid("build_status_reply.json#/$defs/build", status)
    assert status["state"] == "cancelled" and status["escalated"] is True
    tree = status["phase_tree"]
    assert tree["state"] == "cancelled" and tree["activePath"] == []
    assert _running_phases(tree) == [], "a killed build's phases still running"
    assert published[-1]["type"] == "cancelled"
    assert _every_file(tmp_path / "state" / "builds") == []
    assert fdr_record(build)["timing_cache"] == "discarded"


def test_a_daemon_killed_mid_build_has_its_child_cancel_and_clean_up(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()
    with subscribe(daemon) as subscriber:
        build_id = start_build(daemon)
        events_until(subscriber, build_id, lambda e: e["type"] == "step")
    pid = build_status(daemon, build_id)["pid"]
    daemon.stop(signal.SIGKILL)  # nothing of the daemon runs any more
    wait_until(lambda: _gone(pid), timeout=HANG_S, message="the orphaned child's end")
    folder = daemon.workdir / "state" / "builds" / "demo"
    (summary_path,) = folder.glob(f"*.{build_id}.build.json")
    assert _every_file(folder) == [summary_path.name], "what the orphaned child left"
    summary = json.loads(summary_path.read_text())
    assert summary["outcome"] == "cancelled" and summary["cancelSource"] == "sigterm"
    assert "closed the build's control pipe" in summary["cancelReason"]
    assert summary["cancelLatencyMs"] is not None  # cooperative: its builder stopped
    assert summary["cleanupStatus"] == "cleaned" and summary["timingCacheMode"] == "discarded"
    assert summary["phaseTree"]["state"] == "cancelled"
    assert _running_phases(summary["phaseTree"]) == []


def test_sigterm_to_inferd_build_cancels_cooperatively_and_leaves_nothing(
    demo_model: Path, tmp_path: Path
) -> None:
    proc = start_cli(demo_model, tmp_path, step_s=0.05)
    _wait_for_event(proc, tmp_path, "step")
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 3, err
    (summary,) = _summaries(tmp_path)
    assert summary["outcome"] == "cancelled" and summary["cancelSource"] == "sigterm"
    assert summary["cleanupStatus"] == "cleaned" and summary["timingCacheMode"] == "discarded"
    assert summary["phaseTree"]["state"] == "cancelled"
    assert _running_phases(summary["phaseTree"]) == []
    engines = tmp_path / "engines"
    assert _every_file(engines) == [p.name for p in engines.glob("*.build.json")]
