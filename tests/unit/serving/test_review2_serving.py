"""Second review of the serving core's concurrency and state: what two of a
failover, a background rebuild's adoption and the daemon's stop do to one model
when they meet.  Each test drives the real classes in process and orders the
threads with events, never with sleeps; each failed before its fix."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from inferd.engines.quarantine import QUARANTINE_DIR
from inferd.serving.failover import ALERT_CODE
from inferd.serving.rebuild import FallbackRebuilder
from inferd.serving.switching import RuntimeSwitcher
from inferd.types import Alert
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S, wait_until
from tests.unit.serving.test_execution_failover import (  # noqa: F401  (the fixture)
    STICKY,
    Finished,
    Rig,
    fallback_prepared,
    rig_factory,
    take_the_swap,
)
from tests.unit.serving.test_switching import Rig as SwitchRig
from tests.unit.serving.test_switching import rig  # noqa: F401  (the fixture)

# -- a rebuilt engine being adopted as the daemon stops ---------------------------------


def make_rebuilder(
    alerts: list[Alert],
    *,
    start_build: Callable[[dict[str, Any]], dict[str, Any]] = lambda _request: {"build_id": "b1"},
    switch: Callable[..., dict[str, Any]] = lambda *_args: {},
    switcher: RuntimeSwitcher | None = None,
    backoff_s: float = 0.0,
    max_attempts: int = 3,
) -> FallbackRebuilder:
    """A rebuilder whose builds start as ``start_build`` says, alerting into ``alerts``."""
    return FallbackRebuilder(
        start_build=start_build,
        switch=switch,
        switcher=switcher,
        alert=alerts.append,
        can_build=lambda: True,
        backoff_s=backoff_s,
        max_attempts=max_attempts,
    )


def rebuilder_of(rig: SwitchRig, alerts: list[Alert]) -> FallbackRebuilder:  # noqa: F811
    """The daemon's wiring: the rebuilder adopts through the real switcher."""
    return make_rebuilder(alerts, switch=rig.switcher.switch_now, switcher=rig.switcher)


def test_an_adoption_under_way_when_the_daemon_stops_raises_no_alert(
    rig: SwitchRig,  # noqa: F811
) -> None:
    """The build completed just before SIGTERM, so its adoption (``switch_now``,
    loading the engine on the build's thread) had begun when ``Daemon.stop`` ran:
    ``rebuilder.stop``, the drain closing the scheduler, ``switcher.stop`` giving
    the switch up.  The refusal is the stop's, not the build's: before, it was
    reported as an ERROR alert ``engine_build_gave_up`` ("giving up after 1
    build(s)", to the FDR, subscribers and the ground station) on every such
    shutdown, although the engine is trusted and the next start loads it."""
    alerts: list[Alert] = []
    rebuilder = rebuilder_of(rig, alerts)
    rebuilder.on_fallback("m", "engine missing")
    with structlog.testing.capture_logs() as logs:
        adopting = threading.Thread(target=rebuilder.on_build_finished, args=(Finished("b1", "m"),))
        adopting.start()
        # The adoption claimed the model: past the rebuilder's "stopped?" check.
        wait_until(lambda: "m" in rig.switcher._in_progress, HANG_S, message="adopting")
        rebuilder.stop()  # Daemon.stop's order from here on
        rig.scheduler.close()
        stopping = threading.Thread(target=rig.switcher.stop)
        stopping.start()
        wait_until(lambda: rig.switcher._preparers.stopping, HANG_S, message="stop began")
        rig.prepared.set()  # the engine loaded: too late
        stopping.join(HANG_S)
        adopting.join(HANG_S)
    assert not adopting.is_alive() and not stopping.is_alive()
    assert rig.slot.handle is not None and rig.slot.handle.handle_id == 1  # not switched
    assert rig.new_runtime.handles == [2]  # its engine released
    assert alerts == []
    (line,) = [line for line in logs if line["event"] == "engine_rebuild_not_adopted"]
    assert line["model"] == "m" and line["build_id"] == "b1"
    assert rebuilder.describe()["m"]["retry_scheduled"] is False


def test_a_rebuild_refused_for_another_reason_is_still_retried(
    rig: SwitchRig,  # noqa: F811
) -> None:
    """The fix leaves the rest alone: an adoption refused while the daemon runs
    (here: the model failed meanwhile) is a failed build, retried after the
    backoff, with its WARNING alert.  (A switch or failover in progress is not a
    failed build: ``test_review_rebuild_adoption.py``.)"""
    alerts: list[Alert] = []
    rebuilder = rebuilder_of(rig, alerts)
    rebuilder.on_fallback("m", "engine missing")
    rig.slot.state = "failed"  # what ``ModelSlot.drop`` leaves
    try:
        rebuilder.on_build_finished(Finished("b1", "m"))
    finally:
        rebuilder.stop()
    (raised,) = alerts
    assert (raised.level, raised.code) == ("WARNING", "engine_build_failed")
    assert "is failed; not switched" in raised.message


def test_a_background_build_cancelled_by_the_daemons_stop_raises_no_alert() -> None:
    """``Daemon.stop`` stops the rebuilder, then cancels every build: the background
    build's end as ``cancelled`` is the stop's doing.  Before, it raised a WARNING
    alert ``engine_build_cancelled`` saying an operator stopped it and that it is
    "not retried: start one with build.start", on every shutdown during a rebuild;
    the next start rebuilds it by itself."""
    alerts: list[Alert] = []
    rebuilder = make_rebuilder(alerts)
    rebuilder.on_fallback("demo", "engine missing")
    rebuilder.stop()
    with structlog.testing.capture_logs() as logs:
        rebuilder.on_build_finished(Finished("b1", state="cancelled"))
    assert alerts == []
    (line,) = [line for line in logs if line["event"] == "engine_rebuild_stopped"]
    assert line["model"] == "demo" and line["build_id"] == "b1"


