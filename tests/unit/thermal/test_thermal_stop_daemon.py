"""The daemon's stop with jtop's ``start()`` hung and NVML in use: the thermal
step no longer spends its bound (``thermal.stop``, 5 s of the stop's budget,
taken from the drain and the recorder's last flush) on an open that nothing can
interrupt, and the open's thread it leaves is accounted for, not hidden.

The daemon runs in this process, as in ``tests/integration/test_review_root_daemon.py``,
so the test can list its threads; its thermal deadline is made short (the
monitor's ``stale_after_s``) so that NVML is in use within a second.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog
from structlog.typing import EventDict

from inferd import config as config_module
from inferd import daemon as daemon_module
from inferd.daemon import Daemon
from inferd.stop_budget import THERMAL_S
from inferd.supervision import journal_writer
from inferd.supervision.instance import InstanceLock
from inferd.thermal import ThermalMonitor
from inferd.thermal.bounded_read import OPEN_THREAD_NAME
from tests.conftest import HANG_S, render_config, wait_until
from tests.unit.thermal.test_thermal_fallthrough import DEADLINE_S, Jetson


def inferd_threads() -> list[str]:
    """The daemon's threads, as the root daemon review lists them (not the
    process's journal writer)."""
    return sorted(
        thread.name
        for thread in threading.enumerate()
        if thread.name.startswith("inferd-") and thread.name != journal_writer.THREAD_NAME
    )


@pytest.fixture
def jetson(monkeypatch: pytest.MonkeyPatch) -> Iterator[Jetson]:
    assert inferd_threads() == [], "an earlier test left daemon threads running"
    board = Jetson(monkeypatch)
    yield board
    board.release.set()
    for thread in threading.enumerate():
        if thread.name == OPEN_THREAD_NAME:
            thread.join(HANG_S)


class TimedStop:
    """Wraps the monitor's ``stop``: the timeout the daemon gave it, how long it
    took and what it returned."""

    def __init__(self, stop: Callable[[float], bool]) -> None:
        self._stop = stop
        self.calls: list[tuple[float, float, bool]] = []

    def __call__(self, timeout: float) -> bool:
        started = time.monotonic()
        stopped = self._stop(timeout)
        self.calls.append((timeout, time.monotonic() - started, stopped))
        return stopped


def started_daemon(
    monkeypatch: pytest.MonkeyPatch, directory: Path, demo_model: Path, stale_after_s: float
) -> Daemon:
    """A ready daemon in this process whose thermal monitor tries jtop, then NVML, with
    the thermal deadline ``stale_after_s``."""
    monkeypatch.setattr(
        daemon_module,
        "ThermalMonitor",
        functools.partial(ThermalMonitor, stale_after_s=stale_after_s),
    )
    text = render_config(
        directory,
        [{"name": "demo", "path": str(demo_model)}],
        thermal={"sources": ["jtop", "nvml"], "poll_hz": 20.0},
    )
    (directory / "inferd.toml").write_text(text)
    daemon = Daemon(config_module.load(directory / "inferd.toml"))
    daemon.start()
    assert daemon.wait_ready(HANG_S)
    return daemon


def timed_stop(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[EventDict], tuple[float, float, bool]]:
    """Stop ``daemon``: what it logged, and its one ``thermal.stop`` (the timeout it was
    given, how long it took, what it returned)."""
    timed = TimedStop(daemon.thermal.stop)
    monkeypatch.setattr(daemon.thermal, "stop", timed)
    with structlog.testing.capture_logs() as logs:
        daemon.stop()
    (call,) = timed.calls
    return logs, call


def assert_the_open_ends_once_released(jetson: Jetson, daemon: Daemon) -> None:
    """The jtop service answers after the daemon stopped: the open's thread ends, says
    it was abandoned, and closes the client it opened."""
    with structlog.testing.capture_logs() as late:
        jetson.release.set()  # the service answers after the daemon stopped
        wait_until(lambda: inferd_threads() == [], message="the open's thread ending")
    assert [(line["event"], line["source"]) for line in late] == [
        ("thermal_source_open_abandoned", "jtop")
    ]
    assert jetson.jtop.clients[0].closed and not daemon.thermal.abandoned_opens


def test_a_daemon_stop_with_jtop_hung_leaves_the_open_and_says_which(
    jetson: Jetson,
    short_tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    daemon = started_daemon(monkeypatch, short_tmp_path, demo_model, stale_after_s=DEADLINE_S)
    wait_until(lambda: daemon.thermal.describe()["source"] == "nvml", message="NVML in use")
    logs, (given, took, stopped) = timed_stop(daemon, monkeypatch)
    assert given == pytest.approx(THERMAL_S, abs=1.0)  # its whole bound was left to it
    assert took < given / 2, took  # loose: a loaded runner; it took all of it (5.0 s)
    assert stopped is False
    # What is left is the jtop open the monitor names, and only it.
    assert list(daemon.thermal.abandoned_opens) == ["jtop"]
    assert inferd_threads() == [OPEN_THREAD_NAME]
    events = [line["event"] for line in logs]
    (said,) = [line for line in logs if line["event"] == "thermal_monitor_stop_timeout"]
    assert said["log_level"] == "warning" and said["abandoned"] == ["jtop"]
    # Not a failed step, not a thread that blocks the context's end.
    assert "daemon_stop_step_failed" not in events and "threads_did_not_stop" not in events
    assert "daemon_stopped" in events and daemon._context.closed
    again = InstanceLock(short_tmp_path / "run", [])
    again.acquire()  # raises DaemonAlreadyRunningError while the daemon holds it
    again.release()
    assert jetson.nvml.init_count == 0 and jetson.nvml.shutdown_calls == 1
    assert_the_open_ends_once_released(jetson, daemon)
