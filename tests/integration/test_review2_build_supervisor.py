"""Second review of daemon builds: the build child as a process (``BuildManager``).

Each test fails on the code before the review: a cancel that arrived once the child
had exited was accepted and turned a failed build into a cancelled one; a reader
thread that could not start left the build running forever; the child imported
modules from the daemon's working directory; the grace's SIGKILL left what the child
had started; a cleanup refused by an unsafe quarantine ended the build without its
terminal event; a start that failed took one of the peer's starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from inferd.config import BuildsConfig, ModelConfig
from inferd.engine_build import child_exit, supervisor
from inferd.engine_build.build_record import Build, BuildFinished, describe
from inferd.engine_build.pipe import ChildMessage
from inferd.engine_build.supervisor import BuildManager
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S, wait_until
from tests.integration.test_daemon_builds import OPERATOR, _in_the_child

pytestmark = pytest.mark.integration

SLOW = {"step_s": 0.1}


def _manager(
    tmp_path: Path,
    model: Path,
    *,
    grace_s: float = 1.0,
    published: list[dict[str, Any]] | None = None,
    records: list[dict[str, Any]] | None = None,
    finished: list[BuildFinished] | None = None,
    limits: BuildsConfig | None = None,
) -> BuildManager:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return BuildManager(
        {"demo": ModelConfig("demo", model)},
        build_dir=state / "builds",
        engine_dir=state / "engines",
        publish=lambda _topic, payload: (published if published is not None else []).append(
            dict(payload)
        ),
        record=lambda _kind, payload: (records if records is not None else []).append(
            dict(payload)
        ),
        grace_s=grace_s,
        tensorrt_available=lambda: False,
        on_finished=None if finished is None else finished.append,
        limits=limits,
    )


def _start(manager: BuildManager, simulation: dict[str, Any] | None = None) -> Build:
    header = {"model": "demo", "builder": "simulated", "simulation": simulation or SLOW}
    started = manager.start(header, OPERATOR)
    return manager._get(started["build_id"])


def _stepping(build: Build) -> None:
    wait_until(lambda: build.received > 2, timeout=60, message="the child's first events")


def _gone(pid: int) -> bool:
    """No such process, or a zombie (killed, waiting for whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_cancel_once_the_child_has_exited_is_not_accepted_and_changes_nothing(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child died on its own (the OOM killer); a build.cancel that arrives while
    the daemon records its end was accepted, ended the build ``cancelled`` (as if the
    operator had stopped it) with a negative ``cancel_to_exit_ms``."""
    published: list[dict[str, Any]] = []
    manager = _manager(tmp_path, demo_model, published=published)
    replies: list[dict[str, Any]] = []
    clean_up = child_exit.clean_up

    def cancel_meanwhile(engine_path: Path, **kwargs: Any) -> Any:
        # The daemon cleans after the dead child: the end is being recorded.
        replies.append(manager.cancel({"build_id": build.build_id}, OPERATOR))
        return clean_up(engine_path, **kwargs)

    monkeypatch.setattr(child_exit, "clean_up", cancel_meanwhile)
    build = _start(manager)
    _stepping(build)
    os.kill(build.process.pid, signal.SIGKILL)
    assert build.done.wait(HANG_S)
    assert replies and replies[0]["accepted"] is False
    assert build.state == "failed" and build.cancel_source is None
    assert published[-1]["type"] == "failed"
    assert describe(build)["cancel_to_exit_ms"] is None


def test_a_reader_thread_that_cannot_start_leaves_no_build_running(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``can't start new thread`` after the child was spawned: the build stayed
    ``running`` with nobody reading or reaping its child, and every later start of
    the model was refused FAILED_PRECONDITION."""
    manager = _manager(tmp_path, demo_model, limits=BuildsConfig(start_burst=1))
    spawned: list[subprocess.Popen[bytes]] = []
    popen = subprocess.Popen

    def recording(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        process = popen(*args, **kwargs)
        spawned.append(process)
        return process

    class NoReader(threading.Thread):
        def start(self) -> None:
            if self.name.startswith("inferd-build-b"):
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(subprocess, "Popen", recording)
    monkeypatch.setattr(supervisor.threading, "Thread", NoReader)
    with pytest.raises(ProtocolError) as refused:
        manager.start({"model": "demo", "builder": "simulated", "simulation": SLOW}, OPERATOR)
    monkeypatch.undo()
    assert refused.value.code == Code.INTERNAL
    assert manager.running() == 0
    (child,) = spawned
    assert child.returncode is not None, "the child was left running, unreaped"
    build = _start(manager, {"step_s": 0})  # the start it did not use is still the peer's
    assert build.done.wait(HANG_S) and build.state == "completed"


def test_a_start_that_fails_to_spawn_costs_the_peer_no_start(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md 65: a token is taken only when a build starts."""
    manager = _manager(tmp_path, demo_model, limits=BuildsConfig(start_burst=1))

    def no_process(*_args: Any, **_kwargs: Any) -> subprocess.Popen[bytes]:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(ProtocolError) as refused:
        manager.start({"model": "demo", "builder": "simulated"}, OPERATOR)
    monkeypatch.undo()
    assert refused.value.code == Code.INTERNAL
    build = _start(manager, {"step_s": 0})
    assert build.done.wait(HANG_S) and build.state == "completed"


def test_the_build_child_imports_nothing_from_the_daemons_working_directory(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m`` puts the working directory first on ``sys.path``: an ``inferd``
    package (or ``numpy.py``, ...) there ran in the child as the daemon's user."""
    workdir = tmp_path / "cwd"
    (workdir / "inferd").mkdir(parents=True)
    planted = tmp_path / "planted-code-ran"
    (workdir / "inferd" / "__init__.py").write_text(f"open({str(planted)!r}, 'w').close()\n")
    monkeypatch.chdir(workdir)
    manager = _manager(tmp_path, demo_model)
    build = _start(manager, {"step_s": 0})
    assert build.done.wait(HANG_S)
    assert not planted.exists(), "the child ran code from the daemon's working directory"
    assert build.state == "completed", build.error


GRANDCHILD = """
import os, subprocess
_pidfile = os.environ.get("INFERD_TEST_GRANDCHILD")
if _pidfile:
    _sleeper = subprocess.Popen(
        ["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    with open(_pidfile, "w") as _file:
        _file.write(str(_sleeper.pid))
"""


def test_the_grace_kill_reaches_what_the_child_started(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child has its own process group; the escalation killed only the child, so a
    process it had started (a helper, a compiler) outlived the build."""
    _in_the_child(tmp_path, monkeypatch, GRANDCHILD)
    pidfile = tmp_path / "grandchild.pid"
    monkeypatch.setenv("INFERD_TEST_GRANDCHILD", str(pidfile))
    manager = _manager(tmp_path, demo_model, grace_s=0.5)
    build = _start(manager, {"step_s": 0.2, "ignore_cancel": True})
    wait_until(lambda: pidfile.exists() and pidfile.read_text(), message="the grandchild")
    grandchild = int(pidfile.read_text())
    try:
        _stepping(build)
        assert manager.cancel({"build_id": build.build_id}, OPERATOR)["accepted"] is True
        assert build.done.wait(HANG_S)
        assert build.escalated is True and build.state == "cancelled"
        wait_until(lambda: _gone(grandchild), timeout=5, message="the grandchild killed")
    finally:
        if not _gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_a_cleanup_that_raises_still_ends_the_build_with_its_terminal_event(
    tmp_path: Path, demo_model: Path
) -> None:
    """A child killed between its commit's two renames leaves an engine without its
    sidecar; the daemon's cleanup quarantines it, and an unsafe ``quarantine/``
    raised ``UnsafeDirectoryError`` out of ``_finish``: the build was marked failed
    without a terminal event, an FDR record or the finished hook (the rebuilder
    never learnt that its build ended)."""
    published: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    finished: list[BuildFinished] = []
    manager = _manager(
        tmp_path, demo_model, published=published, records=records, finished=finished
    )
    build = _start(manager)
    _stepping(build)
    build.engine_path.write_bytes(b"engine renamed, its sidecar not yet")
    quarantine = build.engine_path.parent / "quarantine"
    quarantine.mkdir()
    quarantine.chmod(0o777)
    os.kill(build.process.pid, signal.SIGKILL)
    assert build.done.wait(HANG_S)
    assert build.state == "failed"
    assert published[-1]["type"] == "failed" and published[-1]["buildId"] == build.build_id
    assert [record["build_id"] for record in records] == [build.build_id]
    assert records[0]["cleanup_status"] == "failed"
    assert [item.build_id for item in finished] == [build.build_id]


# In the child only: the process dies (the OOM killer, the grace's SIGKILL) once its
# engine_build record is on the pipe, before its report.
DIES_BEFORE_ITS_REPORT = """
import os, signal
from inferd.engine_build import pipe as _pipe
_encode = _pipe.encode
def _encode_or_die(message):
    if isinstance(message, _pipe.ReportMessage):  # written in order: the record is out
        os.kill(os.getpid(), signal.SIGKILL)
    return _encode(message)
_pipe.encode = _encode_or_die
"""


def test_a_child_that_dies_after_its_record_is_recorded_as_what_the_daemon_saw(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FDR record was the child's (``outcome: succeeded``) while the build, its
    status and its terminal event said ``failed``.  Since the commit record (DESIGN.md,
    a build child killed after its commit) the daemon reads the summary the child
    left: all of them say what it did, ``completed``, ``killed_after_commit``."""
    _in_the_child(tmp_path, monkeypatch, DIES_BEFORE_ITS_REPORT)
    published: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    manager = _manager(tmp_path, demo_model, published=published, records=records)
    kinds: list[str] = []
    on_message = manager._on_message

    def seen(build: Build, message: ChildMessage) -> None:
        kinds.append(type(message).__name__)
        on_message(build, message)

    monkeypatch.setattr(manager, "_on_message", seen)
    build = _start(manager, {"step_s": 0})
    assert build.done.wait(HANG_S)
    assert "RecordMessage" in kinds and not build.reported  # the point under test
    assert build.state == "completed" and published[-1]["type"] == "completed"
    assert published[-1]["detail"]["killedAfterCommit"] is True
    (record,) = records
    assert record["outcome"] == "succeeded" and record["killed_after_commit"] is True
    assert build.summary_path is not None  # the summary it left, as the daemon concluded it
    summary = json.loads(Path(build.summary_path).read_text())
    assert summary.get("provisional") is False
    assert record["timing_cache"] == summary["timingCacheMode"]
