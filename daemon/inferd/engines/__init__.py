"""Engine identity and trust: naming schema, host tuple, sidecars, manifest, the gate.

A plain library: no ZeroMQ, no ``inferd.bus`` / ``inferd.service``; ``pynvml``,
``pycuda`` and ``tensorrt`` are imported inside the host probes only.
"""

from __future__ import annotations

from inferd.engines.gate import (
    STEP_HOST_MATCH,
    STEP_MANIFEST_DIGEST,
    STEP_SCHEMA_PARSE,
    STEP_SIDECAR_DIGEST,
    STEP_SIDECAR_PRESENT,
    STEPS,
    EngineGate,
    StepVerdict,
    ValidatedEngine,
    explain,
    first_failure,
)
from inferd.engines.host import (
    NV_TEGRA_RELEASE,
    GpuInfo,
    GpuProbe,
    parse_nv_tegra_release,
    probe_gpu_nvml,
    probe_gpu_pycuda,
    probe_tensorrt_version,
    read_host_tuple,
    read_platform_release,
)
from inferd.engines.manifest import Manifest, manifest_json, write_manifest
from inferd.engines.naming import (
    ENGINE_SUFFIX,
    EngineName,
    build_config_hash,
    engine_name_for,
    format_engine_name,
    parse_engine_name,
    sanitize_label,
    sanitize_sku,
)
from inferd.engines.sidecar import read_sidecar, sidecar_path, write_sidecar
from inferd.types import HostTuple

__all__ = [
    "ENGINE_SUFFIX",
    "NV_TEGRA_RELEASE",
    "STEPS",
    "STEP_HOST_MATCH",
    "STEP_MANIFEST_DIGEST",
    "STEP_SCHEMA_PARSE",
    "STEP_SIDECAR_DIGEST",
    "STEP_SIDECAR_PRESENT",
    "EngineGate",
    "EngineName",
    "GpuInfo",
    "GpuProbe",
    "HostTuple",
    "Manifest",
    "StepVerdict",
    "ValidatedEngine",
    "build_config_hash",
    "engine_name_for",
    "explain",
    "first_failure",
    "format_engine_name",
    "manifest_json",
    "parse_engine_name",
    "parse_nv_tegra_release",
    "probe_gpu_nvml",
    "probe_gpu_pycuda",
    "probe_tensorrt_version",
    "read_host_tuple",
    "read_platform_release",
    "read_sidecar",
    "sanitize_label",
    "sanitize_sku",
    "sidecar_path",
    "write_manifest",
    "write_sidecar",
]
