"""``inferd build``'s own error lines (``inferd build: ...`` on stderr) show no
control character: they quote paths, a config's error, and TensorRT's message,
which names an ONNX node's op as the file spells it.  DESIGN.md 252 escaped the
progress and the report; these lines were written raw."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from inferd.cli import build as tensorrt_cli
from tests.tensorrt_bench import Bench
from tests.unit.cli.test_build import off_jetson
from tests.unit.cli.test_review_terminal_daemon import HOSTILE, raw_controls


def test_a_usage_error_line_shows_the_path_escaped(tmp_path: Path) -> None:
    """The line the review named: ``inferd build: {exc}`` (here, the model file is
    missing and its name carries an OSC 52, a screen clear and a forged line)."""
    err = io.StringIO()
    code = tensorrt_cli.run(tmp_path / f"model{HOSTILE}.onnx", engine_dir=tmp_path, err=err)
    assert code == tensorrt_cli.EXIT_USAGE
    shown = err.getvalue()
    assert raw_controls(shown) == [] and shown.count("\n") == 1, shown
    assert shown.startswith("inferd build: model file ") and "modelx\\x1b]52;c;" in shown


def test_a_failed_build_line_shows_the_onnx_op_escaped(
    bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorRT's parser error names the node's op as the ONNX file has it."""
    import onnx
    from onnx import TensorProto, helper

    off_jetson(monkeypatch, tmp_path)
    graph = helper.make_graph(
        [helper.make_node(f"Op{HOSTILE}", ["x"], ["y"], domain="com.example")],
        "hostile",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    )
    model.ir_version = 8
    path = tmp_path / "hostile.onnx"
    onnx.save(model, str(path))
    config = tmp_path / "build.json"
    config.write_text(json.dumps({}))
    err = io.StringIO()
    code = tensorrt_cli.run(path, config, engine_dir=bench.engine_dir, err=err)
    assert code == tensorrt_cli.EXIT_FAILED
    line = next(line for line in err.getvalue().splitlines() if "build failed" in line)
    assert "UNSUPPORTED_NODE" in line and "(op Opx\\x1b]52;c;" in line
    assert raw_controls(err.getvalue()) == []
