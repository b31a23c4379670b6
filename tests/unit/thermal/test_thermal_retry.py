"""A preferred thermal source whose open failed is opened again in the
background while a later one is in use (``thermal/retrying.py``,
``fallthrough.SourceOpens.retry``).

On a Jetson at boot ``jtop.service`` often starts after inferd: jtop's open
failed at once, the monitor read NVML or sysfs, and stayed on it for good
while it worked, without jtop's GPU temperature, power and clocks.  Now the
failed open is retried after 1, 2, 4, ... s (capped at the re-probe interval)
on its own open thread, the poll waiting for none, and jtop takes over when
it opens.  The polls here run one by one on a fake clock; between two, the
test waits for the retry's thread to have ended.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal import OPENERS, ThermalMonitor
from inferd.thermal.bounded_read import OPEN_THREAD_NAME
from inferd.thermal.selection import SourceOpener
from tests.conftest import HANG_S, wait_until
from tests.fakes import fake_jtop, fake_pynvml
from tests.unit.thermal.conftest import FakeClock, ScriptedSource, Sinks, reading

#: When a source whose first open (at 0 s) keeps failing is opened, at 1 Hz over
#: 600 s with the default 60 s re-probe interval: waits of 1, 2, 4, 8, 16, 32 s,
#: then 60 s.
RETRIED_AT = [0, 1, 3, 7, 15, 31, 63, 123, 183, 243, 303, 363, 423, 483, 543]


#: Open threads that earlier tests left running (a hung open ends on its own): not this test's.
_EARLIER: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _earlier_opens() -> None:
    _EARLIER.clear()
    _EARLIER.update(t for t in threading.enumerate() if t.name == OPEN_THREAD_NAME)


def open_threads() -> list[threading.Thread]:
    """This test's open threads still running."""
    return [
        t
        for t in threading.enumerate()
        if t.name == OPEN_THREAD_NAME and t.is_alive() and t not in _EARLIER
    ]


def no_open_running() -> None:
    """A retry started by the last poll has ended (it fails or opens in microseconds)."""
    wait_until(lambda: not open_threads(), message="the retry's thread ending")


def monitor_for(
    sources: tuple[str, ...], clock: FakeClock, *, stale_after_s: float = 5.0
) -> tuple[ThermalMonitor, Sinks]:
    sinks = Sinks()
    config = ThermalConfig(sources=sources, throttle_enter_c=80.0, poll_hz=1.0)
    monitor = ThermalMonitor(
        config, events=sinks.event, record=sinks.record, clock=clock, stale_after_s=stale_after_s
    )
    return monitor, sinks


class Counted:
    """An ``OPENERS`` entry that notes when (s on the fake clock) each open starts."""

    def __init__(self, opener: SourceOpener, clock: FakeClock) -> None:
        self._opener = opener
        self._clock = clock
        self._started_ns = clock.now_ns
        self.at: list[int] = []

    def __call__(self, config: ThermalConfig) -> Any:
        self.at.append(round((self._clock.now_ns - self._started_ns) / 1e9))
        return self._opener(config)


def lost_telemetry(logs: list[MutableMapping[str, Any]], sinks: Sinks) -> list[object]:
    """Everything a lost poll leaves: unavailable events, warnings, FDR records."""
    unavailable: list[object] = [p for _, p in sinks.events if not p["available"]]
    warned = [e for e in logs if e["event"] == "thermal_telemetry_unavailable"]
    return unavailable + warned + list(sinks.records)


def selected(logs: list[MutableMapping[str, Any]]) -> list[tuple[str, str | None]]:
    return [(e["source"], e["replaces"]) for e in logs if e["event"] == "thermal_source_selected"]


@pytest.fixture
def booting(monkeypatch: pytest.MonkeyPatch) -> Iterator[fake_jtop.FakeJtop]:
    """A Jetson at boot: ``jtop.service`` not started yet."""
    state = fake_jtop.FakeJtop(service_active=False)
    state.temperature = {"cpu": fake_jtop.sensor(61.0), "gpu": fake_jtop.sensor(58.0)}
    monkeypatch.setitem(sys.modules, "jtop", fake_jtop.make_module(state))
    yield state
    no_open_running()


