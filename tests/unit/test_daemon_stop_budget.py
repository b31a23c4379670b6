"""``Daemon.stop`` ends within the budget it asks systemd for, whatever hangs, and the
recorder's last flush keeps its time (``inferd.stop_budget``, ``inferd.shutdown``).

The daemon is built, not started: each component that waits at the stop is replaced
by one that hangs (a thread, or a wait, on an event the test sets only at its end),
and every step's bound is made small through the table the stop runs on."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from inferd import config as config_module
from inferd.daemon import Daemon
from inferd.serving.scheduler import InHand
from tests.conftest import HANG_S, render_config

#: Each step's bound in the test, but the recorder's flush (``RECORDER_S``).
BOUND_S = 0.05
RECORDER_S = 0.2
#: How long the alerts' close blocks: no time can be given to it, and it overruns its
#: bound by more than the steps before it left unused (the drain's, its own); the
#: steps after it pay (the publisher's join all of its bound, the guard's a part).
ALERTS_CLOSE_S = 0.175
#: What the stop does after the recorder's flush (context, locks, a log line).
AFTER_FLUSH_S = 0.1


class HungThread(threading.Thread):
    """A component's thread that does not end when told to stop; the timeout of
    its join is kept in ``granted``."""

    def __init__(self, name: str, hung: threading.Event, granted: dict[str, float]) -> None:
        super().__init__(target=hung.wait, name=f"test-hung-{name}", daemon=True)
        self.step = f"{name}.join"
        self.granted = granted
        self.hand = InHand()  # as the engine worker's: no job in it

    def stop(self) -> None:
        pass  # told to stop: it does not

    def join(self, timeout: float | None = None) -> None:
        assert timeout is not None, f"{self.step} waits without a bound"
        self.granted.setdefault(self.step, timeout)  # the stop's join, not the test's
        super().join(timeout)


def test_a_stop_where_everything_hangs_ends_within_its_budget_and_the_recorder_flushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every component hangs at the stop, three builds never finish, and the alerts'
    close takes longer than its bound: ``stop()`` still ends within
    ``stop_budget_s()``, the sum of the table's bounds; no step waits longer than
    its bound, the builds together wait one bound (not one each), the steps after
    the overrun get what is left, and the recorder's flush gets its whole bound
    (before: the budget was drain + grace + 30 s, while the joins waited 10 s each,
    20 s for the ZAP handler and guard, and grace + 10 s for each build, one after
    the other: systemd killed the daemon before the recorder's flush)."""
    (tmp_path / "inferd.toml").write_text(
        render_config(tmp_path, [{"name": "demo", "path": str(tmp_path / "never-loaded.onnx")}])
    )
    daemon = Daemon(config_module.load(tmp_path / "inferd.toml"))
    daemon.stop_bounds = dict.fromkeys(daemon.stop_bounds, BOUND_S)
    daemon.stop_bounds["recorder.stop"] = RECORDER_S

    hung = threading.Event()  # set once the stop is over: every wait on it ends
    granted: dict[str, float] = {}  # what each step that waits was given, in order
    threads = {name: HungThread(name, hung, granted) for name in ("worker", "bus", "publisher")}
    for name, thread in threads.items():
        thread.start()
        setattr(daemon, name, thread)

    def hangs(step: str) -> Any:
        """A stop that waits all the time it is given (its last argument)."""

        def stop(*args: Any) -> None:
            granted[step] = args[-1]
            hung.wait(args[-1])

        return stop

    for step in ("switcher.stop", "failover.stop", "shm.stop", "thermal.stop"):
        component, method = step.split(".")
        monkeypatch.setattr(getattr(daemon, component), method, hangs(step))
    monkeypatch.setattr(daemon.metrics, "stop", hangs("metrics.stop"))
    monkeypatch.setattr(daemon.security, "stop", hangs("security.stop"))
    monkeypatch.setattr(daemon.alerts, "close", lambda: hung.wait(ALERTS_CLOSE_S))
    recorder = SimpleNamespace(
        record=lambda *_args: None, stop=hangs("recorder.stop"), durable_seq=None
    )
    daemon.recorder = recorder  # type: ignore[assignment]
    builds = [
        SimpleNamespace(build_id=f"b{n}", state="running", done=threading.Event()) for n in range(3)
    ]
    monkeypatch.setattr(daemon.builds, "_builds", {build.build_id: build for build in builds})
    monkeypatch.setattr(daemon.builds, "_request_cancel", lambda *_args: True)  # killed later
    shutdown = daemon.builds.shutdown
    took: dict[str, float] = {}

    def timed_shutdown(*args: Any) -> None:
        started = time.monotonic()
        shutdown(*args)
        took["builds.shutdown"] = time.monotonic() - started

    monkeypatch.setattr(daemon.builds, "shutdown", timed_shutdown)

    budget_s = sum(daemon.stop_bounds.values())
    stopping = threading.Thread(target=daemon.stop, name="test-stop", daemon=True)
    try:
        with structlog.testing.capture_logs() as logs:
            started = time.monotonic()
            stopping.start()
            stopping.join(budget_s + AFTER_FLUSH_S)
            elapsed = time.monotonic() - started
            assert not stopping.is_alive(), f"stop() still runs {elapsed:.2f} s in"
    finally:
        hung.set()
        for build in builds:
            build.done.set()
        stopping.join(HANG_S)
        for thread in threads.values():
            thread.join(HANG_S)
        daemon._context.destroy(linger=0)  # not terminated: its threads were alive

    assert daemon.stop_budget_s() == pytest.approx(budget_s)
    assert elapsed <= budget_s + AFTER_FLUSH_S
    assert [line["step"] for line in logs if line["event"] == "daemon_stop_step_failed"] == []
    assert took["builds.shutdown"] <= BOUND_S + 0.03  # three builds, one bound
    # Every step that waits, in the stop's order, given at most its bound.
    assert list(granted) == [
        step
        for step in daemon.stop_bounds
        if step not in ("builds.shutdown", "scheduler.drain", "alerts.close")
    ]
    assert {step for step, wait_s in granted.items() if wait_s > BOUND_S} == {"recorder.stop"}
    # The alerts' overrun was taken from the steps after it, not from the recorder.
    assert granted["publisher.join"] < BOUND_S and granted["security.stop"] < BOUND_S
    # What the steps before could not absorb comes out of the recorder's time: the
    # deadline is hard.  Unloaded that is nothing (0.2 s given); under a loaded CI
    # run the threads' wake-ups overran by a few ms each (0.174 s seen).  Had the
    # steps after the alerts not paid, the recorder would have paid the alerts'
    # overrun (ALERTS_CLOSE_S - BOUND_S = 0.125 s) itself: 0.075 s left.
    assert RECORDER_S / 2 < granted["recorder.stop"] <= RECORDER_S
    assert "threads_did_not_stop" in [line["event"] for line in logs]
