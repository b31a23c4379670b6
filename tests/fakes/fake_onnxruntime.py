"""A fake ``onnxruntime`` whose GPU providers exist, wrapping the real one (real CPU
inference underneath).

Mimics the Python API of ONNX Runtime 1.18-1.20 as ``InferenceSession`` creates a
session: ``onnxruntime/python/onnxruntime_inference_collection.py``
(``InferenceSession.__init__``, ``_create_inference_session``,
``check_and_normalize_provider_args``), the C++ provider creation of
``onnxruntime/python/onnxruntime_pybind_state.cc``
(``CreateExecutionProviderInstance``), the TensorRT EP's option parsing
(``tensorrt_execution_provider_info.cc``: ``ORT_THROW("Invalid TensorRT EP
option: ", key)``) and its EP-context loading
(``onnxruntime/core/providers/tensorrt/onnx_ctx_model_helper.cc``,
``TensorRTCacheModelHandler``).  Rules kept:

* ``get_available_providers()`` lists the providers compiled into the build
  (``FakeOrt.available``, default TensorRT, CUDA, CPU), not the ones a session
  can create.
* ``InferenceSession(path_or_bytes, sess_options=None, providers=None,
  provider_options=None, **kwargs)``: the arguments are normalised as the real
  ``check_and_normalize_provider_args`` does (a name not in the build is a
  ``UserWarning`` "Specified provider '...' is not in available provider
  names.Available providers: '...'" and is not created; a duplicate is warned
  and ignored; option values are stringified; mismatched lengths are a
  ``ValueError``).
* Each provider is created in order.  A provider in ``FakeOrt.not_creatable``
  (its library or CUDA is missing) is skipped after the C++ warning "Failed to
  create <name>. Please reference ...": the session is created without it, no
  error.  ``FakeOrt.trt_creation_error`` makes the TensorRT EP raise
  ``RuntimeError`` at creation (as "LoadLibrary failed ..." does), and an unknown
  TensorRT EP option key raises ``RuntimeError("... Invalid TensorRT EP option:
  <key>")``.  ``CPUExecutionProvider`` is always registered last.
* On ``ValueError``/``RuntimeError`` during creation, with fallback enabled (the
  constructor sets it; ``disable_fallback()`` comes too late for this), the
  session prints "EP Error <e> when using <providers>" and "Falling back to
  <fallback> and retrying.", and is created again once with
  ``['CUDAExecutionProvider', 'CPUExecutionProvider']`` when the TensorRT EP is
  in the build and both TensorRT and CUDA were requested, else
  ``['CPUExecutionProvider']``, *without* the provider options; then it
  disables fallback.  A second failure is raised ``from`` the first.
* A GPU provider's ``device_id`` must be below ``FakeOrt.device_count``
  (``cudaGetDeviceCount``), else creating it raises ``RuntimeError`` (the CUDA
  EP's option parser: "Invalid device ID: <n>, must be between 0 (inclusive)
  and <count> (exclusive)."; the TensorRT EP's ``cudaSetDevice``: "CUDA failure
  101: invalid device ordinal"): the fallback above then retries without the
  provider options, that is on device 0.
* The CUDA EP's options are parsed as ``CUDAExecutionProviderInfo::
  FromProviderOptions`` does (``cuda_execution_provider_info.cc`` through
  ``ProviderOptionsParser``): a key not in ``CUDA_OPTION_KEYS`` raises
  ``RuntimeError('Unknown provider option: "<key>".')``, a ``gpu_mem_limit`` that
  is not a number or an ``arena_extend_strategy`` other than ``kNextPowerOfTwo`` /
  ``kSameAsRequested`` ``'Failed to parse provider option "<key>": ...'``; the
  Python session's fallback then retries without the options.
* ``get_providers()`` returns what was registered; ``get_provider_options()``
  the options each registered provider got, with ``device_id`` ``"0"`` where it
  got none, and for the CUDA EP ``gpu_mem_limit`` SIZE_MAX and
  ``arena_extend_strategy`` ``kNextPowerOfTwo`` where it got none (the real one
  lists every option with its default, a superset).
* The session's GPU memory comes from one BFC arena, the first registered GPU
  provider's (``session_state.cc``: "Each location (OrtDevice) will only have 1
  allocator used for whole session. The EP which is registered first will have
  higher priority"): the CUDA EP's has its ``gpu_mem_limit``, the TensorRT EP's
  none (``CreatePreferredAllocators``: ``CreateCUDAAllocator`` with the defaults).
  ``run`` allocates each input and output there (rounded up to 256 bytes,
  ``kMinAllocationSize``); the arena extends when its free bytes do not hold the
  next one, by it (``kSameAsRequested``) or by a region that doubles from 1 MiB
  (``kNextPowerOfTwo``), keeps what it extended by for the session's life
  (``FakeArena.held``), and an extension past the cap raises the text of
  ``bfc_arena.cc`` (``Extend``, thrown by ``AllocateRawInternal``) as ONNX
  Runtime 1.20.1 words a failed run (microsoft/onnxruntime#23121), ``RuntimeException``
  "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned
  while running <op> node. Name:'<name>' Status Message: ... Available memory of
  <cap - held> is smaller than requested bytes of <n>" (1.32 says "1 : FAIL" and
  raises ``Fail``, same words after "Status Message").  The session serves on.
* A model that is one ``com.microsoft:EPContext`` node is claimed by the
  TensorRT EP when it is registered (``graph.NumberOfNodes() == 1 &&
  GraphHasCtxNode``).  ``embed_mode`` 1: ``ep_cache_context`` holds the engine
  bytes; 0: a path relative to the context model's directory (absolute paths
  and ``..`` refused "For security purpose").  The bytes are deserialized as a
  TensorRT plan of ``tests/fakes/fake_tensorrt.py`` built by TensorRT
  ``FakeOrt.tensorrt_version`` (the library this ONNX Runtime links); other
  bytes fail as the real EP does: ``EPFail`` "TensorRT EP could not
  deserialize engine from binary data".  A ``hardware_architecture`` other
  than this GPU's logs the EP's warning.  The "engine" then computes its ONNX
  model with the real ONNX Runtime on the CPU.  Without the TensorRT EP, the
  real ONNX Runtime gets the context model and refuses the node itself.
* ``Session.run``'s own silent fallback (``onnxruntime_inference_collection.py``,
  ``Session.run``, the same from 1.18 to 1.32, read in 1.32 here): a run that
  raises ``EPFail`` (``FakeOrt.run_ep_failure``: the TensorRT EP fails every run
  while it is set), with fallback enabled, prints "EP Error: <e> using
  <providers>" and "Falling back to <fallback> and retrying.", re-creates the
  session with the fallback providers and no options (``set_providers``, which
  re-creates it as ``_reset_session`` does), disables fallback and runs again:
  the run succeeds on the CUDA EP or the CPU and ``get_providers()`` changes
  under a caller that read it at load.  With fallback disabled the ``EPFail`` is
  raised.  ``FakeOrt.run_fallbacks`` counts those re-creations.
* Everything else (``SessionOptions``, ``GraphOptimizationLevel``, ...) is the
  real module's.

Not modelled: the CUDA EP's checks of option values other than those above, the arena in
``run_with_iobinding`` and the arena's bins and fragmentation, and real GPU
placement: ``run`` is CPU inference.
"""

