"""Under strict overcommit a daemon that gives its sockets a group starts and
serves without ``shm.sock``: the socket it did not bind gets no group (DESIGN.md 299)."""

from __future__ import annotations

import grp
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd import config as config_module
from inferd.daemon import Daemon
from inferd.shm import server as server_module
from tests.conftest import HANG_S, render_config

STRICT = "the kernel's overcommit policy is strict (vm.overcommit_memory = 2) [test]"


def test_a_daemon_with_an_infer_group_starts_under_strict_overcommit(
    short_tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "strict_overcommit", lambda _path: STRICT)
    group = grp.getgrgid(os.getegid()).gr_name
    models = [{"name": "demo", "path": str(demo_model)}]
    config = render_config(short_tmp_path, models, security={"infer_group": group})
    (short_tmp_path / "inferd.toml").write_text(config)
    daemon = Daemon(config_module.load(short_tmp_path / "inferd.toml"))
    with capture_logs() as logs:
        try:
            daemon.start()
            assert daemon.wait_ready(HANG_S)
            shm = daemon.status({})["shm"]
        finally:
            daemon.stop()
    assert shm == {"enabled": False, "reason": STRICT}
    events = [entry["event"] for entry in logs]
    assert "shm_refused_strict_overcommit" in events
    assert "ipc_socket_chmod_failed" not in events  # nothing done to a socket not bound
