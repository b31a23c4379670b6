"""A background rebuild the daemon stopped at its deadline (``builds.max_duration_s``)
is a failed attempt, retried within ``runtime.rebuild_max_attempts``: no one
stopped it.  Before, it was reported as cancelled by someone ("not retried: start
one with build.start"), and the model stayed on the fallback for the rest of the
run; an operator's cancel still is not retried."""

from __future__ import annotations

from dataclasses import dataclass

from inferd.types import Alert
from tests.unit.serving.test_review2_serving import make_rebuilder


@dataclass(frozen=True)
class Finished:
    """A finished build as ``BuildFinished`` reports it."""

    build_id: str
    state: str
    cancel_source: str | None
    model: str = "demo"
    trusted: bool = False
    note: str | None = None
    requested_by: str = "inferd: engine missing"
    error: str | None = None


def _rebuild_once_ended(finished: Finished) -> tuple[list[Alert], bool]:
    """The alerts of a background build that ended as ``finished``, and whether a
    retry was scheduled (its back-off long enough to be seen waiting)."""
    alerts: list[Alert] = []
    rebuilder = make_rebuilder(alerts, backoff_s=60.0, max_attempts=2)
    rebuilder.on_fallback("demo", "engine missing")
    rebuilder.on_build_finished(finished)
    retry = bool(rebuilder.describe()["demo"]["retry_scheduled"])
    rebuilder.stop()
    return alerts, retry


def test_a_rebuild_stopped_at_its_deadline_is_retried_as_a_failed_attempt() -> None:
    alerts, retry = _rebuild_once_ended(Finished("b1", "cancelled", "timeout"))
    assert retry
    (raised,) = alerts
    assert (raised.level, raised.code) == ("WARNING", "engine_build_failed")
    assert "ran past its deadline (builds.max_duration_s)" in raised.message
    assert "retry 2 of 2 in 60 s" in raised.message


def test_a_rebuild_an_operator_cancelled_is_still_not_retried() -> None:
    alerts, retry = _rebuild_once_ended(Finished("b1", "cancelled", "control"))
    assert not retry
    (raised,) = alerts
    assert raised.code == "engine_build_cancelled" and "not retried" in raised.message
