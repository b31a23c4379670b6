"""``inferd run`` with a stderr whose reader has gone (a log collector that died,
``inferd run 2>&1 | tee`` with tee killed): ``main`` mapped ``BrokenPipeError`` to
exit 0 (meant for ``inferd fdr dump | head``) around ``run`` too, so the failure's
own line turned an invalid config (2), a refused start (1) and an engine worker's
death (1) into exit 0, and the ``STATUS=`` after the line was never sent (review B
of the third round, F2).  Now ``STATUS=`` goes first and the line cannot raise."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from structlog.testing import capture_logs

import inferd.daemon
from inferd.cli.main import main
from inferd.config import Config
from inferd.supervision.logging import CurrentStderrLogger
from tests.conftest import REPO, render_config
from tests.unit.cli.conftest import sent

WORKER_DIED = "the engine worker stopped on RuntimeError: injected"


class BrokenStderr:
    """A stderr whose reader has gone: every write is EPIPE.  Each write notes the
    datagrams systemd had received by then (the order of line and ``STATUS=``)."""

    def __init__(self, notify: socket.socket) -> None:
        self.notify = notify
        self.received: list[str] = []
        self.writes: list[tuple[str, list[str]]] = []

    def write(self, text: str) -> int:
        self.received += sent(self.notify)
        self.writes.append((text, list(self.received)))
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    def flush(self) -> None:
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    def datagrams(self) -> list[str]:
        return self.received + sent(self.notify)


@pytest.fixture
def broken(notify: socket.socket) -> BrokenStderr:
    """A broken ``sys.stderr`` (``run`` sets it) beside systemd's end of
    ``$NOTIFY_SOCKET``; ``main``'s process-wide settings left as found (``notify``)."""
    return BrokenStderr(notify)


def run(broken: BrokenStderr, monkeypatch: pytest.MonkeyPatch, config: Path) -> int:
    """``inferd run`` in process; ``sys.stderr`` broken for the call only (pytest's
    capture sets its own when the test's call begins)."""
    with monkeypatch.context() as patch, capture_logs():
        patch.setattr(sys, "stderr", broken)
        return main(["run", "--config", str(config)])


def write_config(tmp_path: Path) -> Path:
    config = tmp_path / "inferd.toml"
    config.write_text(render_config(tmp_path, [{"name": "m", "path": str(tmp_path / "m.onnx")}]))
    return config


def said_after(stderr: BrokenStderr, prefix: str, status: str) -> None:
    """The line starting with ``prefix`` was tried (and lost) after ``status`` was sent."""
    [(_, before)] = [(text, seen) for text, seen in stderr.writes if text.startswith(prefix)]
    assert status in before


def test_an_invalid_config_exits_2_and_tells_systemd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: BrokenStderr
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\nno_such_key = 1\n")
    lost = CurrentStderrLogger.lines_lost
    code = run(broken, monkeypatch, bad)
    assert code == 2  # was 0
    status = f"STATUS=invalid config {bad}: daemon: unknown key 'no_such_key'"
    assert broken.datagrams() == [status]  # was none
    said_after(broken, f"inferd: invalid config {bad}", status)
    assert CurrentStderrLogger.lines_lost == lost + 1  # the line is counted as lost


class Refused:
    """Stands in for ``Daemon``: its start fails as a taken port does."""

    def __init__(self, config: object) -> None:
        pass

    def start(self, supervision: object = None) -> None:
        raise zmq.ZMQError(errno.EADDRINUSE)


def test_a_refused_start_exits_1_and_tells_systemd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: BrokenStderr
) -> None:
    monkeypatch.setattr(inferd.daemon, "Daemon", Refused)
    code = run(broken, monkeypatch, write_config(tmp_path))
    assert code == 1  # was 0
    status = "STATUS=cannot start: Address already in use"
    assert broken.datagrams() == [status, f"ERRNO={errno.EADDRINUSE}"]
    said_after(broken, "inferd: cannot start: ", status)


class DiesServing:
    """Stands in for ``Daemon``: ready at once; its engine worker dies while it
    serves (``Daemon._worker_died`` sets ``failed``; the main loop reads it)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.failed: str | None = None
        self.stopped = False

    def start(self, supervision: object = None) -> None:
        pass

    def startup_progress(self) -> tuple[object, ...]:
        return ()

    def liveness(self) -> dict[str, object]:
        return {}

    def status_line(self) -> str:
        return "serving 1/1"

    def wait_ready(self, timeout: float | None = None) -> bool:
        return True

    def housekeeping(self) -> None:
        self.failed = WORKER_DIED

    def stop_budget_s(self) -> float:
        return 1.0

    def stop(self, on_stopping: object = None) -> None:
        self.stopped = True


def test_an_engine_worker_death_exits_1_and_tells_systemd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: BrokenStderr
) -> None:
    """Exit 1: ``Restart=on-failure`` brings perception back."""
    monkeypatch.setattr(inferd.daemon, "Daemon", DiesServing)
    code = run(broken, monkeypatch, write_config(tmp_path))
    assert code == 1  # was 0
    status = f"STATUS=failed: {WORKER_DIED}"
    datagrams = broken.datagrams()
    assert datagrams[-1] == status  # was never sent
    assert "READY=1" in datagrams
    said_after(broken, f"inferd: {WORKER_DIED}", status)


def test_a_real_broken_pipe_on_stderr_keeps_exit_2(tmp_path: Path) -> None:
    """The process as systemd or a container runtime sees it: fd 2 is a pipe whose
    read end is closed (EPIPE), nothing patched."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\nno_such_key = 1\n")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = subprocess.run(
            [sys.executable, "-m", "inferd.cli", "run", "--config", str(bad)],
            stdout=subprocess.DEVNULL,
            stderr=write_end,
            cwd=REPO,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert process.returncode == 2  # was 0


def test_a_closed_stderr_keeps_exit_2_and_tells_systemd(tmp_path: Path) -> None:
    """``inferd run 2>&-`` (a supervisor that starts it with fd 2 closed): Python
    sets ``sys.stderr`` to None, and the line said after ``STATUS=`` raised
    ``AttributeError``: exit 1, not 2 (review RE, finding 2).  Now fd 2 is opened
    on /dev/null first thing (``process_start``)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\nno_such_key = 1\n")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.setblocking(False)  # all is sent before the process ends
    environ = {k: v for k, v in os.environ.items() if k != "WATCHDOG_USEC"}
    try:
        process = subprocess.run(
            [sys.executable, "-m", "inferd.cli", "run", "--config", str(bad)],
            stdout=subprocess.PIPE,
            env={**environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")},
            cwd=REPO,
            preexec_fn=lambda: os.close(2),  # after the redirections, before exec
            timeout=60,
        )
        datagrams = sent(notify)
    finally:
        notify.close()
    assert process.returncode == 2  # was 1
    assert datagrams == [f"STATUS=invalid config {bad}: daemon: unknown key 'no_such_key'"]
    assert process.stdout == b""  # the line went to /dev/null, not to another file


def test_a_line_said_with_no_stderr_is_counted_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sys.stderr`` None (fd 2 closed when Python started, in a process that never
    ran ``prepare_process``): the line is lost and counted, never raised."""
    lost = CurrentStderrLogger.lines_lost
    monkeypatch.setattr(sys, "stderr", None)
    CurrentStderrLogger().msg("inferd: nobody hears this")
    assert CurrentStderrLogger.lines_lost == lost + 1
