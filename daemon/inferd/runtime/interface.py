"""The contract every runtime strategy implements."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from inferd.types import BuildConfig, EngineCacheEntry, EngineHandle, HostRegion, ThermalState


class InferenceRuntime(Protocol):
    """One inference backend.  Every method but ``thermal_state`` and
    ``current_runtime_label`` is called only from the engine-worker thread that
    owns the device, so implementations need no locking of their own.

    Errors are raised as ``inferd.errors.InferdError`` subclasses; a strategy
    never lets its library's exception types escape.
    """

    def compile_engine(self, model_path: Path, build_config: BuildConfig) -> EngineCacheEntry:
        """Produce (or locate) the artifact this runtime loads for ``model_path``."""
        ...

    def deserialize_engine(self, entry: EngineCacheEntry) -> EngineHandle:
        """Make ``entry`` resident and warmed up; the handle is ready to ``infer``."""
        ...

    def infer(
        self,
        handle: EngineHandle,
        inputs: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray] | None = None,
        regions: Sequence[HostRegion] = (),
    ) -> dict[str, np.ndarray]:
        """Run one request; inputs are already validated against ``handle.inputs``.

        ``outputs``: arrays to write the named outputs into (views of a client's
        shared-memory region, validated against ``handle.outputs``); the result
        holds those very arrays.  An output that comes out with another shape
        raises ``OutputShapeError``.  ``regions``: the regions that some inputs
        and outputs are views of (``HostRegion``), for a runtime that registers
        host memory with its device; the others ignore it."""
        ...

    def release_engine(self, handle: EngineHandle) -> None:
        """Free the engine's resources.  Idempotent."""
        ...

    def thermal_state(self) -> ThermalState:
        """The latest thermal snapshot (never blocks on telemetry)."""
        ...

    def current_runtime_label(self) -> str: ...
