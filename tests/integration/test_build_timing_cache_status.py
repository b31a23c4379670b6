"""A daemon build's timing-cache decision in ``build.status`` and its terminal
``build`` event, and in ``inferctl build status`` (``build follow``'s last line:
``test_build_follow_failed.py``).

The decision (``timingCacheMode``: cold, reused, updated, discarded, quarantined,
unknown) was in the build's summary and its FDR ``engine_build`` record only
(DESIGN.md 268, left (2)): an operator following a build saw none of it.  Each
test drives a simulated build through a real daemon; the simulated builder keeps
its timing cache per host in the daemon's engine dir as TensorRT's does, so a
first build is ``cold`` and a second of the same config ``reused``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from inferd.config import ModelConfig
from inferd.engine_build.build_record import describe
from inferd.engine_build.supervisor import BuildManager
from inferd_client import cli_format
from tests.conftest import HANG_S, DaemonFactory, DaemonProcess, wait_until
from tests.fakes.gpu_site import fake_gpu_env
from tests.integration.test_daemon_builds import (
    AFTER_THE_COMMIT,
    GRACE_S,
    OPERATOR,
    TERMINAL,
    _in_the_child,
    build_records,
    build_status,
    control,
    events_until,
    inferctl,
    start_build,
    subscribe,
)
from tests.integration.test_schemas import assert_valid

pytestmark = pytest.mark.integration


def _build_to_its_end(daemon: DaemonProcess, **simulation: Any) -> tuple[str, dict[str, Any]]:
    """A simulated build of ``demo`` (fast steps), its terminal event (validated)."""
    with subscribe(daemon) as subscriber:
        reply = control(
            daemon, "build.start", model="demo", builder="simulated", simulation=simulation
        )
        build_id = str(reply["result"]["build_id"])
        events = events_until(subscriber, build_id, lambda e: e["type"] in TERMINAL)
    return build_id, events[-1]


def test_completed_builds_report_cold_then_reused_in_status_event_and_cli(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()
    first, terminal = _build_to_its_end(daemon)
    status = build_status(daemon, first)  # validated against the (closed) schema
    summary = json.loads(Path(status["summary_path"]).read_text())
    assert terminal["type"] == "completed" and status["state"] == "completed"
    # No stored cache before the first build: the summary's word, in both places.
    assert summary["timingCacheMode"] == "cold"
    assert status["timing_cache_mode"] == "cold"
    assert terminal["detail"]["timingCacheMode"] == "cold"

    second, terminal = _build_to_its_end(daemon)
    assert build_status(daemon, second)["timing_cache_mode"] == "reused"
    assert terminal["detail"]["timingCacheMode"] == "reused"
    assert cli_format.build_event(terminal, {}).startswith(
        f"COMPLETED build {second} [simulated] timing cache: reused {{"
    )

    shown = inferctl(daemon, "build", "status", first)
    assert shown.returncode == 0, shown.stderr
    assert "  timing_cache_mode: cold\n" in shown.stdout, shown.stdout
    listing = inferctl(daemon, "build", "status", "--json")
    modes = [b["timing_cache_mode"] for b in json.loads(listing.stdout)["builds"]]
    assert modes == ["cold", "reused"]

    # The FDR record said it already: the same word.
    assert daemon.stop() == 0
    assert [r["timing_cache"] for r in build_records(daemon)] == ["cold", "reused"]


def test_a_cancelled_build_reports_none_while_running_then_discarded(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(daemon={"build_cancel_grace_s": GRACE_S})
    with subscribe(daemon) as subscriber:
        build_id = start_build(daemon)  # slow steps: still running when asked
        events_until(subscriber, build_id, lambda e: e["type"] == "step")
        running = build_status(daemon, build_id)
        assert running["state"] == "running"
        assert "timing_cache_mode" in running and running["timing_cache_mode"] is None
        assert "timing_cache_mode" not in "\n".join(cli_format.build(running))
        assert control(daemon, "build.cancel", build_id=build_id)["result"]["accepted"] is True
        terminal = events_until(subscriber, build_id, lambda e: e["type"] in TERMINAL)[-1]
    assert terminal["type"] == "cancelled"
    assert terminal["detail"]["timingCacheMode"] == "discarded"
    assert build_status(daemon, build_id)["timing_cache_mode"] == "discarded"
    assert cli_format.build_event(terminal, {}).startswith(
        f"CANCELLED build {build_id} [simulated] timing cache: discarded {{"
    )


def test_a_child_killed_without_its_report_reports_the_daemons_decision(
    daemon_factory: DaemonFactory,
) -> None:
    """No report, no commit: the daemon decides ``discarded`` (``child_exit``), and
    says so in the status and the terminal event, not only in the FDR record."""
    daemon = daemon_factory(daemon={"build_cancel_grace_s": GRACE_S})
    with subscribe(daemon) as subscriber:
        reply = control(
            daemon,
            "build.start",
            model="demo",
            builder="simulated",
            simulation={"step_s": 0.2, "ignore_cancel": True},
        )
        build_id = str(reply["result"]["build_id"])
        events_until(subscriber, build_id, lambda e: e["type"] == "step")
        control(daemon, "build.cancel", build_id=build_id)
        terminal = events_until(subscriber, build_id, lambda e: e["type"] in TERMINAL)[-1]
    assert terminal["detail"]["escalated"] is True
    assert terminal["detail"]["timingCacheMode"] == "discarded"
    status = build_status(daemon, build_id)
    assert status["escalated"] is True and status["timing_cache_mode"] == "discarded"
    assert status["summary_path"] is None  # the daemon's word, from no summary


def test_a_child_killed_after_its_commit_reports_unknown(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after its commit and its timing cache's save, before its report: the
    daemon cannot know whether the cache was saved (``unknown``, as its FDR record
    says), and the status and terminal event say so rather than nothing."""
    env = fake_gpu_env(None)  # the TensorRT builder, on the fakes
    for key in ("PYTHONPATH", "INFERD_FAKE_TRT_VIOLATIONS"):
        monkeypatch.setenv(key, env[key])
    _in_the_child(tmp_path, monkeypatch, AFTER_THE_COMMIT)
    committed = tmp_path / "committed"
    monkeypatch.setenv("INFERD_TEST_COMMITTED", str(committed))
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    published: list[dict[str, Any]] = []
    manager = BuildManager(
        {"demo": ModelConfig("demo", demo_model)},
        build_dir=state / "builds",
        engine_dir=state / "engines",
        publish=lambda _topic, payload: published.append(dict(payload)),
        record=lambda _kind, _payload: None,
        grace_s=1.0,
        tensorrt_available=lambda: True,
    )
    started = manager.start({"model": "demo"}, OPERATOR)
    wait_until(committed.exists, timeout=60, message="the child after its commit")
    build = manager._get(started["build_id"])
    assert describe(build)["timing_cache_mode"] is None  # no report yet: not known
    os.kill(build.process.pid, signal.SIGKILL)
    assert build.done.wait(HANG_S)

    status = describe(build)
    assert_valid("build_status_reply.json#/$defs/build", status)
    assert status["killed_after_commit"] is True and status["timing_cache_mode"] == "unknown"
    terminal = published[-1]
    assert_valid("event_build.json", {**terminal, "ts_ns": 1, "seq": 1})
    assert terminal["type"] == "completed"
    assert terminal["detail"]["timingCacheMode"] == "unknown"
