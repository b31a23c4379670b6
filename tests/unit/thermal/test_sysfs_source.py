"""The sysfs source (``inferd.thermal.sysfs_source``): zones matched by type,
not number; trip points; unreadable or vanishing zones."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal.sysfs_source import open_sysfs, scan_zones
from tests.unit.thermal.conftest import orin_tree, write_zone


def test_sysfs_matches_zones_by_type_not_number(tmp_path: Path) -> None:
    source = open_sysfs(ThermalConfig(sysfs_root=orin_tree(tmp_path)))
    got = source.read()
    assert (got.cpu_temp_c, got.gpu_temp_c) == (58.5, 57.25)
    assert got.throttle is None and got.clock_mhz is None
    assert source.cpu is not None and source.cpu.path.name == "thermal_zone7"


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0), (12, 3, 40)])
def test_sysfs_zone_numbering_is_irrelevant(tmp_path: Path, order: tuple[int, int, int]) -> None:
    write_zone(tmp_path, order[0], "cpu-thermal", 41000)
    write_zone(tmp_path, order[1], "gpu-thermal", 42000)
    write_zone(tmp_path, order[2], "tj-thermal", 99000)
    got = open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read()
    assert (got.cpu_temp_c, got.gpu_temp_c) == (41.0, 42.0)


def test_sysfs_lowest_passive_trip_point_of_the_matched_zones(tmp_path: Path) -> None:
    write_zone(
        tmp_path,
        2,
        "cpu-thermal",
        50000,
        [
            ("critical", 80000),  # lower but not passive: ignored
            ("passive", 95500),
            ("passive", 92000),
            ("passive", "garbage"),
            ("hot", 70000),
        ],
    )
    write_zone(tmp_path, 0, "gpu-thermal", 50000, [("passive", 93000)])
    write_zone(tmp_path, 1, "tj-thermal", 50000, [("passive", 60000)])  # not configured
    assert open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read().trip_point_c == 92.0


def test_sysfs_without_passive_trip_point_has_none(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, "cpu-thermal", 50000, [("critical", 104000)])
    assert open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read().trip_point_c is None


def test_sysfs_uses_configured_name_order(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, "x86_pkg_temp", 70000)
    write_zone(tmp_path, 1, "CPU-therm", 40000)
    config = ThermalConfig(sysfs_root=tmp_path, cpu_zones=("CPU-therm", "x86_pkg_temp"))
    assert open_sysfs(config).read().cpu_temp_c == 40.0
    config = ThermalConfig(sysfs_root=tmp_path, cpu_zones=("x86_pkg_temp", "CPU-therm"))
    assert open_sysfs(config).read().cpu_temp_c == 70.0


def test_sysfs_nano_names(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, "AO-therm", 30000)
    write_zone(tmp_path, 1, "CPU-therm", 35500)
    write_zone(tmp_path, 2, "GPU-therm", 34000)
    write_zone(tmp_path, 3, "PMIC-Die", 100000)
    got = open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read()
    assert (got.cpu_temp_c, got.gpu_temp_c) == (35.5, 34.0)


@pytest.mark.parametrize("bad", ["hot", "", "4.2e4", "-256000"])
def test_sysfs_garbage_temperature_drops_that_zone_only(tmp_path: Path, bad: str) -> None:
    write_zone(tmp_path, 0, "cpu-thermal", bad)
    write_zone(tmp_path, 1, "gpu-thermal", 47000)
    got = open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read()
    assert (got.cpu_temp_c, got.gpu_temp_c) == (None, 47.0)


def test_sysfs_no_readable_zone_is_unavailable(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, "cpu-thermal", "garbage")
    write_zone(tmp_path, 1, "gpu-thermal", None)  # temp file missing
    source = open_sysfs(ThermalConfig(sysfs_root=tmp_path))
    with pytest.raises(TelemetryUnavailableError, match="cpu-thermal"):
        source.read()


def test_sysfs_zone_vanishing_mid_flight_is_unavailable(tmp_path: Path) -> None:
    zone = write_zone(tmp_path, 4, "gpu-thermal", 51000)
    source = open_sysfs(ThermalConfig(sysfs_root=tmp_path))
    assert source.read().gpu_temp_c == 51.0
    (zone / "temp").unlink()
    with pytest.raises(TelemetryUnavailableError):
        source.read()
    (zone / "temp").write_text("52000\n")
    assert source.read().gpu_temp_c == 52.0


def test_sysfs_skips_zones_with_missing_or_garbage_type(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, None, 90000)
    bad = write_zone(tmp_path, 1, None, 91000)
    (bad / "type").write_bytes(b"\xff\xfe")
    write_zone(tmp_path, 2, "cpu-thermal", 44000)
    assert scan_zones(tmp_path) == {"cpu-thermal": tmp_path / "thermal_zone2"}
    assert open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read().cpu_temp_c == 44.0


def test_sysfs_duplicate_type_takes_lowest_numbered_zone(tmp_path: Path) -> None:
    write_zone(tmp_path, 10, "cpu-thermal", 10000)
    write_zone(tmp_path, 2, "cpu-thermal", 20000)
    assert open_sysfs(ThermalConfig(sysfs_root=tmp_path)).read().cpu_temp_c == 20.0


def test_sysfs_without_matching_zone_or_root_is_unavailable(tmp_path: Path) -> None:
    write_zone(tmp_path, 0, "soc0-thermal", 40000)
    with pytest.raises(TelemetryUnavailableError, match=r"no thermal zone.*soc0-thermal"):
        open_sysfs(ThermalConfig(sysfs_root=tmp_path))
    with pytest.raises(TelemetryUnavailableError, match="not a directory"):
        open_sysfs(ThermalConfig(sysfs_root=tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TelemetryUnavailableError):
        open_sysfs(ThermalConfig(sysfs_root=empty))


def test_sysfs_on_this_machine_fails_gracefully() -> None:
    """The real /sys/class/thermal: read if a configured zone exists, else a
    clean ``TelemetryUnavailableError`` (no crash) -- the usual case here."""
    config = ThermalConfig()
    try:
        zones = scan_zones(config.sysfs_root)
    except TelemetryUnavailableError:
        zones = {}
    if set(zones) & {*config.cpu_zones, *config.gpu_zones}:
        assert open_sysfs(config).read().hottest_c is not None
    else:
        with pytest.raises(TelemetryUnavailableError):
            open_sysfs(config)
