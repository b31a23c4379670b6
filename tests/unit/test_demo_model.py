"""The bundled demo and identity models (``inferd.demo_model``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from inferd.demo_model import (
    DEMO_INPUT_SHAPE,
    DEMO_OUTPUT_SHAPE,
    write_demo_model,
    write_identity_model,
)


def test_demo_model_is_deterministic(tmp_path: Path) -> None:
    digests = {
        hashlib.sha256(write_demo_model(tmp_path / f"{i}.onnx").read_bytes()).hexdigest()
        for i in range(2)
    }
    assert len(digests) == 1


def test_demo_and_identity_model_shapes(tmp_path: Path) -> None:
    import onnx

    demo = onnx.load(str(write_demo_model(tmp_path / "d.onnx")))
    dims = [
        [d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in (demo.graph.input[0], demo.graph.output[0])
    ]
    assert dims == [list(DEMO_INPUT_SHAPE), list(DEMO_OUTPUT_SHAPE)]
    assert {node.op_type for node in demo.graph.node} == {"Conv", "Relu"}
    identity = onnx.load(str(write_identity_model(tmp_path / "i.onnx")))
    assert identity.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert oct((tmp_path / "d.onnx").stat().st_mode & 0o777) == "0o640"  # never world-readable
