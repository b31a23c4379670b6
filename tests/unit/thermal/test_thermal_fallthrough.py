"""While a thermal source's open hangs, the sources after it are tried
(``thermal/fallthrough.py``).

A Jetson whose jtop service hangs at ``start()`` used to have no thermal
telemetry at all until it returned, although NVML or sysfs would have
answered: the selection ran the sources one after the other on one thread.
Now each source opens on its own bounded open; the monitor polls from the
first that opens, and switches to a preferred source whose open finishes late.
The fakes' opens block on an Event the test sets.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import ThermalConfig
from inferd.thermal import OPENERS, ThermalMonitor, ThermalReading
from inferd.thermal.bounded_read import OPEN_THREAD_NAME
from tests.conftest import HANG_S, wait_until
from tests.fakes import fake_jtop, fake_pynvml
from tests.unit.thermal.conftest import FakeClock, ScriptedSource, Sinks, reading
from tests.unit.thermal.test_monitor_open_deadline import HangingOpen, hanging_jtop, hanging_nvml

DEADLINE_S = 0.25  # an open that does not hang finishes well within it
HUNG = f"the open did not finish within {DEADLINE_S:g} s (running for "


def open_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == OPEN_THREAD_NAME and t.is_alive()]


def hung_opens(count: int) -> list[threading.Thread]:
    """The open threads once they are ``count``: an open that returned in time
    may still be ending its thread as the poll goes on."""
    wait_until(lambda: len(open_threads()) == count, message=f"{count} open threads")
    return open_threads()


def monitor_for(
    sources: tuple[str, ...], *, poll_hz: float = 1.0
) -> tuple[ThermalMonitor, Sinks, FakeClock]:
    sinks, clock = Sinks(), FakeClock()
    config = ThermalConfig(sources=sources, throttle_enter_c=80.0, poll_hz=poll_hz)
    monitor = ThermalMonitor(
        config, events=sinks.event, record=sinks.record, clock=clock, stale_after_s=DEADLINE_S
    )
    return monitor, sinks, clock


class Jetson:
    """jtop whose ``start()`` hangs until ``release``, beside an NVML that works."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.jtop = fake_jtop.FakeJtop()
        self.jtop.temperature = {"cpu": fake_jtop.sensor(61.0), "gpu": fake_jtop.sensor(58.0)}
        self.release = threading.Event()
        self.nvml = fake_pynvml.FakeNvml(temperature_c=52)
        monkeypatch.setitem(sys.modules, "jtop", hanging_jtop(self.jtop, self.release))
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(self.nvml))


@pytest.fixture
def jetson(monkeypatch: pytest.MonkeyPatch) -> Iterator[Jetson]:
    board = Jetson(monkeypatch)
    yield board
    board.release.set()


def selected(logs: list[MutableMapping[str, Any]]) -> list[tuple[str, str | None]]:
    return [(e["source"], e["replaces"]) for e in logs if e["event"] == "thermal_source_selected"]


def test_a_hung_jtop_start_falls_through_to_nvml_and_jtop_is_taken_back(jetson: Jetson) -> None:
    """The first poll waits out jtop's deadline; the second reads NVML.  When
    ``start()`` returns, jtop (first in ``thermal.sources``) replaces NVML,
    which is shut down."""
    monitor, sinks, clock = monitor_for(("jtop", "nvml"))
    with capture_logs() as logs:
        first = monitor._poll_once()
        assert not first.is_telemetry_available
        assert monitor.describe()["last_error"].startswith(f"jtop: {HUNG}")
        clock.advance(1)
        second = monitor._poll_once()  # the next source, at the next poll
        assert second.is_telemetry_available and second.gpu_temp_c == 52.0
        described = monitor.describe()
        assert described["source"] == "nvml" and described["available"]
        assert described["skipped_sources"]["jtop"].startswith(HUNG)
        assert sinks.events[-1][1]["source"] == "nvml" and sinks.events[-1][1]["available"]
        assert jetson.nvml.init_count == 1
        (opening,) = hung_opens(1)  # jtop's
        for _ in range(3):  # NVML is read; jtop is not opened again
            clock.advance(1)
            assert monitor._poll_once().gpu_temp_c == 52.0
        assert len(jetson.jtop.clients) == 1
        jetson.release.set()  # the service answers
        opening.join(HANG_S)
        assert not opening.is_alive()
        clock.advance(1)
        back = monitor._poll_once()
    assert back.is_telemetry_available and back.cpu_temp_c == 61.0
    assert monitor.describe()["source"] == "jtop"
    assert monitor.describe()["skipped_sources"] == {}
    assert sinks.events[-1][1]["source"] == "jtop"
    assert jetson.nvml.init_count == 0 and jetson.nvml.shutdown_calls == 1  # NVML closed
    assert selected(logs) == [("nvml", None), ("jtop", "nvml")]
    chose = next(e for e in logs if e["event"] == "thermal_source_selected")
    assert chose["skipped"]["jtop"].startswith(HUNG)
    assert len(jetson.jtop.clients) == 1  # the late client, not a second one
    assert monitor.stop() and jetson.jtop.clients[0].closed
    hung_opens(0)


