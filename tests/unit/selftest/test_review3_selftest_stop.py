"""Third review of the self-test, finding F1: nothing the self-test starts outlives
it.  ``start_daemon`` stops its daemon when the wait for readiness is cut short;
``DaemonRun.stop`` kills it when its own wait is; ``cli.selftest.run`` turns
SIGTERM and SIGHUP into an exception that runs the checks' ``finally`` before the
runner removes the work directory, then puts the handlers back; ``daemon_child``
makes the daemon die with the self-test's thread (``PR_SET_PDEATHSIG``).
The whole self-test under real signals: ``tests/integration/test_review3_selftest_signals.py``."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from inferd.cli import selftest as selftest_cli
from inferd.engine_build.acceptance.scenario import Scenario
from inferd.python_module import python_module
from inferd.selftest import daemon_child, daemon_process
from inferd.selftest.check import Check
from inferd.selftest.context import SelftestContext
from tests.conftest import HANG_S, wait_until


def gone(pid: int) -> bool:
    """The process ended: no such pid, or a zombie nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def kill_if_running(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


class Interrupt(BaseException):
    """What a signal handler raises (``KeyboardInterrupt``, ``cli.selftest.Stopped``)."""


# -- start_daemon and DaemonRun.stop ---------------------------------------------------


def pid_in(path: Path) -> int | None:
    text = path.read_text() if path.exists() else ""
    return int(text) if text.endswith("\n") else None


@pytest.fixture
def sleeper(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """``start_daemon`` starts a child that writes its pid and sleeps, in place of
    ``inferd run``, and its readiness probe is interrupted once that child runs
    (``health`` is where the wait spends its time).  The child is killed
    afterwards, whatever the test saw."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import os, time\n"
        f"with open({str(pid_file)!r}, 'w') as f: f.write(f'{{os.getpid()}}\\n')\n"
        "time.sleep(60)\n"
    )

    class InterruptedProbe:
        """``OperatorClient`` as ``start_daemon`` uses it."""

        def __init__(self, _endpoint: str, timeout: float) -> None:
            self.timeout = timeout

        def __enter__(self) -> InterruptedProbe:
            return self

        def __exit__(self, *_exc: object) -> None:
            return None

        def health(self) -> dict[str, Any]:
            wait_until(lambda: pid_in(pid_file), message="the child running")
            raise Interrupt("Ctrl-C while the daemon starts")

    monkeypatch.setattr(
        daemon_process, "daemon_command", lambda _config: [sys.executable, "-c", script]
    )
    monkeypatch.setattr(daemon_process, "OperatorClient", InterruptedProbe)
    yield pid_file
    pid = pid_in(pid_file)
    if pid is not None:
        kill_if_running(pid)


def test_an_interrupted_wait_for_readiness_stops_the_daemon(
    sleeper: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)  # the module daemon_process uses
    directory = tmp_path / "daemon"
    directory.mkdir()
    with pytest.raises(Interrupt):
        daemon_process.start_daemon(directory, "", ready_timeout_s=HANG_S)
    (process,) = started
    assert process.returncode == -signal.SIGTERM  # stopped, and reaped, before the raise
    assert process.pid == pid_in(sleeper) and gone(process.pid)


def test_a_stop_interrupted_while_the_daemon_drains_kills_it() -> None:
    """A second signal while the daemon takes its time to stop (here: forever)."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ignoring', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == b"ignoring\n"
        daemon = daemon_process.DaemonRun(process, Path("/nonexistent"), Path("/nonexistent"))

        def interrupt(_signum: int, _frame: FrameType | None) -> None:
            raise Interrupt("the second Ctrl-C")

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.2)  # lands in stop()'s wait
            with pytest.raises(Interrupt):
                daemon.stop()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert process.returncode == -signal.SIGKILL
    finally:
        process.kill()
        process.wait()


# -- cli.selftest.run under SIGTERM and SIGHUP -----------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_runs_the_checks_finally_before_the_work_dir_goes(
    signum: signal.Signals, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The check stands for a daemon check: its ``finally`` must run (the daemon
    stopped) while its directory is still there, and no later check runs."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # This test's own handler, so that a signal nothing else handles ends no pytest.
    caught: list[int] = []

    def mine(number: int, _frame: FrameType | None) -> None:
        caught.append(number)

    previous = signal.signal(signum, mine)
    seen: dict[str, Any] = {}

    def signalled(context: SelftestContext, sc: Scenario) -> str:
        directory = context.directory("daemon-onnx")
        try:
            os.kill(os.getpid(), signum)
            # The handler runs between two bytecodes of this thread: soon, not at once.
            wait_until(lambda: caught, timeout=HANG_S, message="the signal handled")
        finally:
            seen["directory_in_finally"] = directory.is_dir()
        sc.check("not reached", False)
        return "not reached"

    def later(_context: SelftestContext, _sc: Scenario) -> str:
        seen["later_check"] = True
        return "not reached"

    checks = (Check("signalled", "cpu", "t", signalled), Check("later", "cpu", "t", later))
    err = io.StringIO()
    try:
        code = selftest_cli.run(out=io.StringIO(), err=err, checks=checks)
        handler_after = signal.getsignal(signum)
    finally:
        signal.signal(signum, previous)
    assert code == 128 + signum
    assert caught == [], "the self-test's handler took the signal"
    assert seen == {"directory_in_finally": True}
    assert list(tmp_path.iterdir()) == []  # the temporary work directory removed
    assert err.getvalue() == f"inferd selftest: stopped by {signum.name}\n"
    assert handler_after is mine  # put back


def test_a_signal_ignored_before_the_self_test_stays_ignored(short_tmp_path: Path) -> None:
    """``nohup inferd selftest``: a hangup still ends nothing."""
    seen: list[object] = []

    def check(_context: SelftestContext, sc: Scenario) -> str:
        seen.append(signal.getsignal(signal.SIGHUP))
        sc.check("ran", True)
        return "ran"

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        code = selftest_cli.run(
            out=io.StringIO(),
            err=io.StringIO(),
            work_dir=short_tmp_path / "work",  # its sockets' paths fit
            checks=(Check("c", "cpu", "t", check),),
        )
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert code == 0 and seen == [signal.SIG_IGN]


# -- daemon_child: the daemon dies with the self-test --------------------------------------

#: A middle process (the self-test) starts a child through ``daemon_child.die_with``
#: and prints its pid; the child says when it is set.
MIDDLE = textwrap.dedent(
    """
    import os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
    print(child.pid, flush=True)
    child.wait()
    """
)
CHILD = textwrap.dedent(
    """
    import sys, time
    from inferd.selftest.daemon_child import die_with
    print("set" if die_with(int(sys.argv[1])) else "parent gone", flush=True)
    time.sleep(60)
    """
)


def test_the_daemon_child_gets_sigterm_when_the_self_test_is_killed() -> None:
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE, CHILD], stdout=subprocess.PIPE, text=True
    )
    assert middle.stdout is not None
    child = int(middle.stdout.readline())
    try:
        assert middle.stdout.readline() == "set\n"
        middle.kill()  # SIGKILL: no finally, no handler of the self-test runs
        middle.wait()
        wait_until(lambda: gone(child), message="the child ending with its parent")
    finally:
        kill_if_running(child)
        middle.kill()
        middle.wait()


