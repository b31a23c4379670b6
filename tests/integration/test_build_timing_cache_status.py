"""A daemon build's timing-cache decision in ``build.status`` and its terminal
``build`` event, and in ``inferctl build status`` (``build follow``'s last line:
``test_build_follow_failed.py``; a child killed after its commit, ``unknown``:
``test_daemon_builds.py``).

The decision (``timingCacheMode``: cold, reused, updated, discarded, quarantined,
unknown) was in the build's summary and its FDR ``engine_build`` record only
(DESIGN.md 268, left (2)): an operator following a build saw none of it.  Each
test drives a simulated build through a real daemon; the simulated builder keeps
its timing cache per host in the daemon's engine dir as TensorRT's does, so a
first build is ``cold`` and a second of the same config ``reused``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from inferd_client import cli_format
from tests.conftest import DaemonFactory, DaemonProcess
from tests.integration.test_daemon_builds import (
    GRACE_S,
    TERMINAL,
    build_records,
    build_status,
    control,
    events_until,
    inferctl,
    start_build,
    subscribe,
)

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
