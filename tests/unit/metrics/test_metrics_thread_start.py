"""The exporter's thread that cannot start (the process's thread limit, DESIGN.md
166): ``start`` raises, and the stop the daemon runs next closes the HTTP
listener.  Before, the stop joined the thread that never started and raised
(a spurious ``daemon_stop_step_failed``) before ``server_close``: the port
stayed bound until the exporter was collected."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import pytest

from inferd.config import MetricsConfig
from inferd.metrics import MetricsExporter
from inferd.metrics.exporter import THREAD_NAME
from tests.conftest import HANG_S
from tests.thread_limit import REFUSAL, refuse_start


class _NoDaemon:
    """A source nothing here reads: the exporter's thread never runs."""

    slots: Mapping[str, Any] = {}

    def status(self, _header: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("nothing here collects the metrics")


def test_a_thread_that_cannot_start_leaves_no_listener_after_the_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = MetricsExporter(MetricsConfig(listen="127.0.0.1:0"), _NoDaemon())
    refuse_start(monkeypatch, THREAD_NAME)
    with pytest.raises(RuntimeError, match=REFUSAL):
        exporter.start()
    monkeypatch.undo()
    host, port = exporter.describe()["listen"].rsplit(":", 1)
    assert exporter.describe()["running"] is False
    exporter.stop(HANG_S)  # raised: cannot join thread before it is started
    with pytest.raises(ConnectionRefusedError):  # the port was still bound
        socket.create_connection((host, int(port)), timeout=HANG_S).close()