def test_the_daemon_child_does_not_start_once_the_self_test_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The self-test died between the fork and the ``prctl``: the child is an
    orphan already, and must not start a daemon nobody will stop.  Otherwise it
    runs the CLI as ``python -m inferd.cli run --config FILE``."""
    ran: list[tuple[str, list[str]]] = []

    def run_module(module: str, *, run_name: str, alter_sys: bool) -> None:
        assert (run_name, alter_sys) == ("__main__", True)
        ran.append((module, sys.argv[1:]))

    monkeypatch.setattr(sys, "argv", ["daemon_child.py", "12345", "run", "--config", "x"])
    monkeypatch.setattr(runpy, "run_module", run_module)
    monkeypatch.setattr(daemon_child, "die_with", lambda _parent: False)
    assert daemon_child.main(sys.argv[1:]) == daemon_child.EXIT_PARENT_GONE
    assert ran == []
    monkeypatch.setattr(daemon_child, "die_with", lambda _parent: True)
    daemon_child.main(sys.argv[1:])
    assert ran == [("inferd.cli", ["run", "--config", "x"])]


def test_the_self_test_starts_its_daemon_through_daemon_child(tmp_path: Path) -> None:
    command = daemon_process.daemon_command(tmp_path / "inferd.toml")
    assert command == [
        *python_module("inferd.selftest.daemon_child"),
        str(os.getpid()),
        "run",
        "--config",
        str(tmp_path / "inferd.toml"),
    ]
