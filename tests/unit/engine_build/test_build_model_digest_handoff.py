"""The digest an engine is named by is handed down the build, never taken again
from the model file (DESIGN.md 178): to the builder that parses (``TensorRTBuilder``,
``model_sha256``), to the session (``BuildRequest.model_sha256``: the summary's
input hash, validation's reference) and to the smoke inference's gate, in the
daemon's build child too.  A model replaced after ``locate_engine`` named the
engine fails the build before TensorRT parses anything; one replaced after
validation read its reference does not change what the engine is checked as."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferd.engine_build import child, validation
from inferd.engine_build.pipeline import compose_tensorrt_build
from inferd.engine_build.session import run_build
from inferd.engines import read_host_tuple
from inferd.engines.locate import locate_engine
from inferd.types import BuildConfig
from tests.tensorrt_bench import Bench
from tests.unit.engine_build.test_build_model_identity import (
    INT8,
    build,
    copy_over,
    nothing_at,
    rename_over,
    write_affine,
)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def two_models(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The deployed model and the one that replaces it (within INT8's tolerance)."""
    yield (
        write_affine(tmp_path / "models" / "m.onnx", 1.0),
        write_affine(tmp_path / "incoming" / "m.onnx", 1.05),
    )


def test_a_model_replaced_between_locate_and_the_build_is_never_parsed(
    bench: Bench, two_models: tuple[Path, Path]
) -> None:
    model, new = two_models
    old_sha = sha256(model)
    config = BuildConfig()
    host = read_host_tuple(precision=config.precision, tegra_release=bench.root / "absent")
    plan = locate_engine(model, config, engine_dir=bench.engine_dir, host=host, force=True)
    assert plan.entry.model_sha256 == old_sha
    copy_over(new, model)  # after the engine was named, before the build is composed
    builder, request = compose_tensorrt_build(
        plan,
        config,
        gpu_memory_budget_bytes=bench.config().gpu_memory_budget_bytes,
        device_id=0,
    )
    summary = run_build(request, builder).summary
    assert summary["outcome"] == "failed" and "changed during the build" in summary["error"]
    assert bench.gpu.trt.parses == [] and bench.gpu.trt.builds == 0
    assert summary["baseline"]["inputHashes"] == {"m.onnx": old_sha}  # the name's model
    assert nothing_at(plan)


def test_a_model_replaced_after_the_reference_was_read_does_not_fail_the_gate(
    bench: Bench, two_models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine is built and compared from the named bytes: the smoke inference
    loads it under that name, not under the digest of whatever the file holds now."""
    model, new = two_models
    reference_case = validation.reference_case

    def then_replaced(
        source: Any, seed: int = 0, token: Any = None, check_deadline: Any = None
    ) -> Any:
        case = reference_case(source, seed, token, check_deadline)
        rename_over(new, model)
        return case

    monkeypatch.setattr(validation, "reference_case", then_replaced)
    plan, summary = build(bench, model, INT8)
    assert sha256(model) != plan.entry.model_sha256  # replaced meanwhile
    assert summary["outcome"] == "completed"
    assert summary["validationStatus"] == "pass", summary["validation"]


def test_the_build_childs_simulated_build_is_summarised_as_the_bytes_it_read(
    tmp_path: Path, two_models: tuple[Path, Path]
) -> None:
    model, new = two_models
    old_sha = sha256(model)
    spec = {
        "builder": "simulated",
        "model_path": str(model),
        "engine_path": str(tmp_path / "engines" / "m.engine"),
        "simulation": {"step_s": 0},
    }
    builder, request = child._builder(spec, BuildConfig())
    copy_over(new, model)  # after the simulated builder read the model
    summary = run_build(request, builder).summary
    assert summary["baseline"]["inputHashes"] == {"m.onnx": old_sha}
