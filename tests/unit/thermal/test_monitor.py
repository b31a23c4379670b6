"""The thermal monitor (``inferd.thermal.monitor``): transitions, events, records
and logs, snapshots, describe(), and the polling thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack
import pytest
from structlog.testing import capture_logs

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal import (
    THERMAL_TOPIC,
    THREAD_NAME,
    TRANSITION_RECORD_KIND,
    SourceSelection,
    ThermalMonitor,
    ThermalReading,
)
from inferd.thermal.bounded_read import READ_THREAD_NAME
from inferd.thermal.throttle import REASON_ENTER, REASON_UNAVAILABLE
from inferd.types import ThermalState
from tests.conftest import HANG_S, wait_until
from tests.unit.thermal.conftest import (
    FakeClock,
    HangingSource,
    ScriptedSource,
    Sinks,
    make_monitor,
    reading,
)

EVENT_KEYS = {
    "source",
    "available",
    "throttle_active",
    "cpu_temp_c",
    "gpu_temp_c",
    "clock_mhz",
    "measured_at_ns",
    "transition",
}
RECORD_KEYS = {
    "throttle_active",
    "previous",
    "cpu_temp_c",
    "gpu_temp_c",
    "threshold_c",
    "source",
    "reason",
}


def test_transition_record_and_event_payloads() -> None:
    source = ScriptedSource(reading(cpu=81.0, gpu=70.5, clock_mhz=918.0))
    with capture_logs() as logs:
        monitor, sinks, clock = make_monitor(source)
        monitor._poll_once()
        clock.advance(1)
        source.step = reading(cpu=74.0, gpu=70.0)
        monitor._poll_once()
        clock.advance(1)
        monitor._poll_once()  # no transition

    assert [kind for kind, _ in sinks.records] == [TRANSITION_RECORD_KIND] * 2
    entered, exited = (payload for _, payload in sinks.records)
    assert set(entered) == RECORD_KEYS and set(exited) == RECORD_KEYS
    assert entered == {
        "throttle_active": True,
        "previous": False,
        "cpu_temp_c": 81.0,
        "gpu_temp_c": 70.5,
        "threshold_c": 80.0,
        "source": "scripted",
        "reason": "temp_at_or_above_enter_threshold",
    }
    assert exited["throttle_active"] is False and exited["previous"] is True
    assert exited["reason"] == "temp_at_or_below_exit_threshold"

    assert [topic for topic, _ in sinks.events] == [THERMAL_TOPIC] * 3
    for _, payload in sinks.events:
        assert set(payload) == EVENT_KEYS
        msgpack.packb(payload)
    first = sinks.events[0][1]
    assert first == {
        "source": "scripted",
        "available": True,
        "throttle_active": True,
        "cpu_temp_c": 81.0,
        "gpu_temp_c": 70.5,
        "clock_mhz": 918.0,
        "measured_at_ns": FakeClock().now_ns,
        "transition": True,
    }
    assert [p["transition"] for _, p in sinks.events] == [True, True, False]
    for _, record in sinks.records:
        msgpack.packb(record)

    levels = {entry["event"]: entry["log_level"] for entry in logs}
    assert levels["thermal_throttle_entered"] == "warning"
    assert levels["thermal_throttle_exited"] == "info"
    assert sum(e["event"] == "thermal_throttle_entered" for e in logs) == 1
    assert sum(e["event"] == "thermal_throttle_exited" for e in logs) == 1


def test_snapshot_is_the_stamped_state_without_io() -> None:
    source = ScriptedSource(reading(cpu=50.0, gpu=48.0, clock_mhz=600.0))
    monitor, _, clock = make_monitor(source)
    assert monitor.snapshot() == ThermalState.unavailable()
    clock.advance(2.5)
    polled = monitor._poll_once()
    reads = source.reads
    for _ in range(5):
        assert monitor.snapshot() is polled
    assert source.reads == reads
    assert polled == ThermalState(
        cpu_temp_c=50.0,
        gpu_temp_c=48.0,
        thermal_throttle_active=False,
        measured_clock_mhz=600.0,
        measured_at_ns=clock.now_ns,
        is_telemetry_available=True,
    )


def test_a_stale_snapshot_is_not_claimed_fresh() -> None:
    source = ScriptedSource(reading(cpu=81.0))
    monitor, _, clock = make_monitor(source, stale_after_s=3.0)
    measured = monitor._poll_once()
    clock.advance(3.0)
    assert monitor.snapshot() is measured
    clock.advance(0.001)
    stale = monitor.snapshot()
    assert not stale.is_telemetry_available and not stale.thermal_throttle_active


def test_describe_is_as_stale_as_the_snapshot() -> None:
    source = ScriptedSource(reading(cpu=85.0))
    monitor, _, clock = make_monitor(source, stale_after_s=3.0)
    monitor._poll_once()
    fresh = monitor.describe()
    assert fresh["available"] and fresh["throttle_active"]
    clock.advance(3.001)  # no poll since: the monitor thread hangs somewhere
    stale = monitor.describe()
    assert not stale["available"] and not stale["throttle_active"]


def test_a_sensor_hanging_while_throttled_is_a_recorded_transition_with_no_second_read() -> None:
    source = HangingSource(reading(cpu=90.0), hang_from=2)
    monitor, sinks, _ = make_monitor(
        source,
        ThermalConfig(throttle_enter_c=80.0, hysteresis_c=5.0, poll_hz=20.0),
        stale_after_s=0.2,
    )

    def transitions() -> list[tuple[bool, str]]:
        return [(payload["throttle_active"], payload["reason"]) for _, payload in sinks.records]

    monitor.start()
    try:
        wait_until(
            lambda: (False, REASON_UNAVAILABLE) in transitions(),
            message="the read deadline passing as a telemetry_unavailable transition",
        )
        assert not monitor.snapshot().is_telemetry_available
        described = monitor.describe()
        assert not described["available"] and not described["throttle_active"]
        polls = described["polls"]
        wait_until(lambda: monitor.describe()["polls"] >= polls + 3, message="polls going on")
        assert source.reads == 2  # never a second read while one hangs
        assert sum(thread.is_alive() for thread in source.readers) == 1
        source.release.set()  # the sensor answers again
        wait_until(lambda: monitor.snapshot().thermal_throttle_active, message="recovery")
    finally:
        source.release.set()
        assert monitor.stop(timeout=2.0)
    assert transitions() == [
        (True, REASON_ENTER),
        (False, REASON_UNAVAILABLE),
        (True, REASON_ENTER),
    ]
    assert sinks.records[1][0] == TRANSITION_RECORD_KIND and sinks.records[1][1]["previous"]


def test_stop_leaves_the_source_open_while_a_read_past_its_deadline_runs() -> None:
    source = HangingSource(reading(cpu=50.0), hang_from=1)
    monitor, _, _ = make_monitor(source, ThermalConfig(poll_hz=20.0), stale_after_s=0.05)
    monitor.start()
    try:
        wait_until(lambda: monitor.describe()["errors"] >= 2, message="polls past the hung read")
        with capture_logs() as logs:
            assert monitor.stop(timeout=0.05) is False  # the read may still use the source
        assert source.closed == 0 and not monitor.describe()["running"]
        assert [entry["event"] for entry in logs] == ["thermal_monitor_stop_timeout"]
    finally:
        source.release.set()
    for thread in source.readers:  # the stop left the source to it: closed as it returns
        thread.join(HANG_S)
    assert monitor.stop(timeout=2.0) is True
    assert source.closed == 1 and not any(thread.is_alive() for thread in source.readers)


def test_unavailable_state_and_rate_limited_warning() -> None:
    with capture_logs() as logs:
        monitor, sinks, clock = make_monitor(
            None, opener=lambda _c: SourceSelection(None, (("jtop", "service down"),))
        )
        for _ in range(30):  # 30 s of 1 Hz polls
            state = monitor._poll_once()
            assert state == ThermalState.unavailable(clock.now_ns)
            clock.advance(1)
        warnings = [e for e in logs if e["event"] == "thermal_telemetry_unavailable"]
        assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
        assert "service down" in warnings[0]["error"]
        clock.advance(29)  # 59 s after the first warning
        monitor._poll_once()
        assert len([e for e in logs if e["event"] == "thermal_telemetry_unavailable"]) == 1
        clock.advance(1)  # 60 s
        monitor._poll_once()
    warnings = [e for e in logs if e["event"] == "thermal_telemetry_unavailable"]
    assert len(warnings) == 2 and warnings[1]["suppressed"] == 30
    assert len(sinks.events) == 32 and sinks.records == []
    assert all(
        p["available"] is False and p["throttle_active"] is False and p["source"] is None
        for _, p in sinks.events
    )


def test_failing_source_goes_unavailable_and_recovers() -> None:
    source = ScriptedSource(reading(cpu=55.0))
    with capture_logs() as logs:
        monitor, sinks, clock = make_monitor(source)
        assert monitor._poll_once().is_telemetry_available
        for failure in (TelemetryUnavailableError("zone vanished"), OSError("EIO")):
            source.step = failure
            clock.advance(1)
            state = monitor._poll_once()
            assert state == ThermalState.unavailable(clock.now_ns)
            assert monitor.snapshot() is state
        source.step = reading(cpu=56.0)
        clock.advance(1)
        state = monitor._poll_once()
    assert state.is_telemetry_available and state.cpu_temp_c == 56.0
    assert state.measured_at_ns == clock.now_ns
    events = [e["event"] for e in logs]
    assert events.count("thermal_telemetry_unavailable") == 1
    assert events.count("thermal_telemetry_restored") == 1
    described = monitor.describe()
    assert described["errors"] == 2 and described["consecutive_errors"] == 0
    assert described["last_error"] == "scripted: OSError: EIO"
    assert [p["available"] for _, p in sinks.events] == [True, False, False, True]


def test_losing_telemetry_while_throttled_is_a_transition() -> None:
    source = ScriptedSource(reading(cpu=90.0))
    monitor, sinks, clock = make_monitor(source)
    assert monitor._poll_once().thermal_throttle_active
    source.step = TelemetryUnavailableError("gone")
    clock.advance(6)  # lost longer than stale_after_s (5 s): the loss counts
    state = monitor._poll_once()
    assert not state.thermal_throttle_active and not state.is_telemetry_available
    source.step = reading(cpu=90.0)
    clock.advance(1)
    assert monitor._poll_once().thermal_throttle_active
    assert [(p["previous"], p["throttle_active"], p["reason"]) for _, p in sinks.records] == [
        (False, True, "temp_at_or_above_enter_threshold"),
        (True, False, "telemetry_unavailable"),
        (False, True, "temp_at_or_above_enter_threshold"),
    ]
    lost = sinks.records[1][1]
    assert lost["cpu_temp_c"] is None and lost["source"] == "scripted"
    assert len(sinks.transitions) == 3


def test_failing_sinks_never_stop_polling() -> None:
    def broken(_name: str, _payload: Mapping[str, Any]) -> None:
        raise ValueError("sink down")

    source = ScriptedSource(reading(cpu=90.0))
    with capture_logs() as logs:
        monitor, _, clock = make_monitor(source, events=broken, record=broken)
        assert monitor._poll_once().thermal_throttle_active
        source.step = reading(cpu=60.0)
        clock.advance(1)
        assert not monitor._poll_once().thermal_throttle_active
    described = monitor.describe()
    assert described["sink_errors"] == 4 and described["transitions"] == 2
    errors = [e for e in logs if e["event"] == "thermal_sink_failed"]
    assert len(errors) == 1 and errors[0]["log_level"] == "error"  # rate limited


def test_a_reading_without_temperature_is_unavailable() -> None:
    monitor, _, _ = make_monitor(ScriptedSource(reading(clock_mhz=900.0)))
    assert not monitor._poll_once().is_telemetry_available
    assert "no temperature" in monitor.describe()["last_error"]


def test_reprobe_after_a_minute_without_telemetry() -> None:
    broken = ScriptedSource(TelemetryUnavailableError("lost"), name="jtop")
    working = ScriptedSource(reading(cpu=50.0), name="sysfs")
    selections = [SourceSelection(broken), SourceSelection(None), SourceSelection(working)]
    opened: list[int] = []

    def opener(_config: ThermalConfig) -> SourceSelection:
        opened.append(clock.now_ns)
        return selections.pop(0)

    monitor, _, clock = make_monitor(None, opener=opener)
    for _ in range(60):
        assert not monitor._poll_once().is_telemetry_available
        clock.advance(1)
    assert len(opened) == 1 and broken.closed == 0
    monitor._poll_once()  # failing for 60 s: close and probe again (nothing found)
    assert len(opened) == 2 and broken.closed == 1 and monitor.source_name is None
    clock.advance(59)
    monitor._poll_once()
    assert len(opened) == 2  # no source: probe again only a minute later
    clock.advance(1)
    state = monitor._poll_once()
    assert len(opened) == 3 and state.is_telemetry_available
    assert monitor.describe()["source"] == "sysfs"


def test_describe() -> None:
    source = ScriptedSource(reading(cpu=82.0, gpu=60.0, clock_mhz=1000.0, trip_point_c=95.0))
    monitor, _, clock = make_monitor(
        source, opener=lambda _c: SourceSelection(source, (("jtop", "no service"),))
    )
    before = monitor.describe()
    assert before["polls"] == 0 and before["available"] is False and before["running"] is False
    monitor._poll_once()
    described = monitor.describe()
    assert described == {
        "source": "scripted",
        "available": True,
        "throttle_active": True,
        "threshold_c": 80.0,
        "hysteresis_c": 5.0,
        "poll_hz": 1.0,
        "last_reading": {
            "cpu_temp_c": 82.0,
            "gpu_temp_c": 60.0,
            "clock_mhz": 1000.0,
            "throttle_signal": None,
            "trip_point_c": 95.0,
            "measured_at_ns": clock.now_ns,
            # the scripted source reports nothing of the GPU: absent, never zero
            "gpu_utilization_pct": None,
            "gpu_memory_used_bytes": None,
            "gpu_memory_total_bytes": None,
            "gpu_power_w": None,
        },
        "polls": 1,
        "errors": 0,
        "consecutive_errors": 0,
        "last_error": None,
        "transitions": 1,
        "sink_errors": 0,
        "skipped_sources": {"jtop": "no service"},
        "retries": {},  # the selection is the only (injected) open, and it opened
        "running": False,
    }
    msgpack.packb(described)


def test_monitor_on_this_machine_reports_unavailable(no_libraries: None, tmp_path: Path) -> None:
    sinks = Sinks()
    monitor = ThermalMonitor(ThermalConfig(sysfs_root=tmp_path), events=sinks.event)
    state = monitor._poll_once()
    assert not state.is_telemetry_available and not state.thermal_throttle_active
    assert set(monitor.describe()["skipped_sources"]) == {"jtop", "nvml", "sysfs"}
    assert monitor.stop()


def test_thread_polls_at_poll_hz_and_stop_joins() -> None:
    source = ScriptedSource(reading(cpu=50.0))
    sinks = Sinks()
    monitor = ThermalMonitor(
        ThermalConfig(poll_hz=50.0),
        events=sinks.event,
        opener=lambda _c: SourceSelection(source, ()),
    )
    started = time.monotonic()
    monitor.start()
    assert THREAD_NAME in {thread.name for thread in threading.enumerate()}
    with pytest.raises(RuntimeError, match="already started"):
        monitor.start()
    wait_until(lambda: source.reads >= 16)
    elapsed = time.monotonic() - started
    # 16 polls at 50 Hz take 15 periods: never faster, and not much slower.
    assert 15 / 50 * 0.9 <= elapsed < 3.0
    assert monitor.snapshot().is_telemetry_available and monitor.describe()["running"]
    assert monitor.stop(timeout=2.0)
    assert THREAD_NAME not in {thread.name for thread in threading.enumerate()}
    # Every thread that ever read has ended: no read can follow the stop.
    assert source.readers and not any(thread.is_alive() for thread in source.readers)
    assert source.closed == 1 and not monitor.describe()["running"]
    assert not monitor.snapshot().is_telemetry_available


def test_stop_leaves_a_read_in_progress_the_source() -> None:
    release = threading.Event()
    entered = threading.Event()

    class SlowSource(ScriptedSource):
        def read(self) -> ThermalReading:
            entered.set()
            release.wait(5.0)
            return super().read()

    source = SlowSource(reading(cpu=50.0))
    monitor = ThermalMonitor(
        ThermalConfig(poll_hz=20.0), opener=lambda _c: SourceSelection(source, ())
    )
    monitor.start()
    assert entered.wait(5.0)
    with capture_logs() as logs:
        assert monitor.stop(timeout=0.05) is False  # stuck in read: source stays open
    assert source.closed == 0
    assert [e["event"] for e in logs] == ["thermal_monitor_stop_timeout"]
    (reader,) = [t for t in threading.enumerate() if t.name == READ_THREAD_NAME]
    release.set()
    reader.join(HANG_S)  # the read returns, and its thread closes the source
    assert monitor.stop(timeout=2.0) is True
    assert source.closed == 1


def test_thread_survives_failing_sinks_and_sources() -> None:
    def broken(_name: str, _payload: Mapping[str, Any]) -> None:
        raise RuntimeError("publisher gone")

    source = ScriptedSource(RuntimeError("driver bug"))
    monitor = ThermalMonitor(
        ThermalConfig(poll_hz=100.0),
        events=broken,
        record=broken,
        opener=lambda _c: SourceSelection(source, ()),
    )
    monitor.start()
    try:
        wait_until(lambda: monitor.describe()["polls"] >= 5)
        source.step = reading(cpu=95.0, trip_point_c=90.0)
        wait_until(lambda: monitor.snapshot().thermal_throttle_active)
        polls = monitor.describe()["polls"]
        wait_until(lambda: monitor.describe()["polls"] > polls + 3)
        assert monitor.describe()["running"]
    finally:
        assert monitor.stop(timeout=2.0)


def test_thread_survives_a_crashing_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    source = ScriptedSource(reading(cpu=50.0))
    monitor = ThermalMonitor(
        ThermalConfig(poll_hz=100.0), opener=lambda _c: SourceSelection(source, ())
    )
    real_poll = monitor._poll_once
    crashes: list[int] = []

    def flaky() -> ThermalState:
        if len(crashes) < 3:
            crashes.append(1)
            raise AssertionError("bug in a poll")
        return real_poll()

    monkeypatch.setattr(monitor, "_poll_once", flaky)
    with capture_logs() as logs:
        monitor.start()
        try:
            wait_until(lambda: source.reads >= 3)
        finally:
            assert monitor.stop(timeout=2.0)
    # The first crash with its traceback; the two after it, within the default
    # ``warn_interval_s``, held back (test_monitor_poll_crashes.py counts them).
    crashed = [e for e in logs if e["event"] == "thermal_poll_crashed"]
    assert [(e.get("suppressed"), e.get("exc_info")) for e in crashed] == [(0, True)]
    assert len(crashes) == 3


def test_restart_after_stop_probes_again() -> None:
    sources = [ScriptedSource(reading(cpu=50.0)), ScriptedSource(reading(cpu=51.0))]

    def opener(_config: ThermalConfig) -> SourceSelection:
        return SourceSelection(sources.pop(0))

    monitor = ThermalMonitor(ThermalConfig(poll_hz=100.0), opener=opener)
    for expected in (50.0, 51.0):
        monitor.start()
        try:
            wait_until(lambda e=expected: monitor.snapshot().cpu_temp_c == e)
        finally:
            assert monitor.stop(timeout=2.0)
    assert sources == []