from __future__ import annotations

import json
import math
import sys
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.fakes import fake_tensorrt

if TYPE_CHECKING:
    import pytest

MIMICS = "ONNX Runtime 1.18-1.20 Python API (onnxruntime_inference_collection.py)"
TRT_EP = "TensorrtExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"

#: ``OrtTensorRTProviderOptionsV2`` keys of ONNX Runtime 1.18-1.20
#: (``tensorrt_execution_provider_info.cc``); any other key is refused.
TRT_OPTION_KEYS = frozenset(
    {
        "device_id",
        "has_user_compute_stream",
        "user_compute_stream",
        "trt_max_partition_iterations",
        "trt_min_subgraph_size",
        "trt_max_workspace_size",
        "trt_fp16_enable",
        "trt_int8_enable",
        "trt_int8_calibration_table_name",
        "trt_int8_use_native_calibration_table",
        "trt_dla_enable",
        "trt_dla_core",
        "trt_dump_subgraphs",
        "trt_engine_cache_enable",
        "trt_engine_cache_path",
        "trt_engine_cache_prefix",
        "trt_engine_decryption_enable",
        "trt_engine_decryption_lib_path",
        "trt_force_sequential_engine_build",
        "trt_context_memory_sharing_enable",
        "trt_layer_norm_fp32_fallback",
        "trt_timing_cache_enable",
        "trt_timing_cache_path",
        "trt_force_timing_cache",
        "trt_detailed_build_log",
        "trt_build_heuristics_enable",
        "trt_sparsity_enable",
        "trt_builder_optimization_level",
        "trt_auxiliary_streams",
        "trt_tactic_sources",
        "trt_extra_plugin_lib_paths",
        "trt_profile_min_shapes",
        "trt_profile_max_shapes",
        "trt_profile_opt_shapes",
        "trt_cuda_graph_enable",
        "trt_dump_ep_context_model",
        "trt_ep_context_file_path",
        "trt_ep_context_embed_mode",
        "trt_weight_stripped_engine_enable",
        "trt_onnx_model_folder_path",
        "trt_onnx_bytestream",
        "trt_onnx_bytestream_size",
        "trt_engine_hw_compatible",
    }
)


