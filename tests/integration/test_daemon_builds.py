"""Engine builds run by the real daemon (``build.start/status/cancel``, ``build`` topic).

Without TensorRT the daemon uses the simulated builder in a child process; the
``simulation`` test knob slows its steps (``step_s``) so a build can be cancelled
mid-way, or makes the child ignore cancel requests (``ignore_cancel``) to
exercise the escalation to killing it after ``daemon.build_cancel_grace_s``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.config import ModelConfig
from inferd.digest import sha256_file
from inferd.engine_build.build_record import describe, fdr_record
from inferd.engine_build.supervisor import BuildManager
from inferd.engines.sidecar import read_sidecar
from inferd.fdr import kinds
from inferd.fdr.reader import ReadReport, read_records
from inferd.types import Peer
from inferd_client import InferenceClient
from tests.conftest import HANG_S, REPO, DaemonFactory, DaemonProcess, Events, wait_until
from tests.conftest import inferctl as shared_inferctl
from tests.fakes.gpu_site import fake_gpu_env
from tests.integration.test_schemas import assert_valid, call

pytestmark = pytest.mark.integration

GRACE_S = 1.0
SLOW = {"step_s": 0.1}
TERMINAL = ("cancelled", "completed", "failed")


def control(daemon: DaemonProcess, op: str, **arguments: Any) -> dict[str, Any]:
    header = {"v": 1, "id": 7, "op": op, **arguments}
    assert_valid("control_request.json", header)
    reply, frames = call(daemon.control, header)
    assert frames == []
    return reply


def start_build(daemon: DaemonProcess, **arguments: Any) -> str:
    reply = control(
        daemon, "build.start", model="demo", builder="simulated", simulation=SLOW, **arguments
    )
    assert_valid("build_start_reply.json#/$defs/ok", reply)
    assert reply["result"]["simulated"] is True and reply["result"]["builder"] == "simulated"
    return str(reply["result"]["build_id"])


def build_status(daemon: DaemonProcess, build_id: str) -> dict[str, Any]:
    reply = control(daemon, "build.status", build_id=build_id)
    assert_valid("build_status_reply.json#/$defs/ok", reply)
    return dict(reply["result"]["build"])


def events_until(
    subscriber: Events, build_id: str, done: Any, timeout: float = HANG_S
) -> list[dict[str, Any]]:
    """Build events of ``build_id`` (each validated) until ``done(event)``."""
    seen: list[dict[str, Any]] = []
    give_up = time.monotonic() + timeout
    while (left := give_up - time.monotonic()) > 0:
        received = subscriber.receive(timeout=left)
        if received is None:
            break
        topic, event = received
        assert topic == "build"
        assert_valid("event_build.json", event)
        if event["buildId"] != build_id:
            continue
        seen.append(event)
        if done(event):
            return seen
    raise AssertionError(f"no matching build event in {timeout}s; got {[e['type'] for e in seen]}")


def build_records(daemon: DaemonProcess) -> list[dict[str, Any]]:
    report = ReadReport()
    records = read_records(daemon.workdir / "state" / "fdr", report, kinds=["engine_build"])
    return [record.payload for record in records]


def subscribe(daemon: DaemonProcess) -> Events:
    """Subscribed to ``build`` before the build starts (slow joiner waited out)."""
    return Events(daemon.events, topics=["build"])


def test_build_runs_beside_serving_and_cancels_from_control(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(daemon={"build_cancel_grace_s": GRACE_S})
    with subscribe(daemon) as subscriber, InferenceClient(daemon.infer) as client:
        began = time.monotonic()
        build_id = start_build(daemon)
        assert time.monotonic() - began < 1.0  # answers at once; the build goes on
        events = events_until(subscriber, build_id, lambda e: e["type"] == "step")
        assert events[0]["type"] == "phase_start" and events[0]["name"] == "Building engine"
        assert all(e["simulated"] for e in events)

        # One build per model at a time.
        again = control(daemon, "build.start", model="demo", builder="simulated")
        assert_valid("build_start_reply.json", again)
        assert again["error"]["code"] == "FAILED_PRECONDITION"
        assert build_id in again["error"]["message"]

        # The resident engine keeps serving while the child builds.
        image = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
        served = 0
        for _ in range(10):
            client.infer("demo", {"image": image})
            served += 1
        status = build_status(daemon, build_id)
        assert status["state"] == "running" and served == 10
        assert status["phase_tree"]["roots"][0]["name"] == "Building engine"
        assert status["phase_tree"]["activePath"][0] == "Building engine"
        assert "nothing to adopt" in status["adoption"] and status["adoptable"] is False

        reply = control(daemon, "build.cancel", build_id=build_id)
        assert_valid("build_cancel_reply.json#/$defs/ok", reply)
        assert reply["result"]["accepted"] is True
        assert reply["result"]["cancel_source"] == "control"
        tail = events_until(subscriber, build_id, lambda e: e["type"] in TERMINAL)
        assert tail[-1]["type"] == "cancelled"
        assert tail[-1]["detail"]["cancelSource"] == "control"
        assert tail[-1]["detail"]["escalated"] is False
        assert "cancel_requested" in [e["type"] for e in tail]

    status = build_status(daemon, build_id)
    assert status["state"] == "cancelled" and status["cancel_source"] == "control"
    assert status["escalated"] is False and status["cleanup_status"] == "cleaned"
    assert status["cancel_latency_ms"] is not None and status["cleanup_latency_ms"] is not None
    assert 0 <= status["cancel_to_exit_ms"] < GRACE_S * 1000
    assert status["phase_tree"]["state"] == "cancelled"
    summary = json.loads(Path(status["summary_path"]).read_text())
    assert summary["cancelSource"] == "control" and summary["simulated"] is True

    listing = control(daemon, "build.status")
    assert_valid("build_status_reply.json#/$defs/ok", listing)
    assert [b["build_id"] for b in listing["result"]["builds"]] == [build_id]
    again = control(daemon, "build.cancel", build_id=build_id)
    assert again["result"]["accepted"] is False  # already over: first cause stays
    unknown = control(daemon, "build.status", build_id="nope")
    assert unknown["error"]["code"] == "NOT_FOUND"

    assert daemon.stop() == 0
    (record,) = build_records(daemon)
    assert record["outcome"] == "cancelled" and record["cancel_source"] == "control"
    assert record["escalated"] is False and record["build_id"] == build_id
    assert record["cancel_latency_ms"] is not None and record["simulated"] is True


def test_sigterm_cancels_a_running_build(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(daemon={"build_cancel_grace_s": 5.0})
    with subscribe(daemon) as subscriber:
        build_id = start_build(daemon)
        events_until(subscriber, build_id, lambda e: e["type"] == "step")
        began = time.monotonic()
        assert daemon.stop(signal.SIGTERM) == 0
    assert time.monotonic() - began < 5.0  # cooperative, well inside the grace period
    (record,) = build_records(daemon)
    assert record["outcome"] == "cancelled" and record["cancel_source"] == "sigterm"
    assert record["escalated"] is False and record["cleanup_status"] == "cleaned"
    assert "build_cancel_requested" in daemon.log()


def test_a_child_ignoring_cancel_is_killed_after_the_grace_period(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(daemon={"build_cancel_grace_s": GRACE_S})
    with subscribe(daemon) as subscriber:
        reply = control(
            daemon,
            "build.start",
            model="demo",
            builder="simulated",
            simulation={"step_s": 0.2, "ignore_cancel": True},
        )
        build_id = reply["result"]["build_id"]
        pid = reply["result"]["pid"]
        events_until(subscriber, build_id, lambda e: e["type"] == "step")
        control(daemon, "build.cancel", build_id=build_id, source="ide")
        tail = events_until(subscriber, build_id, lambda e: e["type"] in TERMINAL)
    assert tail[-1]["type"] == "cancelled" and tail[-1]["detail"]["escalated"] is True
    assert tail[-1]["detail"]["exitCode"] == -signal.SIGKILL
    status = build_status(daemon, build_id)
    assert status["escalated"] is True and status["cancel_source"] == "ide"
    assert GRACE_S * 1000 <= status["cancel_to_exit_ms"] < GRACE_S * 1000 + 2000
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert daemon.stop() == 0
    (record,) = build_records(daemon)
    assert record["escalated"] is True and record["outcome"] == "cancelled"
    assert record["cancel_source"] == "ide"


#: ``inferctl(daemon, *args)`` on all the daemon's sockets, the whole command 20 s.
inferctl = functools.partial(shared_inferctl, timeout=20)


def endpoints(daemon: DaemonProcess) -> list[str]:
    return [
        "--control-endpoint",
        daemon.control,
        "--events-endpoint",
        daemon.events,
        "--infer-endpoint",
        daemon.infer,
    ]


def test_inferctl_build_start_status_cancel_follow(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(daemon={"build_cancel_grace_s": GRACE_S})
    started = inferctl(daemon, "build", "start", "demo", "--simulated", "--precision", "fp16")
    assert started.returncode == 0, started.stderr
    assert re.search(r"^simulated:\s+yes$", started.stdout, re.M) and "fp16" in started.stdout

    build_id = start_build_after(daemon, started.stdout)
    # inferctl says on stderr when its subscription has reached the daemon.
    follow = follow_builds(daemon)
    hang = threading.Timer(HANG_S, follow.kill)  # a follower that never subscribes fails
    hang.start()
    try:
        assert follow.stdout is not None and follow.stderr is not None
        subscribed = follow.stderr.readline()  # before the build starts
        assert subscribed == "following build events\n", subscribed
        hang.cancel()
        build_id = start_build(daemon)
        first = follow.stdout.readline()
        assert "Building engine" in first, first
        shown = inferctl(daemon, "build", "status", build_id)
        assert shown.returncode == 0, shown.stderr
        assert "(SIMULATED)" in shown.stdout and "- Building engine [running" in shown.stdout
        cancelled = inferctl(daemon, "build", "cancel", build_id, "--json")
        assert json.loads(cancelled.stdout)["accepted"] is True
        watchdog = threading.Timer(15, follow.kill)  # a follower that never ends fails
        watchdog.start()
        rest = follow.stdout.read()  # not communicate(): it would skip read-ahead lines
        watchdog.cancel()
        follow.wait(timeout=5)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 1  # the build it followed ended without its engine
    lines = (first + rest).splitlines()
    assert any(line.startswith("  + Graph optimization") for line in lines), lines
    assert lines[-1].startswith(f"CANCELLED build {build_id} [simulated]"), lines[-1]

    listing = inferctl(daemon, "build", "status", "--json")
    builds = json.loads(listing.stdout)["builds"]
    assert [b["state"] for b in builds] == ["completed", "cancelled"]
    assert builds[0]["build_config"]["precision"] == "fp16"
    completed = inferctl(daemon, "build", "follow", builds[0]["build_id"], "--json")
    assert completed.returncode == 0, completed.stderr  # it ended with its engine
    missing = inferctl(daemon, "build", "cancel", "nope")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_inferctl_build_follow_by_id_prints_the_state_then_every_later_event(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(daemon={"build_cancel_grace_s": GRACE_S})
    build_id = start_build(daemon)  # the slow simulation: still running when followed
    follow = follow_builds(daemon, build_id, "--json")
    watchdog = threading.Timer(HANG_S, follow.kill)  # a follower that hangs fails
    watchdog.start()
    try:
        assert follow.stdout is not None and follow.stderr is not None
        assert follow.stderr.readline() == "following build events\n"
        snapshot = json.loads(follow.stdout.readline())
        assert snapshot["type"] == "status" and snapshot["build"]["build_id"] == build_id
        assert snapshot["build"]["state"] == "running"
        assert control(daemon, "build.cancel", build_id=build_id)["result"]["accepted"] is True
        later = [json.loads(line) for line in follow.stdout.read().splitlines()]
        follow.wait(timeout=5)
    finally:
        watchdog.cancel()
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 1  # cancelled: `build follow ID && ...` stops there
    assert later and {event["buildId"] for event in later} == {build_id}
    assert later[-1]["type"] == "cancelled"

    ended = inferctl(daemon, "build", "follow", build_id, "--json")
    assert ended.returncode == 1, ended.stderr
    (only,) = ended.stdout.splitlines()  # a finished build: its state, nothing to wait for
    assert json.loads(only)["build"]["state"] == "cancelled"
    unknown = inferctl(daemon, "build", "follow", "nope")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def follow_builds(daemon: DaemonProcess, *args: str) -> subprocess.Popen[str]:
    """``inferctl build follow ARGS`` running, its stdout and stderr piped as text."""
    return subprocess.Popen(
        [sys.executable, "-m", "inferd_client.cli", *endpoints(daemon), "build", "follow", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def start_build_after(daemon: DaemonProcess, cli_output: str) -> str:
    """Wait for the build started by ``inferctl build start`` (fast default steps) to end."""
    build_id = next(
        line.split(":", 1)[1].strip()
        for line in cli_output.splitlines()
        if line.startswith("build_id:")
    )
    wait_until(
        lambda: build_status(daemon, build_id)["state"] != "running", message="the build ending"
    )
    assert build_status(daemon, build_id)["state"] == "completed"
    return build_id


def test_a_build_directory_not_safely_the_daemons_is_refused_before_a_start_is_taken(
    daemon_factory: DaemonFactory,
) -> None:
    """FAILED_PRECONDITION naming the directory, not INTERNAL; the peer's one start
    (start_burst = 1) is still there for the build once the mode is fixed."""
    daemon = daemon_factory(builds={"start_burst": 1})
    model_dir = daemon.workdir / "state" / "builds" / "demo"
    model_dir.mkdir(parents=True, exist_ok=True)
    model_dir.chmod(0o777)
    reply = control(daemon, "build.start", model="demo", builder="simulated")
    assert_valid("error_reply.json", reply)
    assert reply["error"]["code"] == "FAILED_PRECONDITION", reply
    assert str(model_dir) in reply["error"]["message"]
    assert "writable" in reply["error"]["message"]
    model_dir.chmod(0o700)
    build_id = start_build(daemon)
    assert build_status(daemon, build_id)["state"] in ("running", "completed")


# -- what a build child leaves when it dies or is cancelled late (BuildManager) ------------

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)

# In the child only: the staged engine's fsync takes long (a big engine on a slow disk).
SLOW_ENGINE_WRITE = """
import os, time
_fsync = os.fsync
def _slow(fd):
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        name = ""
    if ".simulated.engine.tmp-" in name:
        time.sleep(60)
    return _fsync(fd)
