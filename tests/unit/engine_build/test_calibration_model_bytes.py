"""INT8 calibration batches are checked against the inputs of the model the build
parses: the bytes whose digest the engine is named by (``ModelSource.read``), parsed
once, never the path read again (``calibration_batches.onnx_inputs``).  A model swapped
at a precise point, after the hash and until the check reads it, on the fake TensorRT."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest

from inferd.digest import model_digest
from inferd.engine_build import BuildRequest, model_source, run_build
from inferd.engine_build.model_source import ModelChangedError
from tests.fakes import fake_tensorrt
from tests.unit.engine_build.conftest import HOST
from tests.unit.engine_build.test_build_model_identity import rename_over
from tests.unit.engine_build.test_tensorrt_builder import (  # noqa: F401  (the fixture)
    INT8,
    W,
    calibrating_builder,
    calibration_set,
    scale_model,
)

#: Every onnx function that parses a model (by path or from bytes).
PARSERS = ("load", "load_model", "load_model_from_string", "load_from_string")


def narrow_model(path: Path) -> Path:
    """``scale_model`` with ``x`` float32 ``[N, W / 2]``: batches of ``[4, W]`` do not fit."""
    model = onnx.load(str(scale_model(path)))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[1].dim_value = W // 2
    onnx.save(model, str(path))
    return path


def test_batches_are_checked_against_the_hashed_model_not_one_swapped_in_before_the_check(
    tmp_path: Path,
    calibration_set: Path,  # noqa: F811  (the fixture imported above)
    gpu: fake_tensorrt.FakeGpuStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading the path, the batches that fit the model the engine is named by (and
    built from) were refused for the other model's inputs."""
    (tmp_path / "models").mkdir()
    model = scale_model(tmp_path / "models" / "scale.onnx")
    sha256 = model_digest(model).sha256
    hashed = shutil.copy(model, tmp_path / "hashed.onnx")
    rename_over(narrow_model(tmp_path / "narrow.onnx"), model)
    read_model = model_source.read_model

    def read_back(path: Path) -> Any:
        rename_over(Path(hashed), model)
        return read_model(path)

    monkeypatch.setattr(model_source, "read_model", read_back)
    engine = tmp_path / "engines" / "scale.engine"
    trt_builder = calibrating_builder(gpu, model, calibration_set, engine, model_sha256=sha256)
    assert trt_builder.calibration_batches is not None
    assert [(spec.name, spec.shape) for spec in trt_builder.calibration_batches.inputs] == [
        ("x", (4, W))
    ]
    summary = run_build(BuildRequest(model, engine, INT8, HOST), trt_builder).summary
    assert summary["outcome"] == "completed", summary["error"]
    assert summary["builderStats"]["calibration"] == "calibrated"
    assert gpu.trt.calibration_batches == 3


def test_batches_are_never_checked_against_a_model_changed_since_its_hash(
    tmp_path: Path,
    calibration_set: Path,  # noqa: F811  (the fixture imported above)
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    """Reading the path, the batches were checked against another model (here one
    they fit): the build went on to fail only when it read the model to parse."""
    (tmp_path / "models").mkdir()
    model = scale_model(tmp_path / "models" / "scale.onnx")
    sha256 = model_digest(model).sha256
    other = onnx.load(str(model))
    other.doc_string = "another model"
    onnx.save(other, str(tmp_path / "other.onnx"))
    rename_over(tmp_path / "other.onnx", model)
    with pytest.raises(ModelChangedError, match="changed during the build"):
        calibrating_builder(
            gpu, model, calibration_set, tmp_path / "engines" / "scale.engine", model_sha256=sha256
        )


def test_the_calibration_check_parses_the_model_once_from_its_bytes(
    tmp_path: Path,
    calibration_set: Path,  # noqa: F811  (the fixture imported above)
    gpu: fake_tensorrt.FakeGpuStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = scale_model(tmp_path / "scale.onnx")
    sha256 = model_digest(model).sha256
    calls: list[str] = []
    for name in PARSERS:
        parse = getattr(onnx, name)

        def counted(*args: Any, _name: str = name, _parse: Any = parse, **kwargs: Any) -> Any:
            calls.append(_name)
            return _parse(*args, **kwargs)

        monkeypatch.setattr(onnx, name, counted)
    calibrating_builder(
        gpu, model, calibration_set, tmp_path / "engines" / "scale.engine", model_sha256=sha256
    )
    assert calls == ["load_model_from_string"]