#: ``CUDAExecutionProviderInfo``'s option keys (``cuda_execution_provider_info.cc``
#: of the 1.17-1.20 releases); any other key is refused.
CUDA_OPTION_KEYS = frozenset(
    {
        "device_id",
        "has_user_compute_stream",
        "user_compute_stream",
        "gpu_mem_limit",
        "arena_extend_strategy",
        "cudnn_conv_algo_search",
        "do_copy_in_default_stream",
        "gpu_external_alloc",
        "gpu_external_free",
        "gpu_external_empty_cache",
        "cudnn_conv_use_max_workspace",
        "enable_cuda_graph",
        "cudnn_conv1d_pad_to_nc1d",
        "tunable_op_enable",
        "tunable_op_tuning_enable",
        "tunable_op_max_tuning_duration_ms",
        "enable_skip_layer_norm_strict_mode",
        "prefer_nhwc",
        "use_ep_level_unified_stream",
        "use_tf32",
    }
)
SIZE_MAX = 2**64 - 1
ARENA_STRATEGIES = ("kNextPowerOfTwo", "kSameAsRequested")
#: ``BFCArena::kMinAllocationSize`` and the default ``initial_chunk_size_bytes``.
_MIN_ALLOCATION = 256
_INITIAL_CHUNK = 1024 * 1024


@dataclass
class FakeArena:
    """The BFC arena that holds a session's GPU memory (see the module docstring)."""

    limit: int = SIZE_MAX
    strategy: str = "kNextPowerOfTwo"
    #: What it extended by (``total_allocated_bytes``): it never gives it back.
    held: int = 0
    _region: int = _INITIAL_CHUNK

    def allocate_run(self, arrays: Sequence[Any], real: Any, node: tuple[str, str]) -> None:
        """Allocate each of ``arrays`` for one run (freed at its end), or raise."""
        in_use = 0
        for array in arrays:
            size = max(1, math.ceil(array.nbytes / _MIN_ALLOCATION)) * _MIN_ALLOCATION
            if self.held - in_use < size:
                self._extend(size, real, node)
            in_use += size

    def _extend(self, size: int, real: Any, node: tuple[str, str]) -> None:
        available = (self.limit - self.held) // _MIN_ALLOCATION * _MIN_ALLOCATION
        if size > available:
            op, name = node
            raise real.capi.onnxruntime_pybind11_state.RuntimeException(
                "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned "
                f"while running {op} node. Name:'{name}' Status Message: /onnxruntime_src/"
                "onnxruntime/core/framework/bfc_arena.cc:376 void* onnxruntime::BFCArena::"
                "AllocateRawInternal(size_t, bool, onnxruntime::Stream*, bool, onnxruntime::"
                f"WaitNotificationFn) Available memory of {available} is smaller than "
                f"requested bytes of {size}"
            )
        extension = size
        if self.strategy == "kNextPowerOfTwo":
            while self._region < size:
                self._region *= 2
            extension = min(self._region, available)
            self._region *= 2
        self.held += extension