def test_a_retry_that_starts_as_the_daemon_stops_raises_no_alert() -> None:
    """A retry's timer fired just before ``rebuilder.stop``; the build manager had
    stopped accepting builds by the time it asked (``UNAVAILABLE``).  Before: a
    WARNING alert ``engine_build_failed`` ("could not start") at shutdown."""
    alerts: list[Alert] = []
    rebuilder: FallbackRebuilder

    def start_build(_request: dict[str, Any]) -> dict[str, Any]:
        rebuilder.stop()  # Daemon.stop ran between the timer's check and this call
        raise ProtocolError(Code.UNAVAILABLE, "the daemon is shutting down")

    rebuilder = make_rebuilder(alerts, start_build=start_build)
    with structlog.testing.capture_logs() as logs:
        rebuilder.on_fallback("demo", "engine missing")
    assert alerts == []
    assert [line["event"] for line in logs] == ["engine_rebuild_not_started"]


def test_a_failover_that_ends_as_the_daemon_stops_raises_no_build_alert() -> None:
    """A failover finishing during the shutdown drain asks for a rebuild, which the
    stopped rebuilder does not start; before, a model past its
    ``rebuild_max_attempts`` also got an ERROR alert ``engine_build_gave_up``
    ("not rebuilt again") for it, although no build was refused for its attempts."""
    alerts: list[Alert] = []
    rebuilder = make_rebuilder(alerts, max_attempts=1)
    rebuilder.on_fallback("demo", "engine missing")
    rebuilder.on_build_finished(Finished("b1"))  # adopted: the model is on tensorrt
    rebuilder.stop()
    rebuilder.on_fallback("demo", "tensorrt failed while serving")
    assert alerts == []


def test_a_retry_whose_timer_cannot_start_gives_up_and_leaves_nothing_waiting(
    monkeypatch: Any,
) -> None:
    """At the process's thread limit (``RuntimeError: can't start new thread``, the
    case of DESIGN.md 151 and 166) the retry's timer did not start but was kept as
    the model's pending retry, and the error escaped into the build's reader
    (``build_finished_hook_failed``): no alert said the model stays on the
    fallback, and no later fallback of the model (a failover) asked for a build
    again, since one seemed scheduled for the rest of the run."""
    alerts: list[Alert] = []
    started: list[str] = []

    def start_build(_request: dict[str, Any]) -> dict[str, Any]:
        started.append(f"b{len(started) + 1}")
        return {"build_id": started[-1]}

    rebuilder = make_rebuilder(alerts, start_build=start_build, backoff_s=60.0)
    rebuilder.on_fallback("demo", "engine missing")
    start = threading.Thread.start

    def refused(thread: threading.Thread) -> None:
        if isinstance(thread, threading.Timer):
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refused)
    rebuilder.on_build_finished(Finished("b1", state="failed", error="out of memory"))
    monkeypatch.undo()
    (raised,) = alerts
    assert (raised.level, raised.code) == ("ERROR", "engine_build_gave_up")
    assert "could not be scheduled" in raised.message
    assert rebuilder.describe()["demo"]["retry_scheduled"] is False
    rebuilder.on_fallback("demo", "failed over")  # the next fallback builds again
    assert started == ["b1", "b2"]
    rebuilder.stop()


# -- a failover whose engine cannot be moved aside ----------------------------------------


def test_a_failover_whose_quarantine_directory_is_unsafe_is_still_recorded_and_rebuilt(
    rig_factory: Any,  # noqa: F811
    monkeypatch: Any,
) -> None:
    """``engines/quarantine.quarantine`` refuses a quarantine directory that is not
    safely the daemon's own (or cannot be made: a read-only engine dir) with
    ``UnsafeDirectoryError``, an ``InferdError``, not an ``OSError``.  The failover
    caught only ``OSError``: the model had already been swapped onto the fallback,
    but the thread then crashed (``execution_failover_crashed``), so no
    ``fallback_to_onnx_trt_ep`` record, no ``tensorrt_execution_failover`` alert,
    no ``runtime`` event, and no rebuild was asked for: the model stayed on the
    fallback, degraded, for the rest of the run.  The code meant to go on ("the
    engine could not be moved aside (see the log)")."""
    failing: Rig = rig_factory([STICKY], run_failover=True)
    fallback_prepared(failing, monkeypatch)
    assert failing.slot.handle is not None and failing.slot.handle.engine_path is not None
    engine: Path = failing.slot.handle.engine_path
    unsafe = engine.parent / QUARANTINE_DIR
    unsafe.mkdir()
    unsafe.chmod(0o777)  # anyone may write it: nothing is moved there
    with structlog.testing.capture_logs() as logs:
        failing.run()
        take_the_swap(failing)
        wait_until(lambda: failing.switcher.claim("demo"), HANG_S, message="the failover done")
    assert "execution_failover_crashed" not in [line["event"] for line in logs]
    (refused,) = [line for line in logs if line["event"] == "failed_engine_not_quarantined"]
    assert "quarantine directory" in refused["error"]
    assert engine.exists()  # left where it was
    assert failing.slot.state == "serving"
    assert failing.slot.handle is not None and failing.slot.handle.runtime_label == "onnx_trt_ep"
    (record,) = [payload for kind, payload in failing.records if kind == "fallback_to_onnx_trt_ep"]
    assert record["cause"] == "execution" and record["quarantined"] is None
    (raised,) = [alert for alert in failing.alerts if alert.code == ALERT_CODE]
    assert "could not be moved aside" in raised.message
    assert failing.events and failing.events[-1][0] == "runtime"
    assert failing.rebuilds  # the background rebuild was asked for
