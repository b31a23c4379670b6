"""An in-process daemon whose flight data recorder could not start: its ``fdr``
alert hook counts the alerts as failures, never as sent, as ``status.fdr``
says the recorder is off (before: ``hooks.fdr.sent`` 2, ``failures`` 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.fdr.inventory import Inventory
from inferd.types import Alert
from tests.conftest import HANG_S, in_process_daemon


def test_the_fdr_hook_fails_alerts_once_the_recorder_could_not_start(
    short_tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def scan(_directory: Path) -> Inventory:
        raise ValueError("segment 1 is not newer than 1")

    monkeypatch.setattr(Inventory, "scan", staticmethod(scan))
    models: list[dict[str, object]] = [{"name": "demo", "path": str(demo_model)}]
    daemon = in_process_daemon(short_tmp_path, models, alerts={"hooks": ["pub", "fdr"]})
    daemon.start()
    try:
        assert daemon.wait_ready(HANG_S)
        daemon.alerts(Alert("CRITICAL", "engine_worker_died", "example", {"queued": 0}))
        status = daemon.status({})
    finally:
        daemon.stop()
    assert status["fdr"]["enabled"] is False
    hooks = status["alerts"]["hooks"]
    assert hooks["pub"]["sent"] == 2  # fdr_unavailable, then the example
    assert (hooks["fdr"]["sent"], hooks["fdr"]["failures"]) == (0, 2)
    assert hooks["fdr"]["last_error"].startswith(
        "ConnectionError('the flight data recorder is not running: cannot start"
    )