@dataclass
class FakeOrt:
    """Knobs and observations of one fake ONNX Runtime; not part of the module."""

    available: tuple[str, ...] = (TRT_EP, CUDA_EP, CPU_EP)
    #: Providers the C++ session cannot create: skipped with "Failed to create ...".
    not_creatable: frozenset[str] = frozenset()
    #: When set, creating the TensorRT EP raises ``RuntimeError`` with this text.
    trt_creation_error: str | None = None
    #: The TensorRT library this ONNX Runtime's TensorRT EP links.
    tensorrt_version: str = fake_tensorrt.TRT10_VERSION
    #: This GPU's compute capability as the TensorRT EP writes it (``major*10+minor``).
    compute_capability: str = "87"
    #: ``cudaGetDeviceCount()``: a GPU provider's ``device_id`` must be below it.
    device_count: int = 1
    #: One entry per session created: model, requested and registered providers.
    sessions: list[dict[str, Any]] = field(default_factory=list)
    #: What the C++ side logged (warnings), in order.
    log: list[str] = field(default_factory=list)
    #: When set, every run of a session with the TensorRT EP registered raises
    #: ``EPFail`` with this text (``Session.run`` then falls back if enabled).
    run_ep_failure: str | None = None
    #: Sessions ``Session.run``'s fallback re-created on other providers.
    run_fallbacks: int = 0


def _warn_cpp(state: FakeOrt, message: str) -> None:
    state.log.append(message)
    print(f"[W:onnxruntime:Default] {message}", file=sys.stderr)


def _normalize(
    providers: Sequence[Any] | None,
    provider_options: Sequence[dict[Any, Any]] | None,
    available: Sequence[str],
) -> tuple[list[str], list[dict[str, str]]]:
    """``check_and_normalize_provider_args`` of the real Python API."""
    if providers is None:
        return [], []
    if provider_options is not None:
        if len(providers) != len(provider_options):
            raise ValueError(
                "'providers' and 'provider_options' should be the same length if both are given."
            )
        pairs = list(zip(providers, provider_options, strict=True))
    else:
        pairs = [(p, {}) if isinstance(p, str) else (p[0], p[1]) for p in providers]
    names: dict[str, dict[str, str]] = {}
    for name, options in pairs:
        if name not in available:
            warnings.warn(
                f"Specified provider '{name}' is not in available provider names."
                f"Available providers: '{', '.join(available)}'",
                stacklevel=3,
            )
        if name in names:
            warnings.warn(f"Duplicate provider '{name}' encountered, ignoring.", stacklevel=3)
            continue
        names[name] = {str(key): str(value) for key, value in options.items()}
    return list(names), list(names.values())


def _check_cuda_options(values: dict[str, str]) -> None:
    """``CUDAExecutionProviderInfo::FromProviderOptions`` for the keys and the arena's
    options (``ProviderOptionsParser::Parse``: ``ORT_THROW_IF_ERROR``, a
    ``RuntimeError`` in Python)."""
    for key, value in values.items():
        if key not in CUDA_OPTION_KEYS:
            raise RuntimeError(f'Unknown provider option: "{key}".')
        if key == "gpu_mem_limit" and not (value.isascii() and value.isdigit()):
            raise RuntimeError(
                f'Failed to parse provider option "{key}": Failed to parse value: "{value}"'
            )
        if key == "arena_extend_strategy" and value not in ARENA_STRATEGIES:
            raise RuntimeError(
                f'Failed to parse provider option "{key}": Failed to get enum value from '
                f'name "{value}"'
            )


def _registered_options(name: str, values: dict[str, str]) -> dict[str, str]:
    """The provider's effective options (``ToProviderOptions``): a GPU provider made
    without a ``device_id`` runs on device 0, a CUDA EP without ``gpu_mem_limit`` has
    an arena without a cap that doubles."""
    defaults = {"device_id": "0"}
    if name == CUDA_EP:
        defaults |= {"gpu_mem_limit": str(SIZE_MAX), "arena_extend_strategy": ARENA_STRATEGIES[0]}
    return {**defaults, **values}


