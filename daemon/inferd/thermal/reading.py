"""What a thermal source returns: one raw reading, not yet stamped or judged."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

#: Readings below this are a sensor reporting itself offline (jtop and some
#: Tegra drivers report -256 C), not a temperature.
OFFLINE_BELOW_C = -100.0


@dataclass(frozen=True)
class GpuUsage:
    """The GPU's utilisation, memory and power at one poll; each field None when
    the source cannot say (NVML on a Jetson, jtop's memory).  ``power_w`` is
    NVML's board draw of the GPU, or jtop's total module input (Jetson modules
    have no GPU-only rail on every model)."""

    utilization_pct: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_w: float | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "gpu_utilization_pct": self.utilization_pct,
            "gpu_memory_used_bytes": self.memory_used_bytes,
            "gpu_memory_total_bytes": self.memory_total_bytes,
            "gpu_power_w": self.power_w,
        }


@dataclass(frozen=True)
class ThermalReading:
    """One raw reading from a source.

    ``throttle`` is the source's own throttle signal (NVML clock event
    reasons) or ``None`` when the source has none; the monitor then decides
    from the temperatures and a threshold.  ``trip_point_c`` is the lowest
    passive trip point (or the driver's slowdown threshold) the source knows
    of, used when ``thermal.throttle_enter_c`` is not configured.
    """

    cpu_temp_c: float | None
    gpu_temp_c: float | None
    throttle: bool | None = None
    throttle_reason: str | None = None
    clock_mhz: float | None = None
    trip_point_c: float | None = None
    #: What the source reports of the GPU's load, memory and power (NVML, jtop);
    #: None where it reports nothing of it (sysfs), never a zero.
    gpu: GpuUsage | None = None

    @property
    def hottest_c(self) -> float | None:
        temps = [temp for temp in (self.cpu_temp_c, self.gpu_temp_c) if temp is not None]
        return max(temps) if temps else None


def is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def implausible(reading: ThermalReading) -> str | None:
    """Why ``reading`` is not one to publish, or None.  A NaN, an infinity, an
    offline marker (-256) or a string is a broken source, not a temperature.
    The whole reading is refused: the sane sensor next to it may be the cooler
    one, and a string would crash ``hottest_c``."""
    for field in ("cpu_temp_c", "gpu_temp_c"):
        value = getattr(reading, field)
        if value is not None and not (is_finite_number(value) and value >= OFFLINE_BELOW_C):
            return f"implausible temperature {field}={value!r}"
    return None


class ThermalSource(Protocol):
    """An opened source.  ``read`` raises ``TelemetryUnavailableError`` when it
    cannot read; ``close`` is idempotent and never raises."""

    name: str

    def read(self) -> ThermalReading: ...

    def close(self) -> None: ...
