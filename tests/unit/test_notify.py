"""sd_notify: the built-in datagram sender (path and abstract sockets), the
Notifier's assignments, and failures that must never reach the daemon."""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd.service.notify import MAX_STATUS_CHARS, Notifier, notify_datagram, one_line


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = str(tmp_path / "notify.sock")
    sock.bind(address)
    sock.settimeout(2)
    yield sock, address
    sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"inferd-test-notify-{os.getpid()}-{id(sock)}"
    sock.bind("\0" + name)
    sock.settimeout(2)
    yield sock, "@" + name
    sock.close()


def _pending(sock: socket.socket) -> list[bytes]:
    sock.settimeout(0.05)
    received = []
    try:
        while True:
            received.append(sock.recv(65536))
    except TimeoutError:
        return received


def test_datagram_to_a_filesystem_socket(path_socket: tuple[socket.socket, str]) -> None:
    sock, address = path_socket
    notify_datagram("READY=1\nSTATUS=serving", address)
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_datagram_to_an_abstract_socket(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, address = abstract_socket
    assert address.startswith("@")
    notify_datagram("WATCHDOG=1", address)
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_unsupported_and_missing_addresses_raise() -> None:
    with pytest.raises(ValueError, match="vsock"):
        notify_datagram("READY=1", "vsock:2:1234")
    with pytest.raises(OSError):
        notify_datagram("READY=1", "/nonexistent/inferd/notify.sock")


def test_notifier_without_notify_socket_does_nothing() -> None:
    notifier = Notifier.from_environment({})
    assert not notifier.enabled
    assert notifier.ready("serving") is False
    assert notifier.watchdog() is False
    assert notifier.sent == 0 and notifier.failures == 0


def test_assignments_in_one_datagram_each(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, address = abstract_socket
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": address})
    assert notifier.enabled and notifier.backend_name == "builtin"
    assert notifier.extend_timeout(2.5)
    assert notifier.ready("serving: demo=onnx_trt_ep")
    assert notifier.watchdog()
    assert notifier.stopping("stopping: demo=onnx_trt_ep", extend_s=32)
    assert notifier.failed("cannot start: bind failed", errno=98)
    assert _pending(sock) == [
        b"EXTEND_TIMEOUT_USEC=2500000",
        b"READY=1\nSTATUS=serving: demo=onnx_trt_ep",
        b"WATCHDOG=1",
        b"STOPPING=1\nSTATUS=stopping: demo=onnx_trt_ep\nEXTEND_TIMEOUT_USEC=32000000",
        b"STATUS=cannot start: bind failed\nERRNO=98",
    ]
    assert notifier.sent == 5


def test_status_is_sent_only_when_it_changes(path_socket: tuple[socket.socket, str]) -> None:
    sock, address = path_socket
    notifier = Notifier(address)
    assert notifier.status("starting 0/1: demo=loading")
    assert not notifier.status("starting 0/1: demo=loading")
    assert notifier.status("starting 0/1: demo=loading", force=True)
    notifier.ready("serving: demo=onnx_trt_ep")
    assert not notifier.status("serving: demo=onnx_trt_ep")  # READY carried it
    assert len(_pending(sock)) == 3


def test_status_is_one_bounded_line() -> None:
    assert one_line("degraded:\n  det=failed\tseg=loading") == "degraded: det=failed seg=loading"
    long = one_line("x" * 1000)
    assert len(long) == MAX_STATUS_CHARS and long.endswith("…")


def test_a_failing_socket_never_raises_and_is_logged_once(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "gone.sock"))
    with capture_logs() as logs:
        for _ in range(5):
            assert notifier.watchdog() is False
    assert notifier.failures == 5
    errors = [entry for entry in logs if entry["event"] == "sd_notify_failed"]
    assert len(errors) == 1 and errors[0]["address"].endswith("gone.sock")


def test_environment_notifier_uses_systemd_python_when_installed(
    path_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, address = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    notifier = Notifier.from_environment()
    installed = importlib.util.find_spec("systemd") is not None
    assert notifier.backend_name == ("systemd-python" if installed else "builtin")
    assert notifier.ready("serving: demo=onnx_trt_ep")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving: demo=onnx_trt_ep"
