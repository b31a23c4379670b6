"""The alert dispatcher (``inferd.alerts.dispatcher``): rate limit and dedup,
failure isolation, logging, threads (no daemon, no ZeroMQ)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher, log_method
from inferd.types import Alert, AlertLevel
from tests.conftest import HANG_S
from tests.unit.alerts.conftest import ALL_LEVELS, FailingHook, FakeClock, RecordingHook, alert


def test_first_goes_out_repeats_are_counted_and_reported_after_the_window() -> None:
    clock, hook = FakeClock(), RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=clock)
    dispatcher(alert())
    clock.now += 3
    dispatcher(alert())
    clock.now += 6.75
    dispatcher(alert())
    assert len(hook.calls) == 1
    assert "suppressed" not in hook.calls[0][3]
    clock.now += 0.25  # exactly 10 s after the first: the window has passed
    dispatcher(alert())
    assert len(hook.calls) == 2
    assert hook.calls[1][3] == {"model": "demo", "suppressed": 2}
    clock.now += 1
    dispatcher(alert())  # a new window opened at the second delivery
    assert len(hook.calls) == 2
    status = dispatcher.status()
    assert (status["raised"], status["sent"], status["suppressed"], status["pending"]) == (
        5,
        2,
        3,
        1,
    )


def test_different_models_and_codes_do_not_suppress_each_other() -> None:
    clock, hook = FakeClock(), RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=clock)
    dispatcher(alert(model="front"))
    dispatcher(alert(model="rear"))
    dispatcher(alert(model=None))
    dispatcher(alert(code="other", model="front"))
    dispatcher(alert(model="front"))
    assert [(call[1], call[3].get("model")) for call in hook.calls] == [
        ("test_alert", "front"),
        ("test_alert", "rear"),
        ("test_alert", None),
        ("other", "front"),
    ]


def test_zero_rate_limit_sends_everything() -> None:
    hook = RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=0.0, clock=FakeClock())
    for _ in range(5):
        dispatcher(alert())
    assert len(hook.calls) == 5
    assert all("suppressed" not in call[3] for call in hook.calls)


def test_flush_reports_a_burst_that_stopped_only_after_its_window() -> None:
    clock, hook = FakeClock(), RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=clock)
    dispatcher(alert())
    dispatcher(alert())
    dispatcher(alert())
    clock.now += 5
    assert dispatcher.flush() == 0
    clock.now += 5
    assert dispatcher.flush() == 1
    assert hook.calls[-1][3] == {"model": "demo", "suppressed": 1}
    assert dispatcher.flush() == 0
    status = dispatcher.status()
    assert status["raised"] == status["sent"] + status["suppressed"] == 3


def test_close_flushes_pending_repeats_closes_hooks_and_drops_later_alerts() -> None:
    clock, hook, failing = FakeClock(), RecordingHook(), FailingHook("failing")
    dispatcher = AlertDispatcher([hook, failing], rate_limit_s=10.0, clock=clock)
    dispatcher(alert())
    dispatcher(alert())
    dispatcher.close()  # a hook whose close() raises does not stop the others
    assert hook.closed and failing.closed
    assert len(hook.calls) == 2
    with capture_logs() as logs:
        dispatcher(alert(model="late"))
    assert len(hook.calls) == 2
    assert logs[-1]["delivered"] is False
    status = dispatcher.status()
    assert status["closed"] and status["dropped_after_close"] == 1
    assert status["raised"] == status["sent"] + status["suppressed"] + 1
    dispatcher.close()  # idempotent


def test_a_repeat_raised_while_close_flushes_is_counted_dropped_not_held_back() -> None:
    clock = FakeClock()

    class RaisesDuringClose(RecordingHook):
        """Raises the same (code, model) again while close() delivers the held repeat,
        as another thread or the hook itself may."""

        def alert(
            self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]
        ) -> None:
            super().alert(level, code, message, fields)
            if len(self.calls) == 2:
                dispatcher(alert(level="CRITICAL"))

    hook = RaisesDuringClose()
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=clock)
    dispatcher(alert())
    dispatcher(alert())  # inside the window: held back until close() flushes it
    with capture_logs() as logs:
        dispatcher.close()
    assert len(hook.calls) == 2 and hook.calls[1][3] == {"model": "demo"}
    status = dispatcher.status()
    assert (status["raised"], status["sent"], status["suppressed"]) == (3, 2, 0)
    assert (status["dropped_after_close"], status["pending"]) == (1, 0)
    assert [entry.get("delivered") for entry in logs if entry["event"] == "alert"] == [
        None,
        False,
    ]


def test_hooks_get_a_read_only_view_and_raisers_cannot_fake_suppressed() -> None:
    seen: list[Mapping[str, Any]] = []

    class Mutating(RecordingHook):
        def alert(
            self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]
        ) -> None:
            seen.append(fields)
            fields["model"] = "changed"  # type: ignore[index]

    hook = RecordingHook()
    dispatcher = AlertDispatcher([Mutating("mutating"), hook], clock=FakeClock())
    dispatcher(Alert("INFO", "x", "m", {"model": "demo", "suppressed": 99}))
    assert hook.calls == [("INFO", "x", "m", {"model": "demo"})]
    assert dispatcher.status()["hooks"]["mutating"]["failures"] == 1


def test_unknown_level_is_delivered_as_error() -> None:
    hook = RecordingHook()
    dispatcher = AlertDispatcher([hook], clock=FakeClock())
    dispatcher(Alert("FATAL", "x", "m"))  # type: ignore[arg-type]
    assert hook.calls == [("ERROR", "x", "m", {})]


def test_a_failing_hook_never_breaks_the_caller_or_the_other_hooks() -> None:
    clock = FakeClock()
    before, failing, after = RecordingHook("before"), FailingHook("failing"), RecordingHook("after")
    dispatcher = AlertDispatcher([before, failing, after], rate_limit_s=10.0, clock=clock)
    with capture_logs() as logs:
        dispatcher(alert(model="a"))
        dispatcher(alert(model="b"))
        dispatcher(alert(model="c"))
        clock.now += 10
        dispatcher(alert(model="d"))
    assert len(before.calls) == len(after.calls) == len(failing.calls) == 4
    errors = [entry for entry in logs if entry["event"] == "alert_hook_failed"]
    assert [entry["failures_since_last_log"] for entry in errors] == [1, 3]
    assert all(entry["log_level"] == "error" and entry["hook"] == "failing" for entry in errors)
    hooks = dispatcher.status()["hooks"]
    assert hooks["failing"] == {
        "sent": 0,
        "failures": 4,
        "last_error": "ConnectionError('ground link down')",
    }
    assert hooks["before"]["sent"] == hooks["after"]["sent"] == 4


def test_duplicate_hook_names_are_told_apart() -> None:
    dispatcher = AlertDispatcher([RecordingHook("x"), RecordingHook("x")])
    assert dispatcher.hook_names == ("x", "x#2")


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_each_delivered_alert_is_logged_once_at_its_level(level: AlertLevel) -> None:
    dispatcher = AlertDispatcher([RecordingHook(), RecordingHook()], clock=FakeClock())
    with capture_logs() as logs:
        dispatcher(alert(level=level))
        dispatcher(alert(level=level))  # suppressed: debug only
    alerts = [entry for entry in logs if entry["event"] == "alert"]
    assert len(alerts) == 1
    assert alerts[0]["log_level"] == log_method(level)
    assert alerts[0]["alert_code"] == "test_alert"
    assert alerts[0]["alert_level"] == level
    assert alerts[0]["alert_fields"] == {"model": "demo"}
    suppressed = [entry for entry in logs if entry["event"] == "alert_suppressed"]
    assert [entry["log_level"] for entry in suppressed] == ["debug"]


def test_concurrent_alerts_are_each_delivered_or_counted() -> None:
    clock, hook = FakeClock(), RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=clock)
    threads, per_thread, models = 8, 500, ("a", "b", "c")
    start = threading.Barrier(threads)

    def worker(index: int) -> None:
        start.wait()
        for count in range(per_thread):
            dispatcher(alert(model=models[(index + count) % len(models)]))

    workers = [threading.Thread(target=worker, args=(index,)) for index in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in workers)
    assert len(hook.calls) == len(models)  # clock stood still: one per key
    clock.now += 10
    assert dispatcher.flush() == len(models)
    raised = threads * per_thread
    status = dispatcher.status()
    assert status["raised"] == raised
    assert status["sent"] == len(hook.calls) == 2 * len(models)
    reported = len(hook.calls) + sum(call[3].get("suppressed", 0) for call in hook.calls)
    assert reported == raised
    assert status["hooks"]["recording"]["sent"] == 2 * len(models)


class _Gate(RecordingHook):
    """Holds each alert until ``release``: a delivery in progress on another thread."""

    def __init__(self) -> None:
        super().__init__("gate")
        self.entered = threading.Event()
        self.release = threading.Event()

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        super().alert(level, code, message, fields)
        self.entered.set()
        assert self.release.wait(HANG_S), "the test never released the delivery"


class _ClosedAtCall(RecordingHook):
    """Records, with each alert, whether the hook was already closed."""

    def __init__(self, gate: _Gate) -> None:
        super().__init__("after_gate")
        self.gate = gate
        self.closed_at_call: list[bool] = []

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        self.closed_at_call.append(self.closed)
        super().alert(level, code, message, fields)

    def close(self) -> None:
        super().close()
        self.gate.release.set()  # the code before the fix closed the hooks at once


class _SignalsWait(threading.Condition):
    """The dispatcher's condition, releasing the gate once ``close()`` waits on it."""

    def __init__(self, lock: Any, gate: _Gate) -> None:
        super().__init__(lock)
        self.gate = gate

    def wait(self, timeout: float | None = None) -> bool:
        self.gate.release.set()
        return super().wait(timeout)


def test_close_waits_for_a_delivery_in_progress_before_closing_the_hooks() -> None:
    gate = _Gate()
    after = _ClosedAtCall(gate)
    dispatcher = AlertDispatcher([gate, after], rate_limit_s=0.0)
    # Released when close() waits for the delivery (the fix), or when it closes
    # the hook behind the gate without waiting (before it): no timing involved.
    dispatcher._idle = _SignalsWait(dispatcher._lock, gate)
    raiser = threading.Thread(target=dispatcher, args=(alert(level="CRITICAL"),))
    raiser.start()
    assert gate.entered.wait(HANG_S)
    dispatcher.close()
    raiser.join(HANG_S)
    assert not raiser.is_alive()
    assert after.closed_at_call == [False], "the alert in flight reached a closed hook"
    assert gate.closed and after.closed
    dispatcher(alert(model="late"))  # after close: dropped, and counted so
    status = dispatcher.status()
    assert (status["raised"], status["sent"], status["dropped_after_close"]) == (2, 1, 1)
    assert status["raised"] == status["sent"] + status["suppressed"] + 1
    assert status["hooks"]["after_gate"] == {"sent": 1, "failures": 0, "last_error": None}
