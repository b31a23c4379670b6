"""A stopped daemon leaves no ipc:// socket file (DESIGN.md 271): libzmq left them,
and a client then waited out its whole timeout on a file nobody listened on; with
the file gone, ``inferctl`` says at once that no daemon runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.conftest import DaemonFactory
from tests.integration.test_shm import inferctl

pytestmark = pytest.mark.integration


def test_a_stopped_daemon_leaves_no_socket_file_and_a_client_fails_at_once(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()
    paths = [Path(e.removeprefix("ipc://")) for e in (daemon.infer, daemon.control, daemon.events)]
    assert all(path.exists() for path in paths)
    assert daemon.stop() == 0
    assert [path for path in paths if os.path.lexists(path)] == []
    started = time.monotonic()
    done = inferctl(daemon, "health")  # its --timeout is 10 s
    assert time.monotonic() - started < 5, "inferctl waited out its timeout"
    assert done.returncode == 3 and "is inferd running?" in done.stderr, done.stderr
