"""What a ``tensorrt`` runtime holds per resident engine, and the set it frees.

``Resident``: one deserialized engine, its execution context, IO specs and
buffers.  ``ResidentSet``: every resident engine of a runtime plus its
``trt.Runtime`` and CUDA context; ``close`` releases them in TensorRT's order
(engines before the runtime that deserialized them) with the context current,
unregisters the client regions registered with the context, then detaches it.
It is kept apart from the runtime object so that ``weakref.finalize`` holds no
reference to the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from inferd.errors import InferenceError
from inferd.runtime.tensorrt_buffers import IOBuffers, numpy_dtype_name
from inferd.runtime.tensorrt_cuda import CudaContext
from inferd.runtime.tensorrt_host import HostRegistrations
from inferd.runtime.tensorrt_log import TensorRTLog, explain_failure
from inferd.runtime.tensorrt_memory import GpuMemoryLedger
from inferd.types import OptimizationProfile, TensorSpec

log = structlog.get_logger("inferd.runtime.tensorrt")

ProfileRange = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass
class Resident:
    """One resident engine and everything allocated for it."""

    key: object
    engine_path: Path
    engine: Any
    context: Any
    buffers: IOBuffers
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dtypes: dict[str, np.dtype[Any]]
    profile_ranges: dict[str, ProfileRange]
    engine_bytes: int
    device_memory_bytes: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    addresses: dict[str, int] = field(default_factory=dict)

    @property
    def base_charge(self) -> int:
        return self.engine_bytes + self.device_memory_bytes

    def free(self) -> None:
        """Drop the TensorRT objects and free the buffers (inside a CUDA section)."""
        self.context = None
        self.engine = None
        self.buffers.free_all()

    def set_input_shape(self, tlog: TensorRTLog, spec: TensorSpec, array: np.ndarray) -> None:
        """Check ``array`` against the engine (fixed shape, or within the profile) and
        set a changed dynamic shape on the execution context."""
        resident = self
        context = resident.context
        shape = tuple(int(dim) for dim in array.shape)
        if len(shape) != len(spec.shape):
            raise InferenceError(
                f"input {spec.name!r} has rank {len(shape)}, the engine expects {len(spec.shape)}"
            )
        if spec.name not in resident.profile_ranges:
            if shape != spec.shape:
                raise InferenceError(
                    f"input {spec.name!r} has shape {list(shape)}, the engine expects "
                    f"{list(spec.shape)}"
                )
            return
        low, _opt, high = resident.profile_ranges[spec.name]
        if not all(lo <= dim <= hi for lo, dim, hi in zip(low, shape, high, strict=True)):
            raise InferenceError(
                f"input {spec.name!r} shape {list(shape)} is outside the engine's optimisation "
                f"profile (min {list(low)}, max {list(high)})"
            )
        if resident.shapes.get(spec.name) != shape:
            mark = tlog.mark()
            if not context.set_input_shape(spec.name, shape):
                raise InferenceError(
                    f"input {spec.name!r}: "
                    + explain_failure(tlog.since(mark), action=f"set shape {list(shape)}")
                )
            resident.shapes[spec.name] = shape


class ResidentSet:
    """What ``close`` (or the garbage collector, through ``weakref.finalize``) frees.
    Kept apart from the runtime object so the finalizer holds no reference to it."""

    def __init__(self, cuda: CudaContext, ledger: GpuMemoryLedger) -> None:
        self.cuda = cuda
        self.ledger = ledger
        self.residents: dict[int, Resident] = {}
        self.trt_runtime: Any = None
        #: Client regions registered with the context (unregistered before it goes).
        self.host = HostRegistrations(cuda)
        self.closed = False

    def close(self) -> None:
        cuda = self.cuda
        with cuda.lock, cuda.tlog.scope():
            if self.closed:
                return
            self.closed = True
            context, cuda.context = cuda.context, None
            if context is None:
                return
            try:
                context.push()
            except cuda.module.Error as exc:  # pragma: no cover - driver failure
                log.error("cuda_context_push_failed", error=str(exc))
                return
            try:
                for resident in self.residents.values():
                    resident.free()
                    self.ledger.release(resident.key)
                self.residents.clear()
                self.host.close()
                self.trt_runtime = None  # after its engines: destroying it first is UB
                cuda.stream = None
            finally:
                try:
                    context.detach()  # current here, so really detached (and popped)
                except cuda.module.Error as exc:  # pragma: no cover - driver failure
                    log.error("cuda_context_detach_failed", error=str(exc))


def read_io_specs(
    trt: Any, engine: Any
) -> tuple[
    tuple[TensorSpec, ...],
    tuple[TensorSpec, ...],
    dict[str, np.dtype[Any]],
    dict[str, ProfileRange],
]:
    """An engine's inputs and outputs (``None`` for a dynamic dimension), their numpy
    dtypes, and each dynamic input's (min, opt, max) shapes of profile 0."""
    inputs: list[TensorSpec] = []
    outputs: list[TensorSpec] = []
    dtypes: dict[str, np.dtype[Any]] = {}
    ranges: dict[str, ProfileRange] = {}
    for index in range(engine.num_io_tensors):
        tensor = str(engine.get_tensor_name(index))
        dims = tuple(int(dim) for dim in engine.get_tensor_shape(tensor))
        dtype_name = numpy_dtype_name(trt, engine.get_tensor_dtype(tensor), tensor=tensor)
        dtypes[tensor] = np.dtype(dtype_name)
        shape = tuple(None if dim < 0 else dim for dim in dims)
        if engine.get_tensor_mode(tensor) == trt.TensorIOMode.INPUT:
            profile = None
            if any(dim < 0 for dim in dims):
                low, opt, high = engine.get_tensor_profile_shape(tensor, 0)
                ranges[tensor] = (
                    tuple(int(d) for d in low),
                    tuple(int(d) for d in opt),
                    tuple(int(d) for d in high),
                )
                # Served with the spec: requests outside it are refused on the bus.
                profile = OptimizationProfile(tensor, *ranges[tensor])
            inputs.append(TensorSpec(tensor, dtype_name, shape, profile))
        else:
            outputs.append(TensorSpec(tensor, dtype_name, shape))
    return tuple(inputs), tuple(outputs), dtypes, ranges


def warm_up_inputs(resident: Resident) -> dict[str, np.ndarray]:
    """Zeros for every input, dynamic ones at the profile's opt shape."""
    return {
        spec.name: np.zeros(spec.warm_up_shape(), resident.dtypes[spec.name])
        for spec in resident.inputs
    }
