"""A build's ``--timeout`` covers its validation and its commit, not only the builder:
a deadline that passes while the engine is validated cancels the build (source
``timeout``) and nothing is committed.  Before, ``run_build`` looked at the deadline
only while the builder's thread ran: an engine whose builder returned just before it
was validated and committed however long that took, and ``inferd build`` exited 0
(review RE, finding 1: timeout 0.3 s, 1.65 s, completed and committed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.engine_build import BuildRequest, run_build, session, validation
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.progress import ProgressAdapter
from inferd.engine_build.simulated import BuilderOutput, SimSettings, SimulatedBuilder
from inferd.types import BuildConfig
from tests.unit.engine_build.conftest import HOST

#: Short enough to keep the tests brief, long enough that the simulated builder
#: (about 0.1 s here) returns well before it.
TIMEOUT_S = 0.5
#: How long past the deadline the stand-ins for slow validation steps go on.
PAST_S = 0.2
#: A reference run left alone runs this long after the builder started.
LONG_RUN_S = 3.0


Prepare = Callable[[SimulatedBuilder, list[float]], None]


def timed_build(
    tmp_path: Path, demo_model: Path, prepare: Prepare
) -> tuple[dict[str, Any], Path, CancellationToken]:
    """A simulated build of ``demo_model`` with ``--timeout`` ``TIMEOUT_S``;
    ``prepare(builder, builder_started)`` is called before it runs;
    ``builder_started`` holds the monotonic time the builder started, once it has
    (within moments of the deadline's start)."""
    request = BuildRequest(
        demo_model, tmp_path / "demo.engine", BuildConfig(), HOST, timeout_s=TIMEOUT_S
    )
    builder = SimulatedBuilder(
        demo_model, request.build_config, HOST, settings=SimSettings(step_s=0.0)
    )
    builder_started: list[float] = []
    build = builder.build

    def timed(monitor: ProgressAdapter, timing_cache: bytes | None) -> BuilderOutput:
        builder_started.append(time.monotonic())
        return build(monitor, timing_cache)

    builder.build = timed  # type: ignore[method-assign]
    prepare(builder, builder_started)
    token = CancellationToken()
    report = run_build(request, builder, token=token, build_id="t1")
    return report.summary, request.engine_path, token


def assert_cancelled_by_the_deadline(
    summary: dict[str, Any], engine: Path, token: CancellationToken
) -> None:
    assert summary["outcome"] == "cancelled", summary["validation"]
    assert summary["cancelSource"] == "timeout"
    assert token.request is not None and token.request.reason == f"timeout {TIMEOUT_S}s"
    assert not summary["eligibleToServe"]
    assert summary["baseline"]["engineSha256"] is None
    # Neither the engine nor its sidecar, staged or committed: only the summary.
    left = [path.name for path in engine.parent.rglob("*") if path.is_file()]
    assert left == [f"{engine.name}.t1.build.json"]


def test_a_deadline_that_passes_in_the_reference_run_stops_it(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime's reference run (here a stand-in that runs ``LONG_RUN_S`` unless
    ``RunOptions.terminate`` is set, and raises then, as ONNX Runtime does) is stopped
    at the deadline, not after it: the build ends then, cancelled, validation
    ``cancelled``."""
    real_run = validation._run
    ended: list[str] = []

    def prepare(_builder: SimulatedBuilder, builder_started: list[float]) -> None:
        def long_run(session: Any, inputs: Any, run_options: Any = None) -> Any:
            until = builder_started[0] + LONG_RUN_S
            while run_options is not None and time.monotonic() < until:
                if run_options.terminate:
                    ended.append("terminated")
                    raise RuntimeError("Exiting due to terminate flag being set to true.")
                time.sleep(0.005)  # stands for the nodes ONNX Runtime runs
            ended.append("ran to its end")
            return real_run(session, inputs, run_options)

        monkeypatch.setattr(validation, "_run", long_run)

    summary, engine, token = timed_build(tmp_path, demo_model, prepare)
    assert_cancelled_by_the_deadline(summary, engine, token)
    assert summary["validationStatus"] == "cancelled"
    assert ended == ["terminated"]
    assert summary["baseline"]["durations"]["totalS"] < LONG_RUN_S


def test_a_deadline_that_passes_in_the_smoke_inference_commits_nothing(
    tmp_path: Path, demo_model: Path
) -> None:
    """The engine's smoke inference cannot be interrupted: when it returns past the
    deadline, with a verdict of ``pass``, the build is cancelled before its commit."""

    def prepare(builder: SimulatedBuilder, builder_started: list[float]) -> None:
        infer = builder.infer
        assert infer is not None

        def slow_infer(engine_path: Path, inputs: dict[str, np.ndarray]) -> Any:
            # Ends PAST_S after the deadline (give or take the few microseconds
            # between the builder's start and the deadline's).
            time.sleep(max(0.0, builder_started[0] + TIMEOUT_S + PAST_S - time.monotonic()))
            return infer(engine_path, inputs)

        builder.infer = slow_infer

    summary, engine, token = timed_build(tmp_path, demo_model, prepare)
    assert_cancelled_by_the_deadline(summary, engine, token)
    assert summary["validationStatus"] == "pass"  # a verdict the deadline overrides
    assert summary["noCancelZone"] is None  # the commit was never entered


def test_a_build_and_validation_within_the_deadline_are_committed(
    tmp_path: Path, demo_model: Path
) -> None:
    """The deadline's checks after the builder cancel nothing on time."""
    summary, engine, token = timed_build(tmp_path, demo_model, lambda _b, _s: None)
    assert (summary["outcome"], summary["validationStatus"]) == ("completed", "pass")
    assert summary["cancelSource"] is None and not token.is_set()
    assert engine.exists()


def test_a_deadline_met_while_the_engine_is_staged_skips_the_gate_and_the_reference(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging (writing and syncing a Jetson's multi-GB engine) past the deadline: the
    build ends there, before the gate hashes the engine and before the reference
    session loads the model, neither of which a deadline can interrupt (review R1 of
    entry 342, finding 2: both ran, 0.8 s each past a 0.5 s timeout)."""
    stage = session.stage_engine
    sessions: list[str] = []

    def prepare(_builder: SimulatedBuilder, builder_started: list[float]) -> None:
        def slow_stage(engine_path: Path, engine: bytes) -> tuple[str, Path]:
            time.sleep(max(0.0, builder_started[0] + TIMEOUT_S + PAST_S - time.monotonic()))
            return stage(engine_path, engine)

        def reference_session(model: Any) -> Any:
            sessions.append(str(model))
            raise AssertionError("made past the deadline")

        monkeypatch.setattr(session, "stage_engine", slow_stage)
        monkeypatch.setattr(validation, "reference_session", reference_session)

    summary, engine, token = timed_build(tmp_path, demo_model, prepare)
    assert_cancelled_by_the_deadline(summary, engine, token)
    assert summary["validationStatus"] == "cancelled" and sessions == []
    assert summary["validation"]["gate"] == "not_run"
