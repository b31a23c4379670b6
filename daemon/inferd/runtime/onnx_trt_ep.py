"""ONNX Runtime strategy (label ``onnx_trt_ep``): the degraded-latency fallback.

Sessions ask for ``[TensorRT EP, CUDA EP, CPU EP]`` filtered to what this ONNX Runtime build
offers.  ONNX Runtime drops a provider it cannot create, and its Python session retries a failed
creation with ``[CUDA EP, CPU EP]`` and no options, that is on device 0 (a session with a GPU
provider off ``runtime.device_id`` is made again there, ``ort_session``), so the runtime
compares the providers the session really registered with the ones it wants
(``ort_providers``): every difference is a ``provider_degraded`` record and, when ONNX
Runtime dropped what it was asked for, one alert; it is refused when
``runtime.ort_require_tensorrt_ep`` or ``runtime.ort_disallow_cpu_fallback`` forbids it.  A
model's staged engine is gated and served through an EP-context model (``ort_ep_context``);
otherwise the session is made from the model's bytes as hashed (``ort_model_source``).  What
the load decides from the model's graph is read from those bytes, parsed once if at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from inferd.config import RuntimeConfig
from inferd.digest import sha256_remembered
from inferd.engines.build_config import workspace_cap_bytes
from inferd.engines.host import read_host_tuple
from inferd.engines.locate import model_file_problem
from inferd.errors import (
    EngineBuildError,
    EngineDeserializeError,
    InferenceError,
    OutOfMemoryError,
    OutputShapeError,
    RuntimeNotAvailableError,
    UnsafeDirectoryError,
)
from inferd.owned_files import ensure_owned_dir
from inferd.runtime.onnx_trt_ep_shapes import check_before_session, profile_options
from inferd.runtime.ort_binding import InPlaceRunner
from inferd.runtime.ort_ep_context import EpContextModel, prepare_ep_context
from inferd.runtime.ort_errors import is_out_of_memory, is_output_shape_error
from inferd.runtime.ort_model_source import HashedModel
from inferd.runtime.ort_precision import int8_refusal
from inferd.runtime.ort_providers import (
    CPU_EP,
    CUDA_EP,
    DEGRADED_KIND,
    PREFERRED_PROVIDERS,
    TRT_EP,
    ProviderResolution,
    cuda_ep_options,
    degradation_payload,
    requested_providers,
)
from inferd.runtime.ort_session import create_session
from inferd.runtime.ort_specs import session_specs, warm_up_inputs
from inferd.types import (
    Alert,
    AlertSink,
    BuildConfig,
    EngineCacheEntry,
    EngineHandle,
    HostRegion,
    HostTuple,
    OptimizationProfile,
    PrecisionMode,
    RecordSink,
    ThermalState,
)

__all__ = ["CPU_EP", "CUDA_EP", "LABEL", "PREFERRED_PROVIDERS", "TRT_EP", "OnnxTrtEpRuntime"]

LABEL = "onnx_trt_ep"
FALLBACK_EVENT = "fallback_to_onnx_trt_ep"
CACHE_UNAVAILABLE_KIND = "ort_cache_unavailable"

log = structlog.get_logger("inferd.runtime.onnx_trt_ep")


def create(
    config: RuntimeConfig,
    *,
    is_fallback: bool,
    alert: AlertSink,
    record: RecordSink,
    thermal: Callable[[], ThermalState],
) -> OnnxTrtEpRuntime:
    return OnnxTrtEpRuntime(
        config, is_fallback=is_fallback, alert=alert, record=record, thermal=thermal
    )


@dataclass
class _Resident:
    session: Any
    output_names: list[str]
    in_place: InPlaceRunner
    fallback_announced: bool = False


def _build_provider_args(
    config: RuntimeConfig,
    cache_dir: Path | None,
    model_sha256: str,
    precision: PrecisionMode,
    profiles: Sequence[OptimizationProfile] = (),
) -> dict[str, dict[str, str]]:
    """Provider options by EP name.  The only place that names TRT EP option keys.
    Without a ``cache_dir`` the TensorRT EP caches nothing (it builds at every load)."""
    cache: dict[str, str] = (
        {"trt_engine_cache_enable": "False", "trt_timing_cache_enable": "False"}
        if cache_dir is None
        else {
            "trt_engine_cache_enable": "True",
            "trt_engine_cache_path": str(cache_dir),
            # Keyed by content, not file name: two models called model.onnx with
            # different weights must never share an engine (onnxruntime #6455).
            "trt_engine_cache_prefix": f"inferd_{model_sha256[:16]}",
            "trt_timing_cache_enable": "True",
            "trt_timing_cache_path": str(cache_dir),
        }
    )
    return {
        TRT_EP: {
            "device_id": str(config.device_id),
            "trt_max_workspace_size": str(workspace_cap_bytes(config.gpu_memory_budget_bytes)),
            "trt_fp16_enable": str(precision in (PrecisionMode.FP16, PrecisionMode.MIXED)),
            "trt_int8_enable": str(precision in (PrecisionMode.INT8, PrecisionMode.MIXED)),
            **cache,
            # The model's profiles: without them a new input shape rebuilds the
            # engine inside session.run (inferd.runtime.onnx_trt_ep_shapes).
            **profile_options(profiles),
        },
        CUDA_EP: cuda_ep_options(config),  # its device and its arena's cap
        CPU_EP: {},
    }


class OnnxTrtEpRuntime:
    def __init__(
        self,
        config: RuntimeConfig,
        *,
        is_fallback: bool = False,
        alert: AlertSink,
        thermal: Callable[[], ThermalState],
        record: RecordSink | None = None,
        host_tuple: Callable[..., HostTuple] | None = None,
    ) -> None:
        try:
            import onnxruntime  # heavy: imported only when this strategy is composed
        except Exception as exc:  # ImportError, or a broken wheel (numpy ABI, libonnxruntime)
            raise RuntimeNotAvailableError(LABEL, f"cannot import onnxruntime: {exc}") from None
        self._ort = onnxruntime
        self._config = config
        self._is_fallback = is_fallback
        self._alert = alert
        self._record: RecordSink = record or (lambda _kind, _payload: None)
        self._thermal = thermal
        #: Read only to gate a staged engine (it needs TensorRT's version and the GPU).
        self._host_tuple = host_tuple if host_tuple is not None else read_host_tuple
        self._residents: dict[int, _Resident] = {}
        self._handle_ids = itertools.count(1)

    def current_runtime_label(self) -> str:
        return LABEL

    def thermal_state(self) -> ThermalState:
        return self._thermal()

    def compile_engine(self, model_path: Path, build_config: BuildConfig) -> EngineCacheEntry:
        """No build step: ORT compiles on session creation, so the entry is the ``.onnx``."""
        problem = model_file_problem(model_path)  # a FIFO is named, never waited on
        if problem is not None:
            raise EngineBuildError(f"model file {model_path} {problem}")
        try:
            model_sha256 = sha256_remembered(model_path)  # the operator's model
        except OSError as exc:
            raise EngineBuildError(f"cannot read model {model_path}: {exc}") from exc
        return EngineCacheEntry(
            runtime_label=LABEL,
            artifact_path=model_path,
            model_path=model_path,
            model_sha256=model_sha256,
            build_config=build_config,
        )

    def requested_providers(self) -> list[str]:
        return list(requested_providers(self._ort.get_available_providers()))

    def deserialize_engine(self, entry: EngineCacheEntry) -> EngineHandle:
        requested = self.requested_providers()
        # The decisions and the session read the bytes whose digest is the entry's,
        # once, parsed once only if a decision needs the graph (ort_model_source);
        # those bytes (hundreds of MB) are not held through the warm-up.
        model = HashedModel(entry)
        try:
            by_input = check_before_session(entry, model, tensorrt_ep=TRT_EP in requested)
            cache_dir, cache_error = self._engine_cache(entry, requested)
            if entry.staged_engines and cache_dir is not None:
                model.release()  # an EP-context model is built next: the session needs no bytes
            elif entry.staged_engines and TRT_EP in requested:
                # Its staged engine goes unused: the TensorRT EP builds from the .onnx.
                precision = entry.build_config.precision
                refused = int8_refusal(entry.model_path, precision, model.quantized)
                if refused is not None:
                    raise EngineDeserializeError(refused)
            context, unused = self._staged_context(entry, requested, cache_dir, model)
            session = self._create_session(entry, requested, cache_dir, context, model)
            resolution = ProviderResolution(tuple(requested), tuple(session.get_providers()))
            self._check_providers(entry, resolution, unused)
            inputs, outputs = session_specs(session, entry.model_path, by_input, model.graph)
        finally:
            model.release()
        output_names = [spec.name for spec in outputs]
        try:
            session.run(output_names, warm_up_inputs(inputs))
        except Exception as exc:
            raise EngineDeserializeError(
                f"warm-up run of {entry.model_path} failed: {exc}"
            ) from exc
        handle = EngineHandle(
            handle_id=next(self._handle_ids),
            runtime_label=LABEL,
            model_sha256=entry.model_sha256,
            inputs=inputs,
            outputs=outputs,
            active_providers=resolution.active,
            is_fallback=self._is_fallback,
            requested_providers=resolution.requested,
            provider_degradation=resolution.degradation,
            engine_cache_error=cache_error,
        )
        self._residents[handle.handle_id] = _Resident(
            session=session,
            output_names=output_names,
            in_place=InPlaceRunner(session, output_names),
        )
        log.info(
            "engine_loaded",
            model=str(entry.model_path),
            model_sha256=entry.model_sha256[:16],
            active_providers=list(resolution.active),
            staged_engine=str(context.engine.path) if context else None,
            fallback=self._is_fallback,
        )
        return handle

    def _engine_cache(
        self, entry: EngineCacheEntry, requested: list[str]
    ) -> tuple[Path | None, str | None]:
        """The model's TensorRT EP cache dir, or (None, why) when it cannot be had.
        Only the TensorRT EP caches, and serving never depends on it: a full,
        read-only or unsafe state dir costs a build at every load (and a staged
        engine, whose context model lives there), recorded, alerted and in status."""
        if TRT_EP not in requested:
            return None, None
        try:
            parent = ensure_owned_dir(
                self._config.ort_trt_cache_dir, what="runtime.ort_trt_cache_dir"
            )
            directory = ensure_owned_dir(parent / entry.model_sha256[:16], what="its model's cache")
            return directory, None
        except UnsafeDirectoryError as exc:
            reason = str(exc)
        staged = [str(path) for path in entry.staged_engines]
        payload = {"model": entry.model_path.stem, "reason": reason, "staged_engines": staged}
        self._record(CACHE_UNAVAILABLE_KIND, payload)
        log.warning(CACHE_UNAVAILABLE_KIND, **payload)
        unused = f"; staged engine {staged[0]} not used" if staged else ""
        self._alert(
            Alert(
                "WARNING",
                CACHE_UNAVAILABLE_KIND,
                f"{entry.model_path.name}: serving without the TensorRT EP engine cache (it "
                f"builds its engine at every load){unused}: {reason}",
                {"reason": reason},
            )
        )
        return None, reason

    def _staged_context(
        self,
        entry: EngineCacheEntry,
        requested: list[str],
        cache_dir: Path | None,
        model: HashedModel,
    ) -> tuple[EpContextModel | None, str | None]:
        """The EP-context model of the model's staged engine (gated), or why none:
        ``(None, engine)`` when this ONNX Runtime has no TensorRT EP to load it (the
        ``.onnx`` serves and the degradation record names the unused engine)."""
        if not entry.staged_engines:
            return None, None
        if len(entry.staged_engines) > 1:
            raise EngineDeserializeError(
                f"{entry.model_path}: onnx_trt_ep loads one staged engine per model, got "
                f"{[str(path) for path in entry.staged_engines]}"
            )
        (engine,) = entry.staged_engines
        if TRT_EP not in requested:
            return None, str(engine)
        if cache_dir is None:  # reported by _engine_cache
            return None, None
        context = prepare_ep_context(
            engine,
            entry,
            cache_dir,
            config=self._config,
            record=self._record,
            host_tuple=self._host_tuple,
            interface=model.graph().interface,  # parsed for the profile check already
        )
        return context, None

    def _create_session(
        self,
        entry: EngineCacheEntry,
        requested: list[str],
        cache_dir: Path | None,
        context: EpContextModel | None,
        model: HashedModel,
    ) -> Any:
        ort = self._ort
        all_options = _build_provider_args(
            self._config,
            cache_dir,
            entry.model_sha256,
            entry.build_config.precision,
            entry.build_config.profiles,
        )
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if self._config.ort_intra_op_threads:
            options.intra_op_num_threads = self._config.ort_intra_op_threads
        read = None
        if context is not None:
            # The graph is one EPContext node: nothing for ORT to optimise, and
            # ONNX Runtime's TensorRT EP asks for level 0 with context models.
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            source: Path | bytes = context.path
            what = (
                f"the EP-context model {context.path} of staged engine {context.engine.path.name}"
            )
        else:  # the very bytes the entry's digest names (ort_model_source)
            read = model.session_model(ort, tensorrt_ep=TRT_EP in requested)
            read.configure(options)
            source, what = read.source, str(entry.model_path)
        session = create_session(
            ort,
            source,
            options,
            requested,
            all_options,
            device_id=self._config.device_id,
            what=what,
        )
        if read is not None:
            read.check_read()
        return session

    def _check_providers(
        self, entry: EngineCacheEntry, resolution: ProviderResolution, unused: str | None
    ) -> None:
        """The one provider check: any wanted GPU provider the session lacks is a
        degradation, recorded every time (on the vehicle it is always an anomaly),
        refused when the configuration says so, and alerted once per session when
        ONNX Runtime dropped what it was asked for or a staged engine goes unused."""
        degradation = resolution.degradation
        if degradation is None:
            return
        refusal = resolution.refusal(self._config)
        payload = degradation_payload(resolution, refused=refusal is not None, staged_engine=unused)
        self._record(DEGRADED_KIND, {"model": entry.model_path.stem, **payload})
        if refusal is not None:
            raise EngineDeserializeError(f"{entry.model_path}: {refusal}")
        fields = {
            "degradation": degradation,
            "requested": list(resolution.requested),
            "active": list(resolution.active),
        }
        if resolution.dropped_silently or unused is not None:
            message = f"{entry.model_path.name}: {resolution.describe()}"
            if unused is not None:
                message += f"; staged engine {unused} not used (it needs {TRT_EP})"
            log.warning(DEGRADED_KIND, model=str(entry.model_path), **fields)
            self._alert(Alert("WARNING", DEGRADED_KIND, message, fields))
        else:
            log.info(
                "gpu_providers_not_in_build",
                available=self._ort.get_available_providers(),
                **fields,
            )

    def infer(
        self,
        handle: EngineHandle,
        inputs: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray] | None = None,
        regions: Sequence[HostRegion] = (),
    ) -> dict[str, np.ndarray]:
        resident = self._residents.get(handle.handle_id)
        if resident is None:
            raise InferenceError(f"engine handle {handle.handle_id} has been released")
        if self._is_fallback and not resident.fallback_announced:
            resident.fallback_announced = True
            self._announce_fallback(handle)
        try:
            if outputs:  # written straight into the client's region (ort_binding)
                return resident.in_place.run(inputs, outputs)
            values = resident.session.run(resident.output_names, dict(inputs))
        except MemoryError as exc:
            raise OutOfMemoryError(f"host memory exhausted during inference: {exc}") from exc
        except OutputShapeError:
            raise
        except Exception as exc:
            if is_out_of_memory(exc):
                raise OutOfMemoryError(f"onnxruntime could not allocate: {exc}") from exc
            if outputs and is_output_shape_error(exc):
                raise OutputShapeError(f"onnxruntime refused a placed output: {exc}") from exc
            raise InferenceError(f"onnxruntime run failed: {exc}") from exc
        return dict(zip(resident.output_names, values, strict=True))

    def _announce_fallback(self, handle: EngineHandle) -> None:
        fields = {
            "model_sha256": handle.model_sha256,
            "active_providers": list(handle.active_providers),
        }
        log.warning(FALLBACK_EVENT, **fields)
        message = (
            "serving on ONNX Runtime (degraded latency): the configured runtime is unavailable"
        )
        self._alert(Alert("WARNING", FALLBACK_EVENT, message, fields))

    def release_engine(self, handle: EngineHandle) -> None:
        self._residents.pop(handle.handle_id, None)
