"""``build.start``'s build config: the model's (profiles included) unless overridden,
and profiles only ever from the model config."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.config import ModelConfig
from inferd.engine_build.build_args import (
    MAX_CANCEL_REASON_CHARS,
    parse_build_config_arg,
    parse_cancel,
)
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


def test_a_cancel_reason_is_a_sentence_of_bounded_length() -> None:
    """It is recorded in the FDR and written to the child's pipe on the bus thread."""
    assert parse_cancel({}) == ("control", "build.cancel from control")
    assert parse_cancel({"reason": "x" * MAX_CANCEL_REASON_CHARS})[1] == "x" * 256
    for reason in ("", "x" * (MAX_CANCEL_REASON_CHARS + 1), 7):
        with pytest.raises(ProtocolError) as refused:
            parse_cancel({"reason": reason})
        assert refused.value.code is Code.INVALID_ARGUMENT
        assert refused.value.message == "'reason' must be a string of 1..256 characters"
