"""The jtop source (``inferd.thermal.jtop_source``) against the fake jtop."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal import GpuUsage, ThermalReading
from inferd.thermal.jtop_source import JtopSource, jtop_sensor_name, open_jtop
from tests.fakes import fake_jtop
from tests.unit.thermal.conftest import orin_tree


def test_jtop_sensor_names_follow_jtop_rules() -> None:
    assert jtop_sensor_name("cpu-thermal") == "cpu"
    assert jtop_sensor_name("tj-thermal") == "tj"
    assert jtop_sensor_name("CPU-therm") == "CPU"
    assert jtop_sensor_name("x86_pkg_temp") == "x86"


def test_jtop_reading(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.temperature = {"cpu": fake_jtop.sensor(52.5), "gpu": fake_jtop.sensor(49.0)}
    jetson.gpu = fake_jtop.igpu(1_300_500)
    source = open_jtop(ThermalConfig(sysfs_root=orin_tree(tmp_path), poll_hz=4.0))
    got = source.read()
    assert got == ThermalReading(
        cpu_temp_c=52.5,
        gpu_temp_c=49.0,
        throttle=None,
        clock_mhz=1300.5,
        trip_point_c=95.0,
        gpu=GpuUsage(utilization_pct=0.0, power_w=7.5),  # no GPU memory from jtop
    )
    assert jetson.clients[0].started and jetson.clients[0].interval == 0.5


def test_jtop_without_a_power_monitor(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.power = {}
    jetson.gpu["gpu"]["status"]["load"] = 63.5
    got = open_jtop(ThermalConfig(sysfs_root=orin_tree(tmp_path))).read()
    assert got.gpu == GpuUsage(utilization_pct=63.5, power_w=None)


def test_jtop_configured_threshold_skips_trip_points(
    jetson: fake_jtop.FakeJtop, tmp_path: Path
) -> None:
    config = ThermalConfig(sysfs_root=orin_tree(tmp_path), throttle_enter_c=70.0)
    assert open_jtop(config).read().trip_point_c is None
    assert jetson.clients[0].interval == 1.0


def test_jtop_nano_sensor_names(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.temperature = {
        "AO": fake_jtop.sensor(30.0),
        "CPU": fake_jtop.sensor(35.0),
        "GPU": fake_jtop.sensor(33.5),
        "thermal": fake_jtop.sensor(34.0),
    }
    got = open_jtop(ThermalConfig(sysfs_root=tmp_path)).read()
    assert (got.cpu_temp_c, got.gpu_temp_c, got.trip_point_c) == (35.0, 33.5, None)


def test_jtop_offline_sensors_are_skipped(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.temperature = {"cpu": fake_jtop.sensor(48.0), "gpu": fake_jtop.sensor(-256)}
    source = open_jtop(ThermalConfig(sysfs_root=tmp_path))
    assert (source.read().cpu_temp_c, source.read().gpu_temp_c) == (48.0, None)
    # Field report: an "online" GPU sensor reading -256 (AGX Orin, R36.4.7).
    jetson.temperature = {"cpu": fake_jtop.sensor(48.0), "gpu": fake_jtop.sensor(-256, True)}
    assert source.read().gpu_temp_c is None
    jetson.temperature = {
        "cpu": fake_jtop.sensor(48.0, online=False),
        "gpu": fake_jtop.sensor(-256),
    }
    with pytest.raises(TelemetryUnavailableError, match="no online sensor"):
        source.read()


def test_jtop_without_gpu_clock(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.gpu = {}
    assert open_jtop(ThermalConfig(sysfs_root=tmp_path)).read().clock_mhz is None


def test_jtop_service_not_active_is_unavailable(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    jetson.service_active = False
    with pytest.raises(TelemetryUnavailableError, match=r"jtop\.service is not active"):
        open_jtop(ThermalConfig(sysfs_root=tmp_path))
    assert jetson.clients[0].closed


def test_jtop_not_importable_is_unavailable(no_libraries: None) -> None:
    with pytest.raises(TelemetryUnavailableError, match="jetson-stats is not importable"):
        open_jtop(ThermalConfig())


def test_jtop_lost_connection_mid_flight(jetson: fake_jtop.FakeJtop, tmp_path: Path) -> None:
    source = open_jtop(ThermalConfig(sysfs_root=tmp_path))
    assert isinstance(source, JtopSource)
    source.read()
    jetson.reader_error = fake_jtop.JtopException(fake_jtop.LOST_CONNECTION)
    with pytest.raises(TelemetryUnavailableError, match="Lost connection"):
        source.read()
    jetson.reader_error = None
    source.close()
    source.close()
    assert jetson.clients[0].closed
    with pytest.raises(TelemetryUnavailableError, match="no longer running"):
        source.read()


def test_fake_jtop_refuses_what_is_not_faked(jetson: fake_jtop.FakeJtop) -> None:
    module = sys.modules["jtop"]
    client = module.jtop()
    with pytest.raises(AttributeError):
        _ = client.thermal_throttle
    with pytest.raises(AttributeError):
        _ = module.JtopError
