"""The build child runs the spec of a daemon older than the build nonce (DESIGN.md
216): the child is started from the package on disk, so a daemon still running
the release before it, once the package is upgraded under it, sends a spec with
no ``nonce``.  That daemon never reads one; its builds must still run."""

from __future__ import annotations

import os
from pathlib import Path

from inferd.engine_build import child_process
from inferd.engine_build.pipe import (
    ChildMessage,
    ErrorMessage,
    ReportMessage,
    child_message_decoder,
)
from tests.conftest import HANG_S
from tests.unit.engine_build.conftest import simulated_spec


def test_a_spec_without_a_nonce_builds_and_its_summary_has_none(
    tmp_path: Path, demo_model: Path
) -> None:
    spec = simulated_spec(tmp_path, demo_model, step_s=0)  # BuildManager.start's, no nonce
    process = child_process.spawn(spec)
    decoder = child_message_decoder()
    messages: list[ChildMessage] = []
    try:
        assert process.stdout is not None
        while True:  # to the end of its stream (stdin stays open: no cancel)
            assert child_process.readable(process, HANG_S), "the child hangs"
            chunk = os.read(process.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            messages += decoder.feed(chunk)
        exit_code = process.wait(timeout=HANG_S)
    finally:
        child_process.reap(process)  # killed only if the test failed before it exited
        child_process.close_pipes(process)
    assert not [m.error for m in messages if isinstance(m, ErrorMessage)]
    [report] = [m for m in messages if isinstance(m, ReportMessage)]
    assert report.summary["outcome"] == "completed"
    assert report.summary["buildId"] == "b1-c0ffee" and report.summary["buildNonce"] is None
    assert exit_code == 0