def test_the_running_monitor_reads_the_next_source_within_a_deadline_and_a_poll(
    jetson: Jetson,
) -> None:
    """The monitor's thread, at 20 Hz: telemetry from NVML within the open's
    deadline and a few polls, while ``jtop.start()`` still hangs."""
    monitor, sinks, _ = monitor_for(("jtop", "nvml"), poll_hz=20.0)
    started = time.monotonic()
    monitor.start()
    try:
        wait_until(lambda: monitor.describe()["available"], message="telemetry from NVML")
        took = time.monotonic() - started
        assert took < DEADLINE_S + 2.0, took  # loose: a loaded runner; the bug is forever
        described = monitor.describe()
        assert described["source"] == "nvml" and described["last_reading"]["gpu_temp_c"] == 52
        assert not jetson.jtop.clients[0].started and len(hung_opens(1)) == 1
        assert any(p["source"] == "nvml" and p["available"] for _, p in list(sinks.events))
        jetson.release.set()
        wait_until(lambda: monitor.describe()["source"] == "jtop", message="jtop taken back")
    finally:
        jetson.release.set()
        assert monitor.stop(timeout=2.0)
    assert jetson.nvml.init_count == 0 and jetson.nvml.shutdown_calls == 1
    assert jetson.jtop.clients[0].closed and len(jetson.jtop.clients) == 1
    hung_opens(0)


