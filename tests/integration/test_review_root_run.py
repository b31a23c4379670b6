"""``inferd run``'s main loop ending on an exception (a bug in the daemon's
periodic work) still stops the daemon in order: the FDR gets its ``stop`` record
and the process exits in failure, with the traceback.

The bug is injected: a ``sitecustomize`` on the daemon's ``PYTHONPATH`` makes
``Daemon.housekeeping`` raise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import HANG_S, DaemonFactory

pytestmark = pytest.mark.integration

BROKEN_HOUSEKEEPING = """
from inferd import daemon

def _broken(self):
    raise RuntimeError("injected by the test: a bug in the main loop")

daemon.Daemon.housekeeping = _broken
"""


def test_an_exception_in_the_main_loop_still_stops_the_daemon(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """Before: the exception left ``_run`` without ``Daemon.stop``, so nothing was
    drained or answered, the recorder's queue was lost with the process (no ``stop``
    record) and the threads were cut off wherever they were."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BROKEN_HOUSEKEEPING)
    python_path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    daemon = daemon_factory(env={"PYTHONPATH": python_path})
    assert daemon.process.wait(timeout=HANG_S) == 1
    log = daemon.log()
    assert "injected by the test: a bug in the main loop" in log and "Traceback" in log
    assert "daemon_stopped" in log
    events = [record.payload["event"] for record in daemon.fdr_records("daemon_lifecycle")]
    assert events == ["start", "ready", "stop"]
