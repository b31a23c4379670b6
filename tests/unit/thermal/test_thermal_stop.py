"""The thermal monitor's stop takes only what it needs (``ThermalMonitor.stop``).

With jtop's ``start()`` hung and NVML in use (a normal running state since the
fall-through of DESIGN.md 253), ``stop(5.0)`` used to wait its whole timeout for
the open, which nothing can interrupt, and so took 5.0 s of the daemon's stop
budget.  Now an open past its deadline is abandoned without a wait: it closes
what it opens when it returns (DESIGN.md 240), and the stop says so: it
returns False, ``abandoned_opens`` names the source, and
``thermal_monitor_stop_timeout`` (at warning level) lists it in ``abandoned``.
A read past its deadline is still waited for: it holds the source in use.
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
from inferd.thermal.bounded_read import OPEN_THREAD_NAME, READ_THREAD_NAME
from tests.conftest import HANG_S, wait_until
from tests.unit.thermal.conftest import HangingSource, ScriptedSource, reading
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


def test_a_read_past_its_deadline_is_still_waited_for_and_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hung read holds the source in use, which is closed only once it ends:
    the stop waits its timeout for it, as before, and it is an error."""
    source = HangingSource(reading(cpu=47.0), hang_from=2)  # the probe read, then a hang
    monkeypatch.setitem(OPENERS, "sysfs", lambda _config: source)
    monitor, _, _ = monitor_for(("sysfs",), poll_hz=20.0)
    monitor.start()
    try:
        wait_until(lambda: source.reads >= 2, message="the read that hangs")
        with capture_logs() as logs:
            started = time.monotonic()
            assert monitor.stop(0.3) is False
            assert time.monotonic() - started >= 0.3  # waited: the read may still end
        assert source.closed == 0  # the read may still use it
        assert monitor.abandoned_opens == ()
        (line,) = [e for e in logs if e["event"] == STOP_EVENT]  # beside the poll's warning
        assert (line["log_level"], line["abandoned"]) == ("error", [])
    finally:
        source.release.set()
    for reader in [t for t in threading.enumerate() if t.name == READ_THREAD_NAME]:
        reader.join(HANG_S)
    assert monitor.stop(2.0) is True and source.closed == 1


def test_an_open_within_its_deadline_is_still_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An open the poll still waits for (within its deadline) that returns
    during the stop: its source is closed by the stop, nothing is left."""
    opener = HangingOpen(ScriptedSource(reading(cpu=61.0), name="jtop"))
    monkeypatch.setitem(OPENERS, "jtop", opener)
    config = ThermalConfig(sources=("jtop",), throttle_enter_c=80.0, poll_hz=20.0)
    monitor = ThermalMonitor(config, stale_after_s=HANG_S)
    opener.release = monitor._stop  # it returns as the stop begins, well within HANG_S
    monitor.start()
    try:
        assert opener.entered.wait(HANG_S)
        with capture_logs() as logs:
            assert monitor.stop(HANG_S) is True
    finally:
        opener.release.set()
    assert opener.source.closed == 1 and monitor.abandoned_opens == ()
    assert [e["event"] for e in logs if e["event"] == STOP_EVENT] == []
    assert [t for t in threading.enumerate() if t.name == OPEN_THREAD_NAME] == []
