"""Engine builds with TensorRT: ONNX parser -> IBuilderConfig -> serialized engine on disk.

``build_engine`` is the one place that drives ``trt.Builder``; the runtime's
``compile_engine`` and ``inferd build`` both call it.  The caller makes the
CUDA context current around it (the builder and the INT8 calibrator's device
buffers live in it).

Precision.  TensorRT 10 takes precision as builder flags on a weakly typed
network (``BuilderFlag.FP16`` / ``INT8``; ``mixed`` sets both).  TensorRT 11
removed those flags: networks are strongly typed and precision follows the
model's own types.  Which one applies is decided by capability
(``hasattr(trt.BuilderFlag, "FP16")``), never by parsing a version string.

Seams for the build issue (progress, cancellation, timing-cache policy):
``BuildHooks.progress_monitor`` supplies a ``trt.IProgressMonitor`` per build,
``BuildHooks.cancelled`` lets a None from the builder be reported as a
cancellation, and ``TimingCachePolicy`` (default: ``TimingCacheFile`` next to
the engines) decides where the cache comes from and goes to; the build
reports the cache as ``cold``, ``reused``, ``updated``, ``discarded`` or
``disabled``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import structlog

from inferd.durable import fsync_directory
from inferd.engines.calibration import (
    CalibrationCacheStore,
    CalibrationLookup,
    calibration_cache_path,
    dataset_sha256,
)
from inferd.engines.sidecar import write_sidecar
from inferd.errors import CalibrationCacheError, EngineBuildError
from inferd.runtime.tensorrt_log import TensorRTLog, explain_failure
from inferd.types import BuildConfig, HostTuple, OptimizationProfile, PrecisionMode

log = structlog.get_logger("inferd.runtime.tensorrt.build")

_WRITE_CHUNK = 8 * 1024 * 1024

#: Builder flags per precision on TensorRT 10 (weakly typed networks).
PRECISION_FLAGS: dict[PrecisionMode, tuple[str, ...]] = {
    PrecisionMode.FP32: (),
    PrecisionMode.FP16: ("FP16",),
    PrecisionMode.INT8: ("INT8",),
    PrecisionMode.MIXED: ("FP16", "INT8"),
}


class TimingCachePolicy(Protocol):
    """Where a build's timing cache comes from and goes to (the build issue's seam)."""

    def load(self) -> bytes | None: ...

    def store(self, data: bytes) -> None: ...


@dataclass
class BuildHooks:
    """Optional hooks a build takes; all default to off.

    ``progress_monitor()`` returns a fresh ``trt.IProgressMonitor`` instance for
    one build (set as ``IBuilderConfig.progress_monitor``); ``cancelled()`` says
    whether a stop was requested (a builder None is then a cancellation, not a
    failure); ``timing_cache(engine_dir, host)`` returns the policy object
    (default: ``inferd.engines.timing_cache.TimingCacheFile``);
    ``calibration_data`` is a directory of ``.npz`` batches for INT8
    calibration (one file per batch, arrays keyed by input name)."""

    progress_monitor: Callable[[], Any] | None = None
    cancelled: Callable[[], bool] | None = None
    timing_cache: Callable[[Path, HostTuple], TimingCachePolicy] | None = None
    calibration_data: Path | None = None


@dataclass(frozen=True)
class BuildResult:
    engine_path: Path
    sha256: str
    size_bytes: int
    duration_s: float
    strongly_typed: bool
    precision_flags: tuple[str, ...]
    workspace_bytes: int
    timing_cache: str
    calibration: str | None = None
    warnings: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        return {
            "engine": str(self.engine_path),
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "duration_s": round(self.duration_s, 3),
            "strongly_typed": self.strongly_typed,
            "precision_flags": list(self.precision_flags),
            "workspace_bytes": self.workspace_bytes,
            "timing_cache": self.timing_cache,
            "calibration": self.calibration,
            "warnings": list(self.warnings),
        }


def has_precision_flags(trt: Any) -> bool:
    """TensorRT 10 has ``BuilderFlag.FP16``; TensorRT 11 (strongly typed only) does not."""
    return hasattr(trt.BuilderFlag, "FP16")


def network_flags(trt: Any, *, strongly_typed: bool) -> int:
    """``create_network`` flags.  Explicit batch is the only mode from TensorRT 10 on
    (``EXPLICIT_BATCH`` is deprecated and ignored), so it is never set."""
    flags = 0
    creation = trt.NetworkDefinitionCreationFlag
    if strongly_typed and hasattr(creation, "STRONGLY_TYPED"):
        flags |= 1 << int(creation.STRONGLY_TYPED)
    return flags


def _parser_error(error: Any) -> str:
    description = str(error.desc())
    node = error.node()
    return f"node {node}: {description}" if isinstance(node, int) and node >= 0 else description


def _dims(value: Any) -> tuple[int, ...]:
    return tuple(int(dim) for dim in value)


def _network_inputs(network: Any) -> dict[str, tuple[int, ...]]:
    inputs: dict[str, tuple[int, ...]] = {}
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        inputs[str(tensor.name)] = _dims(tensor.shape)
    return inputs


def _add_profiles(
    builder: Any,
    config: Any,
    inputs: dict[str, tuple[int, ...]],
    profiles: tuple[OptimizationProfile, ...],
    model: str,
) -> int:
    """One optimisation profile covering every ``OptimizationProfile`` of the build
    config (one per input); checked against the network first, so a mistake is a
    sentence naming the input rather than a TensorRT assertion."""
    seen: dict[str, OptimizationProfile] = {}
    for profile in profiles:
        name = profile.input_name
        if name not in inputs:
            raise EngineBuildError(
                f"{model}: the build config has a profile for {name!r}, but the network's "
                f"inputs are {sorted(inputs)}"
            )
        if name in seen:
            raise EngineBuildError(f"{model}: the build config has two profiles for {name!r}")
        shape = inputs[name]
        if len(profile.min_shape) != len(shape):
            raise EngineBuildError(
                f"{model}: profile for {name!r} has rank {len(profile.min_shape)}, the input "
                f"{list(shape)} has rank {len(shape)}"
            )
        for axis, dim in enumerate(shape):
            if dim >= 0 and not (
                profile.min_shape[axis] == profile.opt_shape[axis] == profile.max_shape[axis] == dim
            ):
                raise EngineBuildError(
                    f"{model}: profile for {name!r} varies axis {axis}, which the network "
                    f"fixes at {dim} (input shape {list(shape)})"
                )
        seen[name] = profile
    dynamic = sorted(name for name, shape in inputs.items() if any(dim < 0 for dim in shape))
    missing = [name for name in dynamic if name not in seen]
    if missing:
        raise EngineBuildError(
            f"{model}: input(s) {missing} have dynamic dimensions "
            f"({', '.join(f'{name} {list(inputs[name])}' for name in missing)}); the build "
            "config needs an optimisation profile (min/opt/max shape) for each"
        )
    if not seen:
        return 0
    optimization_profile = builder.create_optimization_profile()
    for name, profile in seen.items():
        optimization_profile.set_shape(
            name, profile.min_shape, profile.opt_shape, profile.max_shape
        )
    config.add_optimization_profile(optimization_profile)
    return 1


class _TimingCache:
    """Attach a timing cache from ``policy`` to ``config`` and write it back after
    the build.  ``status``: cold / reused / updated / discarded / disabled."""

    def __init__(self, config: Any, policy: TimingCachePolicy | None) -> None:
        self._config = config
        self._policy = policy
        self._previous: bytes | None = None
        self.status = "disabled"
        if policy is None:
            return
        self._previous = policy.load()
        cache = config.create_timing_cache(self._previous or b"")
        accepted = cache is not None and bool(config.set_timing_cache(cache, False))
        if self._previous is None:
            self.status = "cold"
        elif accepted:
            self.status = "reused"
        else:
            # Another TensorRT version or device, or damaged: TensorRT refuses it.
            log.warning("timing_cache_discarded", reason="TensorRT refused the stored cache")
            self.status = "discarded"
        if not accepted:
            cache = config.create_timing_cache(b"")
            config.set_timing_cache(cache, False)

    def finish(self) -> None:
        if self._policy is None:
            return
        cache = self._config.get_timing_cache()
        if cache is None:
            return
        data = bytes(memoryview(cache.serialize()))
        if data == self._previous:
            return
        if self.status == "reused":
            self.status = "updated"
        try:
            self._policy.store(data)
        except OSError as exc:
            log.warning("timing_cache_not_saved", error=str(exc))


class CalibrationCacheSink(Protocol):
    """Where the calibrator puts a freshly computed cache (``CalibrationCacheStore``
    writes it at once; ``_PendingCalibrationCache`` holds it until the build completes)."""

    def store(self, data: bytes) -> None: ...


class _PendingCalibrationCache:
    def __init__(self) -> None:
        self.data: bytes | None = None

    def store(self, data: bytes) -> None:
        self.data = data


@dataclass
class Calibration:
    """INT8 calibration attached to one builder config (``attach_calibration``).

    ``status``: ``calibrated`` or ``reused`` (a trusted cache).  With
    ``defer_store`` the fresh cache is only kept in memory until ``commit()``:
    a cancelled or failed build leaves the stored cache and its sidecars as they
    were."""

    calibrator: Any
    status: str
    store: CalibrationCacheStore
    pending: _PendingCalibrationCache | None = None

    def free(self) -> None:
        """Free the calibrator's device buffers (in the build's CUDA context)."""
        self.calibrator.free()

    def check(self, model: str) -> None:
        """Raise what went wrong inside the calibrator's callbacks (exceptions
        cannot cross TensorRT)."""
        error = self.calibrator.error
        if error is None:
            return
        if isinstance(error, CalibrationCacheError | EngineBuildError):
            raise error
        raise EngineBuildError(f"{model}: INT8 calibration failed: {error}") from error

    def commit(self) -> None:
        """Write a deferred fresh cache (and its sidecars) through the trust store."""
        if self.pending is not None and self.pending.data is not None:
            self.store.store(self.pending.data)
            self.pending.data = None


def attach_calibration(
    trt: Any,
    cuda: Any,
    config: Any,
    *,
    flags: tuple[str, ...],
    calibration_data: Path | None,
    cache_path: Path,
    warnings: list[str],
    defer_store: bool = False,
) -> Calibration | None:
    """Set ``config.int8_calibrator`` when the build uses the INT8 flag and has
    calibration data (the cache at ``cache_path`` is reused only when trusted, see
    ``inferd.engines.calibration``); otherwise append the applicable warning and
    return None.  Raises ``CalibrationCacheError`` (malformed sidecars, corrupt
    cache, unreadable data set) or ``EngineBuildError``."""
    wants_int8 = "INT8" in flags
    if calibration_data is not None and not wants_int8:
        warnings.append("calibration data given, but the build does not use INT8 flags: ignored")
        return None
    if not wants_int8:
        return None
    if calibration_data is None:
        warnings.append(
            "INT8 without calibration data: only explicitly quantized (Q/DQ) layers run in INT8"
        )
        return None
    if not hasattr(trt, "IInt8EntropyCalibrator2"):
        raise EngineBuildError("this TensorRT has no INT8 calibrators; use a Q/DQ model")
    store = CalibrationCacheStore(cache_path, dataset_sha256(calibration_data))
    lookup = store.load()
    log.info("calibration_cache", status=lookup.status, reason=lookup.reason)
    pending = _PendingCalibrationCache() if defer_store else None
    sink: CalibrationCacheSink = pending if pending is not None else store
    calibrator = _make_calibrator(trt, cuda, _npz_batches(calibration_data), lookup, sink)
    config.int8_calibrator = calibrator
    status = "reused" if lookup.data is not None else "calibrated"
    return Calibration(calibrator, status, store, pending)


def _npz_batches(dataset: Path) -> list[Path]:
    files = [dataset] if dataset.is_file() else sorted(dataset.glob("*.npz"))
    if not files:
        raise CalibrationCacheError(f"calibration data set {dataset} holds no .npz batches")
    return files


def _make_calibrator(
    trt: Any,
    cuda: Any,
    batches: list[Path],
    lookup: CalibrationLookup,
    store: CalibrationCacheSink,
) -> Any:
    """An ``IInt8EntropyCalibrator2`` over ``.npz`` batches that reads the trusted
    cache (or None, to calibrate) and writes a fresh one through ``store``.
    Exceptions cannot cross TensorRT's callbacks; they are kept in ``error``."""

    with np.load(batches[0]) as first:
        arrays = [first[key] for key in first.files]
    batch_size = int(arrays[0].shape[0]) if arrays and arrays[0].ndim else 1

    class _Calibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.error: BaseException | None = None
            self.batches_used = 0
            self.wrote = False
            self._files = iter(batches)
            self._device: dict[str, tuple[Any, int]] = {}

        def get_batch_size(self) -> int:
            return batch_size

        def get_batch(self, names: list[str]) -> list[int] | None:
            try:
                path = next(self._files, None)
                if path is None:
                    return None
                with np.load(path) as data:
                    missing = [name for name in names if name not in data.files]
                    if missing:
                        raise CalibrationCacheError(
                            f"calibration batch {path.name} lacks input(s) {missing}"
                        )
                    staged = {name: np.ascontiguousarray(data[name]) for name in names}
                pointers: list[int] = []
                for name in names:
                    array = staged[name]
                    held = self._device.get(name)
                    if held is None or held[1] < array.nbytes:
                        if held is not None:
                            held[0].free()
                        held = (cuda.mem_alloc(max(array.nbytes, 256)), max(array.nbytes, 256))
                        self._device[name] = held
                    cuda.memcpy_htod(held[0], array)
                    pointers.append(int(held[0]))
                self.batches_used += 1
                return pointers
            except Exception as exc:
                self.error = exc
                return None

        def read_calibration_cache(self) -> bytes | None:
            return lookup.data

        def write_calibration_cache(self, cache: Any) -> None:
            try:
                store.store(bytes(memoryview(cache)))
                self.wrote = True
            except Exception as exc:
                self.error = exc

        def free(self) -> None:
            while self._device:
                _, (allocation, _size) = self._device.popitem()
                with contextlib.suppress(Exception):
                    allocation.free()

    return _Calibrator()


