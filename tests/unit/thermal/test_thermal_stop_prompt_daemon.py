"""The daemon's stop while jtop's first open still runs within its deadline: the
thermal step no longer waits out the rest of the deadline (it took its whole
5 s bound, ``thermal.stop``, when the deadline outlasted it), and the open's
thread it leaves is the one ``abandoned_opens`` names.

As in ``test_thermal_stop_daemon.py`` the daemon runs in this process.  The
thermal deadline is made long (``HANG_S``) so the stop surely comes within it,
however slowly a loaded runner starts the daemon.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import structlog

from inferd import config as config_module
from inferd import daemon as daemon_module
from inferd.daemon import Daemon
from inferd.stop_budget import THERMAL_S
from inferd.thermal import ThermalMonitor
from inferd.thermal.bounded_read import OPEN_THREAD_NAME
from tests.conftest import HANG_S, render_config, wait_until
from tests.unit.thermal.test_thermal_fallthrough import Jetson
from tests.unit.thermal.test_thermal_stop_daemon import TimedStop, inferd_threads, jetson

__all__ = ["jetson"]  # the fixture: no daemon thread before, the open joined after


def test_a_daemon_stop_during_jtops_first_open_does_not_wait_for_it(
    jetson: Jetson,
    short_tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        daemon_module, "ThermalMonitor", functools.partial(ThermalMonitor, stale_after_s=HANG_S)
    )
    text = render_config(
        short_tmp_path,
        [{"name": "demo", "path": str(demo_model)}],
        thermal={"sources": ["jtop", "nvml"], "poll_hz": 20.0},
    )
    (short_tmp_path / "inferd.toml").write_text(text)
    daemon = Daemon(config_module.load(short_tmp_path / "inferd.toml"))
    daemon.start()
    assert daemon.wait_ready(HANG_S)
    wait_until(lambda: len(jetson.jtop.clients) == 1, message="jtop's start() entered")
    assert daemon.thermal.describe()["polls"] == 0  # the first poll still waits for it
    timed = TimedStop(daemon.thermal.stop)
    monkeypatch.setattr(daemon.thermal, "stop", timed)
    with structlog.testing.capture_logs() as logs:
        daemon.stop()
    ((given, took, stopped),) = timed.calls
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
    with structlog.testing.capture_logs() as late:
        jetson.release.set()  # the service answers after the daemon stopped
        wait_until(lambda: inferd_threads() == [], message="the open's thread ending")
    assert [(line["event"], line["source"]) for line in late] == [
        ("thermal_source_open_abandoned", "jtop")
    ]
    assert jetson.jtop.clients[0].closed and not daemon.thermal.abandoned_opens
