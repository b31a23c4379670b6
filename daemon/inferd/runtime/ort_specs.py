"""An ONNX Runtime session's inputs and outputs as inferd serves them (``TensorSpec``).

ONNX Runtime's ``get_inputs``/``get_outputs`` give each dimension as a size, a
name (the model's ``dim_param``) or None.  Two things follow from that view:

* **Named sizes.**  ONNX takes one ``dim_param`` name, wherever the graph's inputs
  and outputs use it, as one size.  ONNX Runtime does not check a request against
  it: two inputs declared ``[batch, 3]`` fed batches 2 and 3 fail inside the run,
  at whichever node first meets both (``FAIL``, answered ``INTERNAL``).  Each
  spec keeps the names it shares with another axis (``TensorSpec.shared_dims``,
  counted once per model here) and ``bus.codec`` refuses a request whose sizes
  for one name differ, ``INVALID_ARGUMENT``, before it is queued.
* **Unknown rank.**  An input the model declares without a shape is reported as
  ``[]``, as a scalar is: served as such, every request with a rank would be
  refused.  inferd checks each request against the model's shapes (Triton, too,
  needs each input's rank, from its model configuration) and has no
  configuration to give one, so such an input is refused at load, naming it and
  the fix; the model's graph is read (from the bytes the load hashed,
  ``ort_model_source.HashedModel.graph``) only when an input is reported as ``[]``.
  An output of unknown rank is served (its frames carry their shape).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inferd.errors import EngineDeserializeError
from inferd.runtime.onnx_trt_ep_shapes import model_inputs
from inferd.runtime.ort_model_source import ModelGraph
from inferd.types import OptimizationProfile, TensorSpec

#: ONNX type strings -> numpy dtype names (the wire's dtype vocabulary).
ONNX_TO_NUMPY: dict[str, str] = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(int16)": "int16",
    "tensor(uint16)": "uint16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(bool)": "bool",
}


def session_specs(
    session: Any,
    model_path: Path,
    profiles: Mapping[str, OptimizationProfile],
    graph: Callable[[], ModelGraph],
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The session's input and output specs (``profiles`` by input name), each with
    the dimension names it shares; ``EngineDeserializeError`` for an input type
    inferd cannot serve or an input of unknown rank in ``model_path`` (whose graph
    ``graph`` reads, called only when an input is reported as ``[]``)."""
    input_nodes, output_nodes = list(session.get_inputs()), list(session.get_outputs())
    uses = Counter(
        dim for node in (*input_nodes, *output_nodes) for dim in node.shape if isinstance(dim, str)
    )
    shared = {name for name, count in uses.items() if count > 1}
    inputs = tuple(_spec(node, shared, profiles.get(node.name)) for node in input_nodes)
    outputs = tuple(_spec(node, shared) for node in output_nodes)
    reported_scalar = [spec.name for spec in inputs if not spec.shape]
    if reported_scalar:
        _refuse_unknown_rank(model_path, reported_scalar, graph)
    return inputs, outputs


def warm_up_inputs(specs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """Zeros at each input's opt shape (its static shape when it has no profile)."""
    return {spec.name: np.zeros(spec.warm_up_shape(), spec.dtype) for spec in specs}


def _spec(node: Any, shared: set[str], profile: OptimizationProfile | None = None) -> TensorSpec:
    dtype = ONNX_TO_NUMPY.get(node.type)
    if dtype is None:
        raise EngineDeserializeError(f"tensor {node.name!r} has unsupported type {node.type}")
    shape = tuple(dim if isinstance(dim, int) and dim >= 0 else None for dim in node.shape)
    shared_dims = tuple(
        (axis, dim) for axis, dim in enumerate(node.shape) if isinstance(dim, str) and dim in shared
    )
    return TensorSpec(node.name, dtype, shape, profile, shared_dims)


def _refuse_unknown_rank(
    model_path: Path, names: list[str], graph: Callable[[], ModelGraph]
) -> None:
    """Refuse the inputs of ``names`` (reported as ``[]``) that ``model_path``
    declares without a shape; a real scalar (a shape of no dimension) passes."""
    unranked = [name for name in model_inputs(model_path, graph).unranked if name in names]
    if unranked:
        raise EngineDeserializeError(
            f"{model_path}: input(s) {unranked} declare no shape (unknown rank). inferd "
            "checks every request against the shapes of the model's inputs, and ONNX "
            "Runtime reports such an input as a scalar. Give each a shape in the model, "
            "with a name (dim_param) for each size that varies (e.g. "
            "onnx.tools.update_model_dims.update_inputs_outputs_dims)"
        )
