from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from inferd import errors
from inferd.demo_model import (
    DEMO_INPUT_SHAPE,
    DEMO_OUTPUT_SHAPE,
    write_demo_model,
    write_identity_model,
)
from inferd.types import BuildConfig, OptimizationProfile, PrecisionMode, ThermalState


def test_error_family_has_one_root() -> None:
    family = [
        errors.EngineBuildError,
        errors.EngineDeserializeError,
        errors.EngineHashMismatchError,
        errors.EngineSchemaMismatchError,
        errors.EngineSidecarMissingError,
        errors.CalibrationCacheError,
        errors.InferenceError,
        errors.OutOfMemoryError,
        errors.TelemetryUnavailableError,
    ]
    assert all(issubclass(kind, errors.InferdError) for kind in family)
    assert not issubclass(errors.RuntimeNotAvailableError, errors.InferdError)
    assert errors.EngineHashMismatchError("x", stage="sidecar").stage == "sidecar"


def test_thermal_state_without_telemetry_never_reports_throttle() -> None:
    assert ThermalState.unavailable().thermal_throttle_active is False
    with pytest.raises(ValueError, match="without telemetry"):
        ThermalState(thermal_throttle_active=True, is_telemetry_available=False)
    live = ThermalState(gpu_temp_c=71.5, thermal_throttle_active=True, is_telemetry_available=True)
    assert live.thermal_throttle_active


def test_precision_modes_and_build_config_validation() -> None:
    assert [mode.value for mode in PrecisionMode] == ["fp32", "fp16", "int8", "mixed"]
    with pytest.raises(ValueError, match="workspace_bytes"):
        BuildConfig(workspace_bytes=0)
    with pytest.raises(ValueError, match="optimization_level"):
        BuildConfig(optimization_level=6)


def test_optimization_profile_validation() -> None:
    OptimizationProfile("x", (1, 3), (4, 3), (8, 3))
    with pytest.raises(ValueError, match="rank"):
        OptimizationProfile("x", (1,), (1, 3), (1, 3))
    with pytest.raises(ValueError, match="min <= opt <= max"):
        OptimizationProfile("x", (4, 3), (2, 3), (8, 3))


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
    assert oct((tmp_path / "d.onnx").stat().st_mode & 0o777) == "0o644"


def test_demo_model_cli_writes_the_file(tmp_path: Path) -> None:
    from inferd.cli.main import main

    assert main(["demo-model", str(tmp_path / "m.onnx")]) == 0
    assert main(["demo-model", "--kind", "identity", str(tmp_path / "i.onnx")]) == 0
    assert (tmp_path / "m.onnx").stat().st_size > 100_000
    assert (tmp_path / "i.onnx").exists()


def test_check_config_cli_reports_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from inferd.cli.main import main

    bad = tmp_path / "bad.toml"
    bad.write_text("[[models]]\nname = 'x'\npath = 'x.onnx'\nqueue_policy = 'lifo'\n")
    assert main(["check-config", str(bad)]) == 2
    assert "queue_policy: 'lifo' is not one of" in capsys.readouterr().err