def write_engine_atomically(path: Path, serialized: Any) -> tuple[str, int]:
    """Write a serialized engine (any buffer, e.g. ``IHostMemory``) to ``path``:
    temp file in the same directory, fsync, rename, directory fsync; hashed while
    written.  Returns (sha256, size)."""
    view = memoryview(serialized).cast("B")
    digest = hashlib.sha256()
    temp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            offset = 0
            while offset < len(view):
                chunk = view[offset : offset + _WRITE_CHUNK]
                digest.update(chunk)
                written = 0
                while written < len(chunk):
                    written += os.write(fd, chunk[written:])
                offset += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
        fsync_directory(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return digest.hexdigest(), len(view)


@contextlib.contextmanager
def _step(what: str, model: str, tlog: TensorRTLog) -> Iterator[None]:
    """Turn an exception of the bindings into EngineBuildError naming the step."""
    mark = tlog.mark()
    try:
        yield
    except (EngineBuildError, CalibrationCacheError):
        raise
    except Exception as exc:
        said = tlog.since(mark)
        detail = f" ({said[-1]})" if said else ""
        raise EngineBuildError(f"{model}: TensorRT failed to {what}: {exc}{detail}") from exc


def build_engine(
    trt: Any,
    cuda: Any,
    tlog: TensorRTLog,
    *,
    onnx_path: Path,
    build_config: BuildConfig,
    engine_path: Path,
    workspace_cap_bytes: int,
    timing_cache: TimingCachePolicy | None = None,
    hooks: BuildHooks | None = None,
) -> BuildResult:
    """Build ``onnx_path`` with ``build_config`` and write the engine to
    ``engine_path`` atomically with its ``.sha256`` sidecar.

    Raises ``EngineBuildError`` (parser errors, bad profiles, builder failure or
    cancellation, write failure) or ``CalibrationCacheError``."""
    hooks = hooks or BuildHooks()
    started = time.monotonic()
    model = onnx_path.name
    warnings: list[str] = []
    if not onnx_path.is_file():
        raise EngineBuildError(f"model file {onnx_path} does not exist")
    strongly_typed = not has_precision_flags(trt)

    with _step("create a builder", model, tlog):
        builder = trt.Builder(tlog.logger)
        network = builder.create_network(network_flags(trt, strongly_typed=strongly_typed))
        parser = trt.OnnxParser(network, tlog.logger)
    mark = tlog.mark()
    with _step("parse the model", model, tlog):
        parsed = bool(parser.parse_from_file(str(onnx_path)))
        errors = (
            [] if parsed else [_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
        )
    if not parsed:
        reasons = errors or tlog.since(mark) or ["no reason given"]
        raise EngineBuildError(f"TensorRT's ONNX parser rejected {model}: " + "; ".join(reasons))

    with _step("configure the build", model, tlog):
        config = builder.create_builder_config()
        flags: tuple[str, ...] = ()
        precision = build_config.precision
        if strongly_typed:
            if precision is not PrecisionMode.FP32:
                note = (
                    f"this TensorRT has no precision flags (strongly typed networks): "
                    f"{precision.value} comes from the model's own types, not from the build"
                )
                warnings.append(note)
                log.warning("strongly_typed_precision", model=model, note=note)
        else:
            flags = PRECISION_FLAGS[precision]
            for flag in flags:
                config.set_flag(getattr(trt.BuilderFlag, flag))
            if "FP16" in flags and not getattr(builder, "platform_has_fast_fp16", True):
                warnings.append("this GPU has no fast FP16; FP16 kernels may be slower than FP32")
        workspace = min(build_config.workspace_bytes, workspace_cap_bytes)
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
        config.builder_optimization_level = build_config.optimization_level
        _add_profiles(builder, config, _network_inputs(network), build_config.profiles, model)
        cache = _TimingCache(config, timing_cache)
        monitor = hooks.progress_monitor() if hooks.progress_monitor is not None else None
        if monitor is not None:
            config.progress_monitor = monitor

    calibration = attach_calibration(
        trt,
        cuda,
        config,
        flags=flags,
        calibration_data=hooks.calibration_data,
        cache_path=calibration_cache_path(engine_path),
        warnings=warnings,
    )

    mark = tlog.mark()
    try:
        with _step("build the engine", model, tlog):
            serialized = builder.build_serialized_network(network, config)
    finally:
        if calibration is not None:
            calibration.free()
    if calibration is not None:
        calibration.check(model)
    if serialized is None:
        if hooks.cancelled is not None and hooks.cancelled():
            raise EngineBuildError(f"the engine build of {model} was cancelled")
        raise EngineBuildError(
            f"{model}: " + explain_failure(tlog.since(mark), action="build the engine")
        )
    cache.finish()

    try:
        engine_path.parent.mkdir(parents=True, exist_ok=True)
        sha256, size = write_engine_atomically(engine_path, serialized)
        del serialized
        write_sidecar(engine_path, sha256)
    except OSError as exc:
        raise EngineBuildError(f"cannot write engine {engine_path}: {exc}") from exc
    result = BuildResult(
        engine_path=engine_path,
        sha256=sha256,
        size_bytes=size,
        duration_s=time.monotonic() - started,
        strongly_typed=strongly_typed,
        precision_flags=flags,
        workspace_bytes=workspace,
        timing_cache=cache.status,
        calibration=None if calibration is None else calibration.status,
        warnings=tuple(warnings),
    )
    log.info("engine_built", **result.as_dict())
    return result
