"""Shared by the ``inferd`` command's tests: a short private directory, systemd's end
of ``$NOTIFY_SOCKET`` for ``main`` run in process, and a child interpreter."""

from __future__ import annotations

import faulthandler
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

import inferd.supervision.logging
from tests.conftest import REPO


@pytest.fixture
def base(short_tmp_path: Path) -> Path:
    """A short private directory (ipc socket paths, ``inferd run``)."""
    return short_tmp_path


def sent(sock: socket.socket) -> list[str]:
    """The lines of every datagram waiting on ``sock`` (non-blocking): what was sent
    to systemd so far."""
    lines: list[str] = []
    while True:
        try:
            lines += sock.recv(65536).decode().split("\n")
        except BlockingIOError:
            return lines


@pytest.fixture
def notify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """systemd's end of ``$NOTIFY_SOCKET``; ``main``'s process-wide settings (the
    signal handlers, the fault handler, structlog) left as the test found them."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.setblocking(False)  # all is sent before main() returns
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.setattr(faulthandler, "enable", lambda **_: None)
    # Logging left unconfigured: capture_logs sees the events.
    monkeypatch.setattr(inferd.supervision.logging, "configure_logging", lambda *_: "console")
    numbers = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    handlers = {number: signal.getsignal(number) for number in numbers}
    try:
        yield sock
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        sock.close()


def python_c(
    script: str,
    *args: str,
    timeout: float = 60,
    check: bool = False,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -c script *args`` in a child interpreter, from the repository, its
    output captured as text; ``timeout`` bounds a hang."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        check=check,
        env=env,
    )
