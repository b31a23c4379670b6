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
* ``get_providers()`` returns what was registered; ``get_provider_options()``
  the options each registered provider got, with ``device_id`` ``"0"`` where it
  got none (the real one lists every option with its default, a superset).
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
* Everything else (``SessionOptions``, ``GraphOptimizationLevel``, ...) is the
  real module's.

Not modelled: ``Session.run``'s own fallback on ``EPFail`` (the runtime disables
it), CUDA EP option checking, and real GPU placement: ``run`` is CPU inference.
"""

from __future__ import annotations

import json
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
                # The provider's effective options (``ToProviderOptions``): a GPU
                # provider created without a ``device_id`` runs on device 0.
                registered_options[name] = {"device_id": "0", **values}
            registered.append(CPU_EP)
            registered_options[CPU_EP] = {}
            self._inner = self._inner_session(registered)
            self._providers = registered
            self._provider_options = registered_options
            state.sessions.append(
                {
                    "model": self._model_path,
                    "requested": names,
                    "registered": list(registered),
                    "options": registered_options,
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

        def run(self, output_names: Any, input_feed: Any, run_options: Any = None) -> Any:
            return self._inner.run(output_names, input_feed, run_options)

        def io_binding(self) -> Any:
            return self._inner.io_binding()

        def run_with_iobinding(self, iobinding: Any, run_options: Any = None) -> None:
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
