"""sd_notify: the built-in datagram sender (path and abstract sockets), the
Notifier's assignments, and failures that must never reach the daemon."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd.supervision.notify import MAX_STATUS_CHARS, Notifier, notify_datagram, one_line
from tests.conftest import REPO

pytestmark = pytest.mark.systemd

SYSTEMD_PYTHON_STAND_IN = REPO / "tests" / "fakes" / "systemd_python"


def systemd_python_importable() -> bool:
    """Probe the module the daemon imports, never the bare name ``systemd``:
    run from the repository root that name finds the unit-file folder
    ``systemd/`` as a namespace package."""
    try:
        importlib.import_module("systemd.daemon")
    except ImportError:
        return False
    return True


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


def test_datagram_to_a_filesystem_socket(receiver: tuple[socket.socket, str]) -> None:
    sock, address = receiver
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
        # The stop's budget (32 s) and STOP_EXIT_MARGIN_S (5 s) for the exit after it.
        b"STOPPING=1\nSTATUS=stopping: demo=onnx_trt_ep\nEXTEND_TIMEOUT_USEC=37000000",
        b"STATUS=cannot start: bind failed\nERRNO=98",
    ]
    assert notifier.sent == 5


def test_status_is_sent_only_when_it_changes(receiver: tuple[socket.socket, str]) -> None:
    sock, address = receiver
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
    receiver: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, address = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    notifier = Notifier.from_environment()
    installed = systemd_python_importable()
    assert notifier.backend_name == ("systemd-python" if installed else "builtin")
    assert notifier.ready("serving: demo=onnx_trt_ep")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving: demo=onnx_trt_ep"


_PRINT_BACKEND = """
import sys
if sys.argv[1] == "blocked":
    sys.modules["systemd"] = None  # the documented way to make an import fail
from inferd.supervision.notify import Notifier
notifier = Notifier.from_environment()
assert notifier.ready("serving"), "nothing was sent"
print(notifier.backend_name)
"""


@pytest.mark.parametrize(
    ("systemd_python", "expected"),
    [("stand-in", "systemd-python"), ("blocked", "builtin")],
)
def test_backend_selection_from_the_repository_root(
    receiver: tuple[socket.socket, str], systemd_python: str, expected: str
) -> None:
    """The daemon started from a checkout (``python -c``/``-m`` puts the working
    directory first on ``sys.path``) must not take the repository's ``systemd/``
    unit folder for systemd-python, with or without the real package."""
    sock, address = receiver
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["NOTIFY_SOCKET"] = address
    if systemd_python == "stand-in":
        env["PYTHONPATH"] = str(SYSTEMD_PYTHON_STAND_IN)
    done = subprocess.run(
        [sys.executable, "-c", _PRINT_BACKEND, systemd_python],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_the_repository_root_shadows_the_bare_name() -> None:
    """Why the probe above imports ``systemd.daemon``: from the repository root
    a bare ``find_spec("systemd")`` finds something even without systemd-python."""
    probe = (
        "import importlib.util, sys; sys.modules.pop('systemd', None);"
        "spec = importlib.util.find_spec('systemd');"
        "print(spec is not None and spec.origin is None)"  # a namespace package
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # With systemd-python installed its regular package wins over the folder.
    assert done.stdout.strip() == ("False" if systemd_python_importable() else "True")
