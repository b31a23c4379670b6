"""``inferd build`` as an observed, cancellable build (issue 5, item 8, standalone):
run in a subprocess under the fake TensorRT (tests/fakes/site), it writes its
events with ``--json-log``, a summary next to the engine, prints plain progress
lines when stderr is no terminal and a live tree (rich) when it is; SIGINT
cancels cooperatively (exit 3), a second one forces (exit 130), ``--timeout``
cancels with source ``timeout``.  No partial engine is ever left at the final path."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.fakes.gpu_site import REPO, fake_gpu_env

EXIT_CANCELLED = 3
EXIT_FORCED = 130


def _command(model: Path, tmp_path: Path, *extra: str) -> list[str]:
    config = tmp_path / "build.json"
    config.write_text(json.dumps({"precision": "fp16"}))
    return [
        sys.executable,
        "-m",
        "inferd.cli.build",
        str(model),
        "--build-config",
        str(config),
        "--engine-dir",
        str(tmp_path / "engines"),
        "--json-log",
        str(tmp_path / "events.jsonl"),
        *extra,
    ]


def _start(
    model: Path, tmp_path: Path, *extra: str, step_s: float = 0.0, **kwargs: Any
) -> subprocess.Popen[str]:
    settings = {"INFERD_FAKE_TRT_BUILD_STEP_S": str(step_s)} if step_s else {}
    return subprocess.Popen(
        _command(model, tmp_path, *extra),
        env=fake_gpu_env(None, **settings),
        cwd=REPO,
        text=True,
        **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs},
    )


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_event(
    proc: subprocess.Popen[str], tmp_path: Path, type_: str, name: str | None = None
) -> None:
    """Until ``--json-log`` shows an event of ``type_`` (named ``name``), while the
    build process is alive."""

    def logged() -> bool:
        assert proc.poll() is None, proc.communicate()
        return any(
            e["type"] == type_ and (name is None or e["name"] == name) for e in _events(tmp_path)
        )

    wait_until(logged, timeout=60, message=f"a {type_} event {name or ''}")


def _wait_for_phase(proc: subprocess.Popen[str], tmp_path: Path, name: str) -> None:
    _wait_for_event(proc, tmp_path, "phase_start", name)


def _engines(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "engines").glob("*.engine"))


def _summaries(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in (tmp_path / "engines").glob("*.build.json")]


def _no_partial_files(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    assert _engines(tmp_path) == []
    assert [p.name for p in engines.iterdir() if ".tmp-" in p.name] == []


def test_a_build_completes_with_events_summary_and_plain_progress(
    demo_model: Path, tmp_path: Path
) -> None:
    done = _start(demo_model, tmp_path, "--json")
    stdout, stderr = done.communicate(timeout=120)
    assert done.returncode == 0, stderr
    (line,) = stdout.strip().splitlines()  # --json: stdout is the report, no log line
    report = json.loads(line)
    assert report["status"] == "built" and report["build"]["outcome"] == "completed"
    engine = Path(report["engine"])
    assert _engines(tmp_path) == [engine] and report["build"]["validation_status"] == "pass"

    events = _events(tmp_path)
    types = [e["type"] for e in events]
    assert {"phase_start", "step", "phase_finish"} <= set(types) and types[-1] == "completed"
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    nested = [e for e in events if e["type"] == "phase_start" and e["parentId"] is not None]
    assert nested and {e["buildId"] for e in events} == {report["build"]["build_id"]}

    summary_path = Path(report["build"]["summary"])
    assert summary_path.parent == engine.parent and summary_path.exists()
    summary = json.loads(summary_path.read_text())
    assert summary["outcome"] == "completed" and summary["cancelSource"] is None
    assert summary["baseline"]["engineSha256"] == report["sha256"]
    assert summary["timingCacheMode"] == "cold" and summary["phaseTree"]["state"] == "completed"

    # stderr is no terminal: one plain line per phase start and finish
    lines = stderr.splitlines()
    assert "start     Building engine (2 steps)  (timing cache at start: cold)" in lines
    assert "start       Timing graph nodes (8 steps)" in lines
    assert "finish      Timing graph nodes [finished 8/8]" in lines
    assert "finish    Building engine [finished 2/2]" in lines
    assert "\x1b[" not in stderr


def test_sigint_cancels_cooperatively(demo_model: Path, tmp_path: Path) -> None:
    proc = _start(demo_model, tmp_path, "--json", step_s=0.3)
    _wait_for_phase(proc, tmp_path, "Timing graph nodes")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_CANCELLED, stderr
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["status"] == "cancelled" and report["build"]["cancel_source"] == "sigint"
    assert "cancelled" in stderr and "cancel    requested by sigint" in stderr
    _no_partial_files(tmp_path)
    (summary,) = _summaries(tmp_path)
    assert summary["cancelSource"] == "sigint" and summary["cleanupStatus"] == "cleaned"
    assert summary["timingCacheMode"] == "discarded" and summary["cancelLatencyMs"] < 5000
    types = [e["type"] for e in _events(tmp_path)]
    assert "cancel_requested" in types and types[-1] == "cancelled"


def test_a_second_sigint_forces(demo_model: Path, tmp_path: Path) -> None:
    proc = _start(demo_model, tmp_path, step_s=3.0)
    _wait_for_phase(proc, tmp_path, "Building engine")
    proc.send_signal(signal.SIGINT)
    _wait_for_event(proc, tmp_path, "cancel_requested")  # the first one was handled
    proc.send_signal(signal.SIGINT)
    _stdout, stderr = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_FORCED, stderr
    assert "forced by a second Ctrl-C" in stderr
    _no_partial_files(tmp_path)
    last = _events(tmp_path)[-1]
    assert last["type"] == "cancelled" and last["detail"]["forced"] is True
    assert last["detail"]["cleanup"]["status"] == "cleaned"


def test_timeout_cancels_with_source_timeout(demo_model: Path, tmp_path: Path) -> None:
    proc = _start(demo_model, tmp_path, "--json", "--timeout", "0.5", step_s=0.3)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_CANCELLED, stderr
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["build"]["cancel_source"] == "timeout"
    _no_partial_files(tmp_path)
    (summary,) = _summaries(tmp_path)
    assert summary["cancelSource"] == "timeout" and summary["outcome"] == "cancelled"


def test_a_terminal_gets_a_live_tree(demo_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("rich")
    master, slave = pty.openpty()
    try:
        proc = _start(demo_model, tmp_path, step_s=0.05, stderr=slave)
    finally:
        os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stdout, _ = proc.communicate(timeout=120)
    reader.join(timeout=5)
    os.close(master)
    shown = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, shown
    assert any(line.startswith("built ") for line in stdout.splitlines())
    assert "Timing graph nodes" in shown and "8/8" in shown and "start     " not in shown


def _build(
    model: Path, tmp_path: Path, *extra: str, **settings: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _command(model, tmp_path, "--json", *extra),
        env=fake_gpu_env(None, **settings),
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=120,
    )


def test_an_engine_that_failed_validation_is_quarantined_never_reused_or_trusted(
    demo_model: Path, tmp_path: Path
) -> None:
    failed = _build(demo_model, tmp_path, INFERD_FAKE_TRT_EXECUTE_ERROR="injected: bad kernel")
    assert failed.returncode == 1, failed.stderr
    assert "failed validation" in failed.stderr and "quarantined" in failed.stderr
    assert _engines(tmp_path) == []
    assert list((tmp_path / "engines").glob("*.sha256")) == []
    (summary,) = _summaries(tmp_path)
    moved = Path(summary["validation"]["quarantinedTo"])
    assert moved.parent == tmp_path / "engines" / "quarantine" and moved.exists()
    _assert_the_next_build_builds_rather_than_reuses(demo_model, tmp_path)


def _assert_the_next_build_builds_rather_than_reuses(demo_model: Path, tmp_path: Path) -> None:
    """Nothing an unvalidated build left is reused, nor recorded in a manifest."""
    manifest = tmp_path / "deploy-manifest.json"
    again = _build(demo_model, tmp_path, "--manifest", str(manifest))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["status"] == "built"


def test_a_rebuild_that_fails_validation_leaves_the_trusted_engine_as_it_was(
    demo_model: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "deploy-manifest.json"
    first = _build(demo_model, tmp_path, "--manifest", str(manifest))
    assert first.returncode == 0, first.stderr
    (engine,) = _engines(tmp_path)
    before = engine.stat()
    trusted = json.loads(manifest.read_text())
    failed = _build(
        demo_model, tmp_path, "--force", INFERD_FAKE_TRT_EXECUTE_ERROR="injected: bad kernel"
    )
    assert failed.returncode == 1, failed.stderr
    after = engine.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert json.loads(manifest.read_text()) == trusted


# In the build process only: validation marks that it started, then takes long.
SLOW_VALIDATION = """
import os, time
from pathlib import Path
from inferd.engine_build import session as _session
_validate = _session.validate_build
def _slow(*args, **kwargs):
    Path(os.environ["INFERD_TEST_VALIDATING"]).touch()
    time.sleep(60)  # a long smoke inference; the test forces the exit meanwhile
    return _validate(*args, **kwargs)
