"""A build whose builder thread cannot start (the process's thread limit, DESIGN.md
166): ``run_build`` raises, and what it started before is stopped.  Before, the
stall watchdog (``--stall-after``) went on polling the abandoned build, and the
``--timeout`` timer stayed armed, in a process that goes on after the error (the
self-test's build checks, which run in process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.engine_build import BuildRequest, run_build
from inferd.engine_build import session as session_module
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.progress import StallWatchdog
from inferd.engine_build.simulated import SimulatedBuilder
from inferd.types import BuildConfig
from tests.conftest import HANG_S
from tests.thread_limit import REFUSAL, refuse_start
from tests.unit.engine_build.conftest import HOST


def test_a_builder_thread_that_cannot_start_leaves_no_watchdog_or_timer(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    watchdogs: list[StallWatchdog] = []

    class Watched(StallWatchdog):
        def start(self) -> StallWatchdog:
            watchdogs.append(self)
            return super().start()

    monkeypatch.setattr(session_module, "StallWatchdog", Watched)
    request = BuildRequest(
        demo_model,
        tmp_path / "demo.engine",
        BuildConfig(),
        HOST,
        stall_after_s=60.0,
        timeout_s=60.0,
    )
    builder = SimulatedBuilder(demo_model, request.build_config, HOST)
    token = CancellationToken()
    refuse_start(monkeypatch, "inferd-build-b1")
    with pytest.raises(RuntimeError, match=REFUSAL):
        run_build(request, builder, token=token, build_id="b1")
    monkeypatch.undo()
    (watchdog,) = watchdogs
    assert watchdog._stop.is_set()  # it polled on
    watchdog._thread.join(HANG_S)
    assert not watchdog._thread.is_alive()
    assert token._timer is not None and token._timer.finished.is_set()  # still armed
    assert not token.is_set()
