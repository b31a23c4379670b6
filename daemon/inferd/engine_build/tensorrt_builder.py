"""The real builder behind ``run_build``: TensorRT 10 (or 11) via its Python API.

Same ``Builder`` interface as the simulated one, the same ``ProgressAdapter``
behind ``trt.IProgressMonitor`` (``make_trt_progress_monitor``).  It returns the
serialized engine and timing cache as bytes; ``run_build`` writes them (no-cancel
zone, atomic) and applies the timing-cache policy.  A CUDA context is created
and made current on the calling (build worker) thread for each call, and every
TensorRT object of the call is released, newest first, while it is still
current (``inferd.runtime.tensorrt_release``).  TensorRT's messages reach this
build through the process's one logger (``inferd.runtime.tensorrt_log``).

The model TensorRT parses is the one the engine is named by: its bytes are read
once when the build starts, checked against ``model_sha256`` (the digest in the
engine's name, ``engines/locate.py``) and handed to ``OnnxParser.parse`` with the
model's path (for external weights), never ``parse_from_file``, so a model file
replaced since it was hashed fails the build (``model_source.ModelChangedError``)
instead of being built under the old model's name.  External weights, which the
parser reads by path, are hashed with the model and checked again once it has
read them.

Smoke inference needs device buffers and an execution context, which the
serving runtime owns: pass ``infer`` (e.g. a function loading the engine into a
``TensorRTRuntime``); without it validation stays ``pending``.

INT8 calibration: pass ``calibration_data`` (a directory of ``.npz`` batches)
and ``calibration_cache`` (``inferd.engines.calibration.calibration_cache_path``
of the engine).  When the build uses the INT8 flag, every batch is checked
against the network when the builder is made, before any TensorRT or GPU
work (``prepare_calibration``: a ``CalibrationDataError`` naming the file, the
input, the expected and the actual dtype/shape); the build then fails before
it starts and leaves nothing behind.  The calibrator and the cache-trust
rules are ``attach_calibration``'s; a fresh cache is written (with its
sidecars) only when the engine is committed (``BuilderOutput.keep``, in the
commit's no-cancel zone), so a cancelled or failed build, or one whose engine
failed validation, leaves the stored cache as it was.

The output's ``stats`` (the summary's ``builderStats``): ``workspaceBytes``,
the workspace the build was given (the one rule,
``inferd.engines.build_config.build_workspace_bytes``), ``calibration``
(``calibrated`` / ``reused``) and ``warnings``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from inferd.config import RuntimeConfig
from inferd.digest import model_digest
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.model_source import ModelChangedError, ModelSource
from inferd.engine_build.progress import ProgressAdapter, make_trt_progress_monitor
from inferd.engine_build.simulated import BuilderOutput
from inferd.engine_build.tensorrt_build import (
    PRECISION_FLAGS,
    Calibration,
    add_profiles,
    attach_calibration,
    has_precision_flags,
    network_flags,
    network_inputs,
    parser_error,
    prepare_calibration,
)
from inferd.engine_build.validation import Infer
from inferd.engines.build_config import build_workspace_bytes
from inferd.errors import CalibrationCacheError, EngineBuildError
from inferd.runtime.tensorrt_log import TensorRTLog, explain_failure
from inferd.runtime.tensorrt_release import ReleaseStack, clear_frames
from inferd.types import BuildConfig, PrecisionMode

R = TypeVar("R")

REFUSED = (
    "TensorRT refused the stored timing cache (another TensorRT version or device, or damaged)"
)


class TensorRTBuilder:
    simulated = False

    def __init__(
        self,
        trt: Any,
        cuda: Any,
        onnx_path: Path,
        build_config: BuildConfig,
        *,
        gpu_memory_budget_bytes: int = RuntimeConfig.gpu_memory_budget_bytes,
        device_id: int = 0,
        infer: Infer | None = None,
        calibration_data: Path | None = None,
        calibration_cache: Path | None = None,
        model_sha256: str | None = None,
    ) -> None:
        """``model_sha256``: the digest the engine is named by (None: the model's
        digest now); the bytes parsed must have it."""
        if calibration_data is not None and calibration_cache is None:
            raise ValueError("calibration_data needs calibration_cache (where the cache lives)")
        self.trt = trt
        self.cuda = cuda
        self.onnx_path = onnx_path
        self.model = ModelSource(
            onnx_path,
            model_sha256 if model_sha256 is not None else model_digest(onnx_path).sha256,
        )
        self.config = build_config
        #: The one workspace rule (``inferd.engines.build_config.build_workspace_bytes``).
        self.workspace_bytes = build_workspace_bytes(build_config, gpu_memory_budget_bytes)
        self.device_id = device_id
        self.infer: Infer | None = infer
        self.calibration_data = calibration_data
        self.calibration_cache = calibration_cache
        self.tensorrt_version = str(trt.__version__)
        self.strongly_typed = not has_precision_flags(trt)
        #: Builder flags of the precision (none on strongly typed TensorRT 11).
        self.flags: tuple[str, ...] = (
            () if self.strongly_typed else PRECISION_FLAGS[build_config.precision]
        )
        self.calibration_batches = (
            prepare_calibration(self.model, build_config, calibration_data)
            if calibration_data is not None and "INT8" in self.flags
            else None
        )
        self.tlog = TensorRTLog(trt, owner=f"build {onnx_path.name}")

    def _in_context(self, work: Callable[[ReleaseStack], R]) -> R:
        """Run ``work`` with a fresh CUDA context current and TensorRT's messages routed
        to this build; every TensorRT object it ``hold``s is released, newest first,
        before the context is popped and detached (``tensorrt_release``)."""
        self.cuda.init()
        context = self.cuda.Device(self.device_id).make_context()
        held = ReleaseStack()
        try:
            with self.tlog.scope():
                try:
                    return work(held)
                except BaseException as exc:
                    clear_frames(exc)  # its frames' locals must not outlive the context
                    raise
                finally:
                    held.release()
        finally:
            self.cuda.Context.pop()
            with contextlib.suppress(Exception):
                context.detach()

    def refuses_cache(self, data: bytes) -> str | None:
        return self._in_context(lambda held: self._refuses_cache(held, data))

    def _refuses_cache(self, held: ReleaseStack, data: bytes) -> str | None:
        builder = held.hold(self.trt.Builder(self.tlog.logger))
        config = held.hold(builder.create_builder_config())
        cache = held.hold(config.create_timing_cache(data))
        accepted = cache is not None and bool(config.set_timing_cache(cache, False))
        return None if accepted else REFUSED

    def build(self, monitor: ProgressAdapter, timing_cache: bytes | None) -> BuilderOutput:
        return self._in_context(lambda held: self._build(held, monitor, timing_cache))

    def _build(
        self, held: ReleaseStack, monitor: ProgressAdapter, timing_cache: bytes | None
    ) -> BuilderOutput:
        trt = self.trt
        model = self.onnx_path.name
        try:
            # the bytes the engine's name is the digest of, with its external weights
            onnx_bytes, hashed = self.model.read()
        except ModelChangedError as exc:
            return BuilderOutput(None, None, error=str(exc))
        except OSError as exc:
            return BuilderOutput(None, None, error=f"cannot read {model}: {exc}")
        builder = held.hold(trt.Builder(self.tlog.logger))
        network = held.hold(
            builder.create_network(network_flags(trt, strongly_typed=self.strongly_typed))
        )
        parser = held.hold(trt.OnnxParser(network, self.tlog.logger))
        mark = self.tlog.mark()
        # The parser keeps its own copy of the model (weights included): ours goes now.
        parsed = parser.parse(onnx_bytes, self.model.parser_path)
        del onnx_bytes
        if hashed.external:  # the parser read them by path: the ones hashed?
            try:
                self.model.check_unchanged(hashed)
            except ModelChangedError as exc:
                return BuilderOutput(None, None, error=str(exc))
            except OSError as exc:
                return BuilderOutput(None, None, error=f"cannot read {model} again: {exc}")
        if not parsed:
            errors = [parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
            reasons = errors or self.tlog.since(mark) or ["no reason given"]
            return BuilderOutput(
                None,
                None,
                error=f"TensorRT's ONNX parser rejected {model}: " + "; ".join(reasons),
            )
        config = held.hold(builder.create_builder_config())
        flags = self.flags
        warnings: list[str] = []
        precision = self.config.precision
        if self.strongly_typed:
            if precision is not PrecisionMode.FP32:
                warnings.append(
                    "this TensorRT has no precision flags (strongly typed networks): "
                    f"{precision.value} comes from the model's own types, not from the build"
                )
        else:
            for flag in flags:
                config.set_flag(getattr(trt.BuilderFlag, flag))
            if "FP16" in flags and not getattr(builder, "platform_has_fast_fp16", True):
                warnings.append("this GPU has no fast FP16; FP16 kernels may be slower than FP32")
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.workspace_bytes)
        config.builder_optimization_level = self.config.optimization_level
        inputs = network_inputs(network)
        add_profiles(builder, config, inputs, self.config.profiles, model)
        cache = held.hold(config.create_timing_cache(timing_cache or b""))
        if cache is None or not config.set_timing_cache(cache, False):
            # refuses_cache accepted it a moment ago: never build cold while the
            # session reports the stored cache as used
            return BuilderOutput(None, None, error=REFUSED)
        config.progress_monitor = make_trt_progress_monitor(monitor, trt)
        try:
            calibration = self._calibration(builder, config, inputs, warnings, monitor.token)
        except (CalibrationCacheError, EngineBuildError) as exc:
            return BuilderOutput(None, None, error=f"calibration cache: {exc}")
        stats: dict[str, Any] = {"workspaceBytes": self.workspace_bytes}
        if warnings:
            stats["warnings"] = warnings
        if calibration is not None:
            stats["calibration"] = calibration.status
        mark = self.tlog.mark()
        try:
            serialized = held.hold(builder.build_serialized_network(network, config))
        finally:
            if calibration is not None:
                calibration.free()
        try:
            if calibration is not None:
                calibration.check(model)
        except (CalibrationCacheError, EngineBuildError) as exc:
            return BuilderOutput(None, None, error=str(exc), stats=stats)
        if serialized is None:
            said = self.tlog.since(mark)
            return BuilderOutput(
                None, None, error=explain_failure(said, action="build the engine"), stats=stats
            )
        engine = bytes(memoryview(serialized))
        final_cache = held.hold(config.get_timing_cache())
        data = None if final_cache is None else bytes(memoryview(final_cache.serialize()))
        # A fresh calibration cache is kept only with the engine: written in the commit's
        # no-cancel zone, never for a build cancelled or failed (validation included).
        keep = None if calibration is None else calibration.deferred()
        return BuilderOutput(engine, data, stats=stats, keep=keep)

    def _calibration(
        self,
        builder: Any,
        config: Any,
        inputs: dict[str, tuple[int, ...]],
        warnings: list[str],
        token: CancellationToken,
    ) -> Calibration | None:
        if "INT8" not in self.flags:
            if self.calibration_data is not None:
                warnings.append(
                    "calibration data given, but the build does not use INT8 flags: ignored"
                )
            return None
        if self.calibration_batches is None or self.calibration_cache is None:
            warnings.append(
                "INT8 without calibration data: only explicitly quantized (Q/DQ) layers run in INT8"
            )
            return None
        return attach_calibration(
            self.trt,
            self.cuda,
            builder,
            config,
            batches=self.calibration_batches,
            network=inputs,
            cache_path=self.calibration_cache,
            defer_store=True,
            token=token,  # a cancel point between calibration batches
        )
