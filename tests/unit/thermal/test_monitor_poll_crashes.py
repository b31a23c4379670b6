"""A poll that crashes every time logs its traceback at most once per
``warn_interval_s``, not at ``poll_hz`` (DESIGN.md 232's leftover): the first
crash with its traceback, the crashes after it held back and counted in the
next line."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from inferd.config import ThermalConfig
from inferd.types import ThermalState
from tests.conftest import wait_until
from tests.unit.thermal.conftest import ScriptedSource, make_monitor, reading


def test_a_poll_crashing_every_time_logs_once_a_warn_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = ScriptedSource(reading(cpu=50.0))
    monitor, _sinks, clock = make_monitor(
        source, ThermalConfig(poll_hz=100.0, throttle_enter_c=80.0), warn_interval_s=60.0
    )
    crashes: list[int] = []

    def crashing() -> ThermalState:
        crashes.append(1)
        if len(crashes) == 11:  # the 11th crash comes a warn interval after the first
            clock.advance(60.0)
        raise AssertionError(f"bug in poll {len(crashes)}")

    monkeypatch.setattr(monitor, "_poll_once", crashing)
    with capture_logs() as logs:
        monitor.start()
        try:
            wait_until(lambda: len(crashes) >= 15)
        finally:
            assert monitor.stop(timeout=2.0)
    crashed = [e for e in logs if e["event"] == "thermal_poll_crashed"]
    # Crash 1 logged; 2 to 10 held back and counted in the line of crash 11; the
    # crashes after it are held back again.
    assert [(e.get("suppressed"), e.get("exc_info")) for e in crashed] == [(0, True), (9, True)]
