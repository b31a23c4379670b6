"""TensorRT-direct strategy (label ``tensorrt``): the production path on the vehicle.

* ``compile_engine``: locates this model's engine in ``runtime.engine_dir``
  (``inferd.engines.locate``, step 1 of the engine pipeline).  It never
  builds: with no intact engine for this host it raises
  ``EngineMissingError``, the model serves on the fallback and the daemon
  builds the engine in a build child (``inferd.serving.rebuild``).
  Nothing in an engine dir that is not safely the daemon's own is trusted
  (``inferd.engines.engine_dir``): ``UnsafeDirectoryError`` names why, and no
  build is asked for, since a build refuses that dir too (``BUILD_FIXES``); one
  that could not be checked (``EMFILE``, ``EIO``) is ``UncheckedDirectoryError``,
  no build either (the engine may be there): the next location checks again.
* ``deserialize_engine``: the ``EngineGate`` first (its refusals propagate:
  they are ``InferdError`` and make the service fail over, and the gate logs
  and records ``engine_refused``); then the GPU memory budget, *before* any
  TensorRT call; then ``trt.Runtime(logger).deserialize_cuda_engine`` on the
  bytes ``ValidatedEngine.read_verified`` re-hashed; IO specs; one warm-up run.
* ``infer``: pinned host buffers and device buffers allocated once per tensor
  (re-allocated only when a dynamic shape grows), H2D -> ``execute_async_v3``
  -> D2H -> ``Stream.synchronize`` on the runtime's own stream
  (``tensorrt_execute``); tensors in a client's shared-memory region are read
  and written where they are (``tensorrt_host``).

GPU memory budget: ``tensorrt_memory``; the CUDA context and why every call
makes it current: ``tensorrt_cuda``; resident engines and their release
order: ``tensorrt_resident``.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from inferd.config import RuntimeConfig
from inferd.engines.engine_dir import untrusted_engine_dir
from inferd.engines.gate import EngineGate, ValidatedEngine
from inferd.engines.host import read_host_tuple
from inferd.engines.locate import locate_engine
from inferd.engines.manifest import Manifest, deployment_manifest
from inferd.errors import (
    EngineDeserializeError,
    EngineManifestError,
    EngineMissingError,
    ExecutionFailedError,
    InferdError,
    InferenceError,
    OutOfMemoryError,
    RuntimeNotAvailableError,
    UnsafeDirectoryError,
)
from inferd.runtime.tensorrt_buffers import IOBuffers
from inferd.runtime.tensorrt_cuda import CudaContext, is_sticky_cuda_error
from inferd.runtime.tensorrt_execute import enqueue_and_wait
from inferd.runtime.tensorrt_log import TensorRTLog, explain_failure
from inferd.runtime.tensorrt_memory import GpuMemoryLedger, ledger_for, mib
from inferd.runtime.tensorrt_resident import (
    Resident,
    ResidentSet,
    read_io_specs,
    warm_up_inputs,
)
from inferd.types import (
    AlertSink,
    BuildConfig,
    EngineCacheEntry,
    EngineFile,
    EngineHandle,
    HostRegion,
    HostTuple,
    RecordSink,
    ThermalState,
)

LABEL = "tensorrt"
ACTIVE_PROVIDERS: tuple[str, ...] = ("TensorRT",)

log = structlog.get_logger("inferd.runtime.tensorrt")

#: Names runtimes in TensorRT's log lines (``owner``): a process may hold several.
_runtime_numbers = itertools.count(1)


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
        self._tlog = TensorRTLog(trt, owner=f"tensorrt runtime {next(_runtime_numbers)}")
        self._cuda = CudaContext(cuda, config.device_id, self._tlog)
        self._state = ResidentSet(self._cuda, ledger or ledger_for(config.device_id))
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
        the fallback and the daemon builds the engine in a child process.  An engine dir
        not safely the daemon's own raises ``UnsafeDirectoryError``, as at load: a build
        would refuse it too (``ensure_owned_dir``), so none is asked for; one that could
        not be checked, ``UncheckedDirectoryError`` (from ``locate_engine``), as at load."""
        host = self._host_tuple(
            precision=build_config.precision, device_index=self._config.device_id
        )
        plan = locate_engine(
            model_path,
            build_config,
            engine_dir=self._config.engine_dir,
            host=host,
            manifest=self._manifest_for_locate,
        )
        if plan.untrusted is not None:
            raise UnsafeDirectoryError(f"no trusted engine for this host: {plan.untrusted}")
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
        return deployment_manifest(self._config.engine_manifest, self._config.engine_dir)

    def _manifest_for_locate(self) -> Manifest:
        """The manifest, so that locate prefers an engine it trusts; one that cannot
        be read trusts nothing here (``deserialize_engine`` reports why)."""
        try:
            return self._manifest()
        except EngineManifestError:
            return Manifest.empty()

    def deserialize_engine(self, entry: EngineCacheEntry) -> EngineHandle:
        if entry.runtime_label != LABEL:
            raise EngineDeserializeError(
                f"entry for {entry.artifact_path} was compiled by {entry.runtime_label!r}, "
                f"not {LABEL!r}"
            )
        untrusted = untrusted_engine_dir(entry.artifact_path.parent)
        if untrusted is not None:  # an entry compile_engine did not locate (a build's)
            raise UnsafeDirectoryError(f"engine {entry.artifact_path.name} not loaded: {untrusted}")
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
                resident = self._load(validated, validated.read_verified(), key)
                handle = EngineHandle(
                    handle_id=next(self._handle_ids),
                    runtime_label=LABEL,
                    model_sha256=entry.model_sha256,
                    inputs=resident.inputs,
                    outputs=resident.outputs,
                    active_providers=ACTIVE_PROVIDERS,
                    is_fallback=self._is_fallback,
                    engine_path=validated.path,
                    engine_file=EngineFile(validated.device, validated.inode, validated.sha256),
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

    def _load(self, validated: ValidatedEngine, data: bytearray, key: object) -> Resident:
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
        inputs, outputs, dtypes, ranges = read_io_specs(trt, engine)
        mark = self._tlog.mark()
        context = engine.create_execution_context()
        if context is None:
            raise EngineDeserializeError(
                f"engine {name}: no execution context: "
                + explain_failure(self._tlog.since(mark), action="create an execution context")
            )
        resident = Resident(
            key=key,
            engine_path=validated.path,
            engine=engine,
            context=context,
            buffers=IOBuffers(self._cuda.module),
            inputs=inputs,
            outputs=outputs,
            dtypes=dtypes,
            profile_ranges=ranges,
            engine_bytes=validated.size_bytes,
            device_memory_bytes=int(device_memory),
        )
        try:
            self._run(resident, warm_up_inputs(resident))
        except InferdError as exc:
            resident.free()
            kind = OutOfMemoryError if isinstance(exc, OutOfMemoryError) else EngineDeserializeError
            raise kind(f"warm-up run of engine {name} failed: {exc}") from exc
        except BaseException:
            resident.free()
            raise
        return resident

    # -- infer ----------------------------------------------------------------------------

    def infer(
        self,
        handle: EngineHandle,
        inputs: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray] | None = None,
        regions: Sequence[HostRegion] = (),
    ) -> dict[str, np.ndarray]:
        resident = self._state.residents.get(handle.handle_id)
        if resident is None:
            raise InferenceError(f"engine handle {handle.handle_id} has been released")
        with self._cuda.section():
            if resident.context is None:  # released by another thread meanwhile
                raise InferenceError(f"engine handle {handle.handle_id} has been released")
            return self._run(resident, inputs, outputs or {}, regions)

    def _run(
        self,
        resident: Resident,
        inputs: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray] | None = None,
        regions: Sequence[HostRegion] = (),
    ) -> dict[str, np.ndarray]:
        cuda = self._cuda.module
        try:
            return enqueue_and_wait(
                self._cuda,
                self._tlog,
                self._state.host,
                self._charge_buffers,
                resident,
                inputs,
                outputs or {},
                regions,
            )
        except cuda.MemoryError as exc:
            self._after_failure(resident)
            raise OutOfMemoryError(f"CUDA out of memory during inference: {exc}") from exc
        except cuda.Error as exc:
            self._after_failure(resident)
            raise ExecutionFailedError(
                f"CUDA error during inference: {exc}", sticky=is_sticky_cuda_error(str(exc))
            ) from exc
        except InferdError:
            self._after_failure(resident)
            raise

    def _after_failure(self, resident: Resident) -> None:
        # Never leave queued copies behind that point into buffers about to change.
        with contextlib.suppress(Exception):
            self._cuda.stream.synchronize()
        # Buffers are charged before they grow: a growth that failed (CUDA out of
        # memory) must not leave the budget charged for memory this engine lacks.
        held = resident.base_charge + resident.buffers.device_bytes
        self._state.ledger.settle(resident.key, held)

    def _charge_buffers(self, resident: Resident, required: dict[str, int]) -> None:
        """Charge the IO buffers ``required`` (tensor -> bytes) grows to, or raise."""
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
