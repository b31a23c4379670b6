"""Third review of the self-test, finding F1: a real ``inferd selftest`` (its
``daemon.onnx_serving`` check, through ``cli.selftest.run``) signalled while its
``inferd run`` child starts, in its own session as under ssh, ``timeout`` or a CI
job.  Before: a hangup or a SIGTERM ended the self-test where it stood and the
daemon (which ignores SIGHUP) went on under init with its sockets; a Ctrl-C
during the wait for readiness removed the work directory under the running
daemon.  Now the daemon is gone first, the temporary directory removed (a
``--work-dir`` kept), and the exit status says the signal; a SIGKILLed
self-test takes its daemon with it (``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from inferd.selftest.daemon_process import STOP_TIMEOUT_S
from tests.conftest import HANG_S, REPO, wait_until

pytestmark = pytest.mark.integration

#: The self-test with its daemon check only.  Its signals as a terminal's job has
#: them, whatever this test process inherited (a background job ignores SIGINT).
SELFTEST = """
import signal, sys
from pathlib import Path
for number in (signal.SIGHUP, signal.SIGTERM):
    signal.signal(number, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
from inferd.cli import selftest
from inferd.selftest.daemon_checks import DAEMON_CPU_CHECKS
work_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else None
sys.exit(selftest.run(checks=DAEMON_CPU_CHECKS, work_dir=work_dir))
"""
#: Bounds the daemon's stop after the signal (SIGTERM, then a kill), with room.
GONE_WITHIN_S = STOP_TIMEOUT_S + HANG_S
SIGHUP_BIT = 1 << (signal.SIGHUP - 1)


@dataclass(frozen=True)
class Process:
    pid: int
    #: Field 22 of ``/proc/PID/stat``: the pid's reuse is no survival.
    started: str

    @classmethod
    def of(cls, pid: int) -> Process:
        return cls(pid, _stat(pid)[19])

    def alive(self) -> bool:
        """Running (a zombie nobody reaps has ended)."""
        try:
            fields = _stat(self.pid)
        except FileNotFoundError:
            return False
        return fields[0] != "Z" and fields[19] == self.started

    def ignores_sighup(self) -> bool:
        """``inferd run``'s ``main`` has made SIGHUP ignored: the daemon's own code runs."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & SIGHUP_BIT)
        return False

    def config(self) -> Path:
        argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        return Path(os.fsdecode(argv[argv.index(b"--config") + 1]))


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command's name (state first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def daemon_child(parent: int) -> Process | None:
    """The self-test's ``inferd run`` child, once its daemon code runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat(int(entry.name))[1]) != parent:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"run" in argv and b"--config" in argv:
                child = Process.of(int(entry.name))
                return child if child.ignores_sighup() else None
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return None


@contextlib.contextmanager
def selftest(tmp: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], Process]]:
    """A self-test in its own session, writing its temporary directory under
    ``tmp``, and its daemon child once that runs; both killed afterwards if left."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    process = subprocess.Popen(
        [sys.executable, "-c", SELFTEST, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    child: Process | None = None
    try:
        found = wait_until(lambda: daemon_child(process.pid), message="the daemon child")
        assert found is not None  # wait_until returns a truthy value or fails
        child = found
        yield process, found
    finally:  # what a failed test left: the self-test, and a daemon that outlived it
        if process.returncode is None:
            process.kill()
            process.communicate(timeout=HANG_S)
        if child is not None and child.alive():
            os.kill(child.pid, signal.SIGKILL)


def finished(process: subprocess.Popen[str]) -> tuple[int, str]:
    output, _ = process.communicate(timeout=GONE_WITHIN_S)
    return process.returncode, output


def test_a_hangup_of_the_terminal_stops_the_daemon_and_removes_the_work_dir(
    short_tmp_path: Path,
) -> None:
    with selftest(short_tmp_path) as (process, child):
        work_dir = child.config().parent.parent
        assert work_dir.parent == short_tmp_path and work_dir.name.startswith("ifd-st-")
        os.killpg(process.pid, signal.SIGHUP)  # the foreground job: self-test and daemon
        code, output = finished(process)
        assert not child.alive()
    assert code == 128 + signal.SIGHUP, output
    assert output.endswith("inferd selftest: stopped by SIGHUP\n"), output
    assert not work_dir.exists()


def test_sigterm_to_the_self_test_alone_stops_the_daemon_and_keeps_a_work_dir(
    short_tmp_path: Path,
) -> None:
    work_dir = short_tmp_path / "work"
    with selftest(short_tmp_path, str(work_dir)) as (process, child):
        assert child.config() == work_dir / "daemon-onnx" / "inferd.toml"
        process.send_signal(signal.SIGTERM)  # timeout(1), systemd-run, a cancelled job
        code, output = finished(process)
        assert not child.alive()
    assert code == 128 + signal.SIGTERM, output
    assert (work_dir / "daemon-onnx" / "inferd.log").is_file()  # --work-dir: kept


def test_ctrl_c_while_the_daemon_starts_stops_it_before_its_directory_goes(
    short_tmp_path: Path,
) -> None:
    with selftest(short_tmp_path) as (process, child):
        work_dir = child.config().parent.parent
        process.send_signal(signal.SIGINT)
        code, output = finished(process)
        assert not child.alive()
    assert code != 0, output
    assert "KeyboardInterrupt" in output
    assert not work_dir.exists()


def test_a_killed_self_test_takes_its_daemon_with_it(short_tmp_path: Path) -> None:
    with selftest(short_tmp_path) as (process, child):
        process.kill()  # nothing of the self-test runs: the kernel sends the daemon SIGTERM
        process.wait(timeout=HANG_S)
        wait_until(lambda: not child.alive(), GONE_WITHIN_S, message="the daemon's end")
