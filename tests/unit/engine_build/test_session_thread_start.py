"""A build whose builder thread cannot start (the process's thread limit, DESIGN.md
166): ``run_build`` raises, and what it started before is stopped.  Before, the
stall watchdog (``--stall-after``) went on polling the abandoned build, and the
``--timeout`` timer stayed armed, in a process that goes on after the error (the
self-test's build checks, which run in process)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from inferd.engine_build import BuildRequest, run_build
from inferd.engine_build import session as session_module
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.progress import StallWatchdog
from inferd.engine_build.simulated import SimSettings, SimulatedBuilder
from inferd.types import BuildConfig
from tests.conftest import HANG_S
from tests.thread_limit import REFUSAL, refuse_start
from tests.unit.engine_build.conftest import HOST


def test_a_builder_thread_that_cannot_start_leaves_no_watchdog(
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
    assert not token.is_set()


def test_a_timeout_needs_no_thread_of_its_own(tmp_path: Path, demo_model: Path) -> None:
    """The ``--timeout`` is kept by ``run_build``'s own loop: with every thread
    start but the builder's refused (the thread limit reached after it), the build
    is still cancelled by its deadline, from the caller's thread.  Before, the
    timer's start raised and the build was refused (DESIGN.md 310)."""
    request = BuildRequest(
        demo_model, tmp_path / "demo.engine", BuildConfig(), HOST, timeout_s=0.05
    )
    builder = SimulatedBuilder(
        demo_model, request.build_config, HOST, settings=SimSettings(step_s=0.02)
    )
    token = CancellationToken()
    real_start = threading.Thread.start

    def only_the_builder(thread: threading.Thread) -> None:
        if thread.name != "inferd-build-b2":
            raise RuntimeError(REFUSAL)
        real_start(thread)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(threading.Thread, "start", only_the_builder)
        report = run_build(request, builder, token=token, build_id="b2")
    assert report.summary["outcome"] == "cancelled"
    assert token.request is not None
    assert (token.request.source, token.request.reason) == ("timeout", "timeout 0.05s")
    assert token.request.thread == threading.current_thread().name
