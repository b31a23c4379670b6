"""Checks of what this host is: its platform release, TensorRT, its engine host
tuple (read the way the daemon reads it) and the NVML thermal source."""

from __future__ import annotations

import platform
from typing import Any

from inferd.engine_build.acceptance.scenario import Scenario
from inferd.engine_build.tensorrt_build import has_precision_flags
from inferd.engines.host import (
    NV_TEGRA_RELEASE,
    GpuProbe,
    probe_gpu_nvml,
    probe_gpu_pycuda,
    read_platform_release,
)
from inferd.errors import HostTupleUnavailableError, TelemetryUnavailableError
from inferd.selftest.check import Check, Skipped
from inferd.selftest.context import MISSING_GPU_STACK, SelftestContext
from inferd.types import TENSORRT_VERSION_PATTERN

#: A GPU temperature outside this range is a misread sensor, not a reading.
PLAUSIBLE_GPU_TEMP_C = (-40.0, 150.0)


def host_platform(context: SelftestContext, sc: Scenario) -> str:
    sc.notes["releaseFile"] = str(NV_TEGRA_RELEASE)
    sc.notes["releaseFileExists"] = NV_TEGRA_RELEASE.exists()
    sc.notes["machine"] = platform.machine()
    sc.notes["kernel"] = platform.release()
    try:
        release = read_platform_release()
    except HostTupleUnavailableError as exc:
        sc.check("the platform release is read", False, str(exc))
        return "the platform release cannot be read"
    sc.notes["platform"] = release
    sc.check("the platform release is read", True, release)
    return f"platform {release}" + ("" if sc.notes["releaseFileExists"] else " (not a Jetson)")


def tensorrt_import(context: SelftestContext, sc: Scenario) -> str:
    trt = context.tensorrt()
    version = getattr(trt, "__version__", None)
    sc.notes["version"] = version
    sc.notes["module"] = str(getattr(trt, "__file__", None))
    sc.check(
        "tensorrt.__version__ is a full version",
        isinstance(version, str) and TENSORRT_VERSION_PATTERN.fullmatch(version) is not None,
        version,
    )
    flags = has_precision_flags(trt)
    sc.notes["precisionFlags"] = flags
    typing = "precision builder flags" if flags else "strongly typed networks only"
    return f"TensorRT {version} ({typing})"


def _probe(probe: GpuProbe, device_id: int) -> dict[str, Any]:
    try:
        gpu = probe(device_id)
    except Exception as exc:
        return {"error": str(exc)}
    return {"name": gpu.name, "computeCapability": list(gpu.compute_capability)}


def host_tuple(context: SelftestContext, sc: Scenario) -> str:
    try:
        host = context.host_tuple()
    except HostTupleUnavailableError as exc:
        sc.notes["causes"] = exc.causes
        if exc.causes and set(exc.causes) <= MISSING_GPU_STACK:
            raise Skipped(f"host tuple unavailable: {exc}") from exc
        sc.check("this host's tuple is read", False, str(exc))
        return "the host tuple cannot be read"
    sc.notes["tuple"] = host.describe()
    probes = {
        "nvml": _probe(probe_gpu_nvml, context.device_id),
        "pycuda": _probe(probe_gpu_pycuda, context.device_id),
    }
    sc.notes["probes"] = probes
    sc.check("this host's tuple is read", True, host.summary())
    capabilities = [p["computeCapability"] for p in probes.values() if "computeCapability" in p]
    sc.check(
        "the GPU probes that answer agree on the compute capability",
        len({tuple(c) for c in capabilities}) <= 1,
        probes,
    )
    return host.summary()


def thermal_nvml(context: SelftestContext, sc: Scenario) -> str:
    from inferd.config import ThermalConfig
    from inferd.thermal.nvml_source import open_nvml

    try:
        source = open_nvml(ThermalConfig(nvml_device_index=context.device_id))
    except TelemetryUnavailableError as exc:
        raise Skipped(f"NVML unavailable: {exc}") from exc
    try:
        reading = source.read()
    except TelemetryUnavailableError as exc:
        sc.check("NVML reads the GPU temperature", False, str(exc))
        return "NVML opened but cannot read"
    finally:
        source.close()
    sc.notes["reading"] = {
        "gpuTempC": reading.gpu_temp_c,
        "throttle": reading.throttle,
        "throttleReason": reading.throttle_reason,
        "smClockMhz": reading.clock_mhz,
        "slowdownThresholdC": reading.trip_point_c,
    }
    low, high = PLAUSIBLE_GPU_TEMP_C
    temp = reading.gpu_temp_c
    sc.check(
        "NVML reads a plausible GPU temperature",
        temp is not None and low <= temp <= high,
        temp,
    )
    # None: the driver answered neither reasons function, so the daemon can tell a
    # thermal slowdown only from the temperature threshold.
    sc.check(
        "NVML reads the clock event reasons (thermal slowdown bits)",
        reading.throttle is not None,
        reading.throttle_reason,
    )
    sc.check(
        "NVML reads the SM clock",
        reading.clock_mhz is not None and reading.clock_mhz > 0,
        reading.clock_mhz,
    )
    throttle = "unknown" if reading.throttle is None else str(reading.throttle).lower()
    return f"GPU {temp} C, thermal throttle {throttle}, SM clock {reading.clock_mhz} MHz"


HOST_CPU_CHECKS = (
    Check(
        "host.platform",
        "cpu",
        "the platform release is read (/etc/nv_tegra_release; none off Jetson)",
        host_platform,
    ),
)

HOST_GPU_CHECKS = (
    Check("tensorrt.import", "gpu", "TensorRT imports and reports its version", tensorrt_import),
    Check(
        "host.tuple",
        "gpu",
        "this host's engine tuple (GPU through NVML or pycuda, platform, TensorRT) is read "
        "for real",
        host_tuple,
    ),
)

THERMAL_CHECKS = (
    Check(
        "thermal.nvml",
        "gpu",
        "the NVML thermal source reads the GPU temperature, throttle reasons and SM clock",
        thermal_nvml,
    ),
)
