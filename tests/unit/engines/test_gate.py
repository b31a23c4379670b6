"""The five-step trust gate (``inferd.engines.gate``): each refusal raised,
logged and recorded; explain/steps; an engine swapped after the gate; no writes."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.cli import verify as verify_tool
from inferd.engines import (
    STEPS,
    EngineGate,
    Manifest,
    explain,
    first_failure,
    parse_engine_name,
    write_manifest,
)
from inferd.errors import (
    EngineHashMismatchError,
    EngineSchemaMismatchError,
    EngineSidecarMissingError,
    InferdError,
)
from inferd.types import BuildConfig, HostTuple, PrecisionMode
from tests.unit.engines.conftest import (
    CONTENT,
    FOREIGN,
    HOST,
    MODEL_SHA,
    VALID,
    Deployment,
    Recorder,
    name_for,
)


def test_a_trusted_engine_passes(deployment: Deployment) -> None:
    path = deployment.engine()
    recorder = Recorder()
    with capture_logs() as logs:
        validated = deployment.gate(record=recorder).validate(path)
    assert validated.path == path
    assert validated.name == parse_engine_name(VALID)
    assert validated.sha256 == hashlib.sha256(CONTENT).hexdigest()
    assert validated.size_bytes == len(CONTENT)
    assert validated.unchanged()
    assert bytes(validated.read_verified()) == CONTENT
    assert recorder.records == []
    assert [entry["event"] for entry in logs] == ["engine_validated"]
    verdicts = deployment.gate().steps(path)
    assert [(v.step, v.verdict) for v in verdicts] == [(step, "pass") for step in STEPS]


def _refusal(deployment: Deployment, path: Path) -> tuple[InferdError, Recorder, list[Any]]:
    recorder = Recorder()
    with capture_logs() as logs, pytest.raises(InferdError) as caught:
        deployment.gate(record=recorder).validate(path)
    return caught.value, recorder, logs


@pytest.mark.parametrize(
    ("build", "step", "error_type", "stage", "fragment"),
    [
        (
            lambda d: d.engine("demo.engine"),
            "schema_parse",
            EngineSchemaMismatchError,
            None,
            "does not follow the naming schema",
        ),
        (
            lambda d: d.engine(name_for(FOREIGN)),
            "host_match",
            EngineSchemaMismatchError,
            None,
            "compute_capability 8.6 (engine) vs 8.7 (expected)",
        ),
        (
            lambda d: d.engine(sidecar="missing"),
            "sidecar_present",
            EngineSidecarMissingError,
            None,
            "has no digest sidecar",
        ),
        (
            lambda d: d.engine(sidecar="wrong"),
            "sidecar_digest",
            EngineHashMismatchError,
            "sidecar",
            "does not match its digest sidecar",
        ),
        (
            lambda d: d.engine(sidecar="malformed"),
            "sidecar_digest",
            EngineHashMismatchError,
            "sidecar",
            "is malformed",
        ),
        (
            lambda d: d.engine(manifest="missing"),
            "manifest_digest",
            EngineHashMismatchError,
            "manifest",
            "is not listed in the deployment manifest test-manifest",
        ),
        (
            lambda d: d.engine(manifest="wrong"),
            "manifest_digest",
            EngineHashMismatchError,
            "manifest",
            "is not the one the deployment manifest test-manifest trusts",
        ),
    ],
)
def test_each_refusal_is_raised_logged_and_recorded(
    deployment: Deployment,
    build: Any,
    step: str,
    error_type: type[InferdError],
    stage: str | None,
    fragment: str,
) -> None:
    path = build(deployment)
    error, recorder, logs = _refusal(deployment, path)
    assert type(error) is error_type
    assert fragment in str(error)
    if stage is not None:
        assert isinstance(error, EngineHashMismatchError) and error.stage == stage
    assert recorder.records == [
        ("engine_refused", {"engine": str(path), "step": step, "reason": str(error)})
    ]
    refused = [entry for entry in logs if entry["event"] == "engine_refused"]
    assert len(refused) == 1
    assert refused[0]["step"] == step and refused[0]["reason"] == str(error)
    assert refused[0]["engine"] == str(path) and refused[0]["log_level"] == "warning"
    # explain agrees: its first failure is the step validate refused at
    failure = first_failure(deployment.gate().steps(path))
    assert failure is not None and failure.step == step and failure.message == str(error)


@pytest.mark.parametrize(
    ("field", "host"),
    [
        (
            "compute_capability",
            HostTuple((8, 6), "orin", "r36.4.0", "10.3.0.30", PrecisionMode.FP16),
        ),
        ("gpu_sku", HostTuple((8, 7), "orin-nx", "r36.4.0", "10.3.0.30", PrecisionMode.FP16)),
        ("platform", HostTuple((8, 7), "orin", "r36.3.0", "10.3.0.30", PrecisionMode.FP16)),
        ("tensorrt_version", HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.26", PrecisionMode.FP16)),
        ("precision", HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.30", PrecisionMode.FP32)),
    ],
)
def test_host_mismatch_carries_expected_and_got(
    deployment: Deployment, field: str, host: HostTuple
) -> None:
    path = deployment.engine()
    with pytest.raises(EngineSchemaMismatchError) as caught:
        deployment.gate(host=host).validate(path)
    error = caught.value
    assert error.expected == host.describe()
    assert error.got == HOST.describe()
    assert [key for key in error.expected if error.expected[key] != error.got[key]] == [field]
    assert f"{field} {HOST.describe()[field]} (engine) vs {host.describe()[field]}" in str(error)


def test_caller_expectations_for_model_and_build_config(deployment: Deployment) -> None:
    path = deployment.engine()
    gate = deployment.gate()
    config = BuildConfig(precision=PrecisionMode.FP16)
    assert gate.validate(path, model_sha256=MODEL_SHA, build_config=config).sha256
    with pytest.raises(EngineSchemaMismatchError, match="model_sha256") as caught:
        gate.validate(path, model_sha256=hashlib.sha256(b"other model").hexdigest())
    assert caught.value.got["model_sha256"] == MODEL_SHA[:16]
    with pytest.raises(EngineSchemaMismatchError, match="build_config"):
        gate.validate(
            path, build_config=BuildConfig(precision=PrecisionMode.FP16, optimization_level=5)
        )


@pytest.mark.parametrize(
    ("build", "step", "expected_verdicts"),
    [
        (  # bad name, no sidecar, not in the manifest
            lambda d: d.engine("demo.engine", sidecar="missing", manifest="missing"),
            "schema_parse",
            ["fail", "skipped", "fail", "skipped", "fail"],
        ),
        (  # foreign host, wrong sidecar, wrong manifest digest
            lambda d: d.engine(name_for(FOREIGN), sidecar="wrong", manifest="wrong"),
            "host_match",
            ["pass", "fail", "pass", "fail", "fail"],
        ),
        (  # no sidecar, not in the manifest
            lambda d: d.engine(sidecar="missing", manifest="missing"),
            "sidecar_present",
            ["pass", "pass", "fail", "skipped", "fail"],
        ),
        (  # sidecar and manifest both disagree with the file
            lambda d: d.engine(sidecar="wrong", manifest="wrong"),
            "sidecar_digest",
            ["pass", "pass", "pass", "fail", "fail"],
        ),
    ],
)
def test_several_failures_refuse_at_the_first(
    deployment: Deployment, build: Any, step: str, expected_verdicts: list[str]
) -> None:
    path = build(deployment)
    error, recorder, _logs = _refusal(deployment, path)
    assert [record[1]["step"] for record in recorder.records] == [step]
    again, _, _ = _refusal(deployment, path)  # deterministic
    assert str(again) == str(error)
    verdicts = deployment.gate().steps(path)
    assert [v.verdict for v in verdicts] == expected_verdicts
    assert [v.number for v in verdicts] == [1, 2, 3, 4, 5]


def test_an_engine_file_that_cannot_be_read_is_refused_at_the_digest_step(
    deployment: Deployment,
) -> None:
    path = deployment.engine()
    path.unlink()
    error, recorder, _ = _refusal(deployment, path)
    assert isinstance(error, EngineHashMismatchError) and error.stage == "sidecar"
    assert "cannot be read to check its digest" in str(error)
    assert recorder.records[0][1]["step"] == "sidecar_digest"


def test_explain_and_steps_neither_log_nor_record(deployment: Deployment) -> None:
    path = deployment.engine(sidecar="wrong")
    recorder = Recorder()
    gate = deployment.gate(record=recorder)
    with capture_logs() as logs:
        verdicts = gate.explain(path)
    assert first_failure(verdicts) is not None
    assert logs == [] and recorder.records == []


def test_explain_without_a_host_skips_only_the_host_step(deployment: Deployment) -> None:
    path = deployment.engine()
    verdicts = explain(
        path, host=None, manifest=Manifest(deployment.entries), host_error="no GPU here"
    )
    assert [v.verdict for v in verdicts] == ["pass", "skipped", "pass", "pass", "pass"]
    assert "no GPU here" in verdicts[1].message


def test_a_failing_record_sink_does_not_hide_the_refusal(deployment: Deployment) -> None:
    path = deployment.engine(sidecar="missing")

    def broken(kind: str, payload: Mapping[str, Any]) -> None:
        raise OSError("recorder disk gone")

    gate = EngineGate(HOST, Manifest(deployment.entries), record=broken)
    with capture_logs() as logs, pytest.raises(EngineSidecarMissingError):
        gate.validate(path)
    assert [entry["event"] for entry in logs] == ["engine_refused", "engine_refused_record_failed"]


def test_read_verified_refuses_an_engine_swapped_after_the_gate(deployment: Deployment) -> None:
    path = deployment.engine()
    validated = deployment.gate().validate(path)
    tampered = bytearray(CONTENT)
    tampered[0] ^= 0xFF
    path.write_bytes(bytes(tampered))
    with pytest.raises(EngineHashMismatchError) as caught:
        validated.read_verified()
    assert caught.value.stage == "reread"
    path.unlink()
    assert not validated.unchanged()


def _snapshot(root: Path) -> dict[str, Any]:
    state: dict[str, Any] = {".": root.stat().st_mtime_ns}
    for path in sorted(root.rglob("*")):
        info = path.stat()
        content = path.read_bytes() if path.is_file() else None
        state[str(path.relative_to(root))] = (info.st_mtime_ns, info.st_size, info.st_mode, content)
    return state


def test_the_gate_never_writes(tmp_path: Path) -> None:
    root = tmp_path / "deploy"
    root.mkdir()
    deployment = Deployment(root)
    paths = [
        deployment.engine(),
        deployment.engine("demo.engine", sidecar="missing"),
        deployment.engine(name_for(FOREIGN)),
        deployment.engine(name_for(label="nosidecar"), sidecar="missing"),
        deployment.engine(name_for(label="wrong"), sidecar="wrong"),
        deployment.engine(name_for(label="malformed"), sidecar="malformed"),
        deployment.engine(name_for(label="unlisted"), manifest="missing"),
        root / name_for(label="absent"),
    ]
    manifest_path = root / "manifest.json"
    write_manifest(manifest_path, deployment.entries)
    os.chmod(root, 0o755)
    before = _snapshot(root)
    gate = EngineGate(HOST, Manifest.load(manifest_path), record=Recorder())
    for path in paths:
        with contextlib.suppress(InferdError):
            gate.validate(path)
        gate.steps(path)
    out = io.StringIO()
    for path in paths[:-1]:
        verify_tool.run(path, manifest_path, as_json=True, host=HOST, out=out, err=out)
    assert _snapshot(root) == before
