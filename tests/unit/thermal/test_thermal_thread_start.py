"""The thermal monitor's threads that cannot start (the process's thread limit,
DESIGN.md 166).

The poll thread: ``start`` raises, and the stop the daemon runs next raised too
(it joined the thread that never started: a spurious ``daemon_stop_step_failed``).
A read's thread: the read is lost telemetry, as before; but the never-started
call became the latest one, so the stop waited for it to return and then handed
it the source to close, which nothing then closed.  An open's thread: the late
open nobody had taken was taken by the call whose thread did not start, and
dropped without being closed."""

from __future__ import annotations

import threading

import pytest

from inferd.thermal import THREAD_NAME
from inferd.thermal.bounded_read import READ_THREAD_NAME, BoundedCall, DeadlinePassedError
from tests.conftest import HANG_S, wait_until
from tests.thread_limit import REFUSAL, refuse_start
from tests.unit.thermal.conftest import ScriptedSource, make_monitor, reading


def test_a_poll_thread_that_cannot_start_is_not_joined_by_the_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = ScriptedSource(reading(cpu=50.0))
    monitor, _, _ = make_monitor(source)
    refuse_start(monkeypatch, THREAD_NAME)
    with pytest.raises(RuntimeError, match=REFUSAL):
        monitor.start()
    monkeypatch.undo()
    assert monitor.describe()["running"] is False
    assert monitor.stop() is True  # raised: cannot join thread before it is started
    monitor.start()  # it starts again once stopped
    try:
        assert monitor.describe()["running"] is True
        # Its first poll's open done: a stop before it would leave the open (on a
        # loaded machine, an open may outlast the stop's 0.1 s settle).
        wait_until(lambda: monitor.describe()["polls"] >= 1, message="the first poll")
    finally:
        assert monitor.stop(HANG_S) is True


def test_a_read_whose_thread_cannot_start_leaves_the_source_to_the_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = ScriptedSource(reading(cpu=50.0))
    monitor, _, _ = make_monitor(source)
    assert monitor._poll_once().is_telemetry_available  # a read on its thread
    refuse_start(monkeypatch, READ_THREAD_NAME)
    assert not monitor._poll_once().is_telemetry_available
    monkeypatch.undo()
    assert REFUSAL in monitor.describe()["last_error"]
    assert monitor.stop() is True
    assert source.closed == 1  # 0: handed to a read that never ran
    assert monitor.abandoned_read is None


def test_a_late_outcome_is_kept_when_the_next_call_cannot_start_its_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    discarded: list[str] = []
    call: BoundedCall[str] = BoundedCall(
        0.01, what="open", thread_name="test-bounded", discard=discarded.append
    )
    answer = threading.Event()

    def late() -> str:
        answer.wait(HANG_S)
        return "opened"

    with pytest.raises(DeadlinePassedError):
        call.call(late, "jtop")
    answer.set()
    assert call.wait_returned(HANG_S)
    refuse_start(monkeypatch, "test-bounded")
    with pytest.raises(RuntimeError, match=REFUSAL):
        call.call(lambda: "again", "jtop")
    monkeypatch.undo()
    assert call.take_late() == "opened"  # None: dropped, never closed
    call.abandon()
    assert discarded == []
