"""The monitor against a source that returns nonsense: NaN, infinity, an
offline marker, a string, a bool.  None of it may be published as a fresh
reading, crash the poll, or log more than once per warning interval."""

from __future__ import annotations

import math
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import ThermalConfig
from inferd.thermal import ThermalReading, open_source
from inferd.types import ThermalState
from tests.unit.thermal.conftest import ScriptedSource, make_monitor, reading

BAD_TEMPERATURES: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    -256.0,  # jtop's (and many drivers') "offline" marker
    "57.5",
    True,
]


@pytest.mark.parametrize("bad", BAD_TEMPERATURES, ids=repr)
@pytest.mark.parametrize("field", ["cpu_temp_c", "gpu_temp_c"])
def test_nonsense_temperature_is_not_a_fresh_reading(field: str, bad: Any) -> None:
    # The other sensor reads a sane 50 C: the reading is still refused as a
    # whole (a hot sensor that reads NaN must not pass as the cool one).
    other = "gpu_temp_c" if field == "cpu_temp_c" else "cpu_temp_c"
    source = ScriptedSource(ThermalReading(**{field: bad, other: 50.0}))  # type: ignore[arg-type]
    with capture_logs() as logs:
        monitor, sinks, clock = make_monitor(source)
        state = monitor._poll_once()
    assert state == ThermalState.unavailable(clock.now_ns)
    assert monitor.snapshot().is_telemetry_available is False
    assert sinks.events[-1][1]["available"] is False
    described = monitor.describe()
    assert described["last_reading"] is None
    assert "temperature" in described["last_error"] and field in described["last_error"]
    assert "thermal_poll_crashed" not in [entry["event"] for entry in logs]


def test_plausible_cold_temperature_is_a_reading() -> None:
    # A drone at altitude in winter: -40 C is a real reading, not an offline sensor.
    source = ScriptedSource(reading(cpu=-40.0, gpu=-38.5))
    monitor, _, _ = make_monitor(source)
    state = monitor._poll_once()
    assert state.is_telemetry_available and state.cpu_temp_c == -40.0


def test_nonsense_clock_is_dropped_not_published() -> None:
    source = ScriptedSource(reading(cpu=50.0, clock_mhz=math.nan))
    monitor, sinks, _ = make_monitor(source)
    state = monitor._poll_once()
    assert state.is_telemetry_available and state.measured_clock_mhz is None
    assert sinks.events[-1][1]["clock_mhz"] is None


def test_string_temperature_every_poll_logs_at_a_bounded_rate() -> None:
    source = ScriptedSource(reading(cpu="hot", gpu=50.0))  # type: ignore[arg-type]
    with capture_logs() as logs:
        monitor, sinks, clock = make_monitor(source)
        for _ in range(120):  # two minutes of 1 Hz polls
            monitor._poll_once()
            clock.advance(1)
    events = [entry["event"] for entry in logs]
    assert "thermal_poll_crashed" not in events
    assert events.count("thermal_telemetry_unavailable") == 2  # once per 60 s
    assert len(sinks.events) == 120  # every poll still published (as unavailable)
    assert not any(payload["available"] for _topic, payload in sinks.events)


def test_selection_skips_a_source_whose_probe_reading_is_nonsense() -> None:
    # Otherwise the monitor refuses every read, re-probes, and picks it again.
    broken = ScriptedSource(reading(cpu=math.nan, gpu=50.0), name="broken")
    sane = ScriptedSource(reading(cpu=45.0), name="sane")
    selection = open_source(
        ThermalConfig(sources=("jtop", "sysfs")),
        openers={"jtop": lambda _c: broken, "sysfs": lambda _c: sane},
    )
    assert selection.source is sane
    assert broken.closed == 1
    assert dict(selection.skipped)["jtop"].startswith("probe read failed: implausible temperature")
