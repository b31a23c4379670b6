"""A fake ``tensorrt`` module mimicking the TensorRT 10.3 Python API (``tensorrt``
10.3.0.30, as on JetPack 6.1/6.2), plus a TensorRT-11-flavoured variant.

``make_module(state)`` builds a fresh module object; ``install(monkeypatch)``
puts it into ``sys.modules["tensorrt"]`` together with the fake pycuda
(``tests/fakes/fake_pycuda.py``) whose device memory the fake engines read and
write.  ``tests/fakes/site/`` does the same for a daemon subprocess (put it on
``PYTHONPATH``; see ``tests/fakes/gpu_site.py``).

Only names the real API has exist (a subset of them); anything else raises
``AttributeError``, and the classes use ``__slots__`` so assigning an attribute
the real object lacks (``config.progres_monitor = ...``) fails too.  Names and
signatures follow ``release/10.3`` ``python/src/infer/pyCore.cpp``:

* ``Logger(min_severity)``, ``ILogger`` (subclasses must call
  ``ILogger.__init__`` and implement ``log(severity, msg)``),
  ``ILogger.Severity.{INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE}``.
* ``Builder(logger)``: ``create_network(flags=0)``,
  ``create_builder_config()``, ``create_optimization_profile()``,
  ``build_serialized_network(network, config) -> IHostMemory | None``,
  ``platform_has_fast_fp16``, ``platform_has_fast_int8``.
* ``NetworkDefinitionCreationFlag.{EXPLICIT_BATCH, STRONGLY_TYPED}``;
  ``INetworkDefinition.num_inputs/get_input/num_outputs/get_output``;
  ``ITensor.name/shape/dtype``.
* ``OnnxParser(network, logger)``: ``parse(model, path=None)``,
  ``parse_from_file(model)``, ``num_errors``, ``get_error(i)`` (``desc()``,
  ``code()``, ``node()``, ``file()``, ``line()``, ``func()``), ``clear_errors()``.
  The model is read with the ``onnx`` package: IO names, dtypes and shapes
  (``-1`` for symbolic dims) come from the real graph.  ``parse`` takes any
  buffer (``py::buffer``) and copies it ("We store a copy of the model so that
  weight arrays will persist", ``ModelImporter::parseWithWeightDescriptors``):
  the caller's buffer may go once it returns.  External weights
  (``data_location`` EXTERNAL) are read from the ``location`` relative to the
  directory of ``path`` (``parse``; "Absolute path to the model file for loading
  external weights if required", ``NvOnnxParser.h``), or of the file itself
  (``parse_from_file``); without a ``path`` the location is taken as it is
  (relative to the working directory), as ``WeightsContext::parseExternalWeights``
  does (onnx-tensorrt ``release/10.x``); a ``../`` in it is refused and a file it
  cannot open fails the parse ("Failed to open file: <path>").
  ``path`` is a ``char const*``: a ``str`` (or ``bytes``) or None, never a
  ``pathlib.Path`` (pybind11 refuses it).  ``FakeTensorRT.parses`` records each
  parse (method, path, SHA-256 of the model bytes).
* ``IBuilderConfig``: ``set_flag/clear_flag/get_flag(BuilderFlag.*)``,
  ``set_memory_pool_limit/get_memory_pool_limit(MemoryPoolType.*)``,
  ``builder_optimization_level``, ``progress_monitor``, ``int8_calibrator``,
  ``create_timing_cache(buffer)``, ``set_timing_cache(cache, ignore_mismatch)
  -> bool``, ``get_timing_cache()``, ``add_optimization_profile(profile) -> int``,
  ``set_calibration_profile(profile) -> bool`` (MIN and MAX overwritten by OPT)
  and ``get_calibration_profile()``.
* ``ITimingCache.serialize()/combine()/reset()``; ``IHostMemory`` (buffer
  protocol, ``nbytes``, ``dtype``); ``IOptimizationProfile.set_shape/get_shape``.
* ``IProgressMonitor`` (``phase_start``, ``step_complete``, ``phase_finish``;
  an exception in ``step_complete`` cancels, as the real trampoline does);
  ``IInt8Calibrator`` / ``IInt8EntropyCalibrator2`` (``get_batch_size``,
  ``get_batch(names)``, ``read_calibration_cache``, ``write_calibration_cache``).
  Calibration reads each input's whole volume (the calibration profile's opt
  shape, or the static shape) from the device pointer ``get_batch`` returned,
  as TensorRT does: a short buffer fails as an illegal memory access; a network
  with runtime dimensions and no calibration profile fails the build.
* ``Runtime(logger).deserialize_cuda_engine(buffer) -> ICudaEngine | None``:
  None for bytes the fake builder did not produce (logging TensorRT's
  "Magic tag does not match" serialization error) and for an engine of another
  TensorRT version (logging "The engine plan file is not compatible with this
  version of TensorRT, expecting library version X got Y, please rebuild.").
* ``ICudaEngine``: ``num_io_tensors``, ``get_tensor_name(i)``,
  ``get_tensor_mode(name) -> TensorIOMode.INPUT/OUTPUT``,
  ``get_tensor_shape(name)`` (``-1`` for dynamic dims),
  ``get_tensor_dtype(name) -> DataType.*``,
  ``get_tensor_profile_shape(name, profile_index)``, ``num_optimization_profiles``,
  ``device_memory_size_v2``, ``device_memory_size``,
  ``create_execution_context()`` (allocates ``device_memory_size`` bytes of
  fake device memory; None, with TensorRT's allocation error, when it does
  not fit).
* ``IExecutionContext``: ``set_input_shape(name, shape) -> bool`` (False, with
  TensorRT's error, outside the optimisation profile), ``get_tensor_shape``,
  ``set_tensor_address(name, ptr) -> bool``, ``get_tensor_address``,
  ``execute_async_v3(stream_handle) -> bool``.  The engine *computes its ONNX
  model* (with ONNX Runtime on the CPU) reading its inputs from, and writing
  its outputs to, the fake device memory at the bound addresses, in stream
  order: results appear in host buffers only after the D2H copies and
  ``Stream.synchronize()``.  ``FakeTensorRT.execute_fail_while`` makes
  executions fail while a file exists (so a rebuilt engine can pass): as
  TensorRT does when an enqueue fails (its error logged, False returned), or,
  when the file says ``illegal-address``, as a kernel that reads through a wild
  pointer (the sticky CUDA error of ``fake_pycuda.FakeCuda.fault``: the
  synchronize and every later call in that context fail).

Deliberate strictness beyond TensorRT: ``Builder``, ``Runtime.deserialize_cuda_engine``,
``create_execution_context`` and ``execute_async_v3`` raise (or return
None/False) when no CUDA context is current on the calling thread, or another
one than the engine's.  Real TensorRT would silently fall back to the device's
primary context, which is exactly the bug the runtime's push/pop prevents.

Rules at the real-hardware boundary (``FakeTensorRT.violations`` lists each
breach as a sentence; with ``violations_path`` each is also appended to a
file, so a daemon subprocess can tell its test):

* One logger per process.  TensorRT keeps a single logger pointer (a weak
  reference here: TensorRT does not own the Python object; the builder or
  runtime keeps its own logger alive, ``py::keep_alive<1, 2>``) and replaces it
  only when no builder or runtime is alive.  A builder or runtime made with
  another logger meanwhile gets TensorRT's warning (``LOGGER_DIFFERS``, through
  the first logger; ``logger_warnings`` counts them) and every message it logs
  goes to the first logger.  Logging through a pointer whose logger was
  garbage collected is a violation (a use-after-free on the real thing).  The
  ONNX parser logs to the logger it was given.
* Destruction with the right CUDA context.  ``Builder``,
  ``INetworkDefinition``, ``IBuilderConfig``, ``OnnxParser``, ``Runtime``,
  ``ICudaEngine`` and ``IExecutionContext`` remember the context current when
  they were made; being destroyed with another context current, none, or after
  that context was detached is a violation.  The order of destruction follows
  the bindings' ``py::keep_alive``: a network and a config keep their builder
  alive, an engine its runtime, an execution context its engine (pyCore.cpp,
  release/10.x), a network the ONNX parser made for it (pyOnnx.cpp), so from
  Python children always die before their factories; only the context they die
  in can be wrong.

TensorRT 11 flavour (``FakeTensorRT(flavour=11)``, version ``11.1.0.0``, build
number illustrative): the precision builder flags (``FP16``, ``INT8``,
``BF16``, ``FP8``, ``INT4``, ``OBEY/PREFER_PRECISION_CONSTRAINTS``),
``EXPLICIT_BATCH``, the INT8 calibrator classes (and ``int8_calibrator`` /
``set_calibration_profile``), ``Builder.platform_has_fast_fp16`` /
``platform_has_fast_int8`` and ``ICudaEngine.device_memory_size`` (use
``device_memory_size_v2``) are gone, as in ``release/11.1``'s bindings; every
network is strongly typed (``STRONGLY_TYPED`` is accepted and ignored).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fakes import fake_pycuda

MIMICS = "TensorRT 10.3.0.30 Python API (tensorrt 10.3)"
TRT10_VERSION = "10.3.0.30"
TRT11_VERSION = "11.1.0.0"
#: TensorRT's words when a second logger is given (NVIDIA/TensorRT#1475).
LOGGER_DIFFERS = (
    "[{owner}] The logger passed into createInferRuntime differs from one already provided for "
    "an existing builder, runtime, or refitter. Uses of the global logger, returned by "
    "nvinfer1::getLogger(), will return the existing value. If you don't need the old "
    "builder, runtime, or refitter, then destroy them before creating a new one."
)
ENGINE_MAGIC = b"fTRT-plan\x00"
TIMING_MAGIC = b"fTRT-timing\x00"
#: What an ``execute_fail_while`` file says for a kernel that faults (sticky), and
#: what TensorRT logs when it says nothing (a launch failure that is not sticky).
ILLEGAL_ADDRESS = "illegal-address"
ENQUEUE_FAILURE = (
    "1: [executionContext.cpp::enqueueV3] Error Code 1: Cuda Runtime (too many resources "
    "requested for launch)"
)

_ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 3: "INT8", 6: "INT32", 9: "BOOL", 2: "UINT8", 7: "INT64"}
_ONNX_TYPE_NAMES = {11: "DOUBLE", 16: "BFLOAT16", 4: "UINT16", 5: "INT16", 12: "UINT32"}
_NUMPY = {
    "FLOAT": "float32",
    "HALF": "float16",
    "INT8": "int8",
    "INT32": "int32",
    "BOOL": "bool",
    "UINT8": "uint8",
    "INT64": "int64",
}
_PRECISION_FLAGS = (
    "FP16",
    "INT8",
    "BF16",
    "FP8",
    "INT4",
    "OBEY_PRECISION_CONSTRAINTS",
    "PREFER_PRECISION_CONSTRAINTS",
)


@dataclass
class FakeTensorRT:
    """Knobs and observations of one fake TensorRT; not part of the module."""

    cuda: fake_pycuda.FakeCuda | None = None
    flavour: int = 10
    version: str = ""
    #: ``device_memory_size(_v2)`` of every engine (activation memory).
    device_memory_size: int = 8 * 1024 * 1024
    #: Device tag written into timing caches (a cache from another device is refused).
    device_tag: str = "cc8.7-orin"
    #: When set, ``build_serialized_network`` logs this error and returns None.
    build_error: str | None = None
    #: Seconds each ``step_complete`` of a build waits first (a slow build to cancel).
    build_step_s: float = 0.0
    #: ONNX op types the parser reports as unsupported.
    unsupported_ops: frozenset[str] = frozenset()
    #: When set, ``execute_async_v3`` logs this error and returns False.
    execute_error: str | None = None
    #: A path: while that file exists, executions fail as it says (``ILLEGAL_ADDRESS``:
    #: the kernel faults; other text: logged, and ``execute_async_v3`` returns False).
    execute_fail_while: str | None = None
    calls: list[str] = field(default_factory=list)
    builds: int = 0
    executions: int = 0
    engines_alive: int = 0
    contexts_alive: int = 0
    calibration_batches: int = 0
    timing_cache_hits: int = 0
    timing_cache_misses: int = 0
    last_build: dict[str, Any] = field(default_factory=dict)
    #: Each ONNX parse: ``{"method", "path", "sha256"}`` (of the model bytes parsed).
    parses: list[dict[str, Any]] = field(default_factory=list)
    #: TensorRT rules the code under test broke, one sentence each (see the module doc).
    violations: list[str] = field(default_factory=list)
    #: Also append each violation to this file (a daemon subprocess tells its test).
    violations_path: str | None = None
    #: "The logger passed into ... differs" warnings TensorRT logged.
    logger_warnings: int = 0
    #: Live builders and runtimes: TensorRT takes a new logger only when there are none.
    live_factories: int = 0
    #: TensorRT's one logger pointer (a weak reference: TensorRT does not own it).
    logger_ref: Any = None

    def __post_init__(self) -> None:
        if not self.version:
            self.version = TRT11_VERSION if self.flavour >= 11 else TRT10_VERSION
        # Bound now: a violation found while the interpreter shuts down must still land.
        self._append = _appender(self.violations_path)

    def violation(self, sentence: str) -> None:
        self.violations.append(sentence)
        self._append(sentence)


def _appender(path: str | None) -> Callable[[str], None]:
    if path is None:
        return lambda _sentence: None
    write, open_, close, flags = os.write, os.open, os.close, os.O_WRONLY | os.O_APPEND
    flags |= os.O_CREAT | os.O_CLOEXEC

    def append(sentence: str) -> None:
        descriptor = open_(path, flags, 0o600)
        try:
            write(descriptor, (sentence.replace("\n", " ") + "\n").encode())
        finally:
            close(descriptor)

    return append


def _execute_failure(path: str | None) -> str | None:
    """What the ``execute_fail_while`` file says now; None while it does not exist."""
    if path is None:
        return None
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return None
    return text or ENQUEUE_FAILURE


def _load_external_weights(model: Any, onnx_file: str) -> str | None:
    """Read every external initializer into the model, as onnx-tensorrt's
    ``WeightsContext::parseExternalWeights`` finds it: ``location`` normalised,
    ``../`` refused, then relative to the directory of ``onnx_file`` (the path given
    to the parser), or taken as it is when that has no ``/``.  The parser's error
    message when it cannot, else None."""
    from onnx import TensorProto

    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        normalized = os.path.normpath(info.get("location", ""))
        if "../" in normalized + "/":
            return (
                "Relative paths to parent (../) are not allowed in ONNX external weights! "
                f"Normalized path is: {normalized}"
            )
        slash = onnx_file.rfind("/")
        path = onnx_file[: slash + 1] + normalized if slash >= 0 else normalized
        offset, length = int(info.get("offset", 0)), int(info.get("length", 0))
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                raw = handle.read(length) if length else handle.read()
        except OSError:
            return f"Failed to open file: {path}"
        tensor.raw_data = raw
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]
    return None


def _version_code(version: str) -> int:
    major, minor, patch = (int(part) for part in version.split(".")[:3])
    return major * 10000 + minor * 100 + patch


class Dims(tuple):  # type: ignore[type-arg]
    """``tensorrt.Dims``: a sequence of ints (``-1`` for dynamic)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"({', '.join(str(dim) for dim in self)})"


