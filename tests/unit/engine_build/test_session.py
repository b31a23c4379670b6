"""Whole builds (``inferd.engine_build.session``, simulated builder): the build
summary against its JSON Schema, the FDR record, failures and the retry policy."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from inferd.engine_build import BuildRequest, choose_retry_policy, run_build
from inferd.engine_build.artifacts import TimingCacheOutcome
from inferd.engine_build.simulated import SimSettings, SimulatedBuilder
from inferd.fdr import kinds
from inferd.types import BuildConfig
from tests.conftest import REPO
from tests.unit.engine_build.conftest import HOST, SUMMARY_SCHEMA

FDR_SCHEMA = json.loads((REPO / "schemas" / "fdr" / "engine_build.json").read_text())


def test_schema_is_valid_2020_12() -> None:
    Draft202012Validator.check_schema(SUMMARY_SCHEMA)


class Sink:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, payload: Mapping[str, Any]) -> None:
        self.records.append((kind, dict(payload)))


def test_summary_next_to_engine_and_fdr_record(tmp_path: Path, demo_model: Path) -> None:
    sink = Sink()
    request = BuildRequest(demo_model, tmp_path / "demo.engine", BuildConfig(), HOST)
    builder = SimulatedBuilder(demo_model, request.build_config, HOST)
    report = run_build(request, builder, record=sink)
    assert report.summary_path.parent == request.engine_path.parent
    document = json.loads(report.summary_path.read_text())
    Draft202012Validator(SUMMARY_SCHEMA).validate(document)
    for key in (
        "tensorrtVersion",
        "language",
        "buildConfigHash",
        "gpuSku",
        "timingCacheMode",
        "cancelSource",
        "cancelLatencyMs",
        "cleanupLatencyMs",
        "cleanupStatus",
        "retryPolicy",
        "validationStatus",
        "baseline",
        "phaseTree",
    ):
        assert key in document
    assert document["phaseTree"]["state"] == "completed"
    [(kind, payload)] = sink.records
    assert kind == "engine_build"
    kinds.validate(kind, payload)
    Draft202012Validator(FDR_SCHEMA).validate(payload)
    assert payload["outcome"] == "succeeded" and payload["simulated"] is True


def test_cancelled_build_fdr_outcome(tmp_path: Path, demo_model: Path) -> None:
    sink = Sink()
    request = BuildRequest(
        demo_model, tmp_path / "demo.engine", BuildConfig(), HOST, timeout_s=0.05
    )
    builder = SimulatedBuilder(
        demo_model, request.build_config, HOST, settings=SimSettings(step_s=0.02)
    )
    report = run_build(request, builder, record=sink)
    assert report.summary["outcome"] == "cancelled"
    assert sink.records[0][1]["outcome"] == "cancelled"
    assert sink.records[0][1]["cancel_source"] == "timeout"


def test_builder_exception_is_a_failed_build(tmp_path: Path, demo_model: Path) -> None:
    class Broken(SimulatedBuilder):
        def build(self, monitor: Any, timing_cache: bytes | None) -> Any:
            raise RuntimeError("segfault-ish")

    request = BuildRequest(demo_model, tmp_path / "demo.engine", BuildConfig(), HOST)
    report = run_build(request, Broken(demo_model, request.build_config, HOST))
    assert report.summary["outcome"] == "failed"
    assert "segfault-ish" in (report.summary["error"] or "")
    assert report.summary["retryPolicy"] == "investigate"


def test_an_engine_that_failed_validation_stays_where_quarantined_to_says(
    tmp_path: Path, demo_model: Path
) -> None:
    """A rebuild over a final path whose engine does not match its sidecar (a crash
    between the commit's two renames): the failed engine is quarantined, then
    clean_up quarantines the final path's engine under the same name in the same
    second and process, never over the first."""
    engine = tmp_path / "demo.engine"
    engine.write_bytes(b"left by a crash between the renames")
    engine.with_name("demo.engine.sha256").write_text("0" * 64 + "  demo.engine\n")
    request = BuildRequest(demo_model, engine, BuildConfig(), HOST)
    builder = SimulatedBuilder(demo_model, request.build_config, HOST)

    def failing(_path: Path, _inputs: object) -> dict[str, object]:
        raise RuntimeError("injected: bad kernel")

    builder.infer = failing
    summary = run_build(request, builder).summary
    assert summary["validationStatus"] == "fail"
    moved = Path(summary["validation"]["quarantinedTo"])
    reason = moved.with_name(moved.name + ".reason").read_text()
    assert "failed validation" in reason, f"{moved} now holds: {reason!r}"
    assert hashlib.sha256(moved.read_bytes()).hexdigest() == summary["baseline"]["engineSha256"]


@pytest.mark.parametrize(
    ("evidence", "policy"),
    [
        ({"outcome": "completed", "validation_status": "pass"}, "none"),
        ({"outcome": "completed", "validation_status": "fail"}, "rollback"),
        ({"outcome": "cancelled", "cancel_source": "sigint"}, "retry_with_cache"),
        ({"outcome": "cancelled", "cache_decision": TimingCacheOutcome.QUARANTINED}, "retry_cold"),
        ({"outcome": "failed", "cache_loaded": True}, "retry_cold"),
        ({"outcome": "failed"}, "investigate"),
        ({"outcome": "cancelled", "cleanup_status": "quarantined"}, "investigate"),
        ({"outcome": "cancelled", "cancel_source": "timeout", "stalls": 2}, "retry_with_cache"),
    ],
)
def test_retry_policy_from_evidence(evidence: dict[str, Any], policy: str) -> None:
    base: dict[str, Any] = {
        "outcome": "cancelled",
        "cancel_source": None,
        "cache_decision": TimingCacheOutcome.DISCARDED,
        "cache_loaded": False,
        "cleanup_status": "cleaned",
        "validation_status": "not_applicable",
        "stalls": 0,
    }
    chosen, reason = choose_retry_policy(**{**base, **evidence})
    assert chosen == policy and reason