def _session_arena(registered: Sequence[str], options: dict[str, dict[str, str]]) -> FakeArena:
    """The arena of the first registered GPU provider (the session's one for the GPU)."""
    first = next((name for name in registered if name in (TRT_EP, CUDA_EP)), None)
    if first != CUDA_EP:
        return FakeArena()  # the TensorRT EP's (no cap), or none used: the CPU's
    values = options[CUDA_EP]
    return FakeArena(int(values["gpu_mem_limit"]), values["arena_extend_strategy"])


def _check_device_id(provider: str, value: str, device_count: int) -> None:
    """A GPU provider's ``device_id`` as creating it checks it: the CUDA EP's option
    parser (``CUDAExecutionProviderInfo::FromProviderOptions``, ``ORT_THROW_IF_ERROR``)
    and the TensorRT EP's constructor (``CUDA_CALL_THROW(cudaSetDevice(device_id_))``)
    throw, a ``RuntimeError`` in Python, so the session's fallback retries without
    the provider options."""
    try:
        device_id = int(value)
    except ValueError:
        raise RuntimeError(f'Failed to parse provider option "device_id": {value}') from None
    if 0 <= device_id < device_count:
        return
    if provider == TRT_EP:
        raise RuntimeError(
            "/onnxruntime_src/onnxruntime/core/providers/tensorrt/"
            "tensorrt_execution_provider.cc CUDA failure 101: invalid device ordinal ; "
            f"GPU={device_id} ; expr=cudaSetDevice(device_id_);"
        )
    raise RuntimeError(
        f"Invalid device ID: {device_id}, must be between 0 (inclusive) and "
        f"{device_count} (exclusive)."
    )


def _read_model(path_or_bytes: Any) -> Any:
    import onnx

    if isinstance(path_or_bytes, bytes):
        return onnx.load_from_string(path_or_bytes)
    return onnx.load(str(path_or_bytes), load_external_data=False)


def _context_node(model: Any) -> Any | None:
    nodes = list(model.graph.node)
    if len(nodes) == 1 and nodes[0].op_type == "EPContext" and nodes[0].domain == "com.microsoft":
        return nodes[0]
    return None


def _plan_model(state: FakeOrt, real: Any, data: bytes) -> tuple[bytes, list[str]]:
    """The ONNX model and IO names inside a fake TensorRT plan, or ``EPFail``."""
    magic = fake_tensorrt.ENGINE_MAGIC
    header: Any = None
    if data.startswith(magic):
        start = len(magic) + 4
        length = int.from_bytes(data[len(magic) : start], "big")
        try:
            header = json.loads(data[start : start + length])
        except ValueError:
            header = None
    if not isinstance(header, dict) or header.get("version") != state.tensorrt_version:
        if isinstance(header, dict):
            _warn_cpp(
                state,
                "[TensorRT EP] The engine plan file is not compatible with this version of "
                f"TensorRT, expecting library version {state.tensorrt_version} got "
                f"{header.get('version')}, please rebuild.",
            )
        raise real.capi.onnxruntime_pybind11_state.EPFail(
            "[ONNXRuntimeError] : 11 : EP_FAIL : TensorRT EP could not deserialize engine "
            "from binary data"
        )
    return data[start + length :], [entry["name"] for entry in header["io"]]


