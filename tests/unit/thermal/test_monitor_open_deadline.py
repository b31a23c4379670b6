"""Opening a thermal source has a deadline, like a read (``thermal/opening.py``).

``jtop.start()`` against a service whose socket stopped answering, or
``nvmlInit`` on a wedged driver, blocks for as long as it likes.  The open used
to run on the monitor's thread, so while it hung no poll ran: no ``thermal``
event, no warning, ``status.thermal`` frozen, and ``stop`` gave up with the
open still to finish and nobody to close what it opened.  The open now runs on
``inferd-thermal-open``; the fakes below block until the test releases them.
"""

from __future__ import annotations

import re
import sys
import threading
from types import ModuleType
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import ThermalConfig
from inferd.thermal import OPENERS, THREAD_NAME, ThermalMonitor
from inferd.thermal.bounded_read import OPEN_THREAD_NAME
from inferd.thermal.throttle import REASON_ENTER, REASON_UNAVAILABLE
from tests.conftest import HANG_S, wait_until
from tests.fakes import fake_jtop, fake_pynvml
from tests.unit.thermal.conftest import FakeClock, ScriptedSource, Sinks, reading

DEADLINE_S = 0.25  # an open that does not hang finishes well within it, even on a loaded runner
OPEN_DID_NOT_FINISH = rf"^jtop: the open did not finish within {DEADLINE_S:g} s \(running for "


class HangingOpen:
    """An ``OPENERS`` entry that blocks, like ``jtop.start()`` on a service that
    stopped answering, until ``release`` is set; then it returns ``source``."""

    def __init__(self, source: ScriptedSource) -> None:
        self.source = source
        self.release = threading.Event()
        self.entered = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, _config: ThermalConfig) -> ScriptedSource:
        self.threads.append(threading.current_thread())
        self.entered.set()
        self.release.wait(HANG_S)
        return self.source

    def join(self) -> None:
        """Wait for every open to have returned (and closed what it must)."""
        for thread in self.threads:
            thread.join(HANG_S)
            assert not thread.is_alive()


def open_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == OPEN_THREAD_NAME and t.is_alive()]


@pytest.fixture
def hanging(monkeypatch: pytest.MonkeyPatch) -> HangingOpen:
    """The jtop opener hangs; it opens a source reading 90 C (throttled at 80)."""
    opener = HangingOpen(ScriptedSource(reading(cpu=90.0), name="jtop"))
    monkeypatch.setitem(OPENERS, "jtop", opener)
    return opener


def open_did_not_finish(error: str | None) -> bool:
    return error is not None and re.match(OPEN_DID_NOT_FINISH, error) is not None


def monitor_for(
    sources: tuple[str, ...] = ("jtop",), *, poll_hz: float = 1.0, **kwargs: Any
) -> tuple[ThermalMonitor, Sinks, FakeClock]:
    """A monitor choosing its source with the real ``open_source``."""
    sinks, clock = Sinks(), FakeClock()
    config = ThermalConfig(sources=sources, throttle_enter_c=80.0, poll_hz=poll_hz)
    monitor = ThermalMonitor(
        config,
        events=sinks.event,
        record=sinks.record,
        clock=clock,
        stale_after_s=kwargs.pop("stale_after_s", DEADLINE_S),
        **kwargs,
    )
    return monitor, sinks, clock


def transitions(sinks: Sinks) -> list[tuple[bool, str]]:
    return [(payload["throttle_active"], payload["reason"]) for _, payload in sinks.records]


def test_a_hung_first_open_is_lost_telemetry_and_polling_keeps_its_pace(
    hanging: HangingOpen,
) -> None:
    monitor, sinks, _ = monitor_for(poll_hz=20.0)
    monitor.start()  # returns at once: the daemon's start never waits for an open
    try:
        assert hanging.entered.wait(HANG_S)
        wait_until(lambda: monitor.describe()["polls"] >= 5, message="polls while the open hangs")
        described = monitor.describe()
        assert described["source"] is None and not described["available"]
        assert described["errors"] == described["polls"]
        assert open_did_not_finish(described["last_error"]), described["last_error"]
        assert len(sinks.events) >= 5
        assert all(not payload["available"] for _, payload in sinks.events)
        assert len(hanging.threads) == 1 and len(open_threads()) == 1
        hanging.release.set()  # the service answers: the late open is used
        wait_until(lambda: monitor.snapshot().thermal_throttle_active, message="recovery")
        assert monitor.describe()["source"] == "jtop"
    finally:
        hanging.release.set()
        assert monitor.stop(timeout=2.0)
    assert len(hanging.threads) == 1  # the late source was used, not opened again
    assert transitions(sinks) == [(True, REASON_ENTER)]
    assert hanging.source.closed == 1