def test_jtop_whose_service_starts_late_takes_over_from_nvml(
    monkeypatch: pytest.MonkeyPatch, booting: fake_jtop.FakeJtop
) -> None:
    """jtop's open fails at the first poll and at three retries, NVML is read;
    the service is up before the fourth retry, which opens jtop, and the next
    poll reads jtop: one client left open, NVML shut down, no poll lost."""
    state = booting
    clock = FakeClock()
    jtop = Counted(OPENERS["jtop"], clock)
    monkeypatch.setitem(OPENERS, "jtop", jtop)
    nvml = fake_pynvml.FakeNvml(temperature_c=52)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(nvml))
    monitor, sinks = monitor_for(("jtop", "nvml"), clock)
    sources: list[tuple[int, str]] = []  # (s, source) at each change
    with capture_logs() as logs:
        for second in range(40):
            state_now = monitor._poll_once()
            assert state_now.is_telemetry_available
            source = monitor.describe()["source"]
            if not sources or sources[-1][1] != source:
                sources.append((second, source))
            no_open_running()
            if len(state.clients) == 4:  # the first open and three retries failed
                state.service_active = True
            clock.advance(1)
    assert jtop.at == [0, 1, 3, 7, 15]  # no retry once jtop is in use
    assert sources == [(0, "nvml"), (16, "jtop")]  # the retry at 15 s, taken at the next poll
    assert state_now.cpu_temp_c == 61.0 and sinks.events[-1][1]["source"] == "jtop"
    assert selected(logs) == [("nvml", None), ("jtop", "nvml")]
    opened = [c for c in state.clients if c.started and not c.closed]
    assert len(opened) == 1 and all(c.closed for c in state.clients if not c.started)
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1
    assert lost_telemetry(logs, sinks) == []
    assert monitor.describe()["errors"] == 0 and monitor.describe()["skipped_sources"] == {}
    assert monitor.stop() and opened[0].closed


def test_a_preferred_source_that_keeps_failing_is_retried_at_the_bounded_rate(
    monkeypatch: pytest.MonkeyPatch, booting: fake_jtop.FakeJtop
) -> None:
    """jtop's service never starts and NVML is not installed; sysfs is read.
    Over ten simulated minutes each is opened at 0, 1, 3, 7, 15, 31, 63 s and
    then once a re-probe interval, every client closed, and every poll read."""
    state = booting
    clock = FakeClock()
    jtop = Counted(OPENERS["jtop"], clock)
    nvml = Counted(OPENERS["nvml"], clock)
    sysfs_source = ScriptedSource(reading(cpu=47.0), name="sysfs")
    sysfs = Counted(lambda _config: sysfs_source, clock)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    for name, opener in (("jtop", jtop), ("nvml", nvml), ("sysfs", sysfs)):
        monkeypatch.setitem(OPENERS, name, opener)
    monitor, sinks = monitor_for(("jtop", "nvml", "sysfs"), clock)
    with capture_logs() as logs:
        for _ in range(600):
            assert monitor._poll_once().cpu_temp_c == 47.0
            no_open_running()
            clock.advance(1)
    assert jtop.at == RETRIED_AT and nvml.at == RETRIED_AT
    assert sysfs.at == [0] and sysfs_source.closed == 0  # never disturbed
    assert len(state.clients) == len(RETRIED_AT) and all(c.closed for c in state.clients)
    skipped = monitor.describe()["skipped_sources"]
    assert "jtop.service is not active" in skipped["jtop"] and "not importable" in skipped["nvml"]
    assert [e["source"] for e in logs if e["event"] == "thermal_source_selected"] == ["sysfs"]
    assert lost_telemetry(logs, sinks) == [] and monitor.describe()["errors"] == 0
    assert monitor.stop() and sysfs_source.closed == 1


