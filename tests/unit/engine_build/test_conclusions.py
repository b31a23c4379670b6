"""Which build summaries a daemon concluded (``daemonConclusion``), and what a starting
daemon does with those no daemon did: its predecessor died before it recorded the
build's end (``commit_records.conclude_unconcluded``, DESIGN.md 219)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from inferd.config import BuildsConfig
from inferd.engine_build import BuildRequest, run_build
from inferd.engine_build.admission import DAEMON_START, BuildAdmission
from inferd.engine_build.artifacts import write_json
from inferd.engine_build.build_record import Build
from inferd.engine_build.child_exit import conclude
from inferd.engine_build.commit_records import CONCLUDED_AT_START, conclude_unconcluded
from inferd.engine_build.session import BuildReport, summary_path_for
from inferd.engine_build.simulated import SimulatedBuilder
from inferd.engines.sidecar import read_sidecar, write_sidecar
from inferd.fdr import kinds
from inferd.process_identity import read_boot_id, start_ticks, still_running, this_process
from inferd.types import BuildConfig
from tests.unit.engine_build.conftest import HOST, SUMMARY_SCHEMA
from tests.unit.engine_build.test_commit_record import BUILD_ID, NONCE, _killed_child


def _dead_writer() -> dict[str, Any]:
    """A build process of this boot that has exited (its pid may be reused: the start
    time says it is not the same process)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = start_ticks(process.pid)
    process.wait()
    return {"pid": process.pid, "bootId": read_boot_id(), "startTicks": ticks or 1}


def _engine_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "engines"
    directory.mkdir(mode=0o750)
    return directory


def _build(
    engine_dir: Path, model: Path, name: str = "demo.engine"
) -> tuple[Path, dict[str, Any], BuildReport]:
    """A whole build into ``engine_dir`` (its engine ``name``): its engine, its commit
    record as it was on disk when the commit began, and its report (the final
    summary written)."""
    engine = engine_dir / name
    request = BuildRequest(model, engine, BuildConfig(), HOST)
    seen: dict[str, Any] = {}

    def at_commit() -> None:
        seen["record"] = json.loads(summary_path_for(engine, BUILD_ID).read_text())

    builder = SimulatedBuilder(model, request.build_config, HOST)
    report = run_build(request, builder, build_id=BUILD_ID, nonce=NONCE, during_write=at_commit)
    assert report.summary["validationStatus"] == "pass"
    return engine, seen["record"], report


def _left(path: Path, summary: dict[str, Any], writer: dict[str, Any]) -> None:
    """What a TensorRT build process that died with its daemon left at ``path`` (the
    simulated builder stands in for TensorRT: ``simulated`` false, as a TensorRT
    child writes; its daemon, the concluder, gone too)."""
    write_json(path, {**summary, "simulated": False, "writer": writer, "concluder": _dead_writer()})


def _tensorrt_child(engine: Path) -> Build:
    """A TensorRT daemon build's exited child (its engine the simulated builder's: the
    daemon trusts a TensorRT build's validated engine, never a simulated one's)."""
    build = _killed_child(engine)
    build.builder = "tensorrt"
    return build


