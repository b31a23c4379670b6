"""The background rebuild at shutdown: a build that completes once the daemon
stops is not adopted (``FallbackRebuilder.stop``)."""

from __future__ import annotations

from typing import Any

import structlog

from inferd.serving.rebuild import FallbackRebuilder
from inferd.types import Alert
from tests.unit.serving.test_execution_failover import Finished


def test_a_build_that_completes_once_the_daemon_stops_is_not_adopted() -> None:
    """SIGTERM as a background build completes (too late for its cancel): the
    engine is not loaded while the daemon stops, on the build's reader thread that
    ``RuntimeSwitcher.stop`` waits for only 10 s (a TensorRT load still running at
    exit can crash the process), and no ERROR alert says the build gave up; the
    engine is trusted and in the engine dir, so the next start loads it.  Before:
    the switch was started, or refused and reported as ``engine_build_gave_up``."""
    switched: list[tuple[str, str, str]] = []
    alerts: list[Alert] = []

    def switch(model: str, label: str, requested_by: str) -> dict[str, Any]:
        switched.append((model, label, requested_by))
        return {}

    rebuilder = FallbackRebuilder(
        start_build=lambda _request: {"build_id": "b1"},
        switch=switch,
        alert=alerts.append,
        can_build=lambda: True,
        backoff_s=0.0,
        max_attempts=2,
    )
    rebuilder.on_fallback("demo", "engine missing")
    rebuilder.stop()
    with structlog.testing.capture_logs() as logs:
        rebuilder.on_build_finished(Finished("b1"))
    assert switched == []
    assert alerts == []
    (line,) = [line for line in logs if line["event"] == "engine_rebuild_not_adopted"]
    assert line["model"] == "demo" and line["build_id"] == "b1"
    assert rebuilder.describe()["demo"]["adopted"] is False
