"""TensorRT-direct strategy (label ``tensorrt``): the production path on the vehicle.

* ``compile_engine``: locates this model's engine in ``runtime.engine_dir``
  (``inferd.engines.locate``, step 1 of the engine pipeline).  It never
  builds: with no intact engine for this host it raises
  ``EngineMissingError``, the model serves on the fallback and the daemon
  builds the engine in a build child (``inferd.serving.rebuild``).
* ``deserialize_engine``: the ``EngineGate`` first (its refusals propagate:
  they are ``InferdError`` and make the service fail over, and the gate logs
  and records ``c7.engine_refused``); then the GPU memory budget, *before* any
  TensorRT call; then ``trt.Runtime(logger).deserialize_cuda_engine`` on the
  bytes ``ValidatedEngine.read_verified`` re-hashed; IO specs; one warm-up run.
* ``infer``: pinned host buffers and device buffers allocated once per tensor
  (re-allocated only when a dynamic shape grows), H2D -> ``execute_async_v3``
  -> D2H -> ``Stream.synchronize`` on the runtime's own stream.

GPU memory budget.  ``runtime.gpu_memory_budget_bytes`` bounds what the
TensorRT engines of one GPU hold in this process, summed over every runtime
instance (a process-wide ledger per device): during a make-before-break switch
old and new engine really are resident together.  An engine is charged its
file size before deserialization (an estimate of its weights), then file size +
``device_memory_size_v2`` (activations; ``device_memory_size`` on TensorRT
without it) + its IO buffers.  A refusal raises ``OutOfMemoryError`` and leaves
everything resident as it was.  ONNX Runtime's own arena is not counted.

CUDA context.  ``create`` makes one context on ``runtime.device_id``
(``Device.make_context``) and a stream in it, then pops it: it is current on
no thread between calls.  Every section that touches CUDA or TensorRT pushes
it and pops it again (``CudaContext.section``), because a runtime is not used from
one thread only: make-before-break switching prepares (builds, deserializes,
warms up) on a switch thread while the engine worker serves from the previous
runtime, and the worker then runs ``infer`` and ``release_engine``.  A CUDA
context is current per thread, and TensorRT and pycuda act on whichever one is
current, so without the push the worker would run this engine in no context
(or in another runtime's).  pycuda's ``detach`` only really detaches a context
that is current (or on its creating thread), so ``close`` pushes it first.
A lock serialises sections of one runtime; two runtimes never share a context.
``close`` (also run when the runtime is garbage collected) releases every
engine and detaches the context.
"""

from __future__ import annotations

import contextlib
import itertools
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from inferd.config import RuntimeConfig
from inferd.engines.gate import EngineGate, ValidatedEngine
from inferd.engines.host import read_host_tuple
from inferd.engines.locate import locate_engine
from inferd.engines.manifest import MANIFEST_NAME, Manifest
from inferd.errors import (
    EngineDeserializeError,
    EngineMissingError,
    InferdError,
    InferenceError,
    OutOfMemoryError,
    RuntimeNotAvailableError,
)
from inferd.runtime.tensorrt_buffers import IOBuffers, numpy_dtype_name
from inferd.runtime.tensorrt_cuda import CudaContext
from inferd.runtime.tensorrt_log import TensorRTLog, explain_failure
from inferd.runtime.tensorrt_memory import GpuMemoryLedger, ledger_for, mib
from inferd.types import (
    AlertSink,
    BuildConfig,
    EngineCacheEntry,
    EngineHandle,
    HostTuple,
    RecordSink,
    TensorSpec,
    ThermalState,
)

LABEL = "tensorrt"
ACTIVE_PROVIDERS: tuple[str, ...] = ("TensorRT",)

log = structlog.get_logger("inferd.runtime.tensorrt")


