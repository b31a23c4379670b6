"""The commit record (``session.run_build``) and what the daemon makes of it after a
build child exited without its report (``child_exit.conclude``): the engine it
names committed is kept, a commit that never happened leaves nothing."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from structlog.testing import capture_logs

from inferd.engine_build import BuildRequest, run_build
from inferd.engine_build.artifacts import write_json
from inferd.engine_build.build_record import Build, fdr_record
from inferd.engine_build.child_exit import conclude
from inferd.engine_build.session import BuildReport, summary_path_for
from inferd.engine_build.simulated import SimulatedBuilder
from inferd.engines.sidecar import read_sidecar, write_sidecar
from inferd.types import BuildConfig, Peer
from tests.conftest import REPO
from tests.unit.engine_build.conftest import HOST, SUMMARY_SCHEMA

FDR_SCHEMA = json.loads((REPO / "schemas" / "fdr" / "engine_build.json").read_text())
BUILD_ID = "b1-c0ffee"
NONCE = "5eed" * 8  # the daemon's, given to the child in its spec


def _build(tmp_path: Path, model: Path) -> tuple[Path, dict[str, Any], bool, BuildReport]:
    """A whole simulated build: its engine, the commit record as it was on disk when
    the commit began, whether the engine was at its path then, and the report."""
    engine = tmp_path / "demo" / f"demo.{BUILD_ID}.simulated.engine"
    engine.parent.mkdir(mode=0o750)
    request = BuildRequest(model, engine, BuildConfig(), HOST)
    seen: dict[str, Any] = {}

    def at_commit() -> None:  # in the no-cancel zone, before the renames
        seen["record"] = json.loads(summary_path_for(engine, BUILD_ID).read_text())
        seen["engine_there"] = engine.exists()

    builder = SimulatedBuilder(model, request.build_config, HOST)
    report = run_build(request, builder, build_id=BUILD_ID, nonce=NONCE, during_write=at_commit)
    return engine, seen["record"], seen["engine_there"], report


def test_the_commit_record_is_durable_before_the_commit_and_replaced_after(
    tmp_path: Path, demo_model: Path
) -> None:
    engine, record, engine_there, report = _build(tmp_path, demo_model)
    Draft202012Validator(SUMMARY_SCHEMA).validate(record)
    assert not engine_there and record["buildNonce"] == NONCE
    assert (record["provisional"], record["outcome"]) == (True, "completed")
    assert (record["timingCacheMode"], record["cleanupStatus"]) == ("unknown", "unknown")
    assert record["baseline"]["engineSha256"] == read_sidecar(engine)
    assert report.summary_path == summary_path_for(engine, BUILD_ID)
    final = json.loads(report.summary_path.read_text())
    assert final["provisional"] is False and final["timingCacheMode"] == "cold"


def _killed_child(engine: Path, nonce: str = NONCE) -> Build:
    process = subprocess.Popen(["true"])
    process.wait()
    build = Build(
        build_id=BUILD_ID,
        model="demo",
        builder="simulated",
        build_config={},
        engine_path=engine,
        process=process,
        requested_by="test",
        peer=Peer("internal"),
        started_wall_ns=0,
        started_mono=time.monotonic(),
        nonce=nonce,
    )
    build.exit_code = -9
    return build


@pytest.mark.parametrize("committed", [True, False])
def test_a_child_killed_after_its_commit_record(
    tmp_path: Path, demo_model: Path, committed: bool
) -> None:
    """Killed after the commit: the build is what the record says, its timing cache
    ``unknown``.  Killed before the renames (an older engine at the path): the record
    is removed, the build failed, its timing cache ``discarded``, the older engine kept."""
    engine, record, _, report = _build(tmp_path, demo_model)
    write_json(report.summary_path, record)  # what the child left when it was killed
    if not committed:
        engine.write_bytes(b"an older build's engine")
        write_sidecar(engine)
    build = _killed_child(engine)
    state = conclude(build, tmp_path / "engines", None)
    payload = fdr_record(build)
    Draft202012Validator(FDR_SCHEMA).validate(payload)
    assert payload["killed_after_commit"] is committed
    if committed:
        assert (state, payload["outcome"], payload["timing_cache"]) == (
            "completed",
            "succeeded",
            "unknown",
        )
        assert report.summary_path.exists() and build.summary_path == str(report.summary_path)
        assert read_sidecar(engine) == record["baseline"]["engineSha256"]
    else:
        assert (state, payload["outcome"], payload["timing_cache"]) == (
            "failed",
            "failed",
            "discarded",
        )
        assert not report.summary_path.exists(), "a record of a commit that never happened"
        assert build.cleanup is not None
        assert report.summary_path.name in build.cleanup["removed"]
        assert engine.read_bytes() == b"an older build's engine"


@pytest.mark.parametrize("provisional", [False, True])
def test_a_child_whose_engine_failed_validation_is_never_reported_killed_after_commit(
    tmp_path: Path, demo_model: Path, provisional: bool
) -> None:
    """An engine that failed validation is quarantined, never committed, though its
    build's summary says ``completed`` (``validationStatus`` ``fail``).  A child killed
    after writing that summary, before its report, committed nothing: the build is as
    a reported one (``completed``, not trusted), never ``killed_after_commit``.  A
    commit record saying so (written when a cancel came after the failed validation)
    names no commit either, even with an engine of that digest at the final path (an
    earlier identical build's): it is removed."""
    engine = tmp_path / "demo" / f"demo.{BUILD_ID}.simulated.engine"
    engine.parent.mkdir(mode=0o750)
    request = BuildRequest(demo_model, engine, BuildConfig(), HOST)
    builder = SimulatedBuilder(demo_model, request.build_config, HOST)

    def failing(_path: Path, _inputs: object) -> dict[str, object]:
        raise RuntimeError("injected: bad kernel")

    builder.infer = failing
    report = run_build(request, builder, build_id=BUILD_ID, nonce=NONCE)
    summary = report.summary
    assert (summary["outcome"], summary["validationStatus"]) == ("completed", "fail")
    assert not engine.exists()
    if provisional:
        write_json(report.summary_path, {**summary, "provisional": True})
        engine.write_bytes(Path(summary["validation"]["quarantinedTo"]).read_bytes())
        write_sidecar(engine)
    build = _killed_child(engine)
    with capture_logs() as logs:
        state = conclude(build, tmp_path / "engines", None)
    assert not build.killed_after_commit
    assert "build_killed_after_commit" not in [entry["event"] for entry in logs]
    assert fdr_record(build)["killed_after_commit"] is False
    if provisional:
        assert (state, build.timing_cache) == ("failed", "discarded")
        assert not report.summary_path.exists()
    else:
        assert state == "completed" and build.summary == summary


@pytest.mark.parametrize("provisional", [True, False])
def test_a_summary_another_build_left_with_this_build_id_is_never_taken_as_its_own(
    tmp_path: Path, demo_model: Path, provisional: bool
) -> None:
    """Build ids restart each daemon run (``b1-`` and 24 random bits): an earlier run's
    build of the same engine, with the same id, left its summary (or its commit record,
    killed after its commit) and its committed engine at this build's summary path.
    This build's child died before writing anything: the other build's record must
    not end it ``completed`` (trusted, ``killed_after_commit``); it is left alone."""
    engine, record, _, report = _build(tmp_path, demo_model)  # the earlier run's
    if provisional:
        write_json(report.summary_path, record)
    left = report.summary_path.read_bytes()
    build = _killed_child(engine, nonce="7" * 32)  # this run's build, with the same id
    state = conclude(build, tmp_path / "engines", None)
    assert (state, build.killed_after_commit, build.timing_cache) == (
        "failed",
        False,
        "discarded",
    )
    assert build.summary is None and build.summary_path is None
    assert report.summary_path.read_bytes() == left, "another build's record, left alone"
    assert read_sidecar(engine) == record["baseline"]["engineSha256"], "its engine kept"
