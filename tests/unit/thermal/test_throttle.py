"""The throttle decision (``inferd.thermal.throttle``): hysteresis, thresholds
and the sources' throttle bits, driven through the monitor."""

from __future__ import annotations

from inferd.config import ThermalConfig
from inferd.thermal import ThrottleTracker
from tests.unit.thermal.conftest import ScriptedSource, make_monitor, reading


def test_hysteresis_enter_exit_and_no_flapping_inside_the_band() -> None:
    source = ScriptedSource(reading(cpu=70.0))
    monitor, sinks, clock = make_monitor(source)
    expected = [
        (70.0, False),
        (79.9, False),
        (80.0, True),  # enter at >= 80
        (78.0, True),  # inside the band: holds
        (79.9, True),
        (75.1, True),
        (75.0, False),  # exit at <= 80 - 5
        (79.0, False),  # inside the band: holds
        (76.0, False),
        (81.0, True),
    ]
    states = []
    for temp, _ in expected:
        source.step = reading(cpu=temp)
        clock.advance(1)
        states.append(monitor._poll_once().thermal_throttle_active)
    assert states == [active for _, active in expected]
    assert [payload["throttle_active"] for _, payload in sinks.records] == [True, False, True]
    assert [payload["cpu_temp_c"] for _, payload in sinks.records] == [80.0, 75.0, 81.0]
    assert len(sinks.events) == len(expected)
    assert [p["cpu_temp_c"] for p in sinks.transitions] == [80.0, 75.0, 81.0]


def test_throttle_decides_on_the_hottest_of_cpu_and_gpu() -> None:
    source = ScriptedSource(reading(cpu=60.0, gpu=85.0))
    monitor, sinks, _ = make_monitor(source)
    assert monitor._poll_once().thermal_throttle_active
    source.step = reading(cpu=82.0, gpu=70.0)
    assert monitor._poll_once().thermal_throttle_active
    source.step = reading(cpu=74.0, gpu=None)
    assert not monitor._poll_once().thermal_throttle_active
    assert len(sinks.records) == 2


def test_trip_point_is_the_default_threshold() -> None:
    source = ScriptedSource(reading(gpu=89.0, trip_point_c=90.0))
    monitor, sinks, _ = make_monitor(source, ThermalConfig(hysteresis_c=3.0))
    assert not monitor._poll_once().thermal_throttle_active
    source.step = reading(gpu=90.0, trip_point_c=90.0)
    assert monitor._poll_once().thermal_throttle_active
    source.step = reading(gpu=87.5, trip_point_c=90.0)
    assert monitor._poll_once().thermal_throttle_active
    source.step = reading(gpu=87.0, trip_point_c=90.0)
    assert not monitor._poll_once().thermal_throttle_active
    assert [p["threshold_c"] for _, p in sinks.records] == [90.0, 90.0]


def test_configured_threshold_beats_the_trip_point() -> None:
    source = ScriptedSource(reading(cpu=85.0, trip_point_c=95.0))
    monitor, _, _ = make_monitor(source, ThermalConfig(throttle_enter_c=85.0))
    assert monitor._poll_once().thermal_throttle_active


def test_no_threshold_and_no_bits_never_throttles() -> None:
    source = ScriptedSource(reading(cpu=120.0))
    monitor, sinks, _ = make_monitor(source, ThermalConfig())
    state = monitor._poll_once()
    assert state.is_telemetry_available and not state.thermal_throttle_active
    assert sinks.records == [] and monitor.describe()["threshold_c"] is None


def test_source_throttle_bits_win_over_temperatures() -> None:
    source = ScriptedSource(
        reading(gpu=40.0, throttle=True, throttle_reason="hw_thermal_slowdown", clock_mhz=300.0)
    )
    monitor, sinks, _ = make_monitor(source)
    state = monitor._poll_once()
    assert state.thermal_throttle_active and state.measured_clock_mhz == 300.0
    source.step = reading(gpu=99.0, throttle=False)
    assert not monitor._poll_once().thermal_throttle_active
    assert [p["reason"] for _, p in sinks.records] == [
        "throttle_bits_set:hw_thermal_slowdown",
        "throttle_bits_cleared",
    ]


def test_zero_hysteresis_does_not_flap_at_the_threshold() -> None:
    tracker = ThrottleTracker(enter_c=80.0, hysteresis_c=0.0)
    decisions = [tracker.update(reading(cpu=temp)) for temp in (80.0, 80.0, 80.0, 79.9)]
    assert [d.active for d in decisions] == [True, True, True, False]
    assert [d.changed for d in decisions] == [True, False, False, True]
