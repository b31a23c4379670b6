"""A cancelled build is killed after the grace by its own reader thread
(``supervisor.BuildManager._follow``), never by a timer thread: a cancel always
arranges its kill, even when no thread can start (the process's thread limit,
DESIGN.md 166).

Before, each cancel started a ``threading.Timer``; refused, its ``RuntimeError``
left ``build.cancel`` (the reply an internal error, the cancel recorded and sent),
stopped ``shutdown`` at the first build, and made the deadline's cancel a
``build_reader_failed`` whose child was never killed.  A child that closed its
stdout but lived on escaped its deadline, and so did one with something to say at
each of the reader's polls.

Real build children throughout: simulated ones, and stand-ins started as
``child_process.spawn`` starts them for a child that closed its stdout.  Only the
builds' reader threads may start (each test refuses every other start, and asserts
that none was tried)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferd.config import BuildsConfig, ModelConfig
from inferd.engine_build import child_process
from inferd.engine_build.build_record import Build, describe
from inferd.engine_build.supervisor import BuildManager
from inferd.types import Peer
from tests.conftest import HANG_S, wait_until
from tests.thread_limit import REFUSAL

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)
#: Short, so that each test takes a second or so; long enough to see the kill wait.
GRACE_S = 0.3
#: A build that ignores its cancel and runs far longer than any test.
DEAF = {"step_s": 0.2, "ignore_cancel": True}


@pytest.fixture
def refused(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every thread start refused as at the thread limit, but a build's reader's (the
    test is about what comes after); the names of the refused threads."""
    real_start = threading.Thread.start
    names: list[str] = []

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith("inferd-build-b"):
            real_start(thread)
            return
        names.append(thread.name)
        raise RuntimeError(REFUSAL)

    monkeypatch.setattr(threading.Thread, "start", start)
    return names


@pytest.fixture
def manager(tmp_path: Path, demo_model: Path) -> Iterator[BuildManager]:
    """Two models (two builds may run at once); every child's group killed after."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    builds = BuildManager(
        {"demo": ModelConfig("demo", demo_model), "other": ModelConfig("other", demo_model)},
        build_dir=state / "builds",
        engine_dir=state / "engines",
        publish=lambda _topic, _payload: None,
        record=lambda _kind, _payload: None,
        grace_s=GRACE_S,
        tensorrt_available=lambda: False,
        limits=BuildsConfig(start_burst=10),
    )
    yield builds
    for build in list(builds._builds.values()):  # a failing test's children too
        with contextlib.suppress(OSError):
            os.killpg(build.process.pid, signal.SIGKILL)


def _start(manager: BuildManager, model: str = "demo", **header: Any) -> Build:
    started = manager.start({"model": model, "builder": "simulated", **header}, OPERATOR)
    return manager._get(started["build_id"])


def _stepping(build: Build) -> None:
    wait_until(lambda: build.received > 2, timeout=60, message="the child's first events")


def _killed_after_the_grace(build: Build, source: str) -> None:
    assert build.done.wait(HANG_S), "the build was never killed"
    status = describe(build)
    assert status["state"] == "cancelled" and status["cancel_source"] == source
    assert status["escalated"] is True and build.exit_code == -signal.SIGKILL
    assert status["cancel_to_exit_ms"] >= GRACE_S * 1000


def test_a_cancel_kills_a_silent_deaf_child_after_the_grace_with_no_thread_started(
    manager: BuildManager, refused: list[str]
) -> None:
    """Stopped, the child neither writes nor reads: only the reader's own wait (no
    more than the grace, whatever the build's deadline) sees the cancel."""
    build = _start(manager, simulation={"step_s": 0.2})
    _stepping(build)
    os.kill(build.process.pid, signal.SIGSTOP)
    reply = manager.cancel({"build_id": build.build_id}, OPERATOR)
    assert reply["accepted"] is True and reply["grace_s"] == GRACE_S
    _killed_after_the_grace(build, "control")
    assert refused == []


def test_shutdown_kills_every_build_when_no_thread_can_start(
    manager: BuildManager, refused: list[str]
) -> None:
    builds = [_start(manager, model, simulation=DEAF) for model in ("demo", "other")]
    for build in builds:
        _stepping(build)
    manager.shutdown("sigterm", wait_s=HANG_S)
    for build in builds:
        _killed_after_the_grace(build, "sigterm")
    assert refused == []


def test_the_deadline_kills_a_child_that_ignores_its_cancel_when_no_thread_can_start(
    manager: BuildManager, refused: list[str]
) -> None:
    build = _start(manager, simulation=DEAF, timeout_s=0.5)
    _killed_after_the_grace(build, "timeout")
    assert "deadline of 0.5 s (timeout_s)" in (build.cancel_reason or "")
    assert refused == []


def test_the_deadline_holds_for_a_child_with_something_to_say_at_each_poll(
    manager: BuildManager, refused: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader looked at the deadline only when a poll found nothing to read."""
    monkeypatch.setattr(child_process, "readable", lambda _process, _timeout_s: True)
    build = _start(manager, simulation={**DEAF, "step_s": 0.05}, timeout_s=0.5)
    _killed_after_the_grace(build, "timeout")
    assert refused == []


#: A child that closes its stdout (the reader reads its end), says so, and lives on.
_CLOSES_STDOUT = (
    "import os, sys, time\nos.close(1)\nopen(sys.argv[1], 'w').close()\ntime.sleep(60)\n"
)


@pytest.fixture(params=["pidfd", "no pidfd"])
def exit_wait(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The child's exit awaited through its pidfd, or, where none can be opened (the
    descriptor limit), by ``waitid`` at intervals (the refusal asserted to be met)."""
    refusals: list[int] = []

    def no_pidfd(pid: int, _flags: int = 0) -> int:
        refusals.append(pid)
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    if request.param == "no pidfd":
        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    yield str(request.param)
    assert bool(refusals) == (request.param == "no pidfd")


@pytest.fixture
def closed_stdout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exit_wait: str) -> Path:
    """Builds' children are stand-ins started as ``child_process.spawn`` starts a
    child (its pipes, its own session); the file each creates once its stdout is
    closed."""
    closed = tmp_path / "closed"

    def spawn(_spec: dict[str, Any]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", _CLOSES_STDOUT, str(closed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,
        )

    monkeypatch.setattr(child_process, "spawn", spawn)
    return closed