os.fsync = _slow
"""

# In the child only: validation marks that it started, then waits until the build's
# token is cancelled (bounded by INFERD_TEST_VALIDATION_S), like a slow smoke inference.
SLOW_VALIDATION = """
import os, threading
from pathlib import Path
from inferd.engine_build import cancel as _cancel, session as _session
_cancelled = threading.Event()
_cancel_original = _cancel.CancellationToken.cancel
def _cancel_and_tell(self, *args, **kwargs):
    first = _cancel_original(self, *args, **kwargs)
    _cancelled.set()
    return first
_cancel.CancellationToken.cancel = _cancel_and_tell
_validate = _session.validate_build
def _slow(*args, **kwargs):
    Path(os.environ["INFERD_TEST_VALIDATING"]).touch()
    _cancelled.wait(float(os.environ["INFERD_TEST_VALIDATION_S"]))
    return _validate(*args, **kwargs)
_session.validate_build = _slow
"""


def _in_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    paths = [str(site), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))


def _manager(
    tmp_path: Path, model: Path, grace_s: float, published: list[dict[str, Any]]
) -> BuildManager:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return BuildManager(
        {"demo": ModelConfig("demo", model)},
        build_dir=state / "builds",
        engine_dir=state / "engines",
        publish=lambda _topic, payload: published.append(dict(payload)),
        record=lambda _kind, _payload: None,
        grace_s=grace_s,
        tensorrt_available=lambda: False,
    )


def _files_left(tmp_path: Path) -> list[str]:
    root = tmp_path / "state" / "builds"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _start_simulated(manager: BuildManager, tmp_path: Path, until: Callable[[], bool]) -> Any:
    started = manager.start(
        {"model": "demo", "builder": "simulated", "simulation": {"step_s": 0}}, OPERATOR
    )
    wait_until(until, timeout=60, message="the child at the point under test")
    return manager._get(started["build_id"])


def _writing(tmp_path: Path) -> Callable[[], bool]:
    folder = tmp_path / "state" / "builds" / "demo"
    return lambda: any(".tmp-" in p.name for p in folder.rglob("*"))


def test_a_build_child_killed_while_it_writes_its_engine_leaves_no_file(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_the_child(tmp_path, monkeypatch, SLOW_ENGINE_WRITE)
    published: list[dict[str, Any]] = []
    manager = _manager(tmp_path, demo_model, 1.0, published)
    build = _start_simulated(manager, tmp_path, _writing(tmp_path))
    os.kill(build.process.pid, signal.SIGKILL)  # the OOM killer, a crash
    assert build.done.wait(HANG_S)
    assert build.state == "failed"
    assert _files_left(tmp_path) == [], "partial files of a dead build child left behind"
    record = fdr_record(build)
    assert record["cleanup_status"] == "cleaned" and record["cleanup"]["removed"]
    assert record["timing_cache"] == "discarded"
    assert describe(build)["cleanup_status"] == "cleaned"


def test_a_build_child_killed_at_shutdown_while_it_writes_leaves_no_file(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_the_child(tmp_path, monkeypatch, SLOW_ENGINE_WRITE)
    published: list[dict[str, Any]] = []
    manager = _manager(tmp_path, demo_model, 1.0, published)
    build = _start_simulated(manager, tmp_path, _writing(tmp_path))
    manager.shutdown("sigterm")  # cancel; the child, deaf in its fsync, is killed
    assert build.done.is_set()
    assert build.state == "cancelled" and build.escalated is True
    assert _files_left(tmp_path) == [], "partial files of a killed build child left behind"
    assert fdr_record(build)["cleanup_status"] == "cleaned"


def test_a_build_killed_while_it_validates_leaves_no_engine(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child ignores the cancel while validating (a smoke inference cannot be
    interrupted) and is killed after the grace: its staged engine is removed."""
    _in_the_child(tmp_path, monkeypatch, SLOW_VALIDATION)
    validating = tmp_path / "validating"
    monkeypatch.setenv("INFERD_TEST_VALIDATING", str(validating))
    monkeypatch.setenv("INFERD_TEST_VALIDATION_S", "60")
    published: list[dict[str, Any]] = []
    manager = _manager(tmp_path, demo_model, 1.0, published)
    build = _start_simulated(manager, tmp_path, validating.exists)
    os.kill(build.process.pid, signal.SIGSTOP)  # deaf to the cancel: killed after the grace
    reply = manager.cancel({"build_id": build.build_id}, OPERATOR)
    assert reply["accepted"] is True
    assert build.done.wait(HANG_S)
    assert build.state == "cancelled" and build.escalated is True
    engines = [name for name in _files_left(tmp_path) if ".engine" in name]
    assert engines == [], f"a cancelled build left {engines}"


