"""A prebuilt engine on ONNX Runtime's TensorRT EP: gated, then handed over as an
EP-context model.

ONNX Runtime's TensorRT EP loads a prebuilt engine only from an *EP-context
model* (ONNX Runtime >= 1.17): a graph whose one node is
``com.microsoft:EPContext`` with ``embed_mode`` and ``ep_cache_context`` (the
engine bytes when ``embed_mode`` is 1, a path relative to the context model
when 0), ``hardware_architecture`` (the GPU's compute capability as
``major*10+minor``) and ``onnx_model_filename``; its inputs and outputs are the
original model's.  An engine copied into ``trt_engine_cache_path`` under its own
name is never loaded: the EP names its cache files itself.

``prepare_ep_context`` is the only way a staged engine reaches ONNX Runtime:

1. the ``EngineGate`` (the same five steps as every ``.engine``: name, host
   tuple, sidecar, digest, deployment manifest; refusals are logged, recorded
   as ``engine_refused`` and raised);
2. the bytes ``ValidatedEngine.read_verified`` re-hashed are embedded
   (``embed_mode`` 1): ONNX Runtime never opens the engine file, so what it
   deserializes is what the gate passed (DESIGN.md, "The TensorRT path as it
   will behave on a real Jetson");
3. the context model is checked with ``onnx.checker`` and written with the one
   atomic writer into the model's cache directory, which the daemon owns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.config import RuntimeConfig
from inferd.durable import atomic_write_bytes
from inferd.engines.gate import EngineGate, ValidatedEngine
from inferd.engines.manifest import deployment_manifest
from inferd.errors import EngineDeserializeError
from inferd.owned_files import ensure_owned_dir
from inferd.types import EngineCacheEntry, HostTuple, RecordSink

EP_CONTEXT_OP = "EPContext"
EP_CONTEXT_DOMAIN = "com.microsoft"
#: ``ep_cache_context`` holds the engine bytes (0 would make it a relative path).
EMBED_MODE = 1
CONTEXT_SUFFIX = "_ctx.onnx"
#: protobuf cannot serialize a message of 2 GiB or more; keep room for the graph.
MAX_EMBEDDED_ENGINE_BYTES = 2**31 - 1 - 16 * 1024**2


@dataclass(frozen=True)
class EpContextModel:
    """The context model written for one gated engine."""

    path: Path
    engine: ValidatedEngine


def gate_staged_engine(
    engine: Path,
    entry: EngineCacheEntry,
    *,
    config: RuntimeConfig,
    record: RecordSink,
    host_tuple: Callable[..., HostTuple],
) -> tuple[ValidatedEngine, HostTuple]:
    """The gate's verdict on ``engine`` for ``entry``'s model and build config on this
    host; its refusal (or ``HostTupleUnavailableError``) propagates.  A staged engine
    is the operator's file: a symlink to it (and to its sidecar) is followed, and the
    bytes embedded are those of the file the gate hashed (``read_verified``).  The
    manifest is ``runtime.engine_manifest``, or the engine dir's own when that dir
    is safely the daemon's (``deployment_manifest``)."""
    host = host_tuple(precision=entry.build_config.precision, device_index=config.device_id)
    gate = EngineGate(
        host, deployment_manifest(config.engine_manifest, config.engine_dir), record=record
    )
    validated = gate.validate(
        engine, model_sha256=entry.model_sha256, build_config=entry.build_config, follow=True
    )
    return validated, host


def context_model_path(directory: Path, engine: ValidatedEngine) -> Path:
    """Keyed by the engine's digest: one content, one name."""
    return directory / f"staged_{engine.sha256[:16]}{CONTEXT_SUFFIX}"


def build_context_model(
    model_path: Path, interface: bytes, engine: ValidatedEngine, host: HostTuple
) -> Any:
    """The EP-context ``ModelProto``: one ``EPContext`` node with the original
    model's graph inputs (initializers excluded) and outputs, embedding the verified
    engine bytes.  ``interface``: those of the model as its digest names it, without
    its nodes or weights (``ort_model_source.ModelGraph.interface``): the model is
    not read again (a large inline model would be parsed whole for its inputs)."""
    import onnx
    from onnx import helper

    if engine.size_bytes > MAX_EMBEDDED_ENGINE_BYTES:
        raise EngineDeserializeError(
            f"staged engine {engine.path.name} is {engine.size_bytes} bytes: an EP-context model "
            f"embeds it, and protobuf limits a model to 2 GiB; serve it on the tensorrt runtime"
        )
    original = onnx.load_model_from_string(interface)
    inputs, outputs = list(original.graph.input), list(original.graph.output)
    major, minor = host.compute_capability
    node = helper.make_node(
        EP_CONTEXT_OP,
        [value.name for value in inputs],
        [value.name for value in outputs],
        name=f"inferd_staged_{engine.sha256[:16]}",
        domain=EP_CONTEXT_DOMAIN,
        embed_mode=EMBED_MODE,
        ep_cache_context=bytes(engine.read_verified()),
        hardware_architecture=f"{major}{minor}",
        onnx_model_filename=model_path.name,
        ep_sdk_version=host.tensorrt_version,
        notes=f"inferd staged engine {engine.path.name} sha256 {engine.sha256}",
    )
    opsets = [entry for entry in original.opset_import if entry.domain != EP_CONTEXT_DOMAIN]
    name = f"{original.graph.name or 'model'}_ep_context"
    graph = helper.make_graph([node], name, inputs, outputs)
    model = helper.make_model(
        graph,
        opset_imports=[*opsets, helper.make_opsetid(EP_CONTEXT_DOMAIN, 1)],
        producer_name="inferd",
    )
    model.ir_version = original.ir_version
    return model


def prepare_ep_context(
    engine: Path,
    entry: EngineCacheEntry,
    directory: Path,
    *,
    config: RuntimeConfig,
    record: RecordSink,
    host_tuple: Callable[..., HostTuple],
    interface: bytes,
) -> EpContextModel:
    """Gate ``engine``, then write its EP-context model into ``directory`` (the
    daemon's own: ``inferd.owned_files.ensure_owned_dir``); ``interface``: the
    model's inputs and outputs (``build_context_model``)."""
    import onnx

    validated, host = gate_staged_engine(
        engine, entry, config=config, record=record, host_tuple=host_tuple
    )
    data = build_context_model(entry.model_path, interface, validated, host).SerializeToString()
    try:
        onnx.checker.check_model(data)
    except Exception as exc:  # onnx.checker.ValidationError
        raise EngineDeserializeError(
            f"the EP-context model for staged engine {validated.path.name} is malformed: {exc}"
        ) from exc
    path = context_model_path(
        ensure_owned_dir(directory, what="runtime.ort_trt_cache_dir"), validated
    )
    try:
        atomic_write_bytes(path, data, mode=0o600)
    except OSError as exc:
        raise EngineDeserializeError(f"cannot write EP-context model {path}: {exc}") from exc
    return EpContextModel(path=path, engine=validated)
