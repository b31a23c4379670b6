"""An engine is named, reused, built and validated for a model's external weights too.

A model's digest covers its external data files (``inferd.digest``), so an engine
built for one set of weights is never reused or loaded for others beside the same
``.onnx``; and since TensorRT's parser and ONNX Runtime read those files by path, a
build checks them again once the consumer has read them (``ModelSource``).  The
swaps happen inside the consumer's own call (the fake parser, the real ONNX Runtime
on CPU), never after a sleep.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnxruntime
import pytest

from inferd.engines import read_host_tuple
from inferd.engines.gate import STEP_HOST_MATCH, explain
from inferd.engines.locate import locate_engine
from inferd.engines.manifest import Manifest
from inferd.errors import EngineBuildError, EngineMissingError
from inferd.types import BuildConfig
from tests.tensorrt_bench import Bench
from tests.unit.engine_build.test_build_model_identity import (
    INT8,
    build,
    nothing_at,
    write_affine,
)
from tests.unit.test_model_digest_external_data import new_weights, relocate


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """``y = 2x + 1``, its weights in ``m.onnx.data``; ``new_weights(model, 1.05)`` puts
    ``2x + 1.05``'s there (within INT8's tolerance: validation cannot tell them apart)."""
    return write_affine(tmp_path / "models" / "m.onnx", 1.0, external=True)


def weights(model: Path) -> Path:
    return model.parent / "m.onnx.data"


def test_an_engine_is_neither_reused_nor_loaded_for_new_weights(bench: Bench, model: Path) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, model)  # built, validated, trusted
    assert runtime.compile_engine(model, BuildConfig()).artifact_path == entry.artifact_path
    new_weights(model, 1.05)
    with pytest.raises(EngineMissingError):  # served on the fallback, rebuilt
        runtime.compile_engine(model, BuildConfig())
    host = read_host_tuple(precision=BuildConfig().precision, tegra_release=bench.root / "absent")
    plan = locate_engine(model, BuildConfig(), engine_dir=bench.engine_dir, host=host)
    assert plan.status == "to_build" and plan.entry.artifact_path != entry.artifact_path
    verdicts = explain(
        entry.artifact_path,
        host=host,
        manifest=Manifest.load(bench.engine_dir / "manifest.json"),
        model_sha256=plan.entry.model_sha256,
    )
    refused = [v.step for v in verdicts if v.verdict == "fail"]
    assert refused == [STEP_HOST_MATCH]  # the gate: built for another model


def test_a_model_naming_a_file_outside_its_folder_is_refused_before_any_build(
    bench: Bench, model: Path
) -> None:
    relocate(model, str(weights(model)))  # absolute: ONNX Runtime would read any file
    with pytest.raises(EngineBuildError, match="is an absolute path: refused"):
        build(bench, model, BuildConfig())
    assert bench.gpu.trt.parses == []


def _parse_with(
    bench: Bench,
    monkeypatch: pytest.MonkeyPatch,
    during: Callable[[], None],
    after: Callable[[], None] | None = None,
) -> None:
    """``during`` runs as TensorRT's parser starts reading the model (after the build
    hashed it), ``after`` once it has read it."""
    parser = bench.gpu.tensorrt.OnnxParser
    original = parser.parse

    def parse(self: Any, data: Any, path: str | None = None) -> bool:
        during()
        try:
            return bool(original(self, data, path))
        finally:
            if after is not None:
                after()

    monkeypatch.setattr(parser, "parse", parse)


def test_new_weights_put_in_while_tensorrt_parses_fail_the_build(
    bench: Bench, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _parse_with(bench, monkeypatch, during=lambda: new_weights(model, 1.05))
    plan, summary = build(bench, model, INT8)
    assert summary["outcome"] == "failed", summary["validation"]
    assert "changed during the build (its external data file m.onnx.data)" in summary["error"]
    assert plan.entry.model_sha256[:16] in summary["error"]
    assert bench.gpu.trt.builds == 0 and nothing_at(plan)


def test_weights_swapped_for_the_parse_and_put_back_are_never_built(
    bench: Bench, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swap undone before the check: the content is the one named again, but the
    parser read other weights (a new file renamed in, then the old one back)."""
    data = weights(model)
    aside = data.with_name("kept.data")

    def swap() -> None:
        os.rename(data, aside)
        new_weights(model, 1.05)

    _parse_with(bench, monkeypatch, during=swap, after=lambda: os.replace(aside, data))
    plan, summary = build(bench, model, INT8)
    assert summary["outcome"] == "failed"
    assert "its external data file m.onnx.data was written or replaced" in summary["error"]
    assert bench.gpu.trt.builds == 0 and nothing_at(plan)


def test_new_weights_put_in_while_onnx_runtime_loads_the_reference_fail_validation(
    bench: Bench, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime (1.21 on, real, on CPU) gets the verified bytes but reads the
    external data by path: the weights it read are checked once it has."""
    real = onnxruntime.InferenceSession

    def session(source: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(source, bytes):  # validation's reference, from the verified bytes
            new_weights(model, 1.05)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    plan, summary = build(bench, model, INT8)
    assert summary["outcome"] == "completed" and summary["validationStatus"] == "fail"
    reason = summary["validation"]["reason"]
    assert "changed during the build (its external data file m.onnx.data)" in reason
    assert not summary["eligibleToServe"] and nothing_at(plan)