def create(
    config: RuntimeConfig,
    *,
    is_fallback: bool,
    alert: AlertSink,
    record: RecordSink,
    thermal: Callable[[], ThermalState],
) -> TensorRTRuntime:
    """Compose the strategy; ``RuntimeNotAvailableError`` when TensorRT, pycuda or
    the CUDA device is missing (the service then fails over to ``onnx_trt_ep``)."""
    try:
        import tensorrt as trt
    except Exception as exc:  # ImportError, or OSError from a broken libnvinfer
        raise RuntimeNotAvailableError(
            LABEL, f"the tensorrt package cannot be imported ({exc})"
        ) from None
    try:
        import pycuda.driver as cuda
    except Exception as exc:
        raise RuntimeNotAvailableError(
            LABEL,
            f"pycuda.driver cannot be imported ({exc}); the tensorrt runtime needs it for its "
            "CUDA context, stream and buffers",
        ) from None
    return TensorRTRuntime(
        config,
        trt=trt,
        cuda=cuda,
        is_fallback=is_fallback,
        alert=alert,
        record=record,
        thermal=thermal,
    )


def _clear_frames(exc: BaseException) -> None:
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]


@dataclass
class _Resident:
    """One resident engine and everything allocated for it."""

    key: object
    engine_path: Path
    engine: Any
    context: Any
    buffers: IOBuffers
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dtypes: dict[str, np.dtype[Any]]
    profile_ranges: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
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


class _State:
    """What ``close`` (or the garbage collector, through ``weakref.finalize``) frees.
    Kept apart from the runtime object so the finalizer holds no reference to it."""

    def __init__(self, cuda: CudaContext, ledger: GpuMemoryLedger, tlog: TensorRTLog) -> None:
        self.cuda = cuda
        self.ledger = ledger
        self.tlog = tlog  # TensorRT's logger must outlive every object made with it
        self.residents: dict[int, _Resident] = {}
        self.trt_runtime: Any = None
        self.closed = False

    def close(self) -> None:
        cuda = self.cuda
        with cuda.lock:
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
                self.trt_runtime = None  # after its engines: destroying it first is UB
                cuda.stream = None
            finally:
                try:
                    context.detach()  # current here, so really detached (and popped)
                except cuda.module.Error as exc:  # pragma: no cover - driver failure
                    log.error("cuda_context_detach_failed", error=str(exc))


