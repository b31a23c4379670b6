"""Linux sysfs thermal zones: ``<root>/thermal_zone*/{type,temp}`` and their
passive trip points (``trip_point_N_type`` / ``trip_point_N_temp``).

Zones are matched by their ``type`` name, never by zone number: the numbering
differs between boards and kernel releases.  Values are millidegrees C.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal.reading import OFFLINE_BELOW_C, ThermalReading

_ZONE_RE = re.compile(r"^thermal_zone(\d+)$")
_TRIP_TYPE_RE = re.compile(r"^trip_point_(\d+)_type$")

#: A passive trip point at or below this is one nobody set: ``x86_pkg_temp``
#: reports its unset trip points as 0 on kernels before ``THERMAL_TEMP_INVALID``
#: ("Setting 0, stops sending thermal notifications"); no board throttles there.
UNSET_TRIP_AT_OR_BELOW_C = 0.0


@dataclass(frozen=True)
class Zone:
    type: str
    path: Path
    passive_trip_c: float | None


def _read_text(path: Path) -> str:
    return path.read_text(encoding="ascii").strip()


def read_millidegrees(path: Path) -> float:
    """A sysfs millidegree file as degrees C; raises ``OSError`` / ``ValueError``."""
    value = int(_read_text(path)) / 1000.0
    if value < OFFLINE_BELOW_C:
        raise ValueError(f"{path} reads {value} C: sensor offline")
    return value


def scan_zones(root: Path) -> dict[str, Path]:
    """Zone ``type`` name → zone directory.  For a type that appears twice the
    lowest-numbered zone wins (deterministic); unreadable zones are skipped."""
    if not root.is_dir():
        raise TelemetryUnavailableError(f"sysfs: {root} is not a directory")
    numbered: list[tuple[int, Path]] = []
    for entry in root.iterdir():
        match = _ZONE_RE.match(entry.name)
        if match:
            numbered.append((int(match.group(1)), entry))
    zones: dict[str, Path] = {}
    for _number, path in sorted(numbered):
        try:
            zone_type = _read_text(path / "type")
        except (OSError, UnicodeDecodeError):
            continue
        if zone_type and zone_type not in zones:
            zones[zone_type] = path
    return zones


def lowest_passive_trip_c(zone: Path) -> float | None:
    """The lowest ``passive`` trip point of a zone, or ``None``; garbage and unset
    trip points (at or below 0 C) are ignored."""
    trips: list[float] = []
    try:
        entries = list(zone.iterdir())
    except OSError:
        return None
    for entry in entries:
        match = _TRIP_TYPE_RE.match(entry.name)
        if not match:
            continue
        try:
            if _read_text(entry) != "passive":
                continue
            trip_c = read_millidegrees(zone / f"trip_point_{match.group(1)}_temp")
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if trip_c > UNSET_TRIP_AT_OR_BELOW_C:
            trips.append(trip_c)
    return min(trips) if trips else None


def find_zone(zones: dict[str, Path], names: Sequence[str]) -> Zone | None:
    """The first of ``names`` (in configured order) that exists, with its trip point."""
    for name in names:
        path = zones.get(name)
        if path is not None:
            return Zone(type=name, path=path, passive_trip_c=lowest_passive_trip_c(path))
    return None


def passive_trip_c(config: ThermalConfig) -> float | None:
    """Lowest passive trip point over the configured CPU/GPU zones, or ``None``.

    Used by sources (jtop) that read the same zones but report no trip points.
    Never raises.
    """
    try:
        zones = scan_zones(config.sysfs_root)
    except (TelemetryUnavailableError, OSError):
        return None
    found = [find_zone(zones, config.cpu_zones), find_zone(zones, config.gpu_zones)]
    trips = [zone.passive_trip_c for zone in found if zone and zone.passive_trip_c is not None]
    return min(trips) if trips else None


class SysfsSource:
    name = "sysfs"

    def __init__(self, cpu: Zone | None, gpu: Zone | None) -> None:
        if cpu is None and gpu is None:
            raise ValueError("a sysfs source needs at least one zone")
        self.cpu = cpu
        self.gpu = gpu
        trips = [
            zone.passive_trip_c for zone in (cpu, gpu) if zone and zone.passive_trip_c is not None
        ]
        #: The lowest passive trip point of the matched zones: conservative
        #: when CPU and GPU trip at different temperatures.
        self.trip_point_c = min(trips) if trips else None

    def read(self) -> ThermalReading:
        failures: list[str] = []
        cpu_temp = self._temp(self.cpu, failures)
        gpu_temp = self._temp(self.gpu, failures)
        if cpu_temp is None and gpu_temp is None:
            raise TelemetryUnavailableError(f"sysfs: no readable zone ({'; '.join(failures)})")
        return ThermalReading(
            cpu_temp_c=cpu_temp, gpu_temp_c=gpu_temp, trip_point_c=self.trip_point_c
        )

    @staticmethod
    def _temp(zone: Zone | None, failures: list[str]) -> float | None:
        if zone is None:
            return None
        try:
            return read_millidegrees(zone.path / "temp")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            failures.append(f"{zone.type}: {exc}")
            return None

    def close(self) -> None:
        return None


def open_sysfs(config: ThermalConfig) -> SysfsSource:
    zones = scan_zones(config.sysfs_root)
    cpu = find_zone(zones, config.cpu_zones)
    gpu = find_zone(zones, config.gpu_zones)
    if cpu is None and gpu is None:
        wanted = [*config.cpu_zones, *config.gpu_zones]
        raise TelemetryUnavailableError(
            f"sysfs: no thermal zone of type {wanted} under {config.sysfs_root} "
            f"(found {sorted(zones)})"
        )
    return SysfsSource(cpu, gpu)
