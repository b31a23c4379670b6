"""Value types (``inferd.types``): thermal state, precision modes, build config
and optimisation profile validation."""

from __future__ import annotations

import pytest

from inferd.types import BuildConfig, OptimizationProfile, PrecisionMode, ThermalState


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