def make_module(state: FakeOrt, real: Any) -> types.ModuleType:
    """A module object named ``onnxruntime``: the fake's names, else the real module's."""

    class _Module(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    module = _Module("onnxruntime")
    module.__version__ = real.__version__
    module.__file__ = __file__

    def get_available_providers() -> list[str]:
        return list(state.available)

    class InferenceSession:
        def __init__(
            self,
            path_or_bytes: str | bytes | Any,
            sess_options: Any = None,
            providers: Sequence[Any] | None = None,
            provider_options: Sequence[dict[Any, Any]] | None = None,
            **kwargs: Any,
        ) -> None:
            self._model_path = path_or_bytes
            self._sess_options = sess_options
            self._enable_fallback = True
            try:
                self._create(providers, provider_options)
            except (ValueError, RuntimeError) as e:
                if self._enable_fallback:
                    try:
                        print("*************** EP Error ***************")
                        print(f"EP Error {e} when using {providers}")
                        print(f"Falling back to {self._fallback_providers} and retrying.")
                        print("****************************************")
                        self._create(self._fallback_providers, None)
                        self.disable_fallback()
                        return
                    except Exception as fallback_error:
                        raise fallback_error from e
                raise e

        def _create(
            self, providers: Sequence[Any] | None, provider_options: Sequence[dict[Any, Any]] | None
        ) -> None:
            names = [p if isinstance(p, str) else p[0] for p in providers or []]
            if TRT_EP in state.available and TRT_EP in names and CUDA_EP in names:
                self._fallback_providers = [CUDA_EP, CPU_EP]
            else:
                self._fallback_providers = [CPU_EP]
            names, options = _normalize(providers, provider_options, state.available)
            registered: list[str] = []
            registered_options: dict[str, dict[str, str]] = {}
            for name, values in zip(names, options, strict=True):
                if name not in state.available or name == CPU_EP:
                    continue
                if name == TRT_EP:
                    if state.trt_creation_error is not None:
                        raise RuntimeError(state.trt_creation_error)
                    for key in values:
                        if key not in TRT_OPTION_KEYS:
                            raise RuntimeError(
                                "/onnxruntime_src/onnxruntime/core/providers/tensorrt/"
                                "tensorrt_execution_provider_info.cc:63 static onnxruntime::"
                                "TensorrtExecutionProviderInfo onnxruntime::"
                                "TensorrtExecutionProviderInfo::FromProviderOptions(const "
                                f"onnxruntime::ProviderOptions&) Invalid TensorRT EP option: {key}"
                            )
                if name == CUDA_EP and name not in state.not_creatable:
                    _check_cuda_options(values)
                if name not in state.not_creatable and "device_id" in values:
                    _check_device_id(name, values["device_id"], state.device_count)
                if name in state.not_creatable:
                    _warn_cpp(
                        state,
                        f"Failed to create {name}. Please reference https://onnxruntime.ai/docs/"
                        "execution-providers/TensorRT-ExecutionProvider.html#requirements to "
                        "ensure all dependencies are met."
                        if name == TRT_EP
                        else f"Failed to create {name}. Please reference https://onnxruntime."
                        "ai/docs/execution-providers/CUDA-ExecutionProvider.html#requirements "
                        "to ensure all dependencies are met.",
                    )
                    continue
                registered.append(name)
                registered_options[name] = _registered_options(name, values)
            registered.append(CPU_EP)
            registered_options[CPU_EP] = {}
            self._inner = self._inner_session(registered)
            self._providers = registered
            self._provider_options = registered_options
            self.arena = _session_arena(registered, registered_options)
            nodes = _read_model(self._model_path).graph.node
            self._first_node = next(((node.op_type, node.name) for node in nodes), ("", ""))
            state.sessions.append(
                {
                    "model": self._model_path,
                    "requested": names,
                    "registered": list(registered),
                    "options": registered_options,
                    "arena": self.arena,
                }
            )

        def _inner_session(self, registered: list[str]) -> Any:
            """The real CPU session that computes what this session computes."""
            model = _read_model(self._model_path)
            node = _context_node(model) if TRT_EP in registered else None
            if node is None:
                return real.InferenceSession(
                    self._model_path, sess_options=self._sess_options, providers=[CPU_EP]
                )
            plan = self._engine_bytes(node)
            onnx_bytes, io_names = _plan_model(state, real, plan)
            ctx_io = [*node.input, *node.output]
            if sorted(ctx_io) != sorted(io_names):
                raise real.capi.onnxruntime_pybind11_state.EPFail(
                    f"[ONNXRuntimeError] : 11 : EP_FAIL : (fake TensorRT EP) the EPContext node's "
                    f"inputs/outputs {ctx_io} are not the engine's IO tensors {io_names}"
                )
            return real.InferenceSession(onnx_bytes, providers=[CPU_EP])

        def _engine_bytes(self, node: Any) -> bytes:
            attributes = {a.name: a for a in node.attribute}
            architecture = attributes.get("hardware_architecture")
            if architecture is not None and architecture.s.decode() != state.compute_capability:
                _warn_cpp(
                    state,
                    "[TensorRT EP] Engine was compiled for a different compatibility level and "
                    "might not work or perform suboptimal",
                )
            embed_mode = attributes["embed_mode"].i if "embed_mode" in attributes else 1
            context = attributes["ep_cache_context"].s
            if embed_mode:
                return bytes(context)
            relative = context.decode()
            fail = real.capi.onnxruntime_pybind11_state.EPFail
            if relative.startswith("/"):
                raise fail(
                    "[ONNXRuntimeError] : 11 : EP_FAIL : For security purpose, the "
                    "ep_cache_context attribute should be set with a relative path, but it is "
                    f"an absolute path:  {relative}"
                )
            if ".." in relative:
                raise fail(
                    "[ONNXRuntimeError] : 11 : EP_FAIL : The file path in ep_cache_context "
                    "attribute has '..'. For security purpose, it's not allowed to point "
                    "outside the directory."
                )
            engine = Path(str(self._model_path)).parent / relative
            if not engine.exists():
                raise fail(
                    "[ONNXRuntimeError] : 11 : EP_FAIL : TensorRT EP can't find engine cache: "
                    f"{engine}. Please make sure engine cache is in the same directory or "
                    "sub-directory of context model."
                )
            return engine.read_bytes()

        def get_providers(self) -> list[str]:
            return list(self._providers)

        def get_provider_options(self) -> dict[str, dict[str, str]]:
            return {name: dict(values) for name, values in self._provider_options.items()}

        def disable_fallback(self) -> None:
            self._enable_fallback = False

        def enable_fallback(self) -> None:
            self._enable_fallback = True

        def get_inputs(self) -> Any:
            return self._inner.get_inputs()

        def get_outputs(self) -> Any:
            return self._inner.get_outputs()

        def set_providers(
            self, providers: Sequence[Any] | None = None, provider_options: Any = None
        ) -> None:
            """Re-create the session with ``providers`` (``_reset_session``)."""
            self._create(providers, provider_options)

        def run(self, output_names: Any, input_feed: Any, run_options: Any = None) -> Any:
            try:
                return self._run(output_names, input_feed, run_options)
            except real.capi.onnxruntime_pybind11_state.EPFail as err:
                if self._enable_fallback:  # Session.run's fallback, as the real one
                    print(f"EP Error: {err!s} using {self._providers}")
                    print(f"Falling back to {self._fallback_providers} and retrying.")
                    state.run_fallbacks += 1
                    self.set_providers(self._fallback_providers)
                    self.disable_fallback()
                    return self._run(output_names, input_feed, run_options)
                raise

        def _run(self, output_names: Any, input_feed: Any, run_options: Any) -> Any:
            if state.run_ep_failure is not None and TRT_EP in self._providers:
                raise real.capi.onnxruntime_pybind11_state.EPFail(
                    f"[ONNXRuntimeError] : 11 : EP_FAIL : {state.run_ep_failure}"
                )
            outputs = self._inner.run(output_names, input_feed, run_options)
            tensors = [*input_feed.values(), *outputs]
            self.arena.allocate_run(tensors, real, self._first_node)
            return outputs

        def io_binding(self) -> Any:
            return self._inner.io_binding()

        def run_with_iobinding(self, iobinding: Any, run_options: Any = None) -> None:
            # No fallback here: the real one calls the C++ session and lets EPFail go.
            if state.run_ep_failure is not None and TRT_EP in self._providers:
                raise real.capi.onnxruntime_pybind11_state.EPFail(
                    f"[ONNXRuntimeError] : 11 : EP_FAIL : {state.run_ep_failure}"
                )
            self._inner.run_with_iobinding(iobinding, run_options)

    module.get_available_providers = get_available_providers  # type: ignore[attr-defined]
    module.InferenceSession = InferenceSession  # type: ignore[attr-defined]
    return module


def install(monkeypatch: pytest.MonkeyPatch, state: FakeOrt | None = None) -> FakeOrt:
    """Put a fake ``onnxruntime`` (around the real one) into ``sys.modules``."""
    import onnxruntime as real

    state = state if state is not None else FakeOrt()
    monkeypatch.setitem(sys.modules, "onnxruntime", make_module(state, real))
    return state
