"""The thermal monitor's stop takes only what it needs (``ThermalMonitor.stop``).

With jtop's ``start()`` hung and NVML in use (a normal running state since the
fall-through of DESIGN.md 253), ``stop(5.0)`` used to wait its whole timeout for
the open, which nothing can interrupt, and so took 5.0 s of the daemon's stop
budget.  Now an open past its deadline is abandoned without a wait: it closes
what it opens when it returns (DESIGN.md 240), and the stop says so: it
returns False, ``abandoned_opens`` names the source, and
``thermal_monitor_stop_timeout`` (at warning level) lists it in ``abandoned``.
A read, and an open within its deadline, are no longer waited for either:
``test_thermal_stop_prompt.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from inferd.config import ThermalConfig
from inferd.stop_budget import THERMAL_S
from inferd.thermal import OPENERS, ThermalMonitor
from inferd.thermal.bounded_read import OPEN_THREAD_NAME
from tests.conftest import HANG_S, wait_until
from tests.unit.thermal.conftest import ScriptedSource, reading
from tests.unit.thermal.test_monitor_open_deadline import HangingOpen
from tests.unit.thermal.test_thermal_fallthrough import Jetson, hung_opens, monitor_for

STOP_EVENT = "thermal_monitor_stop_timeout"


@pytest.fixture
def jetson(monkeypatch: pytest.MonkeyPatch) -> Iterator[Jetson]:
    board = Jetson(monkeypatch)
    yield board
    board.release.set()  # whatever the test did: the hung open returns


def test_a_stop_with_jtop_hung_and_nvml_in_use_does_not_wait_for_the_open(
    jetson: Jetson,
) -> None:
    """The daemon's thermal bound as the timeout: the stop used to take all of
    it (5.0 s); now it stops the poll, shuts NVML down and leaves jtop's open
    to close its client on its own thread, and says so."""
    monitor, _, _ = monitor_for(("jtop", "nvml"), poll_hz=20.0)
    monitor.start()
    try:
        wait_until(lambda: monitor.describe()["source"] == "nvml", message="NVML in use")
        (opening,) = hung_opens(1)  # jtop's, past its deadline
        with capture_logs() as logs:
            started = time.monotonic()
            stopped = monitor.stop(THERMAL_S)
            took = time.monotonic() - started
        assert took < THERMAL_S / 2, took  # loose: a loaded runner; it was all of THERMAL_S
        assert stopped is False  # a thread is left: said, not hidden
        assert list(monitor.abandoned_opens) == ["jtop"]
        assert opening.is_alive() and hung_opens(1) == [opening]
        assert not monitor.describe()["running"]
        assert not monitor.snapshot().is_telemetry_available
        assert jetson.nvml.init_count == 0 and jetson.nvml.shutdown_calls == 1  # NVML closed
        (line,) = logs
        assert line["event"] == STOP_EVENT and line["log_level"] == "warning"
        assert line["abandoned"] == ["jtop"] and line["timeout_s"] == THERMAL_S
        assert line["waited_s"] < THERMAL_S / 2
        with capture_logs() as late:
            jetson.release.set()  # the service answers, after the stop
            opening.join(HANG_S)
        assert not opening.is_alive()
    finally:
        jetson.release.set()
    assert [(e["event"], e["source"], e["in_use"]) for e in late] == [
        ("thermal_source_open_abandoned", "jtop", None)
    ]
    client = jetson.jtop.clients[0]
    assert client.started and client.closed and len(jetson.jtop.clients) == 1
    assert not monitor.abandoned_opens  # its thread ended
    assert monitor.stop() is True
    assert jetson.nvml.shutdown_calls == 1  # once


def test_every_hung_open_is_named_and_none_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """jtop and NVML hung, sysfs in use: both opens abandoned at once, in order."""
    hung_jtop = HangingOpen(ScriptedSource(reading(cpu=61.0), name="jtop"))
    hung_nvml = HangingOpen(ScriptedSource(reading(gpu=52.0), name="nvml"))
    hung_nvml.release = hung_jtop.release
    sysfs = ScriptedSource(reading(cpu=47.0), name="sysfs")
    monkeypatch.setitem(OPENERS, "jtop", hung_jtop)
    monkeypatch.setitem(OPENERS, "nvml", hung_nvml)
    monkeypatch.setitem(OPENERS, "sysfs", lambda _config: sysfs)
    monitor, _, _ = monitor_for(("jtop", "nvml", "sysfs"), poll_hz=20.0)
    monitor.start()
    try:
        wait_until(lambda: monitor.describe()["source"] == "sysfs", message="sysfs in use")
        threads = hung_opens(2)
        with capture_logs() as logs:
            started = time.monotonic()
            assert monitor.stop(THERMAL_S) is False
            assert time.monotonic() - started < THERMAL_S / 2
        assert list(monitor.abandoned_opens) == ["jtop", "nvml"]
        assert sysfs.closed == 1
        assert [(e["event"], e["abandoned"]) for e in logs] == [(STOP_EVENT, ["jtop", "nvml"])]
    finally:
        hung_jtop.release.set()
    for thread in threads:
        thread.join(HANG_S)
        assert not thread.is_alive()
    assert hung_jtop.source.closed == 1 and hung_nvml.source.closed == 1
    assert not monitor.abandoned_opens and monitor.stop() is True


def test_an_open_that_returns_as_the_stop_begins_is_closed_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An open the poll waits for (within its deadline) returns as the stop
    begins, racing the stop's ``abandon``: the poll took it (the stop closes
    it) or it was abandoned (its thread closes it).  Either way it is closed
    once, and the stop's result says whether the open's thread was left."""
    opener = HangingOpen(ScriptedSource(reading(cpu=61.0), name="jtop"))
    monkeypatch.setitem(OPENERS, "jtop", opener)
    config = ThermalConfig(sources=("jtop",), throttle_enter_c=80.0, poll_hz=20.0)
    monitor = ThermalMonitor(config, stale_after_s=HANG_S)
    opener.release = monitor._stop  # it returns as the stop begins, well within HANG_S
    monitor.start()
    try:
        assert opener.entered.wait(HANG_S)
        with capture_logs() as logs:
            stopped = monitor.stop(HANG_S)
    finally:
        opener.release.set()
    said = [e["abandoned"] for e in logs if e["event"] == STOP_EVENT]
    assert said == ([] if stopped else [["jtop"]])
    opener.join()
    assert opener.source.closed == 1 and monitor.abandoned_opens == ()
    assert [t for t in threading.enumerate() if t.name == OPEN_THREAD_NAME] == []
    assert monitor.stop() is True and opener.source.closed == 1
