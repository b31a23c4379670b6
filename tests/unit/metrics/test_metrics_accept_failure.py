"""An ``accept`` on the metrics endpoint that fails (``EMFILE``: the daemon's
descriptors all taken) is not retried in a loop.

``socketserver`` swallows the ``OSError`` and returns; the connection stays
queued and the listener readable, so ``inferd-metrics`` called ``accept`` again
at once, a core busy (and the GIL contended beside the engine worker) for as
long as the descriptors were short: the same bug as ``shm.sock``'s (DESIGN.md
200).  It now leaves the listener alone for ``ACCEPT_PAUSE_S``, logs
``metrics_accept_failed``, and serves the connection once descriptors are free.
The thread's own CPU time, from ``/proc``, says whether it spun."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from structlog.testing import capture_logs

from inferd.config import MetricsConfig
from inferd.metrics import MetricsExporter
from inferd.metrics.exporter import THREAD_NAME
from tests.conftest import HANG_S
from tests.unit.shm.test_shm_review4_bounds import descriptors_exhausted


class _NoDaemon:
    """A source no request here reads: only ``GET /other`` (404) is sent."""

    slots: Mapping[str, Any] = {}

    def status(self, _header: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("nothing here collects the metrics")


def _cpu_s(stat: int) -> float:
    """The CPU time (user and system) of the thread whose ``/proc`` stat file
    ``stat`` is open (read again from its start: no descriptor needed)."""
    fields = os.pread(stat, 4096, 0).decode().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_failed_accept_pauses_the_listener_and_the_connection_is_served_later() -> None:
    exporter = MetricsExporter(MetricsConfig(listen="127.0.0.1:0"), _NoDaemon())
    exporter.start()
    try:
        thread = next(t for t in threading.enumerate() if t.name == THREAD_NAME)
        assert thread.native_id is not None
        host, port = exporter.describe()["listen"].rsplit(":", 1)
        # Opened before the descriptors run out.
        stat = os.open(f"/proc/self/task/{thread.native_id}/stat", os.O_RDONLY | os.O_CLOEXEC)
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.settimeout(HANG_S)
        with capture_logs() as logs:
            with descriptors_exhausted():
                before = _cpu_s(stat)
                client.connect((host, int(port)))  # queued in the backlog: accept fails
                time.sleep(0.5)  # a window to measure the thread's CPU in, not a wait for one
                spent = _cpu_s(stat) - before
            assert spent < 0.1, f"inferd-metrics used {spent:.2f} s of CPU in 0.5 s"
            failed = [line for line in logs if line["event"] == "metrics_accept_failed"]
            assert 1 <= len(failed) <= 2, failed  # once per pause
        client.sendall(b"GET /other HTTP/1.0\r\n\r\n")  # served once descriptors are free
        assert client.recv(64).startswith(b"HTTP/1.0 404")
        client.close()
        os.close(stat)
        assert exporter.describe()["requests"] == {"not_found": 1}
    finally:
        exporter.stop()