class IHostMemory(bytes):
    """``tensorrt.IHostMemory``: exposes the buffer protocol, ``nbytes`` and ``dtype``.
    A bytes subclass only because pure Python 3.11 cannot export a buffer
    otherwise; every bytes method is hidden (AttributeError), as on the real one."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") or name in ("nbytes", "dtype"):
            return bytes.__getattribute__(self, name)
        raise AttributeError(f"'tensorrt.IHostMemory' object has no attribute {name!r}")

    @property
    def nbytes(self) -> int:
        return len(self)

    @property
    def dtype(self) -> Any:
        return "UINT8"


def _int_enum(name: str, members: Sequence[tuple[str, int]]) -> type[enum.IntEnum]:
    created = enum.IntEnum(name, list(members))
    created.__module__ = "tensorrt"
    return created


def make_module(state: FakeTensorRT) -> types.ModuleType:
    trt = types.ModuleType("tensorrt", f"fake {MIMICS} (tests/fakes/fake_tensorrt.py)")
    modern = state.flavour >= 11

    Severity = _int_enum(
        "Severity",
        [("INTERNAL_ERROR", 0), ("ERROR", 1), ("WARNING", 2), ("INFO", 3), ("VERBOSE", 4)],
    )
    flag_members = [
        ("FP16", 0),
        ("INT8", 1),
        ("DEBUG", 2),
        ("GPU_FALLBACK", 3),
        ("REFIT", 4),
        ("DISABLE_TIMING_CACHE", 5),
        ("TF32", 6),
        ("SPARSE_WEIGHTS", 7),
        ("OBEY_PRECISION_CONSTRAINTS", 9),
        ("PREFER_PRECISION_CONSTRAINTS", 10),
        ("VERSION_COMPATIBLE", 13),
        ("EXCLUDE_LEAN_RUNTIME", 14),
        ("FP8", 15),
        ("ERROR_ON_TIMING_CACHE_MISS", 16),
        ("BF16", 17),
        ("DISABLE_COMPILATION_CACHE", 18),
        ("STRIP_PLAN", 19),
        ("INT4", 22),
    ]
    if modern:
        flag_members = [
            (name, value) for name, value in flag_members if name not in _PRECISION_FLAGS
        ]
    BuilderFlag = _int_enum("BuilderFlag", flag_members)
    creation_members = (
        [("STRONGLY_TYPED", 1)] if modern else [("EXPLICIT_BATCH", 0), ("STRONGLY_TYPED", 1)]
    )
    NetworkDefinitionCreationFlag = _int_enum("NetworkDefinitionCreationFlag", creation_members)
    MemoryPoolType = _int_enum(
        "MemoryPoolType",
        [
            ("WORKSPACE", 0),
            ("DLA_MANAGED_SRAM", 1),
            ("DLA_LOCAL_DRAM", 2),
            ("DLA_GLOBAL_DRAM", 3),
            ("TACTIC_DRAM", 4),
            ("TACTIC_SHARED_MEMORY", 5),
        ],
    )
    TensorIOMode = _int_enum("TensorIOMode", [("NONE", 0), ("INPUT", 1), ("OUTPUT", 2)])
    DataType = _int_enum(
        "DataType",
        [
            ("FLOAT", 0),
            ("HALF", 1),
            ("INT8", 2),
            ("INT32", 3),
            ("BOOL", 4),
            ("UINT8", 5),
            ("FP8", 6),
            ("BF16", 7),
            ("INT64", 8),
            ("INT4", 9),
        ],
    )
    CalibrationAlgoType = _int_enum(
        "CalibrationAlgoType",
        [
            ("LEGACY_CALIBRATION", 0),
            ("ENTROPY_CALIBRATION", 1),
            ("ENTROPY_CALIBRATION_2", 2),
            ("MINMAX_CALIBRATION", 3),
        ],
    )

    def need_context(what: str) -> Any:
        """The current CUDA context, or a loud failure (see the module doc)."""
        if state.cuda is None:
            return None
        context = state.cuda.current_context()
        if context is None:
            raise RuntimeError(
                f"fake tensorrt: {what} called with no CUDA context current on this thread "
                "(real TensorRT would silently use the primary context)"
            )
        return context

    # -- logging ------------------------------------------------------------------------

    class ILogger:
        def __init__(self) -> None:
            self._trt_base_initialized = True

        def log(self, severity: Any, msg: str) -> None:
            raise RuntimeError('Tried to call pure virtual function "ILogger::log"')

    ILogger.Severity = Severity

    class Logger(ILogger):
        INTERNAL_ERROR = Severity.INTERNAL_ERROR
        ERROR = Severity.ERROR
        WARNING = Severity.WARNING
        INFO = Severity.INFO
        VERBOSE = Severity.VERBOSE

        def __init__(self, min_severity: Any = Severity.WARNING) -> None:
            ILogger.__init__(self)
            self.min_severity = min_severity

        def log(self, severity: Any, msg: str) -> None:
            if int(severity) <= int(self.min_severity):
                print(f"[TRT] [{severity.name[0]}] {msg}", file=sys.stderr)

    def check_logger(logger: Any, owner: str) -> Any:
        if not isinstance(logger, ILogger):
            raise TypeError(f"{owner}(): incompatible constructor arguments (logger: ILogger)")
        if not getattr(logger, "_trt_base_initialized", False):
            raise TypeError(
                f"{type(logger).__name__}.__init__() must be called when overriding __init__"
            )
        return logger

    def adopt_logger(logger: Any, owner: str) -> Any:
        """A builder or runtime made with ``logger``: TensorRT keeps one logger pointer
        and replaces it only when no builder, runtime or refitter is alive."""
        check_logger(logger, owner)
        current = state.logger_ref() if state.logger_ref is not None else None
        if state.live_factories == 0 or current is None:
            if current is None and state.live_factories:
                state.violation(
                    f"{owner}() made while TensorRT still pointed at a garbage-collected logger"
                )
            state.logger_ref = weakref.ref(logger)
        elif current is not logger:
            state.logger_warnings += 1
            emit(None, Severity.WARNING, LOGGER_DIFFERS.format(owner=owner))
        state.live_factories += 1
        return logger

    def emit(_made_with: Any, severity: Any, message: str) -> None:
        """TensorRT logs through its one logger pointer, whatever logger the object
        that logs was made with (``_made_with`` is kept for the call sites' sake)."""
        logger = state.logger_ref() if state.logger_ref is not None else None
        if logger is None:
            state.violation(
                "TensorRT logged through a logger that was garbage-collected (use after "
                f"free): {message}"
            )
            return
        logger.log(severity, message)

    def made_in() -> Any:
        return state.cuda.current_context() if state.cuda is not None else None

    def check_release(what: str, context: Any) -> None:
        """``what``, made in CUDA ``context``, is being destroyed: it must be current."""
        if state.cuda is None or context is None:
            return
        current = state.cuda.current_context()
        if not context._valid:
            why = "after its CUDA context was detached"
        elif current is None:
            why = "with no CUDA context current"
        elif current is not context:
            why = "with another CUDA context current"
        else:
            return
        state.violation(
            f"{what} destroyed {why} (TensorRT frees its GPU memory in the context it was made in)"
        )

    # -- callbacks the application subclasses -------------------------------------------

    class IProgressMonitor:
        def __init__(self) -> None:
            self._trt_base_initialized = True

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            raise RuntimeError(
                'Tried to call pure virtual function "IProgressMonitor::phase_start"'
            )

        def step_complete(self, phase_name: str, step: int) -> bool:
            raise RuntimeError(
                'Tried to call pure virtual function "IProgressMonitor::step_complete"'
            )

        def phase_finish(self, phase_name: str) -> None:
            raise RuntimeError(
                'Tried to call pure virtual function "IProgressMonitor::phase_finish"'
            )

    class IInt8Calibrator:
        def __init__(self) -> None:
            self._trt_base_initialized = True

        def get_batch_size(self) -> int:
            raise RuntimeError(
                'Tried to call pure virtual function "IInt8Calibrator::getBatchSize"'
            )

        def get_batch(self, names: list[str]) -> Any:
            raise RuntimeError('Tried to call pure virtual function "IInt8Calibrator::getBatch"')

        def read_calibration_cache(self) -> Any:
            raise RuntimeError(
                'Tried to call pure virtual function "IInt8Calibrator::readCalibrationCache"'
            )

        def write_calibration_cache(self, cache: Any) -> None:
            raise RuntimeError(
                'Tried to call pure virtual function "IInt8Calibrator::writeCalibrationCache"'
            )

    class IInt8EntropyCalibrator2(IInt8Calibrator):
        def get_algorithm(self) -> Any:
            return CalibrationAlgoType.ENTROPY_CALIBRATION_2

    # -- network and parser -------------------------------------------------------------

    class ITensor:
        __slots__ = ("_dtype", "_is_input", "_name", "_shape")

        @property
        def name(self) -> str:
            return self._name

        @property
        def shape(self) -> Dims:
            return Dims(self._shape)

        @property
        def dtype(self) -> Any:
            return self._dtype

        @property
        def is_network_input(self) -> bool:
            return self._is_input

        @property
        def is_network_output(self) -> bool:
            return not self._is_input

    def make_tensor(name: str, shape: Sequence[int], dtype: Any, is_input: bool) -> ITensor:
        tensor = object.__new__(ITensor)
        tensor._name, tensor._shape, tensor._dtype, tensor._is_input = (
            name,
            tuple(shape),
            dtype,
            is_input,
        )
        return tensor

    class INetworkDefinition:
        __slots__ = (
            "__weakref__",
            "_builder",
            "_context",
            "_inputs",
            "_model",
            "_outputs",
            "_parsers",
            "_strongly_typed",
            "name",
        )

        def __del__(self) -> None:
            check_release("INetworkDefinition", getattr(self, "_context", None))

        @property
        def num_inputs(self) -> int:
            return len(self._inputs)

        @property
        def num_outputs(self) -> int:
            return len(self._outputs)

        @property
        def num_layers(self) -> int:
            return 0 if self._model is None else len(self._model.graph.node)

        def get_input(self, index: int) -> ITensor | None:
            return self._inputs[index] if 0 <= index < len(self._inputs) else None

        def get_output(self, index: int) -> ITensor | None:
            return self._outputs[index] if 0 <= index < len(self._outputs) else None

        def get_flag(self, flag: Any) -> bool:
            return bool(
                flag == NetworkDefinitionCreationFlag.STRONGLY_TYPED and self._strongly_typed
            )

    class ParserError:
        __slots__ = ("_desc", "_node", "_operator")

        def code(self) -> int:
            return 8 if self._node >= 0 else 1  # UNSUPPORTED_NODE / INVALID_GRAPH

        def desc(self) -> str:
            return self._desc

        def file(self) -> str:
            return "ModelImporter.cpp"

        def line(self) -> int:
            return 0

        def func(self) -> str:
            return "parseGraph"

        def node(self) -> int:
            return self._node

        def node_name(self) -> str:
            return ""

        def node_operator(self) -> str:
            return self._operator

    ParserError.__name__ = ParserError.__qualname__ = "IParserError"

    class OnnxParser:
        """``py::keep_alive<1, 3>`` (the parser keeps its logger) and
        ``py::keep_alive<2, 1>`` (the *network* keeps the parser, whose weights it
        uses: ``release/10.3`` ``python/src/parsers/pyOnnx.cpp``); the parser refers
        to its network without keeping it alive."""

        __slots__ = ("__weakref__", "_context", "_errors", "_logger", "_network_ref")

        def __init__(self, network: INetworkDefinition, logger: Any) -> None:
            if not isinstance(network, INetworkDefinition):
                raise TypeError("OnnxParser(): incompatible constructor arguments")
            self._context = made_in()
            self._network_ref = weakref.ref(network)
            network._parsers.append(self)  # keep_alive<2, 1>
            self._logger = check_logger(logger, "OnnxParser")
            self._errors: list[ParserError] = []

        @property
        def _network(self) -> INetworkDefinition:
            network = self._network_ref()
            if network is None:  # cannot happen from Python: the network keeps the parser
                raise RuntimeError("OnnxParser used after its network was destroyed")
            return network

        def __del__(self) -> None:
            check_release("OnnxParser", getattr(self, "_context", None))

        @property
        def num_errors(self) -> int:
            return len(self._errors)

        def get_error(self, index: int) -> ParserError | None:
            return self._errors[index] if 0 <= index < len(self._errors) else None

        def clear_errors(self) -> None:
            self._errors.clear()

        def _error(self, message: str, node: int = -1, operator: str = "") -> bool:
            error = object.__new__(ParserError)
            error._desc, error._node, error._operator = message, node, operator
            self._errors.append(error)
            # The ONNX parser logs to the logger it was given, not TensorRT's pointer.
            self._logger.log(Severity.ERROR, f"ModelImporter.cpp: {message}")
            return False

        def parse(self, model: Any, path: str | None = None) -> bool:
            if path is not None and not isinstance(path, str | bytes):  # char const*
                raise TypeError("parse(): incompatible function arguments (path: str)")
            state.calls.append("OnnxParser.parse")
            data = bytes(memoryview(model))  # py::buffer, copied by the parser
            return self._load(data, "parse", None if path is None else os.fsdecode(path))

        def parse_from_file(self, model: str) -> bool:
            state.calls.append("OnnxParser.parse_from_file")
            try:
                with open(model, "rb") as handle:
                    data = handle.read()
            except OSError as exc:
                return self._error(f"Failed to parse ONNX model from file: {model}: {exc}")
            return self._load(data, "parse_from_file", str(model))

        def _load(self, data: bytes, method: str, location: str | None) -> bool:
            import onnx

            state.parses.append(
                {"method": method, "path": location, "sha256": hashlib.sha256(data).hexdigest()}
            )
            try:
                model = onnx.load_model_from_string(data)
            except Exception as exc:
                return self._error(f"Failed to parse ONNX model: {exc}")
            failed = _load_external_weights(model, location or "")
            if failed is not None:
                return self._error(failed)
            if not model.graph.node and not model.graph.output:
                return self._error("Failed to parse ONNX model: the graph is empty")
            for index, node in enumerate(model.graph.node):
                if node.domain not in ("", "ai.onnx") or node.op_type in state.unsupported_ops:
                    return self._error(
                        f"In node {index} (importFallbackPluginImporter): UNSUPPORTED_NODE: "
                        f'Assertion failed: creator && "Plugin not found, are the plugin name, '
                        f'version, and namespace correct?" (op {node.op_type})',
                        index,
                        node.op_type,
                    )
            initializers = {tensor.name for tensor in model.graph.initializer}

            def tensors(values: Any, is_input: bool) -> list[ITensor] | None:
                found: list[ITensor] = []
                for value in values:
                    if value.name in initializers:
                        continue
                    tensor_type = value.type.tensor_type
                    trt_name = _ONNX_TO_TRT.get(tensor_type.elem_type)
                    if trt_name is None:
                        type_name = _ONNX_TYPE_NAMES.get(
                            tensor_type.elem_type, tensor_type.elem_type
                        )
                        self._error(f"Unsupported data type {type_name} for tensor {value.name}")
                        return None
                    dims = [
                        dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else -1
                        for dim in tensor_type.shape.dim
                    ]
                    found.append(
                        make_tensor(value.name, dims, getattr(DataType, trt_name), is_input)
                    )
                return found

            inputs = tensors(model.graph.input, True)
            outputs = tensors(model.graph.output, False)
            if inputs is None or outputs is None:
                return False
            network = self._network
            network._model = model
            network._inputs = inputs
            network._outputs = outputs
            network.name = model.graph.name
            return True

    # -- builder config, profiles, timing cache -----------------------------------------

    class IOptimizationProfile:
        __slots__ = ("_shapes", "_valid")

        def __init__(self) -> None:
            raise TypeError("IOptimizationProfile: use Builder.create_optimization_profile()")

        def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:
            """The binding's ``opt_profile_set_shape``: ``setDimensions`` for kMIN, kOPT,
            kMAX in turn, each ``PY_ASSERT_RUNTIME_ERROR``-ed: an inconsistent shape
            raises ``RuntimeError`` (it is not left for ``add_optimization_profile``)."""
            low, mid, high = (tuple(int(d) for d in value) for value in (min, opt, max))
            checks = (
                ("min", all(dim >= 0 for dim in low)),
                (
                    "opt",
                    len(mid) == len(low) and all(a <= b for a, b in zip(low, mid, strict=True)),
                ),
                (
                    "max",
                    len(high) == len(mid) and all(b <= c for b, c in zip(mid, high, strict=True)),
                ),
            )
            for selector, consistent in checks:
                if not consistent:
                    raise RuntimeError(
                        f"Shape provided for {selector} is inconsistent with other shapes."
                    )
            self._shapes[input] = (low, mid, high)

        def get_shape(self, input: str) -> list[Dims]:
            return [Dims(shape) for shape in self._shapes.get(input, ((), (), ()))]

    class ITimingCache:
        __slots__ = ("_device", "_entries", "_version")

        def __init__(self) -> None:
            raise TypeError("ITimingCache: use IBuilderConfig.create_timing_cache()")

        def serialize(self) -> IHostMemory:
            document = {
                "device": self._device,
                "version": self._version,
                "entries": sorted(self._entries),
            }
            return IHostMemory(TIMING_MAGIC + json.dumps(document).encode())

        def combine(self, input_cache: Any, ignore_mismatch: bool) -> bool:
            if input_cache._version != self._version:
                return False
            if input_cache._device != self._device and not ignore_mismatch:
                return False
            self._entries |= input_cache._entries
            return True

        def reset(self) -> bool:
            self._entries.clear()
            return True

    def new_cache(device: str, version: str, entries: set[str]) -> ITimingCache:
        cache = object.__new__(ITimingCache)
        cache._device, cache._version, cache._entries = device, version, set(entries)
        return cache

    class IBuilderConfig:
        __slots__ = (
            "_builder",
            "_calibration_profile",
            "_calibrator",
            "_context",
            "_flags",
            "_level",
            "_monitor",
            "_pools",
            "_profiles",
            "_timing_cache",
        )

        def __init__(self) -> None:
            raise TypeError("IBuilderConfig: use Builder.create_builder_config()")

        def __del__(self) -> None:
            check_release("IBuilderConfig", getattr(self, "_context", None))

        def set_flag(self, flag: Any) -> None:
            if not isinstance(flag, BuilderFlag):
                raise TypeError("set_flag(): incompatible function arguments")
            self._flags.add(flag)

        def clear_flag(self, flag: Any) -> None:
            self._flags.discard(flag)

        def get_flag(self, flag: Any) -> bool:
            return flag in self._flags

        def set_memory_pool_limit(self, pool: Any, pool_size: int) -> None:
            if not isinstance(pool, MemoryPoolType) or not isinstance(pool_size, int):
                raise TypeError("set_memory_pool_limit(): incompatible function arguments")
            self._pools[pool] = pool_size

        def get_memory_pool_limit(self, pool: Any) -> int:
            return self._pools.get(pool, 1 << 40)

        @property
        def builder_optimization_level(self) -> int:
            return self._level

        @builder_optimization_level.setter
        def builder_optimization_level(self, value: int) -> None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError("builder_optimization_level: an int is required")
            self._level = value

        @property
        def progress_monitor(self) -> Any:
            return self._monitor

        @progress_monitor.setter
        def progress_monitor(self, monitor: Any) -> None:
            if monitor is not None and not isinstance(monitor, IProgressMonitor):
                raise TypeError("progress_monitor: an IProgressMonitor is required")
            self._monitor = monitor

        @property
        def int8_calibrator(self) -> Any:
            if modern:
                raise AttributeError(
                    "'tensorrt.IBuilderConfig' object has no attribute 'int8_calibrator'"
                )
            return self._calibrator

        @int8_calibrator.setter
        def int8_calibrator(self, calibrator: Any) -> None:
            if modern:
                raise AttributeError(
                    "'tensorrt.IBuilderConfig' object has no attribute 'int8_calibrator'"
                )
            if calibrator is not None and not isinstance(calibrator, IInt8Calibrator):
                raise TypeError("int8_calibrator: an IInt8Calibrator is required")
            self._calibrator = calibrator

        def set_calibration_profile(self, profile: Any) -> bool:
            """Deprecated in 10.1 (still there in 10.3); MIN and MAX are overwritten by OPT."""
            if modern:
                raise AttributeError(
                    "'tensorrt.IBuilderConfig' object has no attribute 'set_calibration_profile'"
                )
            if profile is None:
                self._calibration_profile = None
                return True
            if not isinstance(profile, IOptimizationProfile):
                raise TypeError("set_calibration_profile(): incompatible function arguments")
            if not profile._valid:
                return False
            calibration = object.__new__(IOptimizationProfile)
            calibration._valid = True
            calibration._shapes = {
                name: (opt, opt, opt) for name, (_low, opt, _high) in profile._shapes.items()
            }
            self._calibration_profile = calibration
            return True

        def get_calibration_profile(self) -> Any:
            return self._calibration_profile

        @property
        def num_optimization_profiles(self) -> int:
            return len(self._profiles)

        def add_optimization_profile(self, profile: Any) -> int:
            if not isinstance(profile, IOptimizationProfile) or not profile._valid:
                emit(
                    self._builder._logger,
                    Severity.ERROR,
                    "4: [optimizationProfile.cpp::isValid] Error Code 4: API Usage Error "
                    "(optimization profile is invalid)",
                )
                return -1
            self._profiles.append(profile)
            return len(self._profiles) - 1

        def create_timing_cache(self, serialized_timing_cache: Any) -> ITimingCache | None:
            state.calls.append("IBuilderConfig.create_timing_cache")
            data = bytes(memoryview(serialized_timing_cache))
            if not data:
                return new_cache(state.device_tag, state.version, set())
            document: Any = None
            if data.startswith(TIMING_MAGIC):
                try:
                    document = json.loads(data[len(TIMING_MAGIC) :])
                except ValueError:
                    document = None
            if not isinstance(document, dict) or document.get("version") != state.version:
                emit(
                    self._builder._logger,
                    Severity.ERROR,
                    "1: [timingCache.cpp::TimingCache] Error Code 1: Serialization (Serialization "
                    "assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match)",
                )
                emit(self._builder._logger, Severity.WARNING, "The timing cache will not be used!")
                return None
            return new_cache(str(document["device"]), state.version, set(document["entries"]))

        def set_timing_cache(self, cache: Any, ignore_mismatch: bool) -> bool:
            state.calls.append("IBuilderConfig.set_timing_cache")
            if not isinstance(cache, ITimingCache):
                raise TypeError("set_timing_cache(): incompatible function arguments")
            if cache._device != state.device_tag and not ignore_mismatch:
                emit(
                    self._builder._logger,
                    Severity.ERROR,
                    "3: [timingCache.cpp::setTimingCache] Error Code 3: API Usage Error (the "
                    "timing cache was created on a different device)",
                )
                return False
            self._timing_cache = cache
            return True

        def get_timing_cache(self) -> ITimingCache | None:
            return self._timing_cache

    # -- builder --------------------------------------------------------------------------

    class Builder:
        __slots__ = ("__weakref__", "_alive", "_context", "_logger")

        def __init__(self, logger: Any) -> None:
            state.calls.append("Builder")
            self._context = need_context("Builder()")
            # py::keep_alive<1, 2>: the builder keeps its logger object alive.
            self._logger = adopt_logger(logger, "Builder")
            self._alive = True

        def __del__(self) -> None:
            if getattr(self, "_alive", False):
                self._alive = False
                state.live_factories -= 1
                check_release("Builder", self._context)

        @property
        def platform_has_fast_fp16(self) -> bool:
            return True

        @property
        def platform_has_fast_int8(self) -> bool:
            return True

        def create_network(self, flags: int = 0) -> INetworkDefinition:
            state.calls.append("Builder.create_network")
            known = 0
            for member in NetworkDefinitionCreationFlag:
                known |= 1 << int(member)
            if flags & ~known:
                raise ValueError(f"create_network: unknown flag bits {flags:#x}")
            network = object.__new__(INetworkDefinition)
            network._builder = self  # py::keep_alive<0, 1>: the network keeps its builder
            network._context = made_in()
            network._inputs, network._outputs, network._model = [], [], None
            network._parsers = []
            network.name = "network"
            strongly = modern or bool(
                flags & (1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED))
            )
            network._strongly_typed = strongly
            state.last_build["network_flags"] = flags
            return network

        def create_builder_config(self) -> IBuilderConfig:
            config = object.__new__(IBuilderConfig)
            config._builder = self  # py::keep_alive<0, 1>: the config keeps its builder
            config._context = made_in()
            config._flags = {BuilderFlag.TF32}
            config._pools, config._profiles = {}, []
            config._level, config._monitor, config._calibrator, config._timing_cache = (
                3,
                None,
                None,
                None,
            )
            config._calibration_profile = None
            return config

        def create_optimization_profile(self) -> IOptimizationProfile:
            profile = object.__new__(IOptimizationProfile)
            profile._shapes, profile._valid = {}, True
            return profile

        def _fail(self, message: str) -> None:
            emit(self._logger, Severity.ERROR, message)

        def build_serialized_network(self, network: Any, config: Any) -> IHostMemory | None:
            state.calls.append("Builder.build_serialized_network")
            need_context("build_serialized_network")
            if network._model is None:
                self._fail(
                    "4: [network.cpp::validate] Error Code 4: Internal Error (Network must have "
                    "at least one output)"
                )
                return None
            flags = sorted(flag.name for flag in config._flags)
            state.last_build.update(
                flags=flags,
                strongly_typed=network._strongly_typed,
                workspace=config._pools.get(MemoryPoolType.WORKSPACE),
                optimization_level=config._level,
                timing_cache=config._timing_cache is not None,
                progress_monitor=config._monitor is not None,
                profiles=[dict(profile._shapes) for profile in config._profiles],
                calibration_profile=(
                    None
                    if config._calibration_profile is None
                    else dict(config._calibration_profile._shapes)
                ),
            )
            precision = [name for name in flags if name in _PRECISION_FLAGS]
            if network._strongly_typed and precision:
                self._fail(
                    "3: [builderConfig.cpp::validate] Error Code 3: API Usage Error (Parameter "
                    f"check failed, condition: !config.getFlag(BuilderFlag::k{precision[0]}). "
                    "Precision flags are not allowed on a strongly typed network.)"
                )
                return None
            shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
            for profile in config._profiles:
                shapes.update(profile._shapes)
            for tensor in network._inputs:
                if any(dim < 0 for dim in tensor._shape) and tensor._name not in shapes:
                    self._fail(
                        "4: [network.cpp::validate] Error Code 4: API Usage Error (Network has "
                        "dynamic or shape inputs, but no optimization profile has been defined.)"
                    )
                    return None
            if state.build_error is not None:
                self._fail(state.build_error)
                return None
            if not self._progress(config._monitor, len(network._model.graph.node)):
                self._fail(
                    "2: [builder.cpp::buildSerializedNetwork] Error Code 2: Internal Error (Build "
                    "was cancelled.)"
                )
                return None
            onnx_bytes = network._model.SerializeToString()
            if (
                "INT8" in flags
                and config._calibrator is not None
                and not self._calibrate(config, network)
            ):
                return None
            cache = config._timing_cache
            if cache is not None and "DISABLE_TIMING_CACHE" not in flags and config._level > 0:
                key = hashlib.sha256(onnx_bytes + ",".join(flags).encode()).hexdigest()[:16]
                if key in cache._entries:
                    state.timing_cache_hits += 1
                else:
                    state.timing_cache_misses += 1
                    cache._entries.add(key)
            io = [
                {"name": t._name, "mode": "INPUT", "dtype": t._dtype.name, "shape": list(t._shape)}
                for t in network._inputs
            ] + [
                {"name": t._name, "mode": "OUTPUT", "dtype": t._dtype.name, "shape": list(t._shape)}
                for t in network._outputs
            ]
            header = {
                "version": state.version,
                "io": io,
                "profiles": {name: [list(s) for s in value] for name, value in shapes.items()},
                "device_memory_size": state.device_memory_size,
                "flags": flags,
                "strongly_typed": network._strongly_typed,
            }
            encoded = json.dumps(header).encode()
            state.builds += 1
            return IHostMemory(
                ENGINE_MAGIC + len(encoded).to_bytes(4, "big") + encoded + onnx_bytes
            )

        def _progress(self, monitor: Any, nodes: int) -> bool:
            if monitor is None:
                return True

            def call(method: str, *args: Any) -> Any:
                if method == "step_complete" and state.build_step_s > 0:
                    time.sleep(state.build_step_s)
                try:
                    return getattr(monitor, method)(*args)
                except Exception as exc:  # the trampoline prints and swallows
                    print(f"[ERROR] Exception caught in {method}(): {exc}", file=sys.stderr)
                    return False if method == "step_complete" else None

            call("phase_start", "Building engine", None, 2)
            ok = call("step_complete", "Building engine", 0) is True
            if ok:
                call("phase_start", "Timing graph nodes", "Building engine", max(nodes, 1))
                for step in range(max(nodes, 1)):
                    if call("step_complete", "Timing graph nodes", step) is not True:
                        ok = False
                        break
                call("phase_finish", "Timing graph nodes")
            if ok:
                ok = call("step_complete", "Building engine", 1) is True
            call("phase_finish", "Building engine")
            return ok

        def _calibrate(self, config: Any, network: Any) -> bool:
            """Implicit INT8 calibration as TensorRT 10 does it: a network with runtime
            dimensions needs a calibration profile (NvInfer.h 10.3, setCalibrationProfile:
            "Calibration optimization profile must be set if int8 calibration is used to
            set scales for a network with runtime dimensions"; the error text here is
            the fake's); TensorRT calibrates at the profile's opt shapes and reads each
            input's whole volume from the device pointer ``get_batch`` returned, so a
            short buffer is an illegal memory access (a real GPU reads past it)."""
            calibrator = config._calibrator
            profile = config._calibration_profile
            dynamic = [t._name for t in network._inputs if any(dim < 0 for dim in t._shape)]
            missing = [name for name in dynamic if profile is None or name not in profile._shapes]
            if missing:
                self._fail(
                    "4: [calibrator.cpp::calibrate] Error Code 4: API Usage Error (Calibration "
                    f"profile must be set for a network with runtime dimensions: no calibration "
                    f"shape for input(s) {missing}.)"
                )
                return False
            volumes = {}
            for tensor in network._inputs:
                shape = tensor._shape
                if tensor._name in dynamic:
                    shape = profile._shapes[tensor._name][1]  # kOPT
                itemsize = np.dtype(_NUMPY[tensor._dtype.name]).itemsize
                volumes[tensor._name] = int(np.prod(shape, dtype=np.int64)) * itemsize
            try:
                cache = calibrator.read_calibration_cache()
                if cache:
                    return True
                calibrator.get_batch_size()
                names = [tensor._name for tensor in network._inputs]
                batches = 0
                while True:
                    pointers = calibrator.get_batch(names)
                    if not pointers:
                        break
                    if len(pointers) != len(names):
                        self._fail("Calibrator returned the wrong number of device pointers")
                        return False
                    if state.cuda is not None:
                        try:
                            for name, pointer in zip(names, pointers, strict=True):
                                state.cuda.read(int(pointer), volumes[name])
                        except fake_pycuda.Error as exc:
                            self._fail(
                                "1: [calibrator.cpp::calibrate] Error Code 1: Cuda Runtime "
                                f"({exc}) reading calibration input {name}"
                            )
                            return False
                    batches += 1
                if batches == 0:
                    self._fail("Calibration failure occurred with no scaling factors detected.")
                    return False
                state.calibration_batches += batches
                table = f"TRT-{_version_code(state.version)}-EntropyCalibration2\n" + "".join(
                    f"{name}: 3c010a14\n" for name in names
                )
                calibrator.write_calibration_cache(IHostMemory(table.encode()))
                return True
            except Exception as exc:
                print(f"[ERROR] Exception caught in calibrator: {exc}", file=sys.stderr)
                self._fail(f"Calibration failed: {exc}")
                return False

    # -- runtime, engine, execution context -----------------------------------------------

    class Runtime:
        __slots__ = ("__weakref__", "_alive", "_context", "_logger")

        def __init__(self, logger: Any) -> None:
            state.calls.append("Runtime")
            self._context = made_in()
            # py::keep_alive<1, 2>: the runtime keeps its logger object alive.
            self._logger = adopt_logger(logger, "Runtime")
            self._alive = True

        def __del__(self) -> None:
            if getattr(self, "_alive", False):
                self._alive = False
                state.live_factories -= 1
                check_release("Runtime", self._context)

        def deserialize_cuda_engine(self, serialized_engine: Any) -> ICudaEngine | None:
            state.calls.append("Runtime.deserialize_cuda_engine")
            context = need_context("deserialize_cuda_engine")
            data = bytes(memoryview(serialized_engine))
            failed = (
                "4: [runtime.cpp::deserializeCudaEngine::65] Error Code 4: Internal Error "
                "(Engine deserialization failed.)"
            )
            header: Any = None
            if data.startswith(ENGINE_MAGIC):
                start = len(ENGINE_MAGIC) + 4
                length = int.from_bytes(data[len(ENGINE_MAGIC) : start], "big")
                try:
                    header = json.loads(data[start : start + length])
                    onnx_bytes = data[start + length :]
                except ValueError:
                    header = None
            if not isinstance(header, dict):
                emit(
                    self._logger,
                    Severity.ERROR,
                    "1: [stdArchiveReader.cpp::StdArchiveReader::34] Error Code 1: Serialization "
                    "(Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag does "
                    "not match)",
                )
                emit(self._logger, Severity.ERROR, failed)
                return None
            if header.get("version") != state.version:
                emit(
                    self._logger,
                    Severity.ERROR,
                    "6: The engine plan file is not compatible with this version of TensorRT, "
                    f"expecting library version {state.version} got {header.get('version')}, "
                    "please rebuild.",
                )
                emit(self._logger, Severity.ERROR, failed)
                return None
            engine = object.__new__(ICudaEngine)
            engine._header, engine._onnx, engine._context = header, onnx_bytes, context
            engine._logger, engine._session = self._logger, None
            engine._runtime = self  # py::keep_alive<0, 1>: the engine keeps its runtime
            engine._tensors = {entry["name"]: entry for entry in header["io"]}
            engine._order = [entry["name"] for entry in header["io"]]
            engine._alive = True
            state.engines_alive += 1
            return engine

    class ICudaEngine:
        __slots__ = (
            "__weakref__",
            "_alive",
            "_context",
            "_header",
            "_logger",
            "_onnx",
            "_order",
            "_runtime",
            "_session",
            "_tensors",
        )

        def __init__(self) -> None:
            raise TypeError("ICudaEngine: use Runtime.deserialize_cuda_engine()")

        def __del__(self) -> None:
            if getattr(self, "_alive", False):
                self._alive = False
                state.engines_alive -= 1
                check_release("ICudaEngine", self._context)

        @property
        def num_io_tensors(self) -> int:
            return len(self._order)

        @property
        def num_optimization_profiles(self) -> int:
            return 1

        @property
        def device_memory_size_v2(self) -> int:
            return int(self._header["device_memory_size"])

        @property
        def device_memory_size(self) -> int:
            return int(self._header["device_memory_size"])

        def get_tensor_name(self, index: int) -> str | None:
            return self._order[index] if 0 <= index < len(self._order) else None

        def _tensor(self, name: str) -> dict[str, Any]:
            if name not in self._tensors:
                raise KeyError(name)  # real TensorRT logs an error and returns a default
            return self._tensors[name]

        def get_tensor_mode(self, name: str) -> Any:
            return getattr(TensorIOMode, self._tensor(name)["mode"])

        def get_tensor_shape(self, name: str) -> Dims:
            return Dims(self._tensor(name)["shape"])

        def get_tensor_dtype(self, name: str) -> Any:
            return getattr(DataType, self._tensor(name)["dtype"])

        def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
            shapes = self._header["profiles"].get(name)
            if shapes is None or profile_index != 0:
                return []
            return [Dims(shape) for shape in shapes]

        def create_execution_context(self, strategy: Any = None) -> IExecutionContext | None:
            state.calls.append("ICudaEngine.create_execution_context")
            context = need_context("create_execution_context")
            if context is not self._context:
                emit(
                    self._logger,
                    Severity.ERROR,
                    "1: [defaultAllocator.cpp::allocate] Error Code 1: Cuda Runtime (invalid "
                    "device context)",
                )
                return None
            allocation = None
            size = self.device_memory_size_v2
            if state.cuda is not None and size > 0:
                try:
                    allocation = state.cuda.allocate(size, context)
                except fake_pycuda.Error:
                    emit(
                        self._logger,
                        Severity.ERROR,
                        f"1: [defaultAllocator.cpp::allocate] Error Code 1: Cuda Runtime (out of "
                        f"memory) Requested amount of GPU memory ({size} bytes) could not be "
                        "allocated. There may not be enough free memory for allocation to succeed.",
                    )
                    return None
            execution = object.__new__(IExecutionContext)
            execution._engine, execution._allocation = self, allocation
            execution._shapes = {
                name: tuple(entry["shape"])
                for name, entry in self._tensors.items()
                if entry["mode"] == "INPUT" and all(dim >= 0 for dim in entry["shape"])
            }
            execution._addresses = {}
            execution._output_shapes = {}
            execution._alive = True
            state.contexts_alive += 1
            return execution

        def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            if self._session is None:
                import onnxruntime

                options = onnxruntime.SessionOptions()
                options.intra_op_num_threads = 1
                options.log_severity_level = 3
                self._session = onnxruntime.InferenceSession(
                    self._onnx, sess_options=options, providers=["CPUExecutionProvider"]
                )
            outputs = [name for name in self._order if self._tensors[name]["mode"] == "OUTPUT"]
            values = self._session.run(outputs, feeds)
            return dict(zip(outputs, values, strict=True))

    class IExecutionContext:
        __slots__ = ("_addresses", "_alive", "_allocation", "_engine", "_output_shapes", "_shapes")

        def __init__(self) -> None:
            raise TypeError("IExecutionContext: use ICudaEngine.create_execution_context()")

        def __del__(self) -> None:
            if getattr(self, "_alive", False):
                self._alive = False
                state.contexts_alive -= 1
                check_release("IExecutionContext", self._engine._context)
                if self._allocation is not None and state.cuda is not None:
                    state.cuda.release(self._allocation)

        @property
        def engine(self) -> ICudaEngine:
            return self._engine

        def _log_error(self, message: str) -> None:
            emit(self._engine._logger, Severity.ERROR, message)

        def set_input_shape(self, name: str, shape: Sequence[int]) -> bool:
            state.calls.append("IExecutionContext.set_input_shape")
            entry = self._engine._tensors.get(name)
            if entry is None or entry["mode"] != "INPUT":
                self._log_error(
                    "3: [executionContext.cpp::setInputShape] Error Code 3: API Usage Error "
                    f"(tensor {name} is not an input)"
                )
                return False
            dims = tuple(int(dim) for dim in shape)
            declared = entry["shape"]
            profile = self._engine._header["profiles"].get(name)
            if len(dims) != len(declared):
                self._log_error(
                    "3: [executionContext.cpp::setInputShape] Error Code 3: API Usage Error "
                    f"(rank of {name} must be {len(declared)})"
                )
                return False
            for axis, (dim, fixed) in enumerate(zip(dims, declared, strict=True)):
                if fixed >= 0 and dim != fixed:
                    self._log_error(
                        "3: [executionContext.cpp::setInputShape] Error Code 3: API Usage Error "
                        "(Parameter check failed, condition: engineDims.d[i] == dims.d[i]. "
                        f"Static dimension mismatch while setting input shape for {name}. Set "
                        f"dimensions are {list(dims)}. Expected dimensions are {declared}.)"
                    )
                    return False
                if fixed < 0 and profile is not None:
                    low, high = profile[0][axis], profile[2][axis]
                    if not low <= dim <= high:
                        self._log_error(
                            "3: [executionContext.cpp::setInputShape] Error Code 3: API Usage "
                            f"Error (Supplied binding dimension [{','.join(map(str, dims))}] for "
                            f"bindings[{name}] exceed min ~ max range at index {axis}, maximum "
                            f"dimension in profile is {high}, minimum dimension in profile is "
                            f"{low}, but supplied dimension is {dim}.)"
                        )
                        return False
            self._shapes[name] = dims
            self._output_shapes.clear()
            return True

        def _inputs_specified(self) -> bool:
            return all(
                name in self._shapes
                for name, entry in self._engine._tensors.items()
                if entry["mode"] == "INPUT"
            )

        def _outputs(self) -> dict[str, tuple[int, ...]]:
            if not self._output_shapes and self._inputs_specified():
                static = {
                    name: tuple(entry["shape"])
                    for name, entry in self._engine._tensors.items()
                    if entry["mode"] == "OUTPUT"
                }
                if all(all(dim >= 0 for dim in shape) for shape in static.values()):
                    self._output_shapes.update(static)
                else:
                    feeds = {
                        name: np.zeros(self._shapes[name], _NUMPY[entry["dtype"]])
                        for name, entry in self._engine._tensors.items()
                        if entry["mode"] == "INPUT"
                    }
                    for name, value in self._engine._run(feeds).items():
                        self._output_shapes[name] = tuple(value.shape)
            return self._output_shapes

        def get_tensor_shape(self, name: str) -> Dims:
            entry = self._engine._tensors.get(name)
            if entry is None:
                return Dims(())
            if entry["mode"] == "INPUT":
                return Dims(self._shapes.get(name, tuple(entry["shape"])))
            return Dims(self._outputs().get(name, tuple(entry["shape"])))

        def set_tensor_address(self, name: str, memory: int) -> bool:
            state.calls.append("IExecutionContext.set_tensor_address")
            if name not in self._engine._tensors:
                self._log_error(
                    "3: [executionContext.cpp::setTensorAddress] Error Code 3: API Usage Error "
                    f"(tensor {name} not found)"
                )
                return False
            address = int(memory)
            if address % 256:
                self._log_error(
                    "3: [executionContext.cpp::setTensorAddress] Error Code 3: API Usage Error "
                    f"(address of {name} is not 256-byte aligned)"
                )
                return False
            self._addresses[name] = address
            return True

        def get_tensor_address(self, name: str) -> int:
            return self._addresses.get(name, 0)

        def execute_async_v3(self, stream_handle: int) -> bool:
            state.calls.append("IExecutionContext.execute_async_v3")
            state.executions += 1
            engine = self._engine
            context = state.cuda.current_context() if state.cuda is not None else None
            if state.cuda is not None and context is not engine._context:
                self._log_error(
                    "1: [executionContext.cpp::enqueueV3] Error Code 1: Cuda Runtime (invalid "
                    "device context)"
                )
                return False
            if state.execute_error is not None:
                self._log_error(state.execute_error)
                return False
            failure = _execute_failure(state.execute_fail_while)
            if failure is not None and failure != ILLEGAL_ADDRESS:
                self._log_error(failure)
                return False
            if not self._inputs_specified():
                self._log_error(
                    "3: [executionContext.cpp::enqueueV3] Error Code 3: API Usage Error (not all "
                    "input shapes are specified)"
                )
                return False
            missing = [name for name in engine._order if name not in self._addresses]
            if missing:
                self._log_error(
                    "3: [executionContext.cpp::enqueueV3] Error Code 3: API Usage Error "
                    "(Parameter check failed, condition: "
                    "mContext.profileObliviousBindings.at(profileObliviousIndex) || "
                    "getPtrOrNull(mOutputAllocators, profileObliviousIndex). Neither address or "
                    f"allocator is set for output tensor {missing[0]}.)"
                )
                return False
            inputs = {
                name: (
                    self._addresses[name],
                    self._shapes[name],
                    _NUMPY[engine._tensors[name]["dtype"]],
                )
                for name in engine._order
                if engine._tensors[name]["mode"] == "INPUT"
            }
            outputs = {
                name: (self._addresses[name], shape) for name, shape in self._outputs().items()
            }

            def kernel() -> None:
                cuda = state.cuda
                assert cuda is not None
                if failure == ILLEGAL_ADDRESS:  # a wild pointer: sticky for the context
                    cuda.fault(engine._context, "an illegal memory access was encountered")
                    return
                feeds = {}
                for name, (address, shape, dtype) in inputs.items():
                    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                    raw = cuda.read(address, nbytes) if nbytes else b""
                    feeds[name] = np.frombuffer(raw, dtype).reshape(shape)
                for name, value in engine._run(feeds).items():
                    address, shape = outputs[name]
                    if tuple(value.shape) != tuple(shape):
                        raise fake_pycuda.LaunchError("fake kernel: output shape changed")
                    data = np.ascontiguousarray(value).tobytes()
                    if data:
                        cuda.write(address, data)

            if state.cuda is None:
                return True
            try:
                state.cuda.enqueue(int(stream_handle), kernel, "execute_async_v3")
            except fake_pycuda.Error as exc:
                self._log_error(
                    f"1: [executionContext.cpp::enqueueV3] Error Code 1: Cuda Runtime ({exc})"
                )
                return False
            return True

    if modern:  # gone from the 11.0/11.1 bindings (python/src/infer/pyCore.cpp)
        del Builder.platform_has_fast_fp16, Builder.platform_has_fast_int8
        del ICudaEngine.device_memory_size

    exported: dict[str, Any] = {
        "__version__": state.version,
        "ILogger": ILogger,
        "Logger": Logger,
        "Builder": Builder,
        "IBuilderConfig": IBuilderConfig,
        "BuilderFlag": BuilderFlag,
        "MemoryPoolType": MemoryPoolType,
        "NetworkDefinitionCreationFlag": NetworkDefinitionCreationFlag,
        "INetworkDefinition": INetworkDefinition,
        "ITensor": ITensor,
        "OnnxParser": OnnxParser,
        "IOptimizationProfile": IOptimizationProfile,
        "ITimingCache": ITimingCache,
        "IHostMemory": IHostMemory,
        "IProgressMonitor": IProgressMonitor,
        "Runtime": Runtime,
        "ICudaEngine": ICudaEngine,
        "IExecutionContext": IExecutionContext,
        "TensorIOMode": TensorIOMode,
        "DataType": DataType,
        "Dims": Dims,
    }
    if not modern:
        exported.update(
            IInt8Calibrator=IInt8Calibrator,
            IInt8EntropyCalibrator2=IInt8EntropyCalibrator2,
            CalibrationAlgoType=CalibrationAlgoType,
        )
    for name, value in exported.items():
        if isinstance(value, type) and value.__module__ != "tensorrt":
            value.__module__ = "tensorrt"
        setattr(trt, name, value)
    return trt


