"""A cancel during validation stops it: between its steps and during ONNX Runtime's
reference run (``RunOptions.terminate``), with the status ``cancelled`` and nothing
committed (DESIGN.md entry 137's known limit)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.digest import model_digest
from inferd.engine_build import BuildRequest, run_build, validation
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.model_source import ModelSource
from inferd.engine_build.session import summary_path_for
from inferd.engine_build.simulated import SimulatedBuilder
from inferd.engine_build.validation import ValidationResult
from inferd.types import BuildConfig, PrecisionMode
from tests.conftest import HANG_S, write_slow_model
from tests.unit.engine_build.conftest import HOST


def never(_engine: Path, _inputs: object) -> dict[str, np.ndarray]:
    raise AssertionError("the engine under test ran after the cancel")


def validate_slow(tmp_path: Path, model: Path, token: CancellationToken) -> ValidationResult:
    """Validation of an engine of ``model`` (the gate passed; the engine never runs)."""
    engine = tmp_path / "slow.engine"
    engine.write_bytes(b"engine")
    return validation.validate_build(
        engine,
        ModelSource(model, model_digest(model).sha256),
        PrecisionMode.FP32,
        never,
        gate=lambda _path: None,
        token=token,
    )


def observed_reference_run(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[str]]:
    """Set when validation's reference run starts, and how it ended: ``ran to its end``
    or ``raised: ...`` (ONNX Runtime's terminate)."""
    running = threading.Event()
    ended: list[str] = []
    run = validation._run

    def observed(session: Any, inputs: Any, run_options: Any = None) -> Any:
        running.set()
        try:
            outputs = run(session, inputs, run_options)
        except Exception as exc:
            ended.append(f"raised: {exc}")
            raise
        ended.append("ran to its end")
        return outputs

    monkeypatch.setattr(validation, "_run", observed)
    return running, ended


def test_a_cancel_stops_onnx_runtimes_reference_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel comes as the reference run starts: ONNX Runtime stops between two
    nodes (or before the first) instead of running the model to its end."""
    model = write_slow_model(tmp_path / "slow.onnx", matmuls=60)
    token = CancellationToken()
    running, ended = observed_reference_run(monkeypatch)
    canceller = threading.Thread(
        target=lambda: running.wait(HANG_S) and token.cancel("control", "operator")
    )
    canceller.start()
    result = validate_slow(tmp_path, model, token)
    canceller.join(HANG_S)
    assert (result.status, result.max_abs_error) == ("cancelled", None)
    assert "cancelled (control) before its verdict" in result.reason
    assert len(ended) == 1 and ended[0].startswith("raised: "), ended
    assert "terminate" in ended[0].lower()


def test_a_build_cancelled_while_its_engine_is_validated_commits_nothing(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel comes while the reference session is made (not interruptible): the
    run that would follow never starts, the engine is never run, the build ends
    cancelled with no commit record written and nothing at the final path."""
    engine = tmp_path / "demo" / "demo.b1-c0ffee.simulated.engine"
    engine.parent.mkdir(mode=0o750)
    request = BuildRequest(demo_model, engine, BuildConfig(), HOST)
    builder = SimulatedBuilder(demo_model, request.build_config, HOST)
    builder.infer = never
    token = CancellationToken()
    make_session = validation.reference_session

    def cancelled_meanwhile(model: ModelSource) -> Any:
        session = make_session(model)
        token.cancel("control", "operator")
        return session

    monkeypatch.setattr(validation, "reference_session", cancelled_meanwhile)
    records: list[dict[str, Any]] = []

    def at_commit() -> None:
        records.append(json.loads(summary_path_for(engine, "b1-c0ffee").read_text()))

    report = run_build(request, builder, token=token, build_id="b1-c0ffee", during_write=at_commit)
    summary = report.summary
    assert (summary["outcome"], summary["validationStatus"]) == ("cancelled", "cancelled")
    assert summary["cancelSource"] == "control" and summary["eligibleToServe"] is False
    assert records == [], "no commit record for a build with no verdict"
    assert not engine.exists() and not (engine.parent / "staging").exists()
    assert summary["baseline"]["engineSha256"] is None