def _conclude(engine_dir: Path, deployment: Path | None = None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []

    def record(kind: str, payload: Any) -> None:
        assert kind == CONCLUDED_AT_START
        kinds.validate(kind, payload)
        records.append(dict(payload))

    conclude_unconcluded(engine_dir, deployment_manifest=deployment, record=record)
    return records


def _manifest(engine_dir: Path) -> dict[str, str]:
    path = engine_dir / "manifest.json"
    return json.loads(path.read_text())["engines"] if path.exists() else {}


def test_every_summary_names_its_writer(tmp_path: Path, demo_model: Path) -> None:
    _, record, report = _build(_engine_dir(tmp_path), demo_model)
    for summary in (record, report.summary):
        Draft202012Validator(SUMMARY_SCHEMA).validate(summary)
        assert summary["writer"] == this_process() and summary["concluder"] is None
        assert "daemonConclusion" not in summary, "a build process never concludes itself"


@pytest.mark.parametrize("provisional", [True, False])
def test_a_committed_engine_no_daemon_concluded_is_trusted_at_the_next_start(
    tmp_path: Path, demo_model: Path, provisional: bool
) -> None:
    """The daemon died in its build's commit window, its child killed with it (the commit
    record left) or finishing alone (its final summary left): nothing trusted the
    validated engine; the next start does, once."""
    engine_dir = _engine_dir(tmp_path)
    engine, record, report = _build(engine_dir, demo_model)
    _left(report.summary_path, record if provisional else report.summary, _dead_writer())
    assert _manifest(engine_dir) == {}

    (concluded,) = _conclude(engine_dir)

    assert (concluded["decision"], concluded["build_id"]) == ("trusted", BUILD_ID)
    assert _manifest(engine_dir) == {engine.name: read_sidecar(engine)}
    summary = json.loads(report.summary_path.read_text())
    Draft202012Validator(SUMMARY_SCHEMA).validate(summary)
    conclusion = summary["daemonConclusion"]
    assert summary["provisional"] is False
    assert (conclusion["via"], conclusion["trusted"], conclusion["daemonPid"]) == (
        "daemon_start",
        True,
        os.getpid(),
    )
    assert conclusion.get("killedAfterCommit", False) is provisional
    if provisional:
        assert summary["cleanupStatus"] == "cleaned" and summary["timingCacheMode"] == "unknown"
    assert _conclude(engine_dir) == [], "concluded once"


def test_a_commit_record_whose_commit_never_happened_is_removed_at_start(
    tmp_path: Path, demo_model: Path
) -> None:
    engine_dir = _engine_dir(tmp_path)
    engine, record, report = _build(engine_dir, demo_model)
    engine.write_bytes(b"an older build's engine")  # killed before the commit's renames
    write_sidecar(engine)
    _left(report.summary_path, record, _dead_writer())

    (concluded,) = _conclude(engine_dir)

    assert (concluded["decision"], concluded["outcome"]) == ("not_committed", None)
    assert not report.summary_path.exists()
    assert engine.read_bytes() == b"an older build's engine", "the older engine kept"
    assert _manifest(engine_dir) == {}


def test_a_summary_whose_writer_runs_or_that_names_none_is_left_alone(
    tmp_path: Path, demo_model: Path
) -> None:
    """A child of the dead daemon still running (outside systemd) concludes its own
    build's files; a daemon still running (another one on this engine dir) concludes
    its builds; a summary written before writers and concluders were recorded, or
    whose daemon writes no conclusion, has an unknown conclusion (an operator may
    have taken its engine out of the manifest)."""
    engine_dir = _engine_dir(tmp_path)
    _, record, report = _build(engine_dir, demo_model)
    dead = _dead_writer()
    for summary in (
        {**record, "writer": this_process(), "concluder": dead},  # its child runs
        {**record, "writer": dead, "concluder": this_process()},  # its daemon runs
        report.summary | {"writer": None},
        report.summary | {"writer": dead, "concluder": None},  # a daemon before 219
    ):
        write_json(report.summary_path, {**summary, "simulated": False})
        left = report.summary_path.read_bytes()
        assert _conclude(engine_dir) == []
        assert report.summary_path.read_bytes() == left and _manifest(engine_dir) == {}


def test_with_a_deployment_manifest_the_engine_is_concluded_not_trusted(
    tmp_path: Path, demo_model: Path
) -> None:
    engine_dir = _engine_dir(tmp_path)
    engine, _, report = _build(engine_dir, demo_model)
    _left(report.summary_path, report.summary, _dead_writer())
    deployment = tmp_path / "deployment.json"

    (concluded,) = _conclude(engine_dir, deployment)

    assert (
        concluded["decision"] == "not_trusted"
        and "managed by the deployment" in (concluded["note"])
    )
    assert not (engine_dir / "manifest.json").exists() and not deployment.exists()
    conclusion = json.loads(report.summary_path.read_text())["daemonConclusion"]
    assert conclusion["trusted"] is False and engine.name in conclusion["manifestNote"]


def test_the_daemon_writes_its_conclusion_on_each_builds_summary(
    tmp_path: Path, demo_model: Path
) -> None:
    """Reported or not, a build the daemon concluded is never concluded again at a
    start; a commit record it concluded becomes the final summary, with the cleanup
    the daemon did after the child killed after its commit."""
    engine_dir = _engine_dir(tmp_path)
    engine, record, report = _build(engine_dir, demo_model)
    write_json(report.summary_path, record)  # killed after its commit
    build = _tensorrt_child(engine)
    assert conclude(build, engine_dir, None) == "completed" and build.killed_after_commit

    summary = json.loads(report.summary_path.read_text())
    Draft202012Validator(SUMMARY_SCHEMA).validate(summary)
    conclusion = summary["daemonConclusion"]
    assert (conclusion["via"], conclusion["trusted"], conclusion["killedAfterCommit"]) == (
        "after_child",
        True,
        True,
    )
    assert summary["provisional"] is False and summary["cleanup"] == build.cleanup
    assert _conclude(engine_dir) == []


def test_a_reported_build_is_concluded_via_its_report(tmp_path: Path, demo_model: Path) -> None:
    engine_dir = _engine_dir(tmp_path)
    engine, _, report = _build(engine_dir, demo_model)
    build = _tensorrt_child(engine)
    build.summary, build.summary_path = report.summary, str(report.summary_path)
    build.reported, build.exit_code = True, 0
    assert conclude(build, engine_dir, None) == "completed"

    summary = json.loads(report.summary_path.read_text())
    assert summary["daemonConclusion"]["via"] == "report"
    assert summary["daemonConclusion"]["trusted"] is True
    assert {key: summary[key] for key in report.summary} == report.summary


def test_a_process_is_known_by_its_boot_and_start_time(tmp_path: Path) -> None:
    me = this_process()
    assert still_running(me)
    assert not still_running(_dead_writer())
    assert not still_running({**me, "bootId": "another boot"})
    assert not still_running({**me, "startTicks": me["startTicks"] + 1}), "a reused pid"
    assert still_running({**me, "startTicks": None}), "unknown: its files are left alone"
    # A process name with spaces and parentheses does not shift the fields read.
    odd = tmp_path / "a) b (c"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen(
        [str(odd), "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        ticks = start_ticks(child.pid)
        assert ticks is not None and 0 <= ticks - me["startTicks"] < 3600 * 1000
    finally:
        child.communicate(b"")


def test_a_zombie_writer_is_not_running() -> None:
    """An orphaned build process killed with its daemon stays a zombie until someone
    reaps it: it writes nothing more, and its summary is concluded."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = {"pid": child.pid, "bootId": read_boot_id(), "startTicks": start_ticks(child.pid)}
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    try:
        assert start_ticks(child.pid) == identity["startTicks"], "still in the process table"
        assert not still_running(identity)
    finally:
        child.wait()


def test_a_simulated_build_a_dead_daemon_left_in_the_builds_dir_is_concluded_untrusted(
    tmp_path: Path, demo_model: Path
) -> None:
    """At its start the daemon concludes the builds dir's model folders too (simulated
    builds stage and commit beside their engines there): a commit record left by a
    child killed after its commit becomes the final summary, never trusted (no
    manifest is written there); one whose commit never happened is removed."""
    builds = tmp_path / "builds"
    folder = builds / "demo"
    folder.mkdir(mode=0o750, parents=True)
    _, record, report = _build(folder, demo_model, f"demo.{BUILD_ID}.simulated.engine")
    dead = _dead_writer()
    write_json(report.summary_path, {**record, "writer": dead, "concluder": dead})
    never = folder / "demo.b2-0a0b0c.simulated.engine.b2-0a0b0c.build.json"
    write_json(never, {**record, "buildId": "b2-0a0b0c", "writer": dead, "concluder": dead})
    records: list[tuple[str, dict[str, Any]]] = []
    admission = BuildAdmission(
        builds, BuildsConfig(), lambda kind, payload: records.append((kind, dict(payload))), tuple
    )

    admission.prune([], DAEMON_START)

    decisions = {payload["build_id"]: payload["decision"] for _, payload in records}
    assert decisions == {BUILD_ID: "not_trusted", "b2-0a0b0c": "not_committed"}
    summary = json.loads(report.summary_path.read_text())
    assert summary["provisional"] is False and summary["daemonConclusion"]["trusted"] is False
    assert summary["daemonConclusion"]["killedAfterCommit"] is True
    assert not never.exists() and not (folder / "manifest.json").exists()
