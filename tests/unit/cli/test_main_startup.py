"""``inferd run``'s start-up loop: while the engine worker loads a model it declared
(``max_load_s``), the start timeout is extended to that bound and ``STATUS=`` says
what start-up waits for, over the real sd_notify datagram protocol."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from inferd.cli.main import _start_up
from inferd.supervision.notify import Notifier
from inferd.supervision.watchdog import STARTUP_GRACE_S
from inferd.types import DeclaredOperation, Liveness

LOAD = "loading det (tensorrt)"


class StartingDaemon:
    """The part of ``Daemon`` the start-up loop reads: one model loading for a while."""

    def __init__(self, allowed_s: float) -> None:
        self.config = SimpleNamespace(daemon=SimpleNamespace(startup_extend_s=300.0))
        self.busy = DeclaredOperation(LOAD, time.monotonic_ns(), allowed_s)
        self.checks = 0
        self.failed: str | None = None

    def startup_progress(self) -> tuple[object, ...]:
        return ("det=loading", self.busy.started_ns if self.busy else None)

    def liveness(self) -> dict[str, Liveness]:
        return {"engine_worker": Liveness(time.monotonic_ns(), self.busy)}

    def status_line(self) -> str:
        return "starting 0/1: det=loading" if self.busy else "starting 1/1: det=tensorrt"

    def wait_ready(self, timeout: float) -> bool:
        self.checks += 1
        if self.checks == 3:
            self.busy = None  # the load finished
        return self.checks > 3


def test_a_declared_load_extends_start_up_to_its_bound(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = str(tmp_path / "notify.sock")
    sock.bind(address)
    try:
        daemon = StartingDaemon(allowed_s=900.0)
        _start_up(daemon, Notifier(address), None, threading.Event(), [])  # type: ignore[arg-type]
        sock.setblocking(False)
        lines: list[str] = []
        while True:
            try:
                lines += sock.recv(65536).decode().split("\n")
            except BlockingIOError:
                break
    finally:
        sock.close()
    extends = [int(line.split("=")[1]) for line in lines if line.startswith("EXTEND_TIMEOUT_USEC=")]
    # Once when the declared load was seen (its bound, not startup_extend_s), once after.
    assert len(extends) == 2
    assert (900 + STARTUP_GRACE_S - 1) * 1e6 < extends[0] <= (900 + STARTUP_GRACE_S) * 1e6
    assert extends[1] == 300 * 1_000_000
    assert f"STATUS=starting 0/1: det=loading | waiting: engine_worker {LOAD} 0 s of 900 s" in lines