_session.validate_build = _slow
"""


def _validating_build(demo_model: Path, tmp_path: Path) -> subprocess.Popen[str]:
    """``inferd build`` held in its validation (``SLOW_VALIDATION``), once it is there."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_VALIDATION)
    validating = tmp_path / "validating"
    env = fake_gpu_env(None, INFERD_TEST_VALIDATING=str(validating))
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    proc = subprocess.Popen(
        _command(demo_model, tmp_path),
        env=env,
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(
            lambda: proc.poll() is None and validating.exists(), timeout=60, message="validation"
        )
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc


def test_a_forced_exit_during_validation_leaves_no_engine_to_reuse(
    demo_model: Path, tmp_path: Path
) -> None:
    proc = _validating_build(demo_model, tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        _wait_for_event(proc, tmp_path, "cancel_requested")
        proc.send_signal(signal.SIGINT)  # forced
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_FORCED, err
    _no_partial_files(tmp_path)
    assert not (tmp_path / "engines" / "staging").exists()
    _assert_the_next_build_builds_rather_than_reuses(demo_model, tmp_path)


def test_a_killed_build_s_staging_is_removed_by_the_next_build_of_any_engine(
    demo_model: Path, tmp_path: Path
) -> None:
    """A build SIGKILLed while validating (OOM killer, power loss) leaves its staged
    engine; a later build of another engine name removes it (no live process holds
    its staging lock)."""
    proc = _validating_build(demo_model, tmp_path)
    try:
        proc.send_signal(signal.SIGKILL)  # OOM killer, power loss, kill -9
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    staging = tmp_path / "engines" / "staging"
    leaked = sorted(p for p in staging.rglob("*") if p.is_file())
    assert leaked, "the killed build staged nothing?"
    # The model is rebuilt under another label (or a new model version, another
    # precision: any other engine name).  Its cleanup never looks at the old name.
    again = _build(demo_model, tmp_path, "--model-name", "demo2")
    assert again.returncode == 0, again.stderr
    left = sorted(p for p in staging.rglob("*") if p.is_file()) if staging.exists() else []
    assert left == [], f"staged, never validated, never removed: {left}"