class TensorRTRuntime:
    def __init__(
        self,
        config: RuntimeConfig,
        *,
        trt: Any,
        cuda: Any,
        is_fallback: bool = False,
        alert: AlertSink,
        record: RecordSink,
        thermal: Callable[[], ThermalState],
        ledger: GpuMemoryLedger | None = None,
        host_tuple: Callable[..., HostTuple] | None = None,
    ) -> None:
        self._trt = trt
        self._config = config
        self._is_fallback = is_fallback
        self._alert = alert
        self._record = record
        self._thermal = thermal
        self._host_tuple = host_tuple if host_tuple is not None else read_host_tuple
        self._handle_ids = itertools.count(1)
        self._tlog = TensorRTLog(trt)
        self._cuda = CudaContext(cuda, config.device_id)
        self._state = _State(self._cuda, ledger or ledger_for(config.device_id), self._tlog)
        self._finalizer = weakref.finalize(self, self._state.close)

    # -- small accessors ----------------------------------------------------------------

    def current_runtime_label(self) -> str:
        return LABEL

    def thermal_state(self) -> ThermalState:
        return self._thermal()

    @property
    def ledger(self) -> GpuMemoryLedger:
        return self._state.ledger

    @property
    def resident_count(self) -> int:
        return len(self._state.residents)

    def close(self) -> None:
        """Release every engine and detach the CUDA context.  Idempotent."""
        self._finalizer()

    # -- locate -------------------------------------------------------------------------

    def compile_engine(self, model_path: Path, build_config: BuildConfig) -> EngineCacheEntry:
        """Locate this model's engine; this runtime never builds (DESIGN.md, "One engine
        pipeline"): a missing engine raises ``EngineMissingError``, the model serves on
        the fallback and the daemon builds the engine in a child process."""
        host = self._host_tuple(
            precision=build_config.precision, device_index=self._config.device_id
        )
        plan = locate_engine(
            model_path, build_config, engine_dir=self._config.engine_dir, host=host
        )
        if plan.status == "to_build":
            moved = (
                f"; the unusable file was moved to {plan.quarantined}" if plan.quarantined else ""
            )
            raise EngineMissingError(
                f"no engine for this host in {self._config.engine_dir} "
                f"(expected {plan.entry.artifact_path.name}){moved}",
                engine_path=plan.entry.artifact_path,
            )
        return plan.entry

    # -- deserialize ----------------------------------------------------------------------

    def _manifest(self) -> Manifest:
        configured = self._config.engine_manifest
        if configured is not None:
            return Manifest.load(configured)
        default = self._config.engine_dir / MANIFEST_NAME
        if default.exists():
            return Manifest.load(default)
        return Manifest.empty(source=f"<none: no {default}>")

    def deserialize_engine(self, entry: EngineCacheEntry) -> EngineHandle:
        if entry.runtime_label != LABEL:
            raise EngineDeserializeError(
                f"entry for {entry.artifact_path} was compiled by {entry.runtime_label!r}, "
                f"not {LABEL!r}"
            )
        host = self._host_tuple(
            precision=entry.build_config.precision, device_index=self._config.device_id
        )
        gate = EngineGate(host, self._manifest(), record=self._record)
        validated = gate.validate(
            entry.artifact_path, model_sha256=entry.model_sha256, build_config=entry.build_config
        )
        state = self._state
        budget = self._config.gpu_memory_budget_bytes
        key = object()
        accepted, others = state.ledger.charge(key, validated.size_bytes, budget)
        if not accepted:
            raise OutOfMemoryError(
                f"engine {validated.path.name} needs about {mib(validated.size_bytes)} (its "
                f"file size) but {mib(others)} of the {mib(budget)} GPU memory budget "
                f"(runtime.gpu_memory_budget_bytes) is held by {state.ledger.engines()} "
                "resident engine(s)"
            )
        try:
            with self._cuda.section():
                try:
                    resident = self._load(validated, validated.read_verified(), key)
                except BaseException as exc:
                    # The traceback's frames still reference the engine and its
                    # execution context: drop them while this context is current.
                    _clear_frames(exc)
                    raise
                handle = EngineHandle(
                    handle_id=next(self._handle_ids),
                    runtime_label=LABEL,
                    model_sha256=entry.model_sha256,
                    inputs=resident.inputs,
                    outputs=resident.outputs,
                    active_providers=ACTIVE_PROVIDERS,
                    is_fallback=self._is_fallback,
                )
                state.residents[handle.handle_id] = resident  # under the lock: close() may run
        except BaseException:
            state.ledger.release(key)
            raise
        log.info(
            "engine_loaded",
            engine=str(validated.path),
            model_sha256=entry.model_sha256[:16],
            engine_bytes=resident.engine_bytes,
            device_memory_bytes=resident.device_memory_bytes,
            budget_used_bytes=state.ledger.used(),
            budget_bytes=budget,
        )
        return handle

    def _trt_runtime(self) -> Any:
        state = self._state
        if state.trt_runtime is None:
            state.trt_runtime = self._trt.Runtime(self._tlog.logger)
        return state.trt_runtime

    def _load(self, validated: ValidatedEngine, data: bytearray, key: object) -> _Resident:
        """Deserialize, charge, specs, execution context, buffers, warm-up (in a section)."""
        trt = self._trt
        name = validated.path.name
        mark = self._tlog.mark()
        try:
            engine = self._trt_runtime().deserialize_cuda_engine(data)
        except Exception as exc:
            raise EngineDeserializeError(f"engine {name} could not be deserialized: {exc}") from exc
        finally:
            del data
        if engine is None:
            messages = self._tlog.since(mark)
            log.error("engine_deserialize_failed", engine=name, tensorrt_said=messages)
            raise EngineDeserializeError(
                f"engine {name} could not be deserialized: "
                + explain_failure(messages, action="deserialize the engine")
            )
        device_memory = (
            engine.device_memory_size_v2
            if hasattr(engine, "device_memory_size_v2")
            else engine.device_memory_size
        )
        budget = self._config.gpu_memory_budget_bytes
        accepted, others = self._state.ledger.charge(
            key, validated.size_bytes + device_memory, budget
        )
        if not accepted:
            del engine
            raise OutOfMemoryError(
                f"engine {name} needs {mib(validated.size_bytes + device_memory)} (file "
                f"{mib(validated.size_bytes)} + device memory {mib(device_memory)}) but "
                f"{mib(others)} of the {mib(budget)} GPU memory budget "
                "(runtime.gpu_memory_budget_bytes) is already held"
            )
        inputs: list[TensorSpec] = []
        outputs: list[TensorSpec] = []
        dtypes: dict[str, np.dtype[Any]] = {}
        ranges: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        for index in range(engine.num_io_tensors):
            tensor = str(engine.get_tensor_name(index))
            dims = tuple(int(dim) for dim in engine.get_tensor_shape(tensor))
            dtype_name = numpy_dtype_name(trt, engine.get_tensor_dtype(tensor), tensor=tensor)
            dtypes[tensor] = np.dtype(dtype_name)
            spec = TensorSpec(
                name=tensor,
                dtype=dtype_name,
                shape=tuple(None if dim < 0 else dim for dim in dims),
            )
            if engine.get_tensor_mode(tensor) == trt.TensorIOMode.INPUT:
                inputs.append(spec)
                if any(dim < 0 for dim in dims):
                    low, opt, high = engine.get_tensor_profile_shape(tensor, 0)
                    ranges[tensor] = (
                        tuple(int(d) for d in low),
                        tuple(int(d) for d in opt),
                        tuple(int(d) for d in high),
                    )
            else:
                outputs.append(spec)
        mark = self._tlog.mark()
        context = engine.create_execution_context()
        if context is None:
            raise EngineDeserializeError(
                f"engine {name}: no execution context: "
                + explain_failure(self._tlog.since(mark), action="create an execution context")
            )
        resident = _Resident(
            key=key,
            engine_path=validated.path,
            engine=engine,
            context=context,
            buffers=IOBuffers(self._cuda.module),
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            dtypes=dtypes,
            profile_ranges=ranges,
            engine_bytes=validated.size_bytes,
            device_memory_bytes=int(device_memory),
        )
        try:
            self._run(resident, self._warm_up_inputs(resident))
        except InferdError as exc:
            resident.free()
            kind = OutOfMemoryError if isinstance(exc, OutOfMemoryError) else EngineDeserializeError
            raise kind(f"warm-up run of engine {name} failed: {exc}") from exc
        except BaseException:
            resident.free()
            raise
        return resident

    @staticmethod
    def _warm_up_inputs(resident: _Resident) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {}
        for spec in resident.inputs:
            if spec.name in resident.profile_ranges:
                shape = resident.profile_ranges[spec.name][1]
            else:
                shape = tuple(dim or 0 for dim in spec.shape)
            arrays[spec.name] = np.zeros(shape, resident.dtypes[spec.name])
        return arrays

    # -- infer ----------------------------------------------------------------------------

    def infer(
        self, handle: EngineHandle, inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        resident = self._state.residents.get(handle.handle_id)
        if resident is None:
            raise InferenceError(f"engine handle {handle.handle_id} has been released")
        with self._cuda.section():
            if resident.context is None:  # released by another thread meanwhile
                raise InferenceError(f"engine handle {handle.handle_id} has been released")
            return self._run(resident, inputs)

    def _run(self, resident: _Resident, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        cuda = self._cuda.module
        try:
            return self._enqueue_and_wait(resident, inputs)
        except cuda.MemoryError as exc:
            self._drain()
            raise OutOfMemoryError(f"CUDA out of memory during inference: {exc}") from exc
        except cuda.Error as exc:
            self._drain()
            raise InferenceError(f"CUDA error during inference: {exc}") from exc
        except InferdError:
            self._drain()
            raise

    def _drain(self) -> None:
        # Never leave queued copies behind that point into buffers about to change.
        with contextlib.suppress(Exception):
            self._cuda.stream.synchronize()

    def _input_shape(self, resident: _Resident, spec: TensorSpec, array: np.ndarray) -> None:
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
            mark = self._tlog.mark()
            if not context.set_input_shape(spec.name, shape):
                raise InferenceError(
                    f"input {spec.name!r}: "
                    + explain_failure(self._tlog.since(mark), action=f"set shape {list(shape)}")
                )
            resident.shapes[spec.name] = shape

    def _enqueue_and_wait(
        self, resident: _Resident, inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        cuda = self._cuda.module
        stream = self._cuda.stream
        context = resident.context
        staged: list[tuple[str, np.ndarray]] = []
        for spec in resident.inputs:
            if spec.name not in inputs:
                raise InferenceError(f"input {spec.name!r} is missing")
            array = inputs[spec.name]
            if array.dtype != resident.dtypes[spec.name]:
                raise InferenceError(
                    f"input {spec.name!r} is {array.dtype}, the engine expects {spec.dtype}"
                )
            self._input_shape(resident, spec, array)
            staged.append((spec.name, array))
        out_shapes: list[tuple[str, tuple[int, ...]]] = []
        for spec in resident.outputs:
            shape = tuple(int(dim) for dim in context.get_tensor_shape(spec.name))
            if any(dim < 0 for dim in shape):
                raise InferenceError(
                    f"output {spec.name!r} has a data-dependent shape {list(shape)}, which "
                    "this runtime does not support"
                )
            out_shapes.append((spec.name, shape))

        required = {name: array.nbytes for name, array in staged}
        for name, shape in out_shapes:
            required[name] = int(np.prod(shape, dtype=np.int64)) * resident.dtypes[name].itemsize
        grown = resident.buffers.capacity_after(required)
        if grown != resident.buffers.device_bytes or not resident.buffers.buffers:
            budget = self._config.gpu_memory_budget_bytes
            accepted, others = self._state.ledger.charge(
                resident.key, resident.base_charge + grown, budget
            )
            if not accepted:
                raise OutOfMemoryError(
                    f"IO buffers of {mib(grown)} for engine {resident.engine_path.name} do not "
                    f"fit the GPU memory budget ({mib(others + resident.base_charge)} of "
                    f"{mib(budget)} already held)"
                )
        for name, nbytes in required.items():
            buffer, moved = resident.buffers.ensure(name, nbytes)
            if moved or resident.addresses.get(name) != buffer.address:
                if not context.set_tensor_address(name, buffer.address):
                    raise InferenceError(f"TensorRT refused the device address of {name!r}")
                resident.addresses[name] = buffer.address

        buffers = resident.buffers.buffers
        for name, array in staged:
            if array.nbytes == 0:
                continue
            buffer = buffers[name]
            np.copyto(buffer.host_view(array.nbytes, array.dtype, array.shape), array)
            cuda.memcpy_htod_async(buffer.device, buffer.host_bytes(array.nbytes), stream)
        mark = self._tlog.mark()
        if not context.execute_async_v3(stream.handle):
            raise InferenceError(
                explain_failure(self._tlog.since(mark), action="enqueue the inference")
            )
        for name, _shape in out_shapes:
            if required[name]:
                buffer = buffers[name]
                cuda.memcpy_dtoh_async(buffer.host_bytes(required[name]), buffer.device, stream)
        stream.synchronize()
        # Copy out of the pinned buffers: they are reused by the next request while
        # the reply frames may still be in flight.
        return {
            name: buffers[name].host_view(required[name], resident.dtypes[name], shape).copy()
            for name, shape in out_shapes
        }

    # -- release --------------------------------------------------------------------------

    def release_engine(self, handle: EngineHandle) -> None:
        state = self._state
        with self._cuda.lock:
            resident = state.residents.pop(handle.handle_id, None)
            if resident is None:
                return
            try:
                if self._cuda.context is not None:
                    with self._cuda.section():
                        resident.free()
                else:  # closed: the context (and everything in it) is already gone
                    resident.free()
            finally:
                state.ledger.release(resident.key)
        log.info("engine_released", engine=str(resident.engine_path))
