"""A model that fell back because its engine dir or files could not be checked
(``EMFILE``, ``ENOMEM``: ``UncheckedDirectoryError``, ``UncheckedEngineError``, no
verdict on the engine) is switched to its engine again after the backoff, no build;
before, nothing tried again: one ``EMFILE`` at start or at a failover left TensorRT
off until an operator's switch or a restart (entry 329's "Left").  The real
``FallbackRebuilder``, a scripted switch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from inferd.engine_build.build_record import BuildFinished
from inferd.serving.switching import NotPreparedError
from inferd.types import Alert
from tests.conftest import wait_until
from tests.unit.serving.test_review2_serving import make_rebuilder

UNCHECKED = "UncheckedDirectoryError"
REASON = "engine dir /var/lib/inferd/engines could not be checked: [Errno 24] Too many open files"


class _Rig:
    def __init__(self, *outcomes: str | None, max_attempts: int = 3) -> None:
        #: What each switch meets: a ``NotPreparedError`` cause, or None (switched).
        self.outcomes = list(outcomes)
        self.switched: list[str] = []
        self.started: list[str] = []
        self.alerts: list[Alert] = []
        self.rebuilder = make_rebuilder(
            self.alerts,
            start_build=self._start_build,
            switch=self._switch,
            backoff_s=0.01,
            max_attempts=max_attempts,
        )

    def _switch(self, model: str, runtime: str, requested_by: str) -> dict[str, Any]:
        self.switched.append(f"{model} {runtime} {requested_by}")
        cause = self.outcomes.pop(0) if self.outcomes else UNCHECKED
        if cause is not None:
            raise NotPreparedError(f"{cause}: not prepared", cause)
        return {}

    def _start_build(self, header: dict[str, Any]) -> dict[str, Any]:
        self.started.append(header["model"])
        return {"build_id": "b1"}


def _states_at_each_switch(rig: _Rig) -> list[str]:
    """The model's ``status`` state as each switch of the rebuilder's begins (filled as
    they run)."""
    seen: list[str] = []
    switch = rig._switch

    def switch_seen(model: str, runtime: str, requested_by: str) -> dict[str, Any]:
        seen.append(rig.rebuilder.describe()[model]["state"])
        return switch(model, runtime, requested_by)

    rig.rebuilder._switch = switch_seen
    return seen


def test_an_engine_that_could_not_be_checked_is_located_again_until_it_serves() -> None:
    rig = _Rig(UNCHECKED, None)
    with structlog.testing.capture_logs() as logs:
        why = rig.rebuilder.on_fallback("m", REASON, UNCHECKED)
        assert why is not None and "located again" in why and "Too many open files" in why
        wait_until(lambda: rig.rebuilder.describe()["m"]["adopted"], message="switched back")
    assert rig.switched == ["m tensorrt inferd: engine checked again"] * 2
    assert rig.started == [] and rig.alerts == []  # no build: nothing was wrong with it
    events = [e["event"] for e in logs]
    assert events.count("engine_recheck_scheduled") == 2 and "engine_rechecked" in events
    assert "engine_rebuild_skipped" not in events
    assert rig.rebuilder.describe()["m"]["attempts"] == 0  # no build's attempt


def test_a_recheck_that_finds_the_engine_missing_asks_for_a_build() -> None:
    rig = _Rig("EngineMissingError")
    rig.rebuilder.on_fallback("m", REASON, UNCHECKED)
    wait_until(lambda: rig.started == ["m"], message="the build asked for")
    assert rig.rebuilder.describe()["m"]["state"] == "building"
    rig.rebuilder.stop()


def test_rechecks_are_bounded_and_an_operators_switch_cancels_one() -> None:
    rig = _Rig(max_attempts=2)  # never checked
    with structlog.testing.capture_logs() as logs:
        rig.rebuilder.on_fallback("m", REASON, UNCHECKED)
        wait_until(
            lambda: any(e["event"] == "engine_rebuild_skipped" for e in logs),
            message="given up",
        )
    assert len(rig.switched) == 2 and rig.started == []
    assert rig.rebuilder.describe()["m"]["state"] == "idle"
    # A failover's alert words only (ask=False) schedule nothing.
    assert "could not be checked" in str(
        rig.rebuilder.on_fallback("n", REASON, UNCHECKED, ask=False)
    )
    assert "n" not in rig.rebuilder.describe()
    cancelled = _Rig()
    cancelled.rebuilder._backoff_s = 3600.0
    cancelled.rebuilder.on_fallback("m", REASON, UNCHECKED)
    assert cancelled.rebuilder.describe()["m"]["state"] == "retry_scheduled"
    cancelled.rebuilder.operator_chose("m")
    assert cancelled.rebuilder.describe()["m"]["state"] == "idle" and cancelled.switched == []


def test_an_adoption_that_meets_an_unchecked_engine_dir_is_rechecked_not_abandoned() -> None:
    """A failover's cause is the execution: ``EMFILE`` meets the model at the rebuilt
    engine's adoption, which abandoned it ("engine_build_not_adopted ... not rebuilt";
    review R5, F4).  Now that switch is tried again after the backoff; while it runs,
    ``status`` shows ``adoption_pending``, not ``idle`` (F8)."""
    rig = _Rig(UNCHECKED, None)
    seen = _states_at_each_switch(rig)
    assert rig.rebuilder.on_fallback("m", "tensorrt failed while serving", "execution") is None
    rig.rebuilder.on_build_finished(
        BuildFinished("b1", "m", "completed", "tensorrt", True, None, Path("x"), "inferd", None)
    )
    wait_until(lambda: rig.rebuilder.describe()["m"]["adopted"], message="adopted on recheck")
    assert rig.switched == [
        "m tensorrt inferd: build b1",
        "m tensorrt inferd: engine checked again",
    ]
    assert seen == ["adoption_pending", "adoption_pending"]
    assert rig.alerts == [] and rig.started == ["m"]


def _built(build_id: str) -> BuildFinished:
    return BuildFinished(
        build_id, "m", "completed", "tensorrt", True, None, Path("x"), "inferd", None
    )


def test_an_adoption_left_unchecked_with_its_rechecks_used_is_said() -> None:
    """Three ``EMFILE`` episodes, each healed by a recheck, used the run's rechecks; a
    rebuilt engine's adoption then meeting ``EMFILE`` was dropped with no alert, the
    model ``idle`` on the fallback (review R6, F4).  A recheck that succeeds now gives
    the model its rechecks back, and one that cannot be scheduled is said."""
    rig = _Rig(*[UNCHECKED, None] * 3, UNCHECKED, max_attempts=2)
    for _ in range(3):  # each healed at its second recheck: its rechecks given back
        rig.rebuilder.on_fallback("m", REASON, UNCHECKED)
        wait_until(lambda: rig.rebuilder.describe()["m"]["state"] == "adopted", message="ok")
    assert rig.rebuilder._models["m"].rechecks == 0
    rig.rebuilder._models["m"].rechecks = 2  # used, as by an episode not healed
    assert rig.rebuilder.on_fallback("m", "tensorrt failed while serving", "execution") is None
    rig.rebuilder.on_build_finished(_built("b1"))
    assert [a.code for a in rig.alerts] == ["engine_build_not_adopted"]
    assert "could not be checked" in rig.alerts[0].message


def test_a_recheck_with_no_backoff_and_one_that_raises_show_their_state() -> None:
    """With ``rebuild_backoff_s`` 0 the recheck an adoption schedules fires at once: the
    adoption's end cleared the shared marker while the recheck's switch loaded (shown
    ``idle``); a recheck's switch raising other than ``ProtocolError`` left the marker
    set for good (review R6, F5).  The marker counts the switches under way."""
    rig = _Rig(UNCHECKED, None)
    rig.rebuilder._backoff_s = 0.0
    seen = _states_at_each_switch(rig)
    rig.rebuilder.on_fallback("m", "tensorrt failed while serving", "execution")
    rig.rebuilder.on_build_finished(_built("b1"))
    wait_until(lambda: rig.rebuilder.describe()["m"]["adopted"], message="adopted")
    assert seen == ["adoption_pending", "adoption_pending"]
    broken = _Rig()

    def raises(*_args: Any) -> dict[str, Any]:
        raise RuntimeError("a bug in the switch")

    broken.rebuilder._switch = raises
    broken.rebuilder.on_fallback("m", REASON, UNCHECKED)
    wait_until(lambda: broken.rebuilder._models["m"].timer is None, message="fired")
    wait_until(lambda: broken.rebuilder._models["m"].adopting == 0, message="marker cleared")
    assert broken.rebuilder.describe()["m"]["state"] == "idle"


def test_rechecks_that_end_unchecked_after_an_adoption_are_said_once() -> None:
    """The adoption met ``EMFILE``, and so did each recheck: when the last failed, only
    the log said so, the trusted engine unused and the model ``idle`` (review R7, F1)."""
    rig = _Rig(max_attempts=2)  # every switch meets UncheckedDirectoryError
    assert rig.rebuilder.on_fallback("m", "tensorrt failed while serving", "execution") is None
    rig.rebuilder.on_build_finished(_built("b1"))
    wait_until(lambda: len(rig.alerts) == 1, message="the alert")
    wait_until(lambda: rig.rebuilder.describe()["m"]["state"] == "idle", message="idle")
    assert len(rig.switched) == 3  # the adoption and two rechecks
    ((level, code, message),) = [(a.level, a.code, a.message) for a in rig.alerts]
    assert (level, code) == ("WARNING", "engine_recheck_gave_up")
    assert "could not be checked, 2 times" in message
