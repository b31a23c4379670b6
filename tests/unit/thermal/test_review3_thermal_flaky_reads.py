"""Third review of thermal, finding F2: a failed read while throttled.  Before, one
failed read published throttling False, wrote a critical ``thermal_transition``
record, and made the tracker forget it was throttling: readings inside the band
afterwards stayed False, and a sensor failing every other read wrote a record and
flipped ``throttle_active`` at every poll.  Now the last reading stands for a
failed read until ``stale_after_s`` (as for a slow read); a loss that lasts that
long is published and recorded once, and the band keeps its state across it."""

from __future__ import annotations

import pytest

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal import ThrottleTracker
from inferd.thermal.throttle import (
    REASON_ENTER,
    REASON_EXIT,
    REASON_RESTORED_IN_BAND,
    REASON_UNAVAILABLE,
)
from tests.unit.thermal.conftest import ScriptedSource, Sinks, make_monitor, reading

#: Enter at 85 °C, exit at 80 °C or below: 81..84 °C is the band.
CONFIG = ThermalConfig(throttle_enter_c=85.0, hysteresis_c=5.0)
#: The monitor's default for a 1 Hz poll: max(3 polls, 5 s).
STALE_AFTER_S = 5.0
GLITCH = TelemetryUnavailableError("nvml: nvmlDeviceGetTemperature: Unknown Error")


def records(sinks: Sinks) -> list[tuple[bool, bool, str]]:
    return [(p["previous"], p["throttle_active"], p["reason"]) for _, p in sinks.records]


def test_one_failed_read_inside_the_band_keeps_throttling() -> None:
    """The review's case 1: 86 (enters), cools into the band, one read fails."""
    source = ScriptedSource(reading(cpu=86.0))
    monitor, sinks, clock = make_monitor(source, CONFIG)
    published = []
    for step in (86.0, 84.0, 83.0, GLITCH, 83.0, 84.0, 84.0, 83.0, 82.0):
        source.step = step if isinstance(step, Exception) else reading(cpu=step)
        published.append(monitor._poll_once().thermal_throttle_active)
        clock.advance(1.0)
    assert published == [True] * 9
    assert records(sinks) == [(False, True, REASON_ENTER)]
    assert [p["throttle_active"] for _, p in sinks.events] == [True] * 9  # no flip
    assert monitor.describe()["errors"] == 1  # the failed read is still counted


def test_the_last_reading_stands_for_a_failed_read_until_it_is_stale() -> None:
    source = ScriptedSource(reading(cpu=86.0))
    monitor, sinks, clock = make_monitor(source, CONFIG)
    measured = monitor._poll_once()
    source.step = GLITCH
    clock.advance(STALE_AFTER_S)
    assert monitor._poll_once() is measured  # what snapshot() still returns
    assert monitor.snapshot() is measured
    assert sinks.events[-1][1]["measured_at_ns"] == measured.measured_at_ns
    clock.advance(0.001)  # now stale: snapshot() says unavailable, and so does the poll
    lost = monitor._poll_once()
    assert not lost.is_telemetry_available and not lost.thermal_throttle_active
    assert records(sinks) == [(False, True, REASON_ENTER), (True, False, REASON_UNAVAILABLE)]
    assert sinks.events[-1][1]["transition"] is True


def test_a_lasting_loss_is_recorded_once_and_a_reading_in_the_band_resumes_throttling() -> None:
    source = ScriptedSource(reading(cpu=86.0))
    monitor, sinks, clock = make_monitor(source, CONFIG)
    assert monitor._poll_once().thermal_throttle_active
    source.step = GLITCH
    published = []
    for _ in range(30):  # 30 s without telemetry: one loss, one record
        clock.advance(1.0)
        published.append(monitor._poll_once().thermal_throttle_active)
    assert published == [True] * 5 + [False] * 25  # stale past 5 s
    assert records(sinks) == [(False, True, REASON_ENTER), (True, False, REASON_UNAVAILABLE)]
    source.step = reading(cpu=83.0)  # inside the band: the state held before the loss
    clock.advance(1.0)
    assert monitor._poll_once().thermal_throttle_active
    source.step = reading(cpu=84.0)
    clock.advance(1.0)
    assert monitor._poll_once().thermal_throttle_active
    source.step = reading(cpu=80.0)  # the exit threshold
    clock.advance(1.0)
    assert not monitor._poll_once().thermal_throttle_active
    assert records(sinks)[2:] == [
        (False, True, REASON_RESTORED_IN_BAND),
        (True, False, REASON_EXIT),
    ]
    restored = sinks.records[2][1]
    assert restored["cpu_temp_c"] == 83.0 and restored["threshold_c"] == 85.0


@pytest.mark.parametrize("poll_hz", [1.0, 100.0])
def test_reads_failing_every_other_poll_at_90_c_write_at_most_two_records(poll_hz: float) -> None:
    """The review's case 2 (100 Hz, the ceiling) and the default rate."""
    source = ScriptedSource(reading(cpu=90.0))
    config = ThermalConfig(throttle_enter_c=85.0, hysteresis_c=5.0, poll_hz=poll_hz)
    monitor, sinks, clock = make_monitor(source, config)
    for poll in range(20):
        source.step = GLITCH if poll % 2 else reading(cpu=90.0)
        monitor._poll_once()
        clock.advance(1.0 / poll_hz)
    assert len(sinks.records) <= 2
    assert records(sinks) == [(False, True, REASON_ENTER)]
    assert [p["throttle_active"] for _, p in sinks.events] == [True] * 20


def test_not_throttling_a_failed_read_is_unavailable_at_once() -> None:
    """Nothing is held while cool: the poll says what it got (entry 18)."""
    source = ScriptedSource(reading(cpu=83.0))  # in the band, never entered
    monitor, sinks, clock = make_monitor(source, CONFIG)
    monitor._poll_once()
    source.step = GLITCH
    clock.advance(1.0)
    state = monitor._poll_once()
    assert not state.is_telemetry_available and state.measured_at_ns == clock.now_ns
    assert sinks.records == []


def test_the_tracker_publishes_the_loss_but_the_band_keeps_its_state() -> None:
    tracker = ThrottleTracker(enter_c=85.0, hysteresis_c=5.0)
    assert tracker.update(reading(cpu=86.0)).active
    kept = tracker.lost(lasting=False)
    assert (kept.active, kept.changed, tracker.held) == (True, False, True)
    lost = tracker.lost()
    assert (lost.active, lost.previous, lost.reason) == (False, True, REASON_UNAVAILABLE)
    assert tracker.held is True
    again = tracker.lost()
    assert not again.changed  # a loss is one transition, however many polls it lasts
    resumed = tracker.update(reading(cpu=82.0))
    assert (resumed.active, resumed.previous, resumed.reason) == (
        True,
        False,
        REASON_RESTORED_IN_BAND,
    )
    tracker.lost()
    hotter = tracker.update(reading(cpu=85.5))  # at or above the threshold: entering
    assert (hotter.active, hotter.changed, hotter.reason) == (True, True, REASON_ENTER)
    tracker.lost()
    cooled = tracker.update(reading(cpu=80.0))  # cooled past the band meanwhile
    assert (cooled.active, cooled.changed, cooled.reason) == (False, False, REASON_EXIT)
    assert tracker.held is False