@dataclass
class FakeGpuStack:
    """A fake pycuda and a fake TensorRT sharing one fake device."""

    cuda: fake_pycuda.FakeCuda
    trt: FakeTensorRT
    modules: dict[str, types.ModuleType]

    @property
    def tensorrt(self) -> types.ModuleType:
        return self.modules["tensorrt"]

    @property
    def driver(self) -> types.ModuleType:
        return self.modules["pycuda.driver"]


def make_stack(
    *, cuda: fake_pycuda.FakeCuda | None = None, trt: FakeTensorRT | None = None
) -> FakeGpuStack:
    cuda = cuda or fake_pycuda.FakeCuda()
    trt = trt or FakeTensorRT()
    trt.cuda = cuda
    cuda.on_violation = trt.violation  # pycuda's release rules count as broken rules too
    modules = {**fake_pycuda.make_modules(cuda), "tensorrt": make_module(trt)}
    return FakeGpuStack(cuda=cuda, trt=trt, modules=modules)


def install(
    monkeypatch: pytest.MonkeyPatch,
    *,
    cuda: fake_pycuda.FakeCuda | None = None,
    trt: FakeTensorRT | None = None,
) -> FakeGpuStack:
    """Put the fake ``tensorrt``, ``pycuda`` and ``pycuda.driver`` into ``sys.modules``."""
    stack = make_stack(cuda=cuda, trt=trt)
    for name, module in stack.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return stack


def thread_stack_depth(stack: FakeGpuStack) -> int:
    """How many contexts are pushed on the calling thread (0 after balanced sections)."""
    return len(stack.cuda.stack())


def run_in_thread(function: Callable[[], Any]) -> Any:
    """Run ``function`` on a fresh thread and return (or raise) its result."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