class Everything:
    """jtop, NVML and sysfs whose opens all hang until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.jtop = fake_jtop.FakeJtop()
        self.nvml = fake_pynvml.FakeNvml()
        self.sysfs = HangingOpen(ScriptedSource(reading(cpu=47.0), name="sysfs"))
        self.sysfs.release = self.release
        monkeypatch.setitem(sys.modules, "jtop", hanging_jtop(self.jtop, self.release))
        monkeypatch.setitem(sys.modules, "pynvml", hanging_nvml(self.nvml, self.release))
        monkeypatch.setitem(OPENERS, "sysfs", self.sysfs)


def test_every_source_hanging_holds_one_open_thread_each_and_late_ones_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hung = Everything(monkeypatch)
    monitor, sinks, clock = monitor_for(("jtop", "nvml", "sysfs"))
    try:
        for _ in range(3):  # one open's deadline a poll: jtop, then NVML, then sysfs
            assert not monitor._poll_once().is_telemetry_available
            clock.advance(1)
        assert len(open_threads()) == 3
        with capture_logs() as logs:
            for _ in range(10):  # ten re-probe intervals: no open starts again
                assert not monitor._poll_once().is_telemetry_available
                clock.advance(61)
        assert len(open_threads()) == 3
        assert len(hung.jtop.clients) == 1 and len(hung.sysfs.threads) == 1
        assert hung.nvml.calls.count("nvmlInit") <= 1 and hung.nvml.init_count == 0
        assert [e for e in logs if e["event"] == "thermal_no_source"] == []  # nothing learnt
        error = monitor.describe()["last_error"]
        assert error.startswith(f"jtop: {HUNG}") and f"nvml: {HUNG}" in error
        assert f"sysfs: {HUNG}" in error
        assert set(monitor.describe()["skipped_sources"]) == {"jtop", "nvml", "sysfs"}
    finally:
        hung.release.set()
    threads = [t for t in threading.enumerate() if t.name == OPEN_THREAD_NAME]
    for thread in threads:
        thread.join(HANG_S)
        assert not thread.is_alive()
    with capture_logs() as logs:
        assert monitor._poll_once().cpu_temp_c == 45.0  # jtop, the first of them
    assert monitor.describe()["source"] == "jtop"
    abandoned = [(e["source"], e["in_use"]) for e in logs if "abandoned" in e["event"]]
    assert abandoned == [("nvml", "jtop"), ("sysfs", "jtop")]
    assert hung.nvml.init_count == 0 and hung.nvml.shutdown_calls == 1
    assert hung.sysfs.source.closed == 1 and hung.sysfs.source.reads == 1  # its probe
    assert monitor.stop() and hung.jtop.clients[0].closed
    hung_opens(0)
    assert all(payload["source"] in (None, "jtop") for _, payload in sinks.events)


def hanging_jtop_and_nvml(
    monkeypatch: pytest.MonkeyPatch,
    state: fake_jtop.FakeJtop,
    nvml: fake_pynvml.FakeNvml,
    jtop_release: threading.Event,
    nvml_release: threading.Event,
) -> ScriptedSource:
    """Installs jtop and NVML whose opens hang until their release, and a sysfs source
    that opens at once (the CPU at 47 C): that source."""
    sysfs = ScriptedSource(reading(cpu=47.0), name="sysfs")
    monkeypatch.setitem(sys.modules, "jtop", hanging_jtop(state, jtop_release))
    monkeypatch.setitem(sys.modules, "pynvml", hanging_nvml(nvml, nvml_release))
    monkeypatch.setitem(OPENERS, "sysfs", lambda _config: sysfs)
    return sysfs


def test_late_opens_switch_up_the_order_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """sysfs opens while jtop and NVML hang; NVML's late open replaces sysfs, then
    jtop's replaces NVML: never down the order, each switch logged once."""
    state = fake_jtop.FakeJtop()
    jtop_release, nvml_release = threading.Event(), threading.Event()
    nvml = fake_pynvml.FakeNvml(temperature_c=52)
    sysfs = hanging_jtop_and_nvml(monkeypatch, state, nvml, jtop_release, nvml_release)
    monitor, _, clock = monitor_for(("jtop", "nvml", "sysfs"))
    try:
        with capture_logs() as logs:
            for _ in range(3):
                monitor._poll_once()
                clock.advance(1)
            assert monitor.describe()["source"] == "sysfs"
            assert len(hung_opens(2)) == 2
            nvml_release.set()
            hung_opens(1)  # NVML's returned
            assert monitor._poll_once().gpu_temp_c == 52.0
            clock.advance(1)
            assert sysfs.closed == 1 and monitor.describe()["source"] == "nvml"
            assert set(monitor.describe()["skipped_sources"]) == {"jtop"}
            jtop_release.set()
            hung_opens(0)  # jtop's returned
            assert monitor._poll_once().cpu_temp_c == 45.0
    finally:
        jtop_release.set()
        nvml_release.set()
    assert selected(logs) == [("sysfs", None), ("nvml", "sysfs"), ("jtop", "nvml")]
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1
    assert monitor.stop() and state.clients[0].closed and sysfs.closed == 1


class LateFlakyJtop:
    """An ``OPENERS`` entry for jtop: every open hangs until the test releases
    it, then returns a source whose probe read works and every read after fails."""

    def __init__(self) -> None:
        self.release = threading.Semaphore(0)
        self.opens = 0

    def __call__(self, _config: ThermalConfig) -> ScriptedSource:
        self.opens += 1
        assert self.release.acquire(timeout=HANG_S)
        return FailsAfterProbe(reading(cpu=66.0), name="jtop")


class FailsAfterProbe(ScriptedSource):
    def read(self) -> ThermalReading:
        if self.reads >= 1:
            self.step = OSError("jtop: lost connection with the service")
        return super().read()


