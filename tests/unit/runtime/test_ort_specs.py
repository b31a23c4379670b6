"""A session's specs as inferd serves them (``runtime.ort_specs``): the dimension
names a model gives several axes, and inputs whose rank the model leaves unknown
(which ONNX Runtime reports as ``[]``, as a scalar), on real ONNX Runtime."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from inferd.config import RuntimeConfig
from inferd.errors import EngineDeserializeError
from inferd.runtime.onnx_trt_ep import OnnxTrtEpRuntime
from inferd.runtime.ort_model_source import ModelGraph
from inferd.runtime.ort_specs import session_specs
from inferd.types import BuildConfig, EngineHandle, ThermalState


@dataclass
class Node:
    """What ``session_specs`` reads of ONNX Runtime's ``NodeArg``."""

    name: str
    shape: list[Any]
    type: str = "tensor(float)"


@dataclass
class Session:
    inputs: list[Node]
    outputs: list[Node]

    def get_inputs(self) -> list[Node]:
        return self.inputs

    def get_outputs(self) -> list[Node]:
        return self.outputs


def identity_model(path: Path, shape: list[Any] | None) -> Path:
    """``y = x``; ``shape`` None declares no shape at all (unknown rank)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what every supported ONNX Runtime loads (1.17 on)
    onnx.save(model, path)
    return path


def unread() -> ModelGraph:
    """The graph of a model no input of which is reported as ``[]``: never asked for."""
    raise AssertionError("the model's graph was read although no input needed it")


def load(tmp_path: Path, model: Path) -> EngineHandle:
    runtime = OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"),
        alert=lambda _alert: None,
        thermal=ThermalState.unavailable,
    )
    return runtime.deserialize_engine(runtime.compile_engine(model, BuildConfig()))


def test_only_names_given_to_several_axes_are_kept(tmp_path: Path) -> None:
    session = Session(
        inputs=[Node("a", ["batch", 3]), Node("b", ["batch", "n"])],
        outputs=[Node("y", ["batch", "m", "m", None])],
    )
    inputs, outputs = session_specs(session, tmp_path / "unread.onnx", {}, unread)
    assert [spec.shared_dims for spec in inputs] == [((0, "batch"),), ((0, "batch"),)]
    # "n" names one axis alone: it constrains nothing.  "m" twice in one tensor does.
    assert outputs[0].shared_dims == ((0, "batch"), (1, "m"), (2, "m"))
    assert [spec.shape for spec in (*inputs, *outputs)] == [
        (None, 3),
        (None, None),
        (None, None, None, None),
    ]


def test_an_input_of_unknown_rank_is_refused_at_load_naming_it(tmp_path: Path) -> None:
    model = identity_model(tmp_path / "unranked.onnx", None)
    with pytest.raises(EngineDeserializeError) as caught:
        load(tmp_path, model)
    message = str(caught.value)
    assert "['x']" in message and "unknown rank" in message and "dim_param" in message


def test_a_scalar_input_still_loads(tmp_path: Path) -> None:
    # Reported as [] as well; the model says it is a shape of no dimension.
    handle = load(tmp_path, identity_model(tmp_path / "scalar.onnx", []))
    assert [spec.shape for spec in handle.inputs] == [()]


def test_the_served_specs_carry_the_shared_names(tmp_path: Path) -> None:
    handle = load(tmp_path, identity_model(tmp_path / "batch.onnx", ["batch", 3]))
    assert handle.inputs[0].shared_dims == ((0, "batch"),)  # x and y share it
    assert handle.outputs[0].shared_dims == ((0, "batch"),)