def test_a_cancel_accepted_while_the_engine_is_validated_ends_cancelled(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_the_child(tmp_path, monkeypatch, SLOW_VALIDATION)
    validating = tmp_path / "validating"
    monkeypatch.setenv("INFERD_TEST_VALIDATING", str(validating))
    monkeypatch.setenv("INFERD_TEST_VALIDATION_S", str(HANG_S))
    published: list[dict[str, Any]] = []
    manager = _manager(tmp_path, demo_model, HANG_S, published)
    build = _start_simulated(manager, tmp_path, validating.exists)
    reply = manager.cancel({"build_id": build.build_id}, OPERATOR)
    assert reply["accepted"] is True and reply["cancel_source"] == "control"
    assert build.done.wait(HANG_S)
    terminal = published[-1]
    assert build.state == "cancelled" and not build.escalated
    assert terminal["type"] == "cancelled" and terminal["cancelState"] == "cleaned_up"
    # Its summary as its child wrote it and the daemon concluded it (an ended build
    # keeps only the words build.status shows: child_exit.keep_ended).
    assert build.summary_path is not None
    summary = json.loads(Path(build.summary_path).read_text())
    assert summary["outcome"] == "cancelled"
    assert summary["validationStatus"] == "cancelled", "stopped before its verdict"
    assert summary["timingCacheMode"] == "discarded"
    assert summary["baseline"]["engineSha256"] is None
    assert fdr_record(build)["outcome"] == "cancelled"
    left = [name for name in _files_left(tmp_path) if not name.endswith(".build.json")]
    assert [name for name in left if ".engine" in name] == []


# In the child only: the build marks that it has saved its timing cache (after its
# commit, before its summary and its report), then waits there to be killed.
AFTER_THE_COMMIT = """
import os, time
from pathlib import Path
from inferd.engine_build import timing_cache_policy as _policy
_finish = _policy.TimingCacheManager.finish
def _finish_then_wait(self, *args, **kwargs):
    decision = _finish(self, *args, **kwargs)
    Path(os.environ["INFERD_TEST_COMMITTED"]).touch()
    time.sleep(60)
    return decision
_policy.TimingCacheManager.finish = _finish_then_wait
"""


def test_a_build_child_killed_after_its_commit_leaves_a_trusted_counted_engine(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between its commit and its report (the OOM killer, the grace's SIGKILL):
    the build was recorded ``failed``, its validated engine left neither trusted nor
    counted by the cap, its timing cache claimed ``discarded`` though saved.  The
    daemon now reads the commit record the child wrote before its commit."""
    env = fake_gpu_env(None)  # the TensorRT builder, on the fakes
    for key in ("PYTHONPATH", "INFERD_FAKE_TRT_VIOLATIONS"):
        monkeypatch.setenv(key, env[key])
    _in_the_child(tmp_path, monkeypatch, AFTER_THE_COMMIT)
    committed = tmp_path / "committed"
    monkeypatch.setenv("INFERD_TEST_COMMITTED", str(committed))
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    published: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    manager = BuildManager(
        {"demo": ModelConfig("demo", demo_model)},
        build_dir=state / "builds",
        engine_dir=state / "engines",
        publish=lambda _topic, payload: published.append(dict(payload)),
        record=lambda kind, payload: records.append(dict(payload, kind=kind)),
        grace_s=1.0,
        tensorrt_available=lambda: True,
    )
    started = manager.start({"model": "demo"}, OPERATOR)
    wait_until(committed.exists, timeout=60, message="the child after its commit")
    build = manager._get(started["build_id"])
    assert describe(build)["timing_cache_mode"] is None  # no report yet: not known
    os.kill(build.process.pid, signal.SIGKILL)
    assert build.done.wait(HANG_S)

    engine = build.engine_path
    digest = read_sidecar(engine)
    assert sha256_file(engine) == digest, "the committed engine is intact"
    assert build.state == "completed" and build.killed_after_commit is True
    status = describe(build)
    assert_valid("build_status_reply.json#/$defs/build", status)
    assert (status["killed_after_commit"], status["adoptable"]) == (True, True)
    # The daemon cannot know whether the cache was saved: it says so (DESIGN.md 274).
    assert status["timing_cache_mode"] == "unknown"
    assert status["cleanup_status"] == "cleaned"
    manifest = json.loads((engine.parent / "manifest.json").read_text())
    assert manifest["engines"] == {engine.name: digest}, "trusted as a reported build is"
    (record,) = [r for r in records if r.pop("kind") == "engine_build"]
    kinds.validate("engine_build", record)
    assert (record["outcome"], record["killed_after_commit"]) == ("succeeded", True)
    assert record["exit_code"] == -signal.SIGKILL
    # Saved before the kill, so never claimed "discarded": not known to the daemon.
    assert record["timing_cache"] == "unknown"
    assert list(engine.parent.glob("timing_*.cache")), "the child had saved its timing cache"
    terminal = published[-1]
    assert terminal["type"] == "completed" and terminal["detail"]["killedAfterCommit"] is True
    assert terminal["detail"]["timingCacheMode"] == "unknown"
    assert_valid("event_build.json", {**terminal, "ts_ns": 1, "seq": 1})
    # Counted by the builds cap, and kept by it (an engine the manifest trusts).
    (kept,) = [s for s in manager.admission.retention.scan().sets if s.build_id == build.build_id]
    assert engine in kept.paths and kept.pinned is not None
    left = [p.name for p in engine.parent.iterdir() if ".tmp-" in p.name or p.name == "staging"]
    assert left == [], "partial files of the killed child"
