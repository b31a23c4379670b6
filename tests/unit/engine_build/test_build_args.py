"""``build.start``'s build config: the model's (profiles included) unless overridden,
and profiles only ever from the model config."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.config import ModelConfig
from inferd.engine_build.build_args import parse_build_config_arg
from inferd.engines.build_config import parse_build_config
from inferd.types import OptimizationProfile, PrecisionMode
from inferd_wire.protocol import Code, ProtocolError

PROFILE = OptimizationProfile("image", (1, 3, 8, 8), (4, 3, 8, 8), (8, 3, 8, 8))
MODEL = ModelConfig(
    name="det", path=Path("det.onnx"), precision=PrecisionMode.FP16, profiles=(PROFILE,)
)


def test_a_daemon_build_defaults_to_the_model_build_config_with_its_profiles() -> None:
    built = parse_build_config(parse_build_config_arg(None, MODEL), source="child")
    assert built == MODEL.build_config()
    assert built.profiles == (PROFILE,) and built.precision is PrecisionMode.FP16
    overridden = parse_build_config_arg({"optimization_level": 5}, MODEL)
    assert parse_build_config(overridden, source="child").profiles == (PROFILE,)


def test_build_start_refuses_profiles_other_than_the_model_config() -> None:
    other = {
        "profiles": [
            {
                "input_name": "image",
                "min_shape": [1, 3, 8, 8],
                "opt_shape": [1, 3, 8, 8],
                "max_shape": [1, 3, 8, 8],
            }
        ]
    }
    with pytest.raises(ProtocolError) as refused:
        parse_build_config_arg(other, MODEL)
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert "models['det'].profiles" in refused.value.message
