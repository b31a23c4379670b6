"""A passive trip point that is not set is no throttle threshold.

``x86_pkg_temp`` (in the default ``thermal.cpu_zones``) registers two passive
trip points that user space may set; unset, kernels before the change to
``THERMAL_TEMP_INVALID`` (``drivers/thermal/intel/x86_pkg_temp_thermal.c``
``sys_get_trip_temp``: ``*temp = 0``; 5.15 among them) report them as ``0``, and
the driver's documentation says "Setting 0, stops sending thermal
notifications".  The source took 0 C as the lowest passive trip point, so the
monitor reported throttling at any temperature on such a host.
"""

from __future__ import annotations

from pathlib import Path

from inferd.config import ThermalConfig
from inferd.thermal import SourceSelection, ThermalMonitor
from inferd.thermal.sysfs_source import open_sysfs, passive_trip_c
from tests.unit.thermal.conftest import FakeClock, Sinks, write_zone


def _x86_host(root: Path) -> Path:
    write_zone(root, 0, "acpitz", 27800, [("critical", 119000)])
    # Both of x86_pkg_temp's trip points unset, as a 5.15 kernel shows them.
    write_zone(root, 1, "x86_pkg_temp", 45000, [("passive", 0), ("passive", 0)])
    return root


def test_an_unset_x86_pkg_temp_trip_point_is_no_threshold(tmp_path: Path) -> None:
    config = ThermalConfig(sysfs_root=_x86_host(tmp_path))
    assert open_sysfs(config).read().trip_point_c is None
    assert passive_trip_c(config) is None  # what jtop uses


def test_a_set_trip_point_next_to_an_unset_one_is_the_threshold(tmp_path: Path) -> None:
    write_zone(tmp_path, 1, "x86_pkg_temp", 45000, [("passive", 0), ("passive", 90000)])
    assert open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read().trip_point_c == 90.0


def test_a_cool_x86_host_is_not_reported_throttling(tmp_path: Path) -> None:
    config = ThermalConfig(sysfs_root=_x86_host(tmp_path))
    source = open_sysfs(config)
    monitor = ThermalMonitor(
        config,
        events=Sinks().event,
        clock=FakeClock(),
        opener=lambda _config: SourceSelection(source, ()),
    )
    state = monitor._poll_once()
    assert state.is_telemetry_available and state.cpu_temp_c == 45.0
    assert not state.thermal_throttle_active, monitor.describe()["threshold_c"]