class FailsThenHangs:
    """An ``OPENERS`` entry for jtop: the first open fails at once, the next
    blocks until ``release``, then opens a source reading 66 C."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self.source = ScriptedSource(reading(cpu=66.0), name="jtop")

    def __call__(self, _config: ThermalConfig) -> ScriptedSource:
        self.calls += 1
        if self.calls == 1:
            raise TelemetryUnavailableError("jtop: service: not active")
        self.entered.set()
        self.release.wait(HANG_S)
        return self.source


def timed(poll: Callable[[], object]) -> float:
    started = time.monotonic()
    poll()
    return time.monotonic() - started


def test_a_retry_that_hangs_delays_no_poll_and_starts_no_second_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a 2 s deadline, the poll that starts a retry whose open hangs, and
    the polls after it, read sysfs at once; the hung retry is the only open of
    jtop until it returns, and what it opened then takes over."""
    jtop = FailsThenHangs()
    sysfs = ScriptedSource(reading(cpu=47.0), name="sysfs")
    monkeypatch.setitem(OPENERS, "jtop", jtop)
    monkeypatch.setitem(OPENERS, "sysfs", lambda _config: sysfs)
    clock = FakeClock()
    monitor, sinks = monitor_for(("jtop", "sysfs"), clock, stale_after_s=2.0)
    try:
        with capture_logs() as logs:
            assert monitor._poll_once().cpu_temp_c == 47.0  # jtop failed at once
            clock.advance(1)
            assert timed(monitor._poll_once) < 1.0  # the retry starts; nobody waits for it
            assert jtop.entered.wait(HANG_S)
            for _ in range(120):  # two re-probe intervals
                clock.advance(1)
                assert timed(monitor._poll_once) < 1.0
            assert jtop.calls == 2 and len(open_threads()) == 1
            assert monitor.describe()["source"] == "sysfs"
            jtop.release.set()
            no_open_running()
            clock.advance(1)
            assert monitor._poll_once().cpu_temp_c == 66.0
    finally:
        jtop.release.set()
    assert monitor.describe()["source"] == "jtop" and sysfs.closed == 1
    assert selected(logs) == [("sysfs", None), ("jtop", "sysfs")]
    assert lost_telemetry(logs, sinks) == []
    assert monitor.stop() and jtop.source.closed == 1


class FailsUntilStopped:
    """An ``OPENERS`` entry for jtop: every open fails; the second (the first
    retry) only once the monitor's stop has abandoned it, as a ``jtop.start()``
    that a stop meets a few ms before it fails."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.monitor: ThermalMonitor | None = None

    def __call__(self, _config: ThermalConfig) -> ScriptedSource:
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            monitor = self.monitor
            assert monitor is not None
            wait_until(lambda: monitor.abandoned_opens == ("jtop",), message="the stop")
        raise TelemetryUnavailableError("jtop: service: not active")


def test_a_stop_during_a_retry_that_fails_promptly_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stop lets an open in progress return (up to ``READ_SETTLE_S``), as a
    read: a retry failing a few ms into the stop is no open left behind."""
    jtop = FailsUntilStopped()
    sysfs = ScriptedSource(reading(cpu=47.0), name="sysfs")
    monkeypatch.setitem(OPENERS, "jtop", jtop)
    monkeypatch.setitem(OPENERS, "sysfs", lambda _config: sysfs)
    clock = FakeClock()
    monitor, _ = monitor_for(("jtop", "sysfs"), clock)
    jtop.monitor = monitor
    monitor._poll_once()
    clock.advance(1)
    monitor._poll_once()  # the retry starts
    assert jtop.entered.wait(HANG_S)
    with capture_logs() as logs:
        assert monitor.stop(timeout=5.0) is True
    assert [e for e in logs if e["event"] == "thermal_monitor_stop_timeout"] == []
    assert monitor.abandoned_opens == () and sysfs.closed == 1 and jtop.calls == 2
    no_open_running()
