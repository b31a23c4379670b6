"""``inferd run`` with something planted at ``<runtime_dir>/inferd.lock``: a refused,
named start, exit 2 (``RestartPreventExitStatus=2``: a restart meets the same file),
as for an unsafe directory, not exit 1 and a restart loop.  ``main`` runs in this
process with the real ``Daemon``, whose first start step takes the lock (0.3 s)."""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

import inferd.supervision.logging
from inferd.cli.main import main
from tests.conftest import render_config


@pytest.fixture
def notify(short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """systemd's end of ``$NOTIFY_SOCKET``; ``main``'s process-wide settings (the
    signal handlers, the fault handler, structlog) left as the test found them."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(short_tmp_path / "notify.sock"))
    sock.setblocking(False)  # all is sent before main() returns
    monkeypatch.setenv("NOTIFY_SOCKET", str(short_tmp_path / "notify.sock"))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.setattr(faulthandler, "enable", lambda **_: None)
    monkeypatch.setattr(inferd.supervision.logging, "configure_logging", lambda *_: "console")
    numbers = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    handlers = {number: signal.getsignal(number) for number in numbers}
    try:
        yield sock
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        sock.close()


def test_a_fifo_planted_as_the_lock_file_is_a_named_start_refused_with_exit_2(
    tmp_path: Path, notify: socket.socket, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: ``cannot start: [Errno 22] Invalid argument`` (the FIFO's truncation),
    naming no file, exit 1, and systemd restarted it into the same FIFO."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.mkfifo(run / "inferd.lock")
    config = tmp_path / "inferd.toml"
    config.write_text(render_config(tmp_path, [{"name": "m", "path": str(tmp_path / "m.onnx")}]))
    with capture_logs() as logs:
        code = main(["run", "--config", str(config)])
    assert code == 2
    said = f"cannot start: {run / 'inferd.lock'} is a FIFO, not a regular file: "
    assert f"inferd: {said}" in capsys.readouterr().err
    [status] = notify.recv(65536).decode().rstrip("\n").split("\n")  # no ERRNO=: no OS error
    assert status.startswith(f"STATUS={said}")
    failed = [entry for entry in logs if entry["event"] == "daemon_start_failed"]
    assert [(entry["step"], entry["exc_info"]) for entry in failed] == [("instance_lock", False)]
    assert failed[0]["error"].startswith("UnsafeLockFileError: ")
