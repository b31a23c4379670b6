"""Review of DESIGN.md 219 (``commit_records.conclude_unconcluded``): cases where the
start's conclusion does what the live conclusion (``child_exit.conclude``) never
would, or where one summary stops the others.  Each test fails on 9662f86."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from inferd.engine_build import BuildRequest, child_process, run_build
from inferd.engine_build.artifacts import write_json
from inferd.engine_build.pipe import ChildMessage, ReportMessage, child_message_decoder
from inferd.engine_build.session import summary_path_for
from inferd.engine_build.simulated import SimulatedBuilder
from inferd.engines.manifest import record_in_manifest
from inferd.engines.sidecar import read_sidecar, write_sidecar
from inferd.python_module import python_module
from inferd.types import BuildConfig
from tests.conftest import HANG_S
from tests.unit.engine_build.conftest import HOST
from tests.unit.engine_build.test_commit_record import BUILD_ID, NONCE
from tests.unit.engine_build.test_conclusions import (
    _build,
    _conclude,
    _dead_writer,
    _engine_dir,
    _manifest,
)


def _as_tensorrt(summary: dict[str, Any], writer: dict[str, Any]) -> dict[str, Any]:
    """``summary`` as a dead daemon's TensorRT build child left it (the simulated
    builder stands in for TensorRT: ``simulated`` false, as a TensorRT child writes)."""
    return {**summary, "simulated": False, "writer": writer, "concluder": _dead_writer()}


def test_a_simulated_builds_summary_is_never_trusted_at_start(
    tmp_path: Path, demo_model: Path
) -> None:
    """The live conclusion never trusts a simulated build (``conclude``: ``not
    build.simulated``), and the builds cap never counts one as committed
    (``engine_outputs._completed_digest``: ``simulated is not False``).  At start the
    summary's ``simulated`` is not looked at: with ``runtime.engine_dir =
    "builds/demo"`` (nothing refuses it) a simulated build's summary lies in the
    engine dir, and a dead daemon's is trusted in ``manifest.json``."""
    engine_dir = tmp_path / "state" / "builds" / "demo"
    engine_dir.mkdir(mode=0o750, parents=True)
    engine = engine_dir / f"demo.{BUILD_ID}.simulated.engine"  # supervisor._engine_path
    request = BuildRequest(demo_model, engine, BuildConfig(), HOST)
    builder = SimulatedBuilder(demo_model, request.build_config, HOST)
    report = run_build(request, builder, build_id=BUILD_ID, nonce=NONCE)
    assert report.summary["simulated"] is True and report.summary["validationStatus"] == "pass"
    dead = _dead_writer()
    write_json(report.summary_path, {**report.summary, "writer": dead, "concluder": dead})

    (record,) = _conclude(engine_dir)

    assert record["decision"] == "not_trusted", "a simulated engine trusted"
    assert record["note"] == "a simulated build: never trusted"
    assert _manifest(engine_dir) == {}


def test_one_damaged_summary_does_not_stop_the_conclusion_of_the_others(
    tmp_path: Path, demo_model: Path
) -> None:
    """A summary that parses but has a field of another type (hand-edited, another
    release's) raises out of ``conclude_unconcluded`` (``committed``: ``"..."`` has no
    ``get``): every summary after it is left unconcluded, and ``BuildManager.prune``
    catches it only around the whole admission prune, so the start's staging sweep
    and caps are skipped too."""
    engine_dir = _engine_dir(tmp_path)
    engine, _, report = _build(engine_dir, demo_model)
    write_json(report.summary_path, _as_tensorrt(report.summary, _dead_writer()))
    damaged_id = "b9-abcdef"
    damaged = engine_dir / f"a.engine.{damaged_id}.build.json"  # listed first
    write_json(
        damaged,
        {
            **_as_tensorrt(report.summary, _dead_writer()),
            "buildId": damaged_id,
            "baseline": "damaged",
        },
    )

    records = _conclude(engine_dir)

    assert {r["build_id"]: r["decision"] for r in records}.get(BUILD_ID) == "trusted"
    assert _manifest(engine_dir) == {engine.name: read_sidecar(engine)}


def test_a_completed_build_whose_engine_was_replaced_is_not_said_to_have_ended(
    tmp_path: Path, demo_model: Path
) -> None:
    """``ended`` means "a build that committed nothing (cancelled, failed)"
    (schemas/fdr/build_concluded_at_start.json).  A completed build whose engine
    another build replaced since is recorded ``ended``, ``outcome: completed``:
    the FDR then says a build that committed its engine committed nothing."""
    engine_dir = _engine_dir(tmp_path)
    engine, _, report = _build(engine_dir, demo_model)
    engine.write_bytes(b"a later build's engine")
    write_sidecar(engine)
    write_json(report.summary_path, _as_tensorrt(report.summary, _dead_writer()))

    (record,) = _conclude(engine_dir)

    assert (record["outcome"], record["decision"]) == ("completed", "superseded"), record


def _run_child(spec: dict[str, Any]) -> ReportMessage:
    """The child run as a daemon of the release before 219 ran it: ``spawn``'s
    command line, without the ``concluder`` that ``spawn`` now adds."""
    process = subprocess.Popen(
        [*python_module("inferd.engine_build.child"), json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        close_fds=True,
        start_new_session=True,
    )
    decoder = child_message_decoder()
    messages: list[ChildMessage] = []
    try:
        assert process.stdout is not None
        while True:  # to the end of its stream
            assert child_process.readable(process, HANG_S), "the child hangs"
            chunk = os.read(process.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            messages += decoder.feed(chunk)
        assert process.wait(timeout=HANG_S) == 0
    finally:
        child_process.reap(process)
        child_process.close_pipes(process)
    [report] = [m for m in messages if isinstance(m, ReportMessage)]
    return report


def test_a_build_of_a_daemon_that_writes_no_conclusion_is_not_concluded_at_start(
    tmp_path: Path, demo_model: Path
) -> None:
    """The child runs the package on disk (``child_process.spawn``): a daemon of the
    release before 219, once the package is upgraded under it, starts children that
    write ``writer``, and concludes their builds without ever writing
    ``daemonConclusion``.  After the restart each such build is concluded again: a
    ``build_concluded_at_start`` record (critical, WARNING) for a build its daemon
    did conclude, and its engine trusted again even where the operator took it out
    of ``manifest.json`` since, the case DESIGN.md 219 says it never touches
    ("written by a release that says so").  The spec is the one that daemon sends
    (BuildManager.start's, unchanged by 219)."""
    engine_dir = _engine_dir(tmp_path)
    engine = engine_dir / "demo.engine"
    report = _run_child(
        {
            "build_id": BUILD_ID,
            "nonce": NONCE,
            "builder": "simulated",
            "model_path": str(demo_model),
            "engine_path": str(engine),
            "engine_dir": str(engine_dir),
            "device_id": 0,
            "gpu_memory_budget_bytes": 0,
            "simulation": {"step_s": 0},
            "build_config": {},
        }
    )
    assert report.summary["outcome"] == "completed" and report.summary["concluder"] is None
    # The old daemon concluded it (on its own terms); the operator later took the
    # engine out of the manifest on purpose.
    record_in_manifest(engine_dir / "manifest.json", "other.engine", "0" * 64)
    left = summary_path_for(engine, BUILD_ID).read_bytes()

    assert _conclude(engine_dir) == []
    assert summary_path_for(engine, BUILD_ID).read_bytes() == left
    assert json.loads((engine_dir / "manifest.json").read_text())["engines"] == {
        "other.engine": "0" * 64
    }
