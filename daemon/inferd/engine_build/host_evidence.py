"""What a build ran on and what it cost this process, read from the host, never
assumed: the NVIDIA driver version and the GPU memory in use (NVML, through the
one opener ``inferd.nvml``) and the process's peak resident set (``getrusage``).

Where NVML cannot answer (a Jetson has no NVML, a CI runner no GPU) the value is
``None`` and the matching ``…_unavailable`` field says why; a build summary
never carries a placeholder.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Any

from inferd.nvml import NvmlDevice, NvmlUnavailableError, handle_for_cuda_device


@dataclass(frozen=True)
class HostEvidence:
    driver_version: str | None
    driver_unavailable: str | None
    peak_rss_bytes: int
    gpu_memory_used_bytes: int | None
    #: ``process``: this process's own use; ``device``: the whole GPU's (NVML lists
    #: no entry for this process, e.g. under a container's PID namespace).
    gpu_memory_scope: str | None
    gpu_memory_unavailable: str | None

    def resources(self) -> dict[str, Any]:
        """The summary's ``resources`` object."""
        return {
            "peakRssBytes": self.peak_rss_bytes,
            "gpuMemoryUsedBytes": self.gpu_memory_used_bytes,
            "gpuMemoryScope": self.gpu_memory_scope,
            "gpuMemoryUnavailable": self.gpu_memory_unavailable,
        }


def peak_rss_bytes() -> int:
    """This process's peak resident set size; Linux reports ``ru_maxrss`` in KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_host_evidence(device_index: int = 0) -> HostEvidence:
    rss = peak_rss_bytes()
    try:
        device = handle_for_cuda_device(device_index)  # CUDA's numbering, as the build's
    except NvmlUnavailableError as exc:
        return HostEvidence(None, str(exc), rss, None, None, str(exc))
    with device:
        driver, driver_unavailable = _driver_version(device)
        used, scope, memory_unavailable = _gpu_memory(device, os.getpid())
    return HostEvidence(driver, driver_unavailable, rss, used, scope, memory_unavailable)


def _driver_version(device: NvmlDevice) -> tuple[str | None, str | None]:
    try:
        version = device.nvml.nvmlSystemGetDriverVersion()
    except Exception as exc:
        return None, f"nvml: nvmlSystemGetDriverVersion failed: {exc}"
    # nvidia-ml-py before convertStrBytes returns bytes
    return (version.decode() if isinstance(version, bytes) else str(version)), None


def _gpu_memory(device: NvmlDevice, pid: int) -> tuple[int | None, str | None, str | None]:
    nvml, handle = device.nvml, device.handle
    try:
        for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            # usedGpuMemory is None where NVML reports NVML_VALUE_NOT_AVAILABLE
            if process.pid == pid and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory), "process", None
    except Exception as exc:
        process_failure = f"nvmlDeviceGetComputeRunningProcesses failed: {exc}; "
    else:
        process_failure = ""
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).used), "device", None
    except Exception as exc:
        return None, None, f"nvml: {process_failure}nvmlDeviceGetMemoryInfo failed: {exc}"
