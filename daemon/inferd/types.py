"""Plain data passed between components.  Imports nothing from inferd."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class PrecisionMode(enum.StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    MIXED = "mixed"


@dataclass(frozen=True)
class OptimizationProfile:
    """min/opt/max shape per dynamic input, as TensorRT optimisation profiles take them."""

    input_name: str
    min_shape: tuple[int, ...]
    opt_shape: tuple[int, ...]
    max_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        ranks = {len(self.min_shape), len(self.opt_shape), len(self.max_shape)}
        if len(ranks) != 1:
            raise ValueError(f"profile {self.input_name!r}: min/opt/max shapes differ in rank")
        for low, opt, high in zip(self.min_shape, self.opt_shape, self.max_shape, strict=True):
            if not 0 < low <= opt <= high:
                raise ValueError(
                    f"profile {self.input_name!r}: need 0 < min <= opt <= max per dimension, "
                    f"got {self.min_shape} / {self.opt_shape} / {self.max_shape}"
                )


@dataclass(frozen=True)
class BuildConfig:
    precision: PrecisionMode = PrecisionMode.FP32
    workspace_bytes: int = 1 << 30
    optimization_level: int = 3
    profiles: tuple[OptimizationProfile, ...] = ()

    def __post_init__(self) -> None:
        if self.workspace_bytes <= 0:
            raise ValueError(f"workspace_bytes must be positive, got {self.workspace_bytes}")
        if not 0 <= self.optimization_level <= 5:
            raise ValueError(f"optimization_level must be 0..5, got {self.optimization_level}")


@dataclass(frozen=True)
class EngineCacheEntry:
    """What a runtime can load: the artifact, the model it came from and how it was built.

    For ``onnx_trt_ep`` the artifact is the ``.onnx`` itself and
    ``staged_engines`` lists prebuilt TRT EP engines to place in its cache.
    """

    runtime_label: str
    artifact_path: Path
    model_path: Path
    model_sha256: str
    build_config: BuildConfig
    staged_engines: tuple[Path, ...] = ()


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output. ``None`` in ``shape`` is a dynamic dimension."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]

    def as_wire(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True, eq=False)
class EngineHandle:
    """A resident engine.  Opaque: the runtime keeps the real object; callers
    see only identity, IO specs and where it runs."""

    handle_id: int
    runtime_label: str
    model_sha256: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    active_providers: tuple[str, ...] = ()
    is_fallback: bool = False


@dataclass(frozen=True)
class ThermalState:
    cpu_temp_c: float | None = None
    gpu_temp_c: float | None = None
    thermal_throttle_active: bool = False
    measured_clock_mhz: float | None = None
    measured_at_ns: int = 0
    is_telemetry_available: bool = False

    def __post_init__(self) -> None:
        if not self.is_telemetry_available and self.thermal_throttle_active:
            raise ValueError("throttle cannot be reported active without telemetry")

    @classmethod
    def unavailable(cls, measured_at_ns: int = 0) -> ThermalState:
        return cls(measured_at_ns=measured_at_ns)


AlertLevel = Literal[
    "EMERGENCY", "ALERT", "CRITICAL", "ERROR", "WARNING", "NOTICE", "INFO", "DEBUG"
]


@dataclass(frozen=True)
class Alert:
    level: AlertLevel
    code: str
    message: str
    fields: Mapping[str, Any] = field(default_factory=dict)


#: Components raise alerts through a plain callable; the service decides where
#: they go (PUB ``alert`` topic, log, later the FDR and ground-station hooks).
AlertSink = Callable[[Alert], None]

#: Components publish events (topic, payload) through this; the service owns the PUB socket.
EventSink = Callable[[str, Mapping[str, Any]], None]

#: Components write flight-data-recorder records through this: ``record(kind,
#: payload)``.  It validates the payload against the kind's required keys
#: (raising ``ValueError`` on a programming error) and never blocks.
RecordSink = Callable[[str, Mapping[str, Any]], None]
