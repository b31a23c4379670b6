"""NVML (``nvidia-ml-py``, module ``pynvml``): GPU temperature, the clock event
reasons with the SW/HW thermal slowdown bits, the SM clock, and the GPU's
utilisation, memory and power draw (each absent where the driver does not
report it).

NVML is opened through ``inferd.nvml`` (which imports ``pynvml`` lazily), on the
GPU CUDA numbers ``thermal.nvml_device_index`` (default ``runtime.device_id``):
NVML's own numbering ignores ``CUDA_VISIBLE_DEVICES`` and need not be CUDA's, so
``handle_for_cuda_device`` finds it by PCI bus id, or refuses when it cannot tell.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.nvml import NvmlDevice, NvmlUnavailableError, handle_for_cuda_device
from inferd.thermal.reading import GpuUsage, ThermalReading

#: nvmlClocksEventReasonSwThermalSlowdown / HwThermalSlowdown (same values under
#: the deprecated nvmlClocksThrottleReason* names); used if a binding lacks both.
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_FUNCTION_NOT_FOUND = 13

log = structlog.get_logger("inferd.thermal")


def _constant(nvml: Any, names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = getattr(nvml, name, None)
        if isinstance(value, int):
            return value
    return default


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class NvmlSource:
    name = "nvml"

    def __init__(self, device: NvmlDevice, *, slowdown_c: float | None) -> None:
        nvml = device.nvml
        self._device = device
        #: Which GPU is read: for the monitor's ``thermal_source_selected`` (``gpu``).
        self.gpu = f"CUDA device {device.index}, {device.matched_by}"
        self._nvml = nvml
        self._handle = device.handle
        self.slowdown_c = slowdown_c
        self._sw_bit = _constant(
            nvml,
            ("nvmlClocksEventReasonSwThermalSlowdown", "nvmlClocksThrottleReasonSwThermalSlowdown"),
            SW_THERMAL_SLOWDOWN,
        )
        self._hw_bit = _constant(
            nvml,
            ("nvmlClocksEventReasonHwThermalSlowdown", "nvmlClocksThrottleReasonHwThermalSlowdown"),
            HW_THERMAL_SLOWDOWN,
        )
        # The new name first; older bindings (and drivers) have only the old one.
        self._reason_getters: list[Callable[[Any], int]] = [
            getter
            for getter in (
                getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None),
                getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
            )
            if getter is not None
        ]

    def read(self) -> ThermalReading:
        nvml = self._nvml
        try:
            temp = float(nvml.nvmlDeviceGetTemperature(self._handle, nvml.NVML_TEMPERATURE_GPU))
        except nvml.NVMLError as exc:
            raise TelemetryUnavailableError(f"nvml: nvmlDeviceGetTemperature: {exc}") from exc
        throttle, reason = self._throttle()
        return ThermalReading(
            cpu_temp_c=None,
            gpu_temp_c=temp,
            throttle=throttle,
            throttle_reason=reason,
            clock_mhz=self._clock_mhz(),
            trip_point_c=self.slowdown_c,
            gpu=self._usage(),
        )

    def _usage(self) -> GpuUsage:
        utilization = self._query("nvmlDeviceGetUtilizationRates")
        memory = self._query("nvmlDeviceGetMemoryInfo")
        power_mw = self._query("nvmlDeviceGetPowerUsage")
        return GpuUsage(
            utilization_pct=_number(getattr(utilization, "gpu", None)),
            memory_used_bytes=_integer(getattr(memory, "used", None)),
            memory_total_bytes=_integer(getattr(memory, "total", None)),
            power_w=None if (mw := _number(power_mw)) is None else mw / 1000.0,
        )

    def _query(self, function: str) -> Any:
        """``function(handle)``, or None when the binding lacks it or the driver
        does not support it (an iGPU, a MIG slice, no permission)."""
        getter = getattr(self._nvml, function, None)
        if getter is None:
            return None
        try:
            return getter(self._handle)
        except self._nvml.NVMLError:
            return None

    def _throttle(self) -> tuple[bool | None, str | None]:
        nvml = self._nvml
        while self._reason_getters:
            getter = self._reason_getters[0]
            try:
                reasons = int(getter(self._handle))
            except nvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code in (_NVML_ERROR_FUNCTION_NOT_FOUND, _NVML_ERROR_NOT_SUPPORTED):
                    # The driver lacks this entry point: try the older name, or
                    # fall back to temperature thresholds for good.
                    log.info(
                        "thermal_nvml_reasons_unsupported",
                        function=getattr(getter, "__name__", "reasons"),
                        error=str(exc),
                    )
                    self._reason_getters.pop(0)
                    continue
                raise TelemetryUnavailableError(f"nvml: clock event reasons: {exc}") from exc
            active = [
                label
                for label, bit in (
                    ("sw_thermal_slowdown", self._sw_bit),
                    ("hw_thermal_slowdown", self._hw_bit),
                )
                if reasons & bit
            ]
            return bool(active), ",".join(active) or None
        return None, None

    def _clock_mhz(self) -> float | None:
        nvml = self._nvml
        try:
            return float(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM))
        except nvml.NVMLError:
            return None

    def close(self) -> None:
        try:
            self._device.close()
        except Exception as exc:
            log.warning("thermal_nvml_shutdown_failed", error=str(exc))


def open_nvml(config: ThermalConfig) -> NvmlSource:
    try:
        device = handle_for_cuda_device(config.nvml_device_index)
    except NvmlUnavailableError as exc:
        raise TelemetryUnavailableError(str(exc)) from exc
    nvml = device.nvml
    try:
        slowdown_c: float | None = float(
            nvml.nvmlDeviceGetTemperatureThreshold(
                device.handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
            )
        )
    except Exception:
        slowdown_c = None
    return NvmlSource(device, slowdown_c=slowdown_c)
