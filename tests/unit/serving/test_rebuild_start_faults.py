"""A rebuild's start that raises, and an operator's switch while a start is refused
for room (``serving/rebuild.py``: ``_start``, ``_wait_for_room``, ``operator_chose``,
``on_build_finished``).

Before, ``_start`` caught only ``ProtocolError``: anything else out of ``build.start``
(a ``PermissionError`` from admission's prune, a ``MemoryError``) reached the caller
(``on_fallback``'s, or the ended build's reader thread) with no alert, and
``on_build_finished`` asked for the waiting rebuilds before handling the ended build,
so a fault there dropped the ended build's handling.  And an operator's switch that
came while a start was on its way to a refusal for room found nothing to cancel: the
rebuild then waited, and started at the next build's end against their choice.
A fake ``start_build``, the real ``FallbackRebuilder``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from inferd.engine_build.build_record import BuildFinished
from inferd.serving.rebuild import FallbackRebuilder
from inferd.types import Alert
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import wait_until


def _room() -> ProtocolError:
    """``build.start``'s refusal for room (``builds.max_running``)."""
    return ProtocolError(Code.RESOURCE_EXHAUSTED, "builds.max_running is 1 and 1 are running")


def _rebuilder(
    start_build: Callable[[dict[str, Any]], Mapping[str, Any]],
    alert: Callable[[Alert], None],
    backoff_s: float = 3600.0,
) -> FallbackRebuilder:
    return FallbackRebuilder(
        start_build=start_build,
        switch=lambda *_args: {},
        alert=alert,
        can_build=lambda: True,
        backoff_s=backoff_s,
        max_attempts=3,
    )


def _failed(build_id: str, model: str) -> BuildFinished:
    return BuildFinished(
        build_id, model, "failed", "tensorrt", False, None, Path("x"), "inferd", "it failed"
    )


def test_a_start_that_raises_is_alerted_as_not_started() -> None:
    alerts: list[Alert] = []

    def start_build(_header: dict[str, Any]) -> Mapping[str, Any]:
        raise PermissionError(1, "Operation not permitted", "builds/m/old.engine")

    rebuilder = _rebuilder(start_build, alerts.append)
    with structlog.testing.capture_logs() as logs:
        why = rebuilder.on_fallback("m", "engine missing")
    assert why is not None and why.startswith("its build could not start: PermissionError: ")
    ((code, model),) = [(a.code, a.fields["model"]) for a in alerts]
    assert (code, model) == ("engine_build_failed", "m")
    (said,) = [e for e in logs if e["event"] == "engine_rebuild_not_started"]
    assert said["exc_info"] is True and "Operation not permitted" in said["error"]
    assert rebuilder.describe()["m"]["build_id"] is None  # not "building"


def test_the_ended_build_is_handled_whatever_its_wake_up_of_a_waiting_one_raises() -> None:
    """The waiting rebuild of 'b', asked for again at the end of the rebuild of 'a',
    fails in a way ``_start`` does not catch (here the alert of its refusal): the
    failed rebuild of 'a' is still handled, its retry scheduled and alerted."""
    alerts: list[Alert] = []
    calls: list[str] = []

    def start_build(header: dict[str, Any]) -> Mapping[str, Any]:
        calls.append(header["model"])
        if header["model"] == "b" and len(calls) == 2:
            raise _room()  # 'a' runs: 'b' waits
        if header["model"] == "b":
            raise ProtocolError(Code.INVALID_ARGUMENT, "no such model")
        return {"build_id": f"b{len(calls)}"}

    def alert(raised: Alert) -> None:
        alerts.append(raised)
        if raised.fields["model"] == "b":
            raise RuntimeError("the alert sink failed")

    rebuilder = _rebuilder(start_build, alert)
    assert rebuilder.on_fallback("a", "engine missing") is None
    assert rebuilder.on_fallback("b", "engine missing") is None  # waits for room
    with pytest.raises(RuntimeError, match="the alert sink failed"):  # the hook logs it
        rebuilder.on_build_finished(_failed("b1", "a"))
    assert [(a.code, a.fields["model"]) for a in alerts] == [
        ("engine_build_failed", "b"),
        ("engine_build_failed", "a"),
    ]
    assert "retry 2 of 3" in alerts[1].message
    described = rebuilder.describe()["a"]
    assert described["build_id"] is None and described["retry_scheduled"] is True
    rebuilder.stop()


def test_an_operators_switch_while_a_start_is_refused_for_room_cancels_it() -> None:
    calls: list[str] = []
    rebuilder: FallbackRebuilder

    def start_build(header: dict[str, Any]) -> Mapping[str, Any]:
        calls.append(header["model"])
        if len(calls) == 1:
            rebuilder.operator_chose("m")  # the operator's runtime.switch, as it is refused
            raise _room()
        return {"build_id": "b2"}

    alerts: list[Alert] = []
    rebuilder = _rebuilder(start_build, alerts.append)
    with structlog.testing.capture_logs() as logs:
        assert rebuilder.on_fallback("m", "engine missing") == "cancelled"
        rebuilder.on_build_finished(_failed("b1", "other"))  # another build's end: room
    assert calls == ["m"] and rebuilder._models["m"].waiting is None
    assert rebuilder.describe()["m"] == {
        "state": "idle",
        "attempts": 0,
        "build_id": None,
        "retry_scheduled": False,
        "retry_in_s": None,
        "waiting_for_room": None,
        "waiting_on_build": None,
        "adoption_pending": False,
        "adopted": False,
        "skipped": None,
    }
    events = [e["event"] for e in logs]
    assert "engine_rebuild_retry_cancelled" in events and "engine_rebuild_waiting" not in events
    assert alerts == []
    # A later fallback asks for a build again.
    assert rebuilder.on_fallback("m", "engine missing") is None and calls == ["m", "m"]


