"""A build that started while the daemon started (an operator's ``build.start``, once
the control socket is bound, or a rebuild the first activation asked for) and a
start-up step after it that fails: the build is cancelled, its child reaped and its
record written before the recorder closes, as a stop does (``Daemon._halt``).

The daemon runs in this process; the build is the simulated builder's child."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from inferd import config as config_module
from inferd.daemon import Daemon
from inferd.fdr.reader import read_records
from inferd.types import Peer
from tests.conftest import HANG_S, render_config

pytestmark = pytest.mark.integration

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)


@pytest.mark.parametrize("step", ["shm.start", "metrics.start"])
def test_a_build_started_during_a_failed_start_is_cancelled_and_its_child_reaped(
    step: str, short_tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the failed start released the sockets and threads but never ended the
    builds: the child (its own process group) went on building after ``inferd run``
    exited 1, its ``inferd-build-*`` thread ran on, and its ``engine_build`` record
    was lost."""
    text = render_config(
        short_tmp_path,
        [{"name": "demo", "path": str(demo_model)}],
        daemon={"build_cancel_grace_s": 5.0},
    )
    (short_tmp_path / "inferd.toml").write_text(text)
    daemon = Daemon(config_module.load(short_tmp_path / "inferd.toml"))
    started: dict[str, Any] = {}
    component, method = step.split(".")

    def build_then_fail(*_args: Any) -> None:
        header = {"model": "demo", "builder": "simulated", "simulation": {"step_s": 0.1}}
        started.update(daemon.builds.start(header, OPERATOR))
        raise RuntimeError(f"injected by the test: {step} failed")

    monkeypatch.setattr(getattr(daemon, component), method, build_then_fail)
    with pytest.raises(RuntimeError, match="injected by the test"):
        daemon.start()
    build = daemon.builds._get(started["build_id"])
    outlived = build.process.poll() is None
    if outlived:  # not left to build on after the test
        build.process.kill()
        build.process.wait(HANG_S)
    assert not outlived, "the build's child outlived the failed start"
    assert build.state == "cancelled" and build.cancel_source == "sigterm"
    assert [t.name for t in threading.enumerate() if t.name.startswith("inferd-build-")] == []
    kept = ("daemon_lifecycle", "engine_build")
    records = list(read_records(short_tmp_path / "state" / "fdr", kinds=kept))
    kinds = [record.kind for record in records]
    assert kinds == ["daemon_lifecycle", "daemon_lifecycle", "engine_build"]
    assert records[1].payload["event"] == "start_failed" and records[1].payload["step"] == step
    assert records[2].payload["build_id"] == started["build_id"]
    assert records[2].payload["outcome"] == "cancelled"
    assert daemon._context.closed
