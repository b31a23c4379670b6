"""jetson-stats (``jtop``): temperatures and the GPU clock, read from the
``jtop.service`` daemon.

``jtop`` names a sensor after its thermal zone ``type`` cut at the first ``-``
(else ``_``): ``cpu-thermal`` → ``cpu``.  The configured zone names are mapped
the same way.  jtop reports no throttle signal and no trip points, so the
passive trip points are read from sysfs when no threshold is configured.
GPU load comes from ``gpu[name].status.load`` (percent) and power from
``power.tot.power`` (mW, the module's total input); jtop reports no separate
GPU memory (a Jetson's GPU shares the system RAM), so that stays absent.
``jtop`` is imported inside ``open_jtop`` only.

The client never says its data is old: when the service's stats stop coming
(the service stuck in a sensor read), it decodes the last ones again every
``interval * 3`` and ``ok(spin=True)`` stays True.  Each of the service's stats
carries ``/proc/uptime`` as the service read it (``uptime``), the host's
``CLOCK_BOOTTIME``: data older than ``max(4 service intervals, 3 s)`` makes the
read unavailable (DESIGN.md 168).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import structlog

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal.reading import OFFLINE_BELOW_C, GpuUsage, ThermalReading
from inferd.thermal.sysfs_source import passive_trip_c

#: jtop's update interval is shared by every client of the service; never ask
#: it for more than this.
_MIN_INTERVAL_S = 0.5
#: The service's data is stale once older than this many of its intervals
#: (the client re-serves old data after 3), or ...
_STALE_INTERVALS = 4
#: ... this long, whichever is longer (a loaded service runs late).
_MIN_STALE_S = 3.0

log = structlog.get_logger("inferd.thermal")


def jtop_sensor_name(zone_type: str) -> str:
    """The name jtop gives the thermal zone of type ``zone_type``."""
    return zone_type.split("-")[0] if "-" in zone_type else zone_type.split("_")[0]


def _sensor_names(zone_types: Sequence[str]) -> tuple[str, ...]:
    names: list[str] = []
    for zone_type in zone_types:
        name = jtop_sensor_name(zone_type)
        if name not in names:
            names.append(name)
    return tuple(names)


def _temperature(sensors: Mapping[str, Any], names: Sequence[str]) -> float | None:
    by_lower = {str(key).lower(): value for key, value in sensors.items()}
    for name in names:
        entry = sensors.get(name, by_lower.get(name.lower()))
        if entry is None:
            continue
        if isinstance(entry, Mapping):
            if not entry.get("online", True):
                continue
            entry = entry.get("temp")
        if isinstance(entry, bool) or not isinstance(entry, int | float):
            continue
        temp = float(entry)
        if temp >= OFFLINE_BELOW_C:  # jtop reports an offline sensor as -256
            return temp
    return None


class JtopSource:
    name = "jtop"

    def __init__(
        self,
        jetson: Any,
        *,
        cpu_names: tuple[str, ...],
        gpu_names: tuple[str, ...],
        trip_point_c: float | None,
        stale_after_s: float = _MIN_STALE_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._jetson = jetson
        self._closed = False
        self.cpu_names = cpu_names
        self.gpu_names = gpu_names
        self.trip_point_c = trip_point_c
        self.stale_after_s = stale_after_s
        #: The host's uptime now (what ``/proc/uptime`` says); None: not Linux.
        self._clock = clock if clock is not None else _boot_clock()

    def read(self) -> ThermalReading:
        try:
            # spin=True: do not block for fresh data; re-raises the reader
            # thread's error (e.g. "Lost connection with jtop server").
            running = self._jetson.ok(spin=True)
            sensors = self._jetson.temperature
        except Exception as exc:
            raise TelemetryUnavailableError(f"jtop: {exc}") from exc
        if not running:
            raise TelemetryUnavailableError("jtop: the client is no longer running")
        if not isinstance(sensors, Mapping):
            raise TelemetryUnavailableError(f"jtop: temperature is a {type(sensors).__name__}")
        self._check_fresh()
        cpu = _temperature(sensors, self.cpu_names)
        gpu = _temperature(sensors, self.gpu_names)
        if cpu is None and gpu is None:
            raise TelemetryUnavailableError(
                f"jtop: no online sensor named {[*self.cpu_names, *self.gpu_names]} "
                f"(has {sorted(map(str, sensors))})"
            )
        return ThermalReading(
            cpu_temp_c=cpu,
            gpu_temp_c=gpu,
            clock_mhz=self._gpu_clock_mhz(),
            trip_point_c=self.trip_point_c,
            gpu=GpuUsage(utilization_pct=self._gpu_load_pct(), power_w=self._total_power_w()),
        )

    def _check_fresh(self) -> None:
        """Raises when the service's data is older than ``stale_after_s``; a jtop
        without an ``uptime`` stamp is taken as it comes."""
        if self._clock is None:
            return
        try:
            uptime = self._jetson.uptime
        except Exception:
            return
        if not isinstance(uptime, timedelta):
            return
        age_s = self._clock() - uptime.total_seconds()
        if age_s > self.stale_after_s:
            raise TelemetryUnavailableError(
                f"jtop: the service's data is {age_s:.1f} s old "
                f"(stale after {self.stale_after_s:g} s: the service stopped reading)"
            )

    def _gpu_load_pct(self) -> float | None:
        try:
            for gpu in self._jetson.gpu.values():
                load = gpu["status"]["load"]
                if isinstance(load, int | float) and not isinstance(load, bool):
                    return float(load)
        except Exception:
            return None
        return None

    def _total_power_w(self) -> float | None:
        try:
            milliwatts = self._jetson.power["tot"]["power"]
        except Exception:  # no power monitor on this module, or an older jtop
            return None
        if isinstance(milliwatts, bool) or not isinstance(milliwatts, int | float):
            return None
        return float(milliwatts) / 1000.0

    def _gpu_clock_mhz(self) -> float | None:
        try:
            for gpu in self._jetson.gpu.values():
                current = gpu["freq"]["cur"]  # kHz
                if isinstance(current, int | float) and not isinstance(current, bool):
                    return float(current) / 1000.0
        except Exception:
            return None
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._jetson.close()
        except Exception as exc:
            log.warning("thermal_jtop_close_failed", error=str(exc))


def open_jtop(config: ThermalConfig, *, clock: Callable[[], float] | None = None) -> JtopSource:
    try:
        from jtop import JtopException, jtop
    except Exception as exc:  # ImportError, or a broken install raising anything
        raise TelemetryUnavailableError(f"jtop: jetson-stats is not importable: {exc}") from exc
    jetson = jtop(interval=max(_MIN_INTERVAL_S, 1.0 / config.poll_hz))
    try:
        jetson.start()  # connects to jtop.service and waits for the first data
    except JtopException as exc:
        _close_quietly(jetson)
        raise TelemetryUnavailableError(f"jtop: service: {exc}") from exc
    except Exception as exc:
        _close_quietly(jetson)
        raise TelemetryUnavailableError(f"jtop: start failed: {type(exc).__name__}: {exc}") from exc
    trip = passive_trip_c(config) if config.throttle_enter_c is None else None
    interval = max(_MIN_INTERVAL_S, 1.0 / config.poll_hz)
    with contextlib.suppress(Exception):  # the service's, which another client may have set
        interval = max(interval, float(jetson.interval))
    return JtopSource(
        jetson,
        cpu_names=_sensor_names(config.cpu_zones),
        gpu_names=_sensor_names(config.gpu_zones),
        trip_point_c=trip,
        stale_after_s=max(_STALE_INTERVALS * interval, _MIN_STALE_S),
        clock=clock,
    )


def _boot_clock() -> Callable[[], float] | None:
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    if clock_id is None:
        return None
    return lambda: time.clock_gettime(clock_id)


def _close_quietly(jetson: Any) -> None:
    with contextlib.suppress(Exception):
        jetson.close()
