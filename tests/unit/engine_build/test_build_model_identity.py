"""An engine is built and validated from exactly the model its name was hashed from.

``locate_engine`` names the engine by the model's SHA-256; the build reads the model
again later (TensorRT's parser, ONNX Runtime's reference).  A model file replaced
in between (copied over, or renamed over by a deployment tool) must fail the build,
or its validation, saying so: never an engine named and trusted as the old model but
built from the new one.  The swaps happen at the exact point in the real call order
(a hook around ``TensorRTBuilder.build``, which ``run_build`` calls after the hash
and inside which TensorRT parses), never after a sleep.
"""

from __future__ import annotations

import gc
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import pytest

from inferd.engine_build.pipeline import compose_tensorrt_build, record_trust
from inferd.engine_build.session import run_build
from inferd.engine_build.tensorrt_builder import TensorRTBuilder
from inferd.engines import read_host_tuple
from inferd.engines.locate import EnginePlan, locate_engine
from inferd.types import BuildConfig, PrecisionMode
from tests.fakes import fake_tensorrt
from tests.tensorrt_bench import Bench, W

INT8 = BuildConfig(precision=PrecisionMode.INT8)  # validation's tolerance: 0.1


def write_affine(path: Path, bias: float, *, external: bool = False) -> Path:
    """``y = 2 * x + bias``, ``x`` float32 ``[2, W]``; ``external``: its weights in
    ``<name>.data`` beside it (ONNX external data)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
        "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, W])],
        [
            numpy_helper.from_array(np.full((W,), 2.0, np.float32), "two"),
            numpy_helper.from_array(np.full((W,), bias, np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            location=path.name + ".data",
            size_threshold=0,
        )
    else:
        onnx.save(model, str(path))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_over(new: Path, model: Path) -> None:
    model.write_bytes(new.read_bytes())  # an operator's cp: same inode, new bytes


def rename_over(new: Path, model: Path) -> None:
    staged = model.with_name(".incoming.onnx")
    staged.write_bytes(new.read_bytes())
    os.replace(staged, model)  # a deployment tool's atomic replace


def around_build(
    monkeypatch: pytest.MonkeyPatch,
    before: Callable[[], None] | None = None,
    after: Callable[[], None] | None = None,
) -> None:
    """Run ``before`` when ``run_build`` calls the builder (after locate's and the
    session's hashes, before TensorRT parses) and ``after`` once it returned."""
    original = TensorRTBuilder.build

    def build(self: TensorRTBuilder, monitor: Any, timing_cache: bytes | None) -> Any:
        if before is not None:
            before()
        try:
            return original(self, monitor, timing_cache)
        finally:
            if after is not None:
                after()

    monkeypatch.setattr(TensorRTBuilder, "build", build)


def build(bench: Bench, model: Path, config: BuildConfig) -> tuple[EnginePlan, dict[str, Any]]:
    """The one engine pipeline's steps 1-3, as ``inferd build`` and the build child run them."""
    host = read_host_tuple(precision=config.precision, tegra_release=bench.root / "absent")
    plan = locate_engine(model, config, engine_dir=bench.engine_dir, host=host, force=True)
    builder, request = compose_tensorrt_build(
        plan,
        config,
        gpu_memory_budget_bytes=bench.config().gpu_memory_budget_bytes,
        device_id=0,
    )
    return plan, run_build(request, builder).summary


@pytest.fixture
def models(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The deployed model (``y = 2x + 1``) and the one that replaces it (``2x + 1.05``:
    within INT8's tolerance of the first, so validation alone cannot tell them apart)."""
    yield (
        write_affine(tmp_path / "models" / "m.onnx", 1.0),
        write_affine(tmp_path / "incoming" / "m.onnx", 1.05),
    )


def nothing_at(plan: EnginePlan) -> bool:
    engine = plan.entry.artifact_path
    staged = list(engine.parent.glob(f"staging/*/{engine.name}*"))
    return not os.path.lexists(engine) and not staged


@pytest.mark.parametrize("swap", [copy_over, rename_over], ids=["copied", "renamed"])
def test_a_model_replaced_between_its_hash_and_the_parse_fails_the_build(
    bench: Bench,
    models: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    swap: Callable[[Path, Path], None],
) -> None:
    model, new = models
    old_sha, new_sha = sha256(model), sha256(new)
    around_build(monkeypatch, before=lambda: swap(new, model))
    plan, summary = build(bench, model, BuildConfig())
    assert plan.entry.model_sha256 == old_sha  # the name is the old model's
    assert summary["outcome"] == "failed", summary["validation"]
    assert "changed during the build" in summary["error"]
    assert new_sha[:16] in summary["error"] and old_sha[:16] in summary["error"]
    assert bench.gpu.trt.parses == [] and bench.gpu.trt.builds == 0  # nothing built from it
    assert summary["baseline"]["inputHashes"] == {"m.onnx": old_sha}
    assert nothing_at(plan)


def test_a_model_swapped_for_the_parse_and_put_back_is_never_built_or_trusted(
    bench: Bench, models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swap undone before validation: validation reads the old model again and
    (INT8's tolerance) cannot tell the engine of the new one from it."""
    model, new = models
    old_bytes, old_sha = model.read_bytes(), sha256(model)
    around_build(
        monkeypatch,
        before=lambda: copy_over(new, model),
        after=lambda: model.write_bytes(old_bytes),
    )
    plan, summary = build(bench, model, INT8)
    parsed = [parse["sha256"] for parse in bench.gpu.trt.parses]
    assert all(digest == old_sha for digest in parsed), "TensorRT parsed another model"
    decision = record_trust(
        summary, plan.entry.artifact_path, manifest=bench.engine_dir / "manifest.json"
    )
    assert not decision.trusted
    assert summary["outcome"] == "failed" and "changed during the build" in summary["error"]
    assert nothing_at(plan)


def test_a_model_replaced_after_the_parse_fails_validation_saying_so(
    bench: Bench, models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built from the right bytes, but the model the engine is named by is gone
    before validation: the engine is never compared with another model."""
    model, new = models
    old_sha = sha256(model)
    around_build(monkeypatch, after=lambda: rename_over(new, model))
    plan, summary = build(bench, model, BuildConfig())
    assert [parse["sha256"] for parse in bench.gpu.trt.parses] == [old_sha]
    assert summary["outcome"] == "completed" and summary["validationStatus"] == "fail"
    reason = summary["validation"]["reason"]
    assert "changed during the build" in reason and old_sha[:16] in reason
    assert summary["validation"]["quarantinedTo"]  # kept for analysis, never at the path
    assert not summary["eligibleToServe"] and nothing_at(plan)


def test_tensorrt_parses_the_verified_bytes_with_the_models_absolute_path(
    bench: Bench, models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _new = models
    monkeypatch.chdir(model.parent.parent)
    relative = Path("models") / model.name
    plan, summary = build(bench, relative, BuildConfig())
    assert summary["outcome"] == "completed" and summary["validationStatus"] == "pass"
    assert bench.gpu.trt.parses == [
        {"method": "parse", "path": str(model), "sha256": plan.entry.model_sha256}
    ]
    assert "OnnxParser.parse_from_file" not in bench.gpu.trt.calls


def test_a_model_with_external_data_builds_and_validates_from_anywhere(
    bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_affine(tmp_path / "models" / "big.onnx", 1.0, external=True)
    assert (model.parent / "big.onnx.data").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # external data is found beside the model, not here
    _plan, summary = build(bench, model, BuildConfig())
    assert summary["outcome"] == "completed", summary["error"]
    assert summary["validationStatus"] == "pass", summary["validation"]
    assert bench.gpu.trt.parses[0]["path"] == str(model)


class _OrtBefore121:
    """``InferenceSession`` as ONNX Runtime before 1.21 makes it for these calls: the
    external-data folder option is an unknown key, ignored; ``on_path`` runs when a
    session is made from a path."""

    def __init__(self, on_path: Callable[[], None] | None = None) -> None:
        self.real = onnxruntime.InferenceSession
        self.on_path = on_path
        self.paths: list[str] = []

    def __call__(self, model: Any, sess_options: Any = None, **kw: Any) -> Any:
        if isinstance(model, str | os.PathLike):
            self.paths.append(str(model))
            if self.on_path is not None:
                self.on_path()
            return self.real(model, sess_options, **kw)
        return self.real(model, None, **kw)


def test_an_onnx_runtime_without_the_folder_option_validates_external_data_by_path(
    bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_affine(tmp_path / "models" / "big.onnx", 1.0, external=True)
    monkeypatch.chdir(tmp_path)
    ort = _OrtBefore121()
    monkeypatch.setattr(onnxruntime, "InferenceSession", ort)
    monkeypatch.setattr(onnxruntime, "__version__", "1.20.1")
    _plan, summary = build(bench, model, BuildConfig())
    assert summary["validationStatus"] == "pass", summary["validation"]
    assert ort.paths == [str(model)]


def test_an_onnx_runtime_without_the_folder_option_is_never_given_bytes_with_external_data(
    bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given bytes, ONNX Runtime before 1.21 (JetPack 6's) reads external data beside
    its working directory: other weights of the same name there made the reference,
    and a right engine failed validation.  Such a model is given by its path."""
    model = write_affine(tmp_path / "models" / "big.onnx", 1.0, external=True)
    write_affine(tmp_path / "big.onnx", 1.05, external=True)  # big.onnx.data in the cwd
    monkeypatch.chdir(tmp_path)
    ort = _OrtBefore121()
    monkeypatch.setattr(onnxruntime, "InferenceSession", ort)
    monkeypatch.setattr(onnxruntime, "__version__", "1.20.1")
    _plan, summary = build(bench, model, BuildConfig())
    assert summary["validationStatus"] == "pass", summary["validation"]
    assert ort.paths == [str(model)]


def test_a_model_replaced_while_onnx_runtime_loads_it_by_path_fails_validation(
    bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_affine(tmp_path / "models" / "big.onnx", 1.0, external=True)
    new = write_affine(tmp_path / "incoming" / "big.onnx", 1.05)
    monkeypatch.chdir(tmp_path)
    ort = _OrtBefore121(on_path=lambda: rename_over(new, model))
    monkeypatch.setattr(onnxruntime, "InferenceSession", ort)
    monkeypatch.setattr(onnxruntime, "__version__", "1.20.1")
    _plan, summary = build(bench, model, INT8)
    assert summary["validationStatus"] == "fail"
    assert "changed during the build" in summary["validation"]["reason"]


# -- the fake parser keeps TensorRT's rules for external weights ---------------------------


@pytest.fixture
def parser(gpu: fake_tensorrt.FakeGpuStack) -> Iterator[Any]:
    """An ONNX parser for a fresh network, made and destroyed with a context current."""
    trt = gpu.tensorrt
    gpu.driver.init()
    context = gpu.driver.Device(0).make_context()
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    yield trt.OnnxParser(network, logger)
    del network, builder
    gc.collect()  # what the test made dies with its context current
    context.detach()


@pytest.mark.parametrize(("given", "parsed"), [(True, True), (False, False)])
def test_fake_parse_finds_external_weights_beside_the_path_it_is_given(
    parser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: bool, parsed: bool
) -> None:
    model = write_affine(tmp_path / "models" / "big.onnx", 1.0, external=True)
    monkeypatch.chdir(tmp_path)
    assert parser.parse(model.read_bytes(), str(model) if given else None) is parsed
    if not parsed:  # without a path: relative to the working directory
        assert parser.get_error(0).desc() == "Failed to open file: big.onnx.data"


def test_fake_parse_refuses_external_weights_in_a_parent_directory(
    parser: Any, tmp_path: Path
) -> None:
    import onnx

    model = write_affine(tmp_path / "models" / "big.onnx", 1.0, external=True)
    proto = onnx.load(str(model), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../big.onnx.data"
    assert not parser.parse(proto.SerializeToString(), str(model))
    assert "Relative paths to parent (../) are not allowed" in parser.get_error(0).desc()


def test_fake_parse_takes_the_path_as_a_string_as_the_binding_does(
    parser: Any, tmp_path: Path
) -> None:
    model = write_affine(tmp_path / "m.onnx", 1.0)
    with pytest.raises(TypeError):
        parser.parse(model.read_bytes(), model)  # char const*: a pathlib.Path is refused
    with pytest.raises(TypeError):
        parser.parse(str(model))  # py::buffer: a str is not one
    assert parser.parse(bytearray(model.read_bytes()), str(model))
