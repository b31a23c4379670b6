"""TensorRT network and builder-config helpers for ``TensorRTBuilder``
(``inferd.engine_build.tensorrt_builder``), the one builder that drives
``trt.Builder``: network creation flags, precision flags, optimisation
profiles, parser errors and INT8 calibration.

Precision.  TensorRT 10 takes precision as builder flags on a weakly typed
network (``BuilderFlag.FP16`` / ``INT8``; ``mixed`` sets both).  TensorRT 11
removed those flags: networks are strongly typed and precision follows the
model's own types.  Which one applies is decided by capability
(``hasattr(trt.BuilderFlag, "FP16")``), never by parsing a version string.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from inferd.engine_build.calibration_batches import (
    CalibrationBatches,
    calibration_inputs,
    check_calibration_batches,
    onnx_inputs,
)
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.model_source import ModelSource
from inferd.engines.build_config import check_profiles as shared_check_profiles
from inferd.engines.build_config import unprofiled_dynamic_inputs
from inferd.engines.calibration import (
    CalibrationCacheStore,
    CalibrationLookup,
    dataset_sha256,
)
from inferd.errors import CalibrationCacheError, CalibrationDataError, EngineBuildError
from inferd.types import BuildConfig, OptimizationProfile, PrecisionMode

log = structlog.get_logger("inferd.runtime.tensorrt.build")

#: Builder flags per precision on TensorRT 10 (weakly typed networks).
PRECISION_FLAGS: dict[PrecisionMode, tuple[str, ...]] = {
    PrecisionMode.FP32: (),
    PrecisionMode.FP16: ("FP16",),
    PrecisionMode.INT8: ("INT8",),
    PrecisionMode.MIXED: ("FP16", "INT8"),
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


def parser_error(error: Any) -> str:
    description = str(error.desc())
    node = error.node()
    return f"node {node}: {description}" if isinstance(node, int) and node >= 0 else description


def _dims(value: Any) -> tuple[int, ...]:
    return tuple(int(dim) for dim in value)


def network_inputs(network: Any) -> dict[str, tuple[int, ...]]:
    inputs: dict[str, tuple[int, ...]] = {}
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        inputs[str(tensor.name)] = _dims(tensor.shape)
    return inputs


def check_profiles(
    inputs: dict[str, tuple[int, ...]],
    profiles: tuple[OptimizationProfile, ...],
    model: str,
) -> dict[str, OptimizationProfile]:
    """The build config's ``OptimizationProfile`` per input, checked against the
    network's inputs (``-1``: a runtime dimension) by the one profile rule
    (``inferd.engines.build_config.check_profiles``); every dynamic input needs one."""
    try:
        seen = shared_check_profiles(inputs, profiles)
    except ValueError as exc:
        raise EngineBuildError(f"{model}: {exc}") from None
    missing = unprofiled_dynamic_inputs(inputs, profiles)
    if missing:
        raise EngineBuildError(
            f"{model}: input(s) {sorted(missing)} have dynamic dimensions "
            f"({', '.join(f'{name} {shape}' for name, shape in missing.items())}); the build "
            "config needs an optimisation profile (min/opt/max shape) for each"
        )
    return seen


def add_profiles(
    builder: Any,
    config: Any,
    inputs: dict[str, tuple[int, ...]],
    profiles: tuple[OptimizationProfile, ...],
    model: str,
) -> int:
    """One optimisation profile covering every ``OptimizationProfile`` of the build
    config (one per input), checked first (``check_profiles``)."""
    seen = check_profiles(inputs, profiles, model)
    if not seen:
        return 0
    optimization_profile = builder.create_optimization_profile()
    for name, profile in seen.items():
        optimization_profile.set_shape(
            name, profile.min_shape, profile.opt_shape, profile.max_shape
        )
    config.add_optimization_profile(optimization_profile)
    return 1


def prepare_calibration(
    model: ModelSource, build_config: BuildConfig, dataset: Path
) -> CalibrationBatches:
    """Check every batch of ``dataset`` against the network ``model`` makes (its bytes
    with the build's digest) and the build config's profiles, before any builder or
    GPU work (see ``inferd.engine_build.calibration_batches``).  Raises
    ``EngineBuildError`` (``CalibrationDataError`` for the data set)."""
    declared = onnx_inputs(model)
    shapes = {name: shape for name, (_dtype, shape) in declared.items()}
    name = model.path.name
    profiles = check_profiles(shapes, build_config.profiles, name)
    return check_calibration_batches(dataset, calibration_inputs(declared, profiles, name))


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
    ``defer_store`` the fresh cache is only kept in memory until ``deferred()``'s
    write runs in the engine's commit: a cancelled or failed build, or one whose
    engine failed validation, leaves the stored cache and its sidecars as they were."""

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

    def deferred(self) -> Callable[[], None] | None:
        """The write of a deferred fresh cache, for when the engine is committed
        (``BuilderOutput.keep``); None when there is none.  It holds the store and the
        bytes only, never the calibrator (a TensorRT object of the build's context)."""
        data = None if self.pending is None else self.pending.data
        if data is None:
            return None
        store = self.store
        return lambda: store.store(data)


def attach_calibration(
    trt: Any,
    cuda: Any,
    builder: Any,
    config: Any,
    *,
    batches: CalibrationBatches,
    network: dict[str, tuple[int, ...]],
    cache_path: Path,
    defer_store: bool = False,
    token: CancellationToken | None = None,
) -> Calibration:
    """Set ``config.int8_calibrator`` over ``batches`` (checked by
    ``prepare_calibration``) for a build with the INT8 flag; the cache at
    ``cache_path`` is reused only when trusted (``inferd.engines.calibration``).
    For a network with runtime dimensions also its calibration profile
    (TensorRT 10: "Calibration optimization profile must be set if int8
    calibration is used to set scales for a network with runtime dimensions"):
    min = opt = max = the opt shapes the batches were checked against, which is
    what TensorRT reads from each ``get_batch`` pointer.  A cancel (``token``) is
    a cancel point between batches: ``get_batch`` gives no more.  Raises
    ``CalibrationCacheError`` (malformed sidecars, corrupt cache) or
    ``EngineBuildError``."""
    if not hasattr(trt, "IInt8EntropyCalibrator2"):
        raise EngineBuildError("this TensorRT has no INT8 calibrators; use a Q/DQ model")
    checked = {spec.name: spec.shape for spec in batches.inputs if not spec.dynamic}
    parsed = {name: shape for name, shape in network.items() if all(dim >= 0 for dim in shape)}
    if set(network) != set(batches.names) or checked != parsed:
        raise EngineBuildError(
            f"the parsed network's inputs {network} are not the ones the calibration data was "
            f"checked against { {spec.name: spec.shape for spec in batches.inputs} }"
        )
    dynamic = [spec for spec in batches.inputs if spec.dynamic]
    if dynamic:
        profile = builder.create_optimization_profile()
        for spec in dynamic:
            profile.set_shape(spec.name, spec.shape, spec.shape, spec.shape)
        if not config.set_calibration_profile(profile):
            raise EngineBuildError(
                "TensorRT refused the calibration profile "
                + ", ".join(f"{spec.name} {list(spec.shape)}" for spec in dynamic)
            )
    store = CalibrationCacheStore(cache_path, dataset_sha256(batches.dataset))
    lookup = store.load()
    log.info("calibration_cache", status=lookup.status, reason=lookup.reason)
    pending = _PendingCalibrationCache() if defer_store else None
    sink: CalibrationCacheSink = pending if pending is not None else store
    calibrator = _make_calibrator(trt, cuda, batches, lookup, sink, token)
    config.int8_calibrator = calibrator
    status = "reused" if lookup.data is not None else "calibrated"
    return Calibration(calibrator, status, store, pending)


def _make_calibrator(
    trt: Any,
    cuda: Any,
    batches: CalibrationBatches,
    lookup: CalibrationLookup,
    store: CalibrationCacheSink,
    token: CancellationToken | None = None,
) -> Any:
    """An ``IInt8EntropyCalibrator2`` over checked ``.npz`` batches that reads the
    trusted cache (or None, to calibrate) and writes a fresh one through ``store``.
    Each input's device buffer holds exactly what TensorRT reads from it (its
    calibration shape's volume).  Exceptions cannot cross TensorRT's callbacks;
    they are kept in ``error`` and the calibrator reports no more batches."""

    class _Calibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.error: BaseException | None = None
            self.batches_used = 0
            self.wrote = False
            self._files = iter(batches.files)
            self._device: dict[str, Any] = {}

        def get_batch_size(self) -> int:
            return batches.batch_size

        def get_batch(self, names: list[str]) -> list[int] | None:
            try:
                if sorted(names) != sorted(batches.names):
                    raise CalibrationDataError(
                        f"TensorRT asked for a batch of {list(names)}, the calibration data "
                        f"was checked for {list(batches.names)}"
                    )
                if token is not None and token.is_set():
                    return None  # cancelled: TensorRT ends calibration with what it has
                path = next(self._files, None)
                if path is None:
                    return None
                staged = batches.load(path)
                pointers: list[int] = []
                for name in names:
                    if name not in self._device:
                        spec = batches.inputs[batches.names.index(name)]
                        self._device[name] = cuda.mem_alloc(max(spec.nbytes, 1))
                    cuda.memcpy_htod(self._device[name], staged[name])
                    pointers.append(int(self._device[name]))
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
                _, allocation = self._device.popitem()
                with contextlib.suppress(Exception):
                    allocation.free()

    return _Calibrator()
