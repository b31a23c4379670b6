"""The NVML source (``inferd.thermal.nvml_source``) against the fake pynvml."""

from __future__ import annotations

import sys

import pytest

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal import GpuUsage, ThermalReading
from inferd.thermal.nvml_source import NvmlSource, open_nvml
from tests.fakes import fake_pynvml


def test_nvml_reading(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.temperature_c, nvml.sm_clock_mhz = 61, 1305
    source = open_nvml(ThermalConfig())
    got = source.read()
    assert got == ThermalReading(
        cpu_temp_c=None,
        gpu_temp_c=61.0,
        throttle=False,
        throttle_reason=None,
        clock_mhz=1305.0,
        trip_point_c=90.0,
        gpu=GpuUsage(
            utilization_pct=37.0,
            memory_used_bytes=1024**3,
            memory_total_bytes=12 * 1024**3,
            power_w=61.25,
        ),
    )
    assert "nvmlDeviceGetCurrentClocksEventReasons" in nvml.calls
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" not in nvml.calls


@pytest.mark.parametrize(
    ("reasons", "throttle", "reason"),
    [
        (0, False, None),
        (fake_pynvml.SW_THERMAL, True, "sw_thermal_slowdown"),
        (fake_pynvml.HW_THERMAL, True, "hw_thermal_slowdown"),
        (
            fake_pynvml.SW_THERMAL | fake_pynvml.HW_THERMAL | fake_pynvml.SW_POWER_CAP,
            True,
            "sw_thermal_slowdown,hw_thermal_slowdown",
        ),
        (fake_pynvml.SW_POWER_CAP | 0x1 | 0x8, False, None),  # power cap, idle: not thermal
    ],
)
def test_nvml_thermal_slowdown_bits(
    nvml: fake_pynvml.FakeNvml, reasons: int, throttle: bool, reason: str | None
) -> None:
    nvml.reasons = reasons
    got = open_nvml(ThermalConfig()).read()
    assert (got.throttle, got.throttle_reason) == (throttle, reason)


def test_nvml_constants_have_the_real_values(nvml: fake_pynvml.FakeNvml) -> None:
    module = sys.modules["pynvml"]
    assert module.nvmlClocksEventReasonSwThermalSlowdown == 0x20
    assert module.nvmlClocksEventReasonHwThermalSlowdown == 0x40
    assert module.nvmlClocksThrottleReasonHwThermalSlowdown == 0x40
    with pytest.raises(AttributeError):
        _ = module.nvmlDeviceGetThermalState  # not a real NVML name


def test_nvml_older_binding_uses_throttle_reasons(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.has_event_reasons = False
    sys.modules["pynvml"] = fake_pynvml.make_module(nvml)  # monkeypatch restores it
    nvml.reasons = fake_pynvml.HW_THERMAL
    assert open_nvml(ThermalConfig()).read().throttle is True
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in nvml.calls


def test_nvml_old_driver_without_event_reasons_falls_back(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.errors["nvmlDeviceGetCurrentClocksEventReasons"] = (
        fake_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    )
    nvml.reasons = fake_pynvml.SW_THERMAL
    source = open_nvml(ThermalConfig())
    assert source.read().throttle is True
    assert source.read().throttle is True
    assert nvml.calls.count("nvmlDeviceGetCurrentClocksEventReasons") == 1  # not retried


def test_nvml_reasons_not_supported_means_no_throttle_signal(
    nvml: fake_pynvml.FakeNvml,
) -> None:
    for name in (
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
    ):
        nvml.errors[name] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    got = open_nvml(ThermalConfig()).read()
    assert got.throttle is None and got.gpu_temp_c == 50.0 and got.trip_point_c == 90.0


def test_nvml_clock_failure_keeps_the_reading(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.errors["nvmlDeviceGetClockInfo"] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml.errors["nvmlDeviceGetTemperatureThreshold"] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    got = open_nvml(ThermalConfig()).read()
    assert (got.gpu_temp_c, got.clock_mhz, got.trip_point_c) == (50.0, None, None)


def test_nvml_gpu_lost_mid_flight_is_unavailable(nvml: fake_pynvml.FakeNvml) -> None:
    source = open_nvml(ThermalConfig())
    source.read()
    nvml.errors["nvmlDeviceGetTemperature"] = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(TelemetryUnavailableError, match="GPU is lost"):
        source.read()
    del nvml.errors["nvmlDeviceGetTemperature"]
    nvml.errors["nvmlDeviceGetCurrentClocksEventReasons"] = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(TelemetryUnavailableError, match="clock event reasons"):
        source.read()


def test_nvml_init_failure_is_unavailable(nvml: fake_pynvml.FakeNvml) -> None:
    nvml.errors["nvmlInit"] = fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(TelemetryUnavailableError, match="NVML Shared Library Not Found"):
        open_nvml(ThermalConfig())
    nvml.errors["nvmlInit"] = fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(TelemetryUnavailableError, match="Driver Not Loaded"):
        open_nvml(ThermalConfig())


def test_nvml_missing_device_shuts_nvml_down(nvml: fake_pynvml.FakeNvml) -> None:
    with pytest.raises(TelemetryUnavailableError, match="no device 3"):
        open_nvml(ThermalConfig(nvml_device_index=3))
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1


def test_nvml_not_importable_is_unavailable(no_libraries: None) -> None:
    with pytest.raises(TelemetryUnavailableError, match="pynvml is not importable"):
        open_nvml(ThermalConfig())


def test_nvml_close_shuts_down_once(nvml: fake_pynvml.FakeNvml) -> None:
    source = open_nvml(ThermalConfig())
    assert isinstance(source, NvmlSource) and nvml.init_count == 1
    source.close()
    source.close()
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1


def test_nvml_usage_the_driver_does_not_report_is_absent(nvml: fake_pynvml.FakeNvml) -> None:
    """An iGPU or a MIG slice answers NOT_SUPPORTED for utilisation and power: the
    reading says None (no metric), never 0, and the temperature still counts."""
    nvml.utilization_pct, nvml.power_mw = None, None
    nvml.errors["nvmlDeviceGetMemoryInfo"] = fake_pynvml.NVML_ERROR_NOT_SUPPORTED
    got = open_nvml(ThermalConfig()).read()
    assert got.gpu == GpuUsage()
    assert got.gpu_temp_c == 50.0
