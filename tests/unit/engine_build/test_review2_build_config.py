"""Second review of builds: ``inferd build`` and ``build.start`` read one build config
document the same way, so both build the engine the daemon looks for.

For a model the daemon config serves at fp16, ``inferd build --config ...
--build-config '{"workspace_bytes": ...}'`` built an fp32 engine (the document's
missing keys came from ``BuildConfig()``), while ``build.start`` with the same
``build_config`` built fp16 (its missing keys come from the model): two engine names
for the same inputs, and the daemon never found the one built before flight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferd.cli.build import _build_config_for
from inferd.config import ModelConfig
from inferd.engine_build.build_args import parse_build_config_arg
from inferd.engines.build_config import parse_build_config
from inferd.types import OptimizationProfile, PrecisionMode

PROFILE = OptimizationProfile("image", (1, 3, 224, 224), (2, 3, 224, 224), (4, 3, 224, 224))


@pytest.mark.parametrize(
    "document",
    [
        {"workspace_bytes": 256 << 20},
        {"optimization_level": 2},
        {},
        {"precision": "fp32"},
    ],
)
def test_inferd_build_and_build_start_take_one_document_to_one_build_config(
    tmp_path: Path, demo_model: Path, document: dict[str, object]
) -> None:
    model = ModelConfig("demo", demo_model, precision=PrecisionMode.FP16, profiles=(PROFILE,))
    path = tmp_path / "build.json"
    path.write_text(json.dumps(document))
    daemon = parse_build_config(parse_build_config_arg(document, model), source="daemon")
    assert _build_config_for(demo_model, path, (model,)) == daemon
