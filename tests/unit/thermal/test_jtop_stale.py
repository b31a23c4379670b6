"""A jtop service whose stats stopped coming is lost telemetry, not a fresh reading.

The real client (jetson-stats 4.2.12 and 7.2.0, ``jtop/jtop.py`` ``_get_data``)
waits ``interval * 3`` for the service's sync event and, when it does not come,
decodes the same ``sync_data`` again; ``ok(spin=True)`` stays True.  A service
stuck in its own sensor read (the same I2C and sysfs nodes entry 134 bounds for
the daemon) therefore served its last temperatures as new ones for as long as
it hung.  Each of the service's stats carries ``/proc/uptime`` as the service
read it: the source now compares it with the host's ``CLOCK_BOOTTIME``
(``fake_jtop.FakeJtop.uptime_s``; ``clock=`` stands for the boot clock).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal import SourceSelection, ThermalMonitor
from inferd.thermal.jtop_source import open_jtop
from tests.fakes import fake_jtop
from tests.unit.thermal.conftest import FakeClock, Sinks, orin_tree


class Seconds:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_jtop_data_the_service_stopped_updating_is_unavailable_not_fresh(
    jetson: fake_jtop.FakeJtop, tmp_path: Path
) -> None:
    boot = Seconds()
    jetson.uptime_s = boot.now
    jetson.temperature = {"cpu": fake_jtop.sensor(71.0), "gpu": fake_jtop.sensor(69.0)}
    config = ThermalConfig(sysfs_root=orin_tree(tmp_path))
    source = open_jtop(config, clock=boot)
    assert source.read().cpu_temp_c == 71.0
    boot.now += 1.0
    jetson.uptime_s += 1.0  # the service read its sensors again
    assert source.read().cpu_temp_c == 71.0
    # The service hangs: its stamp and temperatures stay where they were, while
    # the client keeps answering ok(spin=True) with them.
    boot.now += 2.0
    assert source.read().cpu_temp_c == 71.0  # within a few service intervals
    boot.now += 30.0
    with pytest.raises(TelemetryUnavailableError, match=r"data is 32\.0 s old"):
        source.read()
    # A re-probe on the hung service: its first reading is judged as well.
    with pytest.raises(TelemetryUnavailableError, match=r"data is 32\.0 s old"):
        open_jtop(config, clock=boot).read()
    jetson.uptime_s = boot.now  # the service is back
    jetson.temperature = {"cpu": fake_jtop.sensor(88.0), "gpu": fake_jtop.sensor(69.0)}
    assert source.read().cpu_temp_c == 88.0


def test_a_monitor_on_a_hung_jtop_service_reports_no_telemetry(
    jetson: fake_jtop.FakeJtop, tmp_path: Path
) -> None:
    seconds = Seconds()
    jetson.uptime_s = seconds.now
    config = ThermalConfig(sysfs_root=orin_tree(tmp_path), throttle_enter_c=80.0)
    source = open_jtop(config, clock=seconds)
    sinks, clock = Sinks(), FakeClock()
    monitor = ThermalMonitor(
        config,
        events=sinks.event,
        record=sinks.record,
        clock=clock,
        opener=lambda _config: SourceSelection(source, ()),
    )
    monitor._poll_once()
    for _ in range(20):  # the service hangs for 20 polls (20 s at 1 Hz)
        seconds.now += 1.0
        clock.advance(1.0)
        monitor._poll_once()
    assert not monitor.snapshot().is_telemetry_available
    assert "s old" in monitor.describe()["last_error"]