def test_a_preferred_source_that_opens_late_and_fails_switches_once_a_reprobe_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flap bound: jtop opens late every time, then fails.  The monitor goes
    back down to NVML only by a re-probe (after jtop failed for a minute) and up
    to jtop at most once per re-probe interval, since a source's open starts at
    most once a round."""
    jtop = LateFlakyJtop()
    nvml = fake_pynvml.FakeNvml(temperature_c=52)
    monkeypatch.setitem(OPENERS, "jtop", jtop)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(nvml))
    monitor, _, clock = monitor_for(("jtop", "nvml"))
    sources: list[tuple[float, str | None]] = []  # (simulated s, source) at each change
    try:
        for second in range(600):
            monitor._poll_once()
            source = monitor.describe()["source"]
            if not sources or sources[-1][1] != source:
                sources.append((second, source))
            if open_threads() and source == "nvml":  # jtop's open returns, late
                jtop.release.release()
                wait_until(lambda: not open_threads(), message="the late open returning")
            clock.advance(1)
    finally:
        for _ in range(5):
            jtop.release.release()
    assert monitor.stop()
    ups = [at for at, source in sources if source == "jtop"]
    downs = [at for at, source in sources if source == "nvml"]
    assert len(ups) >= 5  # the scenario did cycle
    assert all(later - earlier >= 60 for earlier, later in itertools.pairwise(ups))
    # Down the order only after jtop failed for a re-probe interval.
    assert all(down - up >= 60 for up, down in zip(ups, downs[1:], strict=False))
    assert jtop.opens <= 600 // 60 + 1
    assert nvml.init_count == 0 and nvml.shutdown_calls == nvml.calls.count("nvmlInit")


def test_stop_closes_every_source_whose_open_ends_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state, nvml = fake_jtop.FakeJtop(), fake_pynvml.FakeNvml()
    release = threading.Event()
    sysfs = hanging_jtop_and_nvml(monkeypatch, state, nvml, release, release)
    monitor, _, clock = monitor_for(("jtop", "nvml", "sysfs"))
    try:
        for _ in range(3):
            monitor._poll_once()
            clock.advance(1)
        assert monitor.describe()["source"] == "sysfs"
        threads = hung_opens(2)
        with capture_logs() as logs:
            assert monitor.stop(timeout=0.05) is False  # two opens still hang
            assert sysfs.closed == 1  # the source in use is not left open
            assert not monitor.snapshot().is_telemetry_available
            release.set()
            for thread in threads:
                thread.join(HANG_S)
                assert not thread.is_alive()
    finally:
        release.set()
    abandoned = sorted((e["source"], e["in_use"]) for e in logs if "abandoned" in e["event"])
    assert abandoned == [("jtop", None), ("nvml", None)]
    assert state.clients[0].started and state.clients[0].closed
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1
    assert monitor.stop() is True and sysfs.closed == 1


def test_with_jtop_hung_and_no_other_source_the_error_names_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state, release = fake_jtop.FakeJtop(), threading.Event()
    monkeypatch.setitem(sys.modules, "jtop", hanging_jtop(state, release))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    monitor, _, clock = monitor_for(("jtop", "nvml"))
    try:
        with capture_logs() as logs:
            for _ in range(4):
                assert not monitor._poll_once().is_telemetry_available
                clock.advance(1)
        error = monitor.describe()["last_error"]
        assert error.startswith(f"jtop: {HUNG}") and "; nvml: " in error
        assert set(monitor.describe()["skipped_sources"]) == {"jtop", "nvml"}
        no_source = [e for e in logs if e["event"] == "thermal_no_source"]
        assert len(no_source) == 1 and no_source[0]["skipped"]["jtop"].startswith(HUNG)
        (opening,) = hung_opens(1)
    finally:
        release.set()
    opening.join(HANG_S)
    assert monitor._poll_once().is_telemetry_available
    assert monitor.describe()["source"] == "jtop" and monitor.describe()["skipped_sources"] == {}
    assert monitor.stop() and state.clients[0].closed