def test_an_operators_earlier_switch_does_not_cancel_a_later_wait() -> None:
    """Only a switch that comes while the start is on its way cancels it."""

    def start_build(_header: dict[str, Any]) -> Mapping[str, Any]:
        raise _room()

    rebuilder = _rebuilder(start_build, lambda _alert: None)
    rebuilder.on_fallback("m", "engine missing")
    rebuilder.operator_chose("m")  # cancels that wait
    assert rebuilder._models["m"].waiting is None
    assert rebuilder.on_fallback("m", "engine missing") is None  # the next one waits
    assert rebuilder._models["m"].waiting == "engine missing"


def test_a_start_refused_for_a_cause_that_may_pass_is_retried_after_the_backoff() -> None:
    """``UNAVAILABLE`` (a build directory that could not be checked: ``EMFILE``) and
    ``INTERNAL`` (a child that could not be spawned) were alerted and dropped: the
    model stayed on the fallback until it fell back again (entry 340's "Left").  Now
    each is an attempt retried as a failed build is, until the attempts are used."""
    refusals = [
        ProtocolError(Code.UNAVAILABLE, "build dir unchecked: [Errno 24] Too many open files"),
        ProtocolError(Code.INTERNAL, "could not start the build process: [Errno 11]"),
    ]
    calls: list[str] = []

    def start_build(header: dict[str, Any]) -> Mapping[str, Any]:
        calls.append(header["model"])
        if refusals:
            raise refusals.pop(0)
        return {"build_id": "b3"}

    alerts: list[Alert] = []
    rebuilder = _rebuilder(start_build, alerts.append, backoff_s=0.01)
    why = rebuilder.on_fallback("m", "engine missing")
    assert why is not None and "Too many open files" in why
    wait_until(lambda: rebuilder.describe()["m"]["build_id"] == "b3", message="retried")
    assert calls == ["m", "m", "m"] and rebuilder.describe()["m"]["attempts"] == 3
    assert [(a.level, a.code) for a in alerts] == [("WARNING", "engine_build_failed")] * 2
    assert alerts[0].message.endswith("; it stays on onnx_trt_ep; retry 2 of 3 in 0 s")
    assert alerts[1].message.endswith("retry 3 of 3 in 0 s")
    rebuilder.stop()


def test_a_start_refused_for_good_is_not_retried_and_used_attempts_give_up() -> None:
    """An unsafe build directory (``FAILED_PRECONDITION``) is an operator's to fix: said,
    not retried.  A transient refusal with the attempts used gives up (ERROR)."""
    alerts: list[Alert] = []

    def unsafe(_header: dict[str, Any]) -> Mapping[str, Any]:
        raise ProtocolError(Code.FAILED_PRECONDITION, "builds/m is a symlink")

    rebuilder = _rebuilder(unsafe, alerts.append, backoff_s=0.01)
    rebuilder.on_fallback("m", "engine missing")
    assert (alerts[0].level, alerts[0].code) == ("WARNING", "engine_build_failed")
    assert alerts[0].message.endswith("; it stays on onnx_trt_ep; not retried")
    assert rebuilder.describe()["m"]["state"] == "idle"  # a later fallback asks again

    def unavailable(_header: dict[str, Any]) -> Mapping[str, Any]:
        raise ProtocolError(Code.UNAVAILABLE, "build dir unchecked: [Errno 24]")

    alerts.clear()
    rebuilder = _rebuilder(unavailable, alerts.append, backoff_s=0.01)
    rebuilder.on_fallback("m", "engine missing")
    wait_until(lambda: len(alerts) == 3, message="three attempts")
    assert [(a.level, a.code) for a in alerts] == [
        ("WARNING", "engine_build_failed"),
        ("WARNING", "engine_build_failed"),
        ("ERROR", "engine_build_gave_up"),
    ]
    assert alerts[2].message.endswith("giving up after 3 build(s)")
    wait_until(lambda: rebuilder.describe()["m"]["state"] == "gave_up", message="gave up")
    rebuilder.stop()


def test_an_operators_switch_as_a_start_is_refused_for_a_cause_that_may_pass_is_kept() -> None:
    """The switch came while ``build.start`` was on its way and was refused
    ``UNAVAILABLE``: the retry built against the operator's choice (review R5, F7)."""
    calls: list[str] = []
    rebuilder: FallbackRebuilder

    def start_build(_header: dict[str, Any]) -> Mapping[str, Any]:
        calls.append("start")
        rebuilder.operator_chose("m")  # as the start is on its way
        raise ProtocolError(Code.UNAVAILABLE, "build dir unchecked: [Errno 24]")

    alerts: list[Alert] = []
    rebuilder = _rebuilder(start_build, alerts.append, backoff_s=0.01)
    rebuilder.on_fallback("m", "engine missing")
    assert rebuilder.describe()["m"]["state"] == "idle" and calls == ["start"]
    assert alerts[0].message.endswith("not retried: an operator switched the model since")
