"""``inferd acceptance stuck-build`` (``inferd.engine_build.acceptance``): each
scenario with the simulated builder, its summaries against their JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from inferd.engine_build import acceptance
from tests.unit.engine_build.conftest import SUMMARY_SCHEMA


@pytest.mark.parametrize("scenario", sorted(acceptance.SCENARIOS))
def test_acceptance_scenario(scenario: str, tmp_path: Path) -> None:
    assert acceptance.run(tmp_path, scenarios=[scenario]) == 0, (tmp_path / "report.md").read_text()
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    assert evidence["simulated"] is True and evidence["label"] == "simulated"
    # Every summary the scenario reports must be among the files checked below
    # (a pattern that matched nothing would check nothing).
    reported = {Path(b["summaryPath"]) for sc in evidence["scenarios"] for b in sc["builds"]}
    assert reported, "the scenario reported no build summary"
    found = set((tmp_path / "work" / "engines").rglob("*.build.json"))
    assert reported <= found, sorted(map(str, reported - found))
    for summary_file in found:
        document = json.loads(summary_file.read_text())
        Draft202012Validator(SUMMARY_SCHEMA).validate(document)
        assert document["simulated"] is True
