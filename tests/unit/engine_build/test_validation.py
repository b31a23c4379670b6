"""Build validation (``inferd.engine_build.validation``): tolerance by precision,
the sidecar gate, eligibility to serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from inferd.engine_build import BuildRequest, eligible_to_serve, run_build
from inferd.engine_build.simulated import SimulatedBuilder
from inferd.engine_build.validation import validate_build
from inferd.types import BuildConfig, PrecisionMode
from tests.unit.engine_build.conftest import HOST


def test_validation_tolerance_depends_on_precision(tmp_path: Path, demo_model: Path) -> None:
    request = BuildRequest(demo_model, tmp_path / "demo.engine", BuildConfig(), HOST)
    run_build(request, SimulatedBuilder(demo_model, request.build_config, HOST), record=None)

    def off_by(delta: float) -> Any:
        def infer(engine: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            outputs = SimulatedBuilder.simulated_infer(engine, inputs)
            return {k: v + delta for k, v in outputs.items()}

        return infer

    engine = request.engine_path
    assert validate_build(engine, demo_model, PrecisionMode.FP32, off_by(0.0)).status == "pass"
    assert validate_build(engine, demo_model, PrecisionMode.FP32, off_by(0.005)).status == "fail"
    assert validate_build(engine, demo_model, PrecisionMode.FP16, off_by(0.005)).status == "pass"
    assert validate_build(engine, demo_model, PrecisionMode.INT8, off_by(0.05)).status == "pass"
    engine.with_name(engine.name + ".sha256").unlink()
    refused = validate_build(engine, demo_model, PrecisionMode.FP32, off_by(0.0))
    assert refused.status == "fail" and refused.gate == "refused"


def test_only_a_validated_completed_build_is_eligible() -> None:
    assert eligible_to_serve({"outcome": "completed", "validationStatus": "pass"})
    assert not eligible_to_serve({"outcome": "completed", "validationStatus": "pending"})
    assert not eligible_to_serve({"outcome": "completed", "validationStatus": "fail"})
    assert not eligible_to_serve({"outcome": "cancelled", "validationStatus": "not_applicable"})
