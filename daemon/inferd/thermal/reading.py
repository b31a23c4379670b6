"""What a thermal source returns: one raw reading, not yet stamped or judged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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

    @property
    def hottest_c(self) -> float | None:
        temps = [temp for temp in (self.cpu_temp_c, self.gpu_temp_c) if temp is not None]
        return max(temps) if temps else None


class ThermalSource(Protocol):
    """An opened source.  ``read`` raises ``TelemetryUnavailableError`` when it
    cannot read; ``close`` is idempotent and never raises."""

    name: str

    def read(self) -> ThermalReading: ...

    def close(self) -> None: ...