def test_a_hung_reprobe_after_throttling_keeps_polling_and_recovers(
    hanging: HangingOpen, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Throttled, then the source fails: the transition is written at the first
    failed read past stale_after_s; the re-probe a minute later hangs however
    long, and polls go on."""
    throttled = ScriptedSource(reading(cpu=90.0), name="jtop")
    monkeypatch.setitem(OPENERS, "jtop", lambda _config: throttled)
    monitor, sinks, clock = monitor_for()
    assert monitor._poll_once().thermal_throttle_active
    throttled.step = OSError("I2C read failed")
    clock.advance(1)  # past stale_after_s (DEADLINE_S): the loss counts
    monitor._poll_once()
    assert transitions(sinks) == [(True, REASON_ENTER), (False, REASON_UNAVAILABLE)]
    assert sinks.records[1][1]["previous"] is True
    monkeypatch.setitem(OPENERS, "jtop", hanging)  # the service stopped answering
    clock.advance(61)  # failing for a minute: re-probe
    with capture_logs() as logs:
        for _ in range(5):
            assert not monitor._poll_once().is_telemetry_available
            clock.advance(61)  # past the re-probe interval every time: still one open
    assert throttled.closed == 1  # closed before the re-probe
    assert len(hanging.threads) == 1 and len(open_threads()) == 1
    described = monitor.describe()
    assert open_did_not_finish(described["last_error"]), described["last_error"]
    assert described["source"] is None and described["consecutive_errors"] == 6
    reprobes = [entry for entry in logs if entry["event"] == "thermal_source_reprobe"]
    assert [entry["source"] for entry in reprobes] == ["jtop"]
    warnings = [e for e in logs if e["event"] == "thermal_telemetry_unavailable"]
    assert warnings and open_did_not_finish(warnings[0]["error"])
    assert len(sinks.events) == 7  # one event a poll, hung open or not
    assert len(sinks.records) == 2  # lost once, recorded once
    hanging.release.set()
    hanging.join()
    assert monitor._poll_once().thermal_throttle_active  # the late source, used
    assert transitions(sinks)[2:] == [(True, REASON_ENTER)]
    assert len(hanging.threads) == 1
    assert monitor.stop() and hanging.source.closed == 1


def test_stop_with_an_open_past_its_deadline_closes_what_it_opens_later(
    hanging: HangingOpen,
) -> None:
    monitor, _, _ = monitor_for(poll_hz=20.0)
    monitor.start()
    try:
        wait_until(
            lambda: open_did_not_finish(monitor.describe()["last_error"]),
            message="the open past its deadline",
        )
        with capture_logs() as logs:
            assert monitor.stop(timeout=0.05) is False  # bounded, like a hung read
            assert not monitor.describe()["running"]
            hanging.release.set()
            hanging.join()
        # Nobody polls any more: the open closed its source itself.
        assert hanging.source.closed == 1
        events = [entry["event"] for entry in logs]
        assert events == ["thermal_monitor_stop_timeout", "thermal_source_open_abandoned"]
    finally:
        hanging.release.set()
    assert monitor.stop(timeout=2.0) is True
    assert hanging.source.closed == 1  # once
    assert open_threads() == []


def test_stop_while_the_poll_still_waits_for_the_open(hanging: HangingOpen) -> None:
    """``stop`` comes before the open's deadline: the poll stops waiting for it
    (DESIGN.md 257's follow-up: it used to be left waiting), the open then
    ends within its deadline, and what it opened is closed, not used."""
    monitor, _, _ = monitor_for(stale_after_s=HANG_S)
    monitor.start()
    try:
        assert hanging.entered.wait(HANG_S)
        assert monitor.stop(timeout=0.05) is False
        assert [t for t in threading.enumerate() if t.name == THREAD_NAME] == []
    finally:
        hanging.release.set()
    hanging.join()
    assert hanging.source.closed == 1 and monitor.describe()["source"] is None
    assert monitor.stop(timeout=2.0) is True
    assert hanging.source.closed == 1


def test_an_open_that_ended_late_and_was_never_used_is_closed_at_stop(
    hanging: HangingOpen,
) -> None:
    monitor, _, _ = monitor_for()
    assert not monitor._poll_once().is_telemetry_available
    hanging.release.set()
    hanging.join()  # finished, not yet taken by a poll
    assert monitor.stop() is True
    assert hanging.source.closed == 1


def hanging_jtop(state: fake_jtop.FakeJtop, release: threading.Event) -> ModuleType:
    """The fake jetson-stats whose ``start()`` waits for ``release`` first."""
    module = fake_jtop.make_module(state)
    base: Any = module.jtop

    class jtop(base):  # type: ignore[misc,valid-type]
        __slots__ = ()

        def start(self) -> None:
            release.wait(HANG_S)
            super().start()

    module.jtop = jtop  # type: ignore[attr-defined]
    return module


def hanging_nvml(state: fake_pynvml.FakeNvml, release: threading.Event) -> ModuleType:
    """The fake pynvml whose ``nvmlInit`` waits for ``release`` first."""
    module = fake_pynvml.make_module(state)
    init = module.nvmlInit

    def nvmlInit() -> None:
        release.wait(HANG_S)
        init()

    module.nvmlInit = nvmlInit  # type: ignore[attr-defined]
    return module


def stop_while_opening(source: str) -> threading.Thread:
    """Start a monitor whose open of ``source`` hangs, stop it (which gives up)
    and return the open's thread."""
    monitor, _, _ = monitor_for((source,), poll_hz=20.0)
    monitor.start()
    wait_until(
        lambda: "the open did not finish" in (monitor.describe()["last_error"] or ""),
        message="the open past its deadline",
    )
    assert monitor.describe()["last_error"].startswith(f"{source}: the open did not finish")
    assert monitor.stop(timeout=0.05) is False
    (thread,) = open_threads()
    return thread


def test_a_jtop_client_started_after_stop_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    state, release = fake_jtop.FakeJtop(), threading.Event()
    monkeypatch.setitem(sys.modules, "jtop", hanging_jtop(state, release))
    try:
        opening = stop_while_opening("jtop")
        assert len(state.clients) == 1 and not state.clients[0].started
    finally:
        release.set()
    opening.join(HANG_S)  # the open returns after the monitor stopped
    assert not opening.is_alive()
    assert state.clients[0].started and state.clients[0].closed  # jtop's close()


def test_nvml_initialised_after_stop_is_shut_down_once(monkeypatch: pytest.MonkeyPatch) -> None:
    state, release = fake_pynvml.FakeNvml(), threading.Event()
    monkeypatch.setitem(sys.modules, "pynvml", hanging_nvml(state, release))
    try:
        opening = stop_while_opening("nvml")
        assert state.init_count == 0
    finally:
        release.set()
    opening.join(HANG_S)  # nvmlInit returns after the monitor stopped
    assert not opening.is_alive()
    assert state.init_count == 0 and state.shutdown_calls == 1  # one nvmlShutdown, no leak


def test_a_jtop_start_that_ends_late_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    state, release = fake_jtop.FakeJtop(), threading.Event()
    state.temperature = {"cpu": fake_jtop.sensor(91.0), "gpu": fake_jtop.sensor(60.0)}
    monkeypatch.setitem(sys.modules, "jtop", hanging_jtop(state, release))
    monitor, sinks, clock = monitor_for(("jtop",))
    try:
        assert not monitor._poll_once().is_telemetry_available
        clock.advance(1)
        assert not monitor._poll_once().is_telemetry_available
        assert open_did_not_finish(monitor.describe()["last_error"])
        (opening,) = open_threads()
    finally:
        release.set()
    opening.join(HANG_S)
    assert not opening.is_alive()
    clock.advance(1)
    state_now = monitor._poll_once()
    assert state_now.thermal_throttle_active and state_now.cpu_temp_c == 91.0
    assert len(state.clients) == 1  # the late client, not a second one
    assert monitor.stop() and state.clients[0].closed
    assert transitions(sinks) == [(True, REASON_ENTER)]
