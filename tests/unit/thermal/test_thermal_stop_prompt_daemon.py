"""The daemon's stop while jtop's first open still runs within its deadline: the
thermal step no longer waits out the rest of the deadline (it took its whole
5 s bound, ``thermal.stop``, when the deadline outlasted it), and the open's
thread it leaves is the one ``abandoned_opens`` names.

As in ``test_thermal_stop_daemon.py`` the daemon runs in this process.  The
thermal deadline is made long (``HANG_S``) so the stop surely comes within it,
however slowly a loaded runner starts the daemon.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.stop_budget import THERMAL_S
from inferd.thermal.bounded_read import OPEN_THREAD_NAME
from tests.conftest import HANG_S, wait_until
from tests.unit.thermal.test_thermal_fallthrough import Jetson
from tests.unit.thermal.test_thermal_stop_daemon import (
    assert_the_open_ends_once_released,
    inferd_threads,
    jetson,
    started_daemon,
    timed_stop,
)

__all__ = ["jetson"]  # the fixture: no daemon thread before, the open joined after


def test_a_daemon_stop_during_jtops_first_open_does_not_wait_for_it(
    jetson: Jetson,
    short_tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    daemon = started_daemon(monkeypatch, short_tmp_path, demo_model, stale_after_s=HANG_S)
    wait_until(lambda: len(jetson.jtop.clients) == 1, message="jtop's start() entered")
    assert daemon.thermal.describe()["polls"] == 0  # the first poll still waits for it
    logs, (given, took, stopped) = timed_stop(daemon, monkeypatch)
    assert given == pytest.approx(THERMAL_S, abs=1.0)
    assert took < given / 2, took  # loose: a loaded runner; it took all of it (5.0 s)
    assert stopped is False and list(daemon.thermal.abandoned_opens) == ["jtop"]
    assert inferd_threads() == [OPEN_THREAD_NAME]  # not the poll: the stop woke it
    events = [line["event"] for line in logs]
    (said,) = [line for line in logs if line["event"] == "thermal_monitor_stop_timeout"]
    assert said["log_level"] == "warning" and said["abandoned"] == ["jtop"]
    assert "daemon_stop_step_failed" not in events and "threads_did_not_stop" not in events
    assert "thermal_telemetry_unavailable" not in events  # the poll cut short: not a loss
    assert "daemon_stopped" in events and daemon._context.closed
    assert jetson.nvml.init_count == 0 and jetson.nvml.shutdown_calls == 0  # never reached
    assert_the_open_ends_once_released(jetson, daemon)
