"""What an ``onnx_trt_ep`` session is made of: the very model its digest names.

``compile_engine`` hashes the model (and its external data files); the session is
made afterwards.  ONNX Runtime given the model's path read whatever the path named
then, so weights replaced in between were served under the old model's digest,
which names the TensorRT EP's cache and gates a staged engine; asking the digest
again after the load (DESIGN.md 201) did not see a change undone meanwhile (A to B
to A).  So the model's bytes are read once (``inferd.model_bytes``), their digest
checked to be the entry's, and the session made from exactly those bytes.

ONNX Runtime still reads external data files by path: from the model's folder,
named by ``session.model_external_initializers_file_folder_path`` (1.21 on; given
bytes, an earlier ONNX Runtime looks beside its working directory).  Once the
session exists they must still be the very files hashed (inode, size, mtime,
ctime: a rename over one and back moves its ctime).  Before 1.21 a model with
external data is loaded from its path, and the model file is checked so too; so
is it for a session that asks for the TensorRT EP, whose parser is handed the
subgraph's initializers by ONNX Runtime: that it finds external weights of a model
given as bytes is not yet confirmed on a GPU (a device check, DESIGN.md).
Either way a model changed meanwhile loads nothing (``EngineDeserializeError``).

The load's decisions about the model (the INT8 Q/DQ check, the profile check, the
unknown-rank refusal) read its graph from those same bytes, parsed once without
external data (``HashedModel.graph``), and only when one of them asks: a file
replaced between two reads of the path could otherwise have a model refused or
accepted for another's graph.  What they need is kept (``ModelGraph``), not the
``onnx.ModelProto``, which with inline weights is as large as the model and would
be held while ONNX Runtime makes the session.

A staged engine's EP-context model is not read here: it holds the gated engine's
bytes, not the model's weights, is written by the daemon into its own cache
directory, which only its user may change, and stays loaded by path, how the real
TensorRT EP takes a context model otherwise being unconfirmed (DESIGN.md 154).  Its
load still decides from the model's graph (the profile check), read once so too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.digest import ModelDigest
from inferd.errors import EngineDeserializeError
from inferd.external_data import model_directory
from inferd.model_bytes import (
    MODEL_FILE,
    model_file_replaced,
    parse_model,
    read_model,
    replaced_external_files,
)
from inferd.types import EngineCacheEntry

#: ONNX Runtime's session option (1.21 on) naming the folder of a model's external
#: data when the model is given as bytes; earlier versions ignore the key.
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"
_EXTERNAL_DATA_FOLDER_SINCE = (1, 21)
#: The ops of an explicitly quantized (Q/DQ) model: it carries its own INT8 scales.
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


class ModelParseError(Exception):
    """The model's bytes (as hashed) are not an ONNX model; its text is onnx's.  Each
    decision words its own refusal (``ort_precision``, ``onnx_trt_ep_shapes``)."""


@dataclass(frozen=True)
class ModelGraph:
    """What a load decides from the model's graph, read from one ``onnx.ModelProto``.

    ``inputs``: the graph's inputs that are not initializers (as ONNX Runtime's
    ``get_inputs``), ``None`` for a dynamic dimension; ``unranked``: the inputs that
    declare no shape at all, in graph order; ``quantized``: a Q/DQ node anywhere (the
    graph, its functions, their subgraphs), None when not looked for (``qdq``): that
    walks every node, 24 ms for 20,000 where the parse took 3, so only for the INT8
    check."""

    inputs: dict[str, list[int | None]]
    unranked: tuple[str, ...]
    quantized: bool | None
    #: The model without nodes or weights, serialized: its IR version, opsets, graph
    #: name, inputs (initializers excluded) and outputs: what a staged engine's
    #: EP-context model declares (``ort_ep_context.build_context_model``).
    interface: bytes = b""

    @classmethod
    def of(cls, model: Any, *, qdq: bool) -> ModelGraph:
        graph = model.graph
        initializers = {tensor.name for tensor in graph.initializer}
        inputs = {
            value.name: [
                dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None
                for dim in value.type.tensor_type.shape.dim
            ]
            for value in graph.input
            if value.name not in initializers
        }
        unranked = tuple(
            value.name for value in graph.input if not value.type.tensor_type.HasField("shape")
        )
        skeleton = type(model)()
        skeleton.ir_version = model.ir_version
        skeleton.opset_import.extend(model.opset_import)
        skeleton.graph.name = graph.name
        skeleton.graph.input.extend(v for v in graph.input if v.name not in initializers)
        skeleton.graph.output.extend(graph.output)
        quantized = _has_qdq_nodes(model) if qdq else None
        return cls(inputs, unranked, quantized, skeleton.SerializeToString())


def _has_qdq_nodes(model: Any) -> bool:
    graphs = [model.graph, *model.functions]  # a FunctionProto has nodes too
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            if node.op_type in QDQ_OPS:
                return True
            for attribute in node.attribute:
                graphs.extend([attribute.g] if attribute.HasField("g") else [])
                graphs.extend(attribute.graphs)
    return False


@dataclass(frozen=True)
class SessionModel:
    """``source``: what ``InferenceSession`` is given, the bytes read (the model's
    path before ONNX Runtime 1.21 for a model with external data); ``hashed``: the
    files their digest, the entry's, was taken over.  Held only while the session is
    made: the bytes can be hundreds of MB."""

    path: Path
    source: bytes | Path
    hashed: ModelDigest

    def configure(self, options: Any) -> None:
        """Point ONNX Runtime's ``options`` at the folder of the model's external data."""
        if self.hashed.external and isinstance(self.source, bytes):
            options.add_session_config_entry(EXTERNAL_DATA_FOLDER, model_directory(self.path))

    def check_read(self) -> None:
        """Once the session is made: refuse it unless every file ONNX Runtime read by
        path is still the very file hashed (stat only: nothing is read again)."""
        replaced = replaced_external_files(self.path, self.hashed)
        if isinstance(self.source, Path) and model_file_replaced(self.path, self.hashed):
            replaced.insert(0, MODEL_FILE)
        if replaced:
            raise EngineDeserializeError(
                f"model {self.path} changed while ONNX Runtime loaded it ({', '.join(replaced)} "
                "was written or replaced since it was hashed for this load): nothing was "
                "loaded from it; load it again"
            )


class HashedModel:
    """The model of one load: its bytes read once (``read``), refused unless their
    digest is still ``entry.model_sha256``, and parsed at most once, when a decision
    first asks for its graph (``graph``).  ``release`` drops the bytes (hundreds of
    MB) once no decision or session needs them; the graph read stays."""

    def __init__(self, entry: EngineCacheEntry) -> None:
        self.entry = entry
        self._read: tuple[bytes, ModelDigest] | None = None
        self._graph: ModelGraph | None = None

    def read(self) -> tuple[bytes, ModelDigest]:
        """The model's bytes and what they were hashed with, read at the first call."""
        if self._read is None:
            self._read = _read_checked(self.entry)
        return self._read

    def graph(self) -> ModelGraph:
        """The model's graph as those bytes hold it (``ModelParseError`` when they are
        not an ONNX model); the ``onnx.ModelProto`` is dropped once read."""
        if self._graph is None:
            self._graph = self._parse(qdq=False)
        return self._graph

    def quantized(self) -> bool:
        """Whether the graph has Q/DQ nodes (``graph``'s errors).  The INT8 check asks it
        before any other decision, so the one parse reads it too; asked after a parse
        that did not, it would parse again."""
        if self._graph is None or self._graph.quantized is None:
            self._graph = self._parse(qdq=True)
        return bool(self._graph.quantized)

    def _parse(self, *, qdq: bool) -> ModelGraph:
        data, _hashed = self.read()
        try:
            model = parse_model(data)
        except Exception as exc:  # onnx raises DecodeError, ...
            raise ModelParseError(str(exc)) from exc
        return ModelGraph.of(model, qdq=qdq)

    def session_model(self, ort: Any, *, tensorrt_ep: bool) -> SessionModel:
        """What ONNX Runtime ``ort`` is given: those bytes, or the path for a model with
        external data where ``tensorrt_ep`` (the session asks for the TensorRT EP) or
        before 1.21 (above)."""
        data, hashed = self.read()
        path = self.entry.model_path
        if hashed.external and (tensorrt_ep or not external_data_from_memory(ort)):
            return SessionModel(path, path, hashed)
        return SessionModel(path, data, hashed)

    def release(self) -> None:
        self._read = None


def _read_checked(entry: EngineCacheEntry) -> tuple[bytes, ModelDigest]:
    path = entry.model_path
    try:
        data, hashed = read_model(path)
    except OSError as exc:
        raise EngineDeserializeError(f"cannot read model {path}: {exc}") from None
    if hashed.sha256 != entry.model_sha256:
        raise EngineDeserializeError(
            f"model {path} changed since it was hashed for this load (its digest is now "
            f"{hashed.sha256[:16]}, not {entry.model_sha256[:16]}): nothing was loaded from "
            "it; load it again"
        )
    return data, hashed


def external_data_from_memory(ort: Any) -> bool:
    """Whether ONNX Runtime ``ort`` finds the external data of a model given as bytes
    in the folder ``EXTERNAL_DATA_FOLDER`` names (1.21 on, onnxruntime PR #23557)."""
    found = re.match(r"(\d+)\.(\d+)", str(getattr(ort, "__version__", "")))
    return found is not None and (int(found[1]), int(found[2])) >= _EXTERNAL_DATA_FOLDER_SINCE