def test_a_child_that_closed_its_stdout_is_killed_after_a_cancels_grace(
    manager: BuildManager, refused: list[str], closed_stdout: Path
) -> None:
    build = _start(manager)
    wait_until(closed_stdout.exists, timeout=60, message="the child's stdout closed")
    assert manager.cancel({"build_id": build.build_id}, OPERATOR)["accepted"] is True
    _killed_after_the_grace(build, "control")
    assert refused == []


def test_a_child_that_closed_its_stdout_still_meets_its_deadline(
    manager: BuildManager, refused: list[str], closed_stdout: Path
) -> None:
    """It waited for the child's exit, for ever, with no deadline."""
    build = _start(manager, timeout_s=0.5)
    _killed_after_the_grace(build, "timeout")
    assert closed_stdout.exists()
    assert refused == []


def test_a_child_that_exits_after_closing_its_stdout_ends_as_its_own(
    manager: BuildManager, monkeypatch: pytest.MonkeyPatch, exit_wait: str
) -> None:
    """A control: the reader's wait for the exit ends at the exit, not at a slice."""

    def spawn(_spec: dict[str, Any]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", "import os, sys; os.close(1); sys.exit(3)"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )

    monkeypatch.setattr(child_process, "spawn", spawn)
    build = _start(manager)
    assert build.done.wait(HANG_S)
    assert build.state == "failed" and build.exit_code == 3
    assert build.cancel_source is None and build.escalated is False


def test_a_child_that_ended_while_its_reader_was_busy_is_not_cancelled_at_the_deadline(
    manager: BuildManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader acts on a passed deadline before it reads what is waiting: a child
    that reported and exited while the reader was busy past the deadline ends as
    its own (``completed``), not ``cancelled`` by a timeout (review of entry 292)."""
    from inferd.engine_build.pipe import ReportMessage

    on_message = BuildManager._on_message
    exited: list[bool] = []

    def busy(self: BuildManager, build: Build, message: object) -> None:
        on_message(self, build, message)  # type: ignore[arg-type]
        if isinstance(message, ReportMessage):  # the child exits on its own meanwhile
            info = os.waitid(os.P_PID, build.process.pid, os.WEXITED | os.WNOWAIT)
            exited.append(info is not None and info.si_status == 0)  # a zombie, unreaped
            # ... and the reader, busy until now, finds its deadline passed.
            build.deadline_s = time.monotonic() - build.started_mono - 0.01

    monkeypatch.setattr(BuildManager, "_on_message", busy)
    build = _start(manager, simulation={"step_s": 0.01})
    assert build.done.wait(HANG_S)
    status = describe(build)
    assert exited == [True]  # the case itself
    assert (status["state"], build.exit_code, status["cancel_source"]) == ("completed", 0, None)


def test_a_grace_shorter_than_the_readers_shortest_wait_does_not_spin_it() -> None:
    from types import SimpleNamespace

    from inferd.engine_build.reader_deadlines import MIN_WAKE_S, BuildDeadlines

    silent = SimpleNamespace(
        cancel_requested_mono=None,
        started_mono=time.monotonic(),
        deadline_s=3600.0,
        escalated=False,
    )
    deadlines = BuildDeadlines(silent, 0.001, lambda _build: None)  # type: ignore[arg-type]
    assert deadlines.wait_s() == MIN_WAKE_S
    silent.cancel_requested_mono = time.monotonic()  # a cancel: its grace is due at once
    assert deadlines.wait_s() <= 0.001


def test_what_an_exited_child_left_holding_its_stdout_is_killed_a_grace_after_its_deadline() -> (
    None
):
    """The child exits by its deadline but a process it started keeps its stdout:
    no EOF would come, and with the deadline's cancel skipped for an exited child
    (it ends as its own), the build would read forever (review of entry 299)."""
    from types import SimpleNamespace

    from inferd.engine_build.reader_deadlines import BuildDeadlines

    started = (
        "import subprocess, sys; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", started], stdout=subprocess.PIPE, start_new_session=True
    )
    assert process.stdout is not None
    build = SimpleNamespace(
        process=process,
        started_mono=time.monotonic(),
        deadline_s=0.3,
        cancel_requested_mono=None,
        escalated=False,
        exit_code=None,
        lock=threading.Lock(),
        build_id="b-left",
    )
    cancelled: list[object] = []
    deadlines = BuildDeadlines(build, 0.2, cancelled.append)  # type: ignore[arg-type]
    try:
        while True:  # supervisor._follow's loop
            assert time.monotonic() - build.started_mono < HANG_S, "no EOF: read forever"
            deadlines.act()
            readable = child_process.readable(process, deadlines.wait_s())
            if readable and not os.read(process.stdout.fileno(), 65536):
                break
        took = time.monotonic() - build.started_mono
        assert cancelled == [] and build.escalated is False  # its end is its own
        assert took >= 0.3 + 0.2  # the deadline, then a grace for the pipe to close
    finally:
        child_process.kill(process)
        process.wait()
