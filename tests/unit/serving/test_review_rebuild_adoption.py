"""A rebuilt engine's adoption meets a switch or failover of its model in progress, and an
operator's switch meets a retry not yet started (``serving/rebuild.py`` ``_adopt``,
``released``, ``operator_chose``; ``serving/switching.py`` ``switch_now``, ``unclaim``).

The real switcher and rebuilder on the rig of ``test_review_switch_rebuild.py`` (a slot
whose preparations are fakes, a thread standing in for the engine worker).  Threads are
ordered with events; ``wait_until`` only bounds a hang."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
import structlog

from inferd.errors import RuntimeNotAvailableError
from inferd.serving.rebuild import FallbackRebuilder
from inferd.serving.rebuild_adoption import ADOPTION_TRIES
from inferd.serving.switching import ModelClaimedError
from inferd.types import Alert, EngineHandle, Peer
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S, wait_until
from tests.integration.test_review_schemas import pinned_alert_codes
from tests.unit.serving.test_execution_failover import Finished
from tests.unit.serving.test_review_switch_rebuild import (  # noqa: F401  (the fixture)
    SPEC,
    Released,
    Rig,
    rebuilder_of,
    rig,
    starting,
)

Reply = dict[str, Any] | ProtocolError


class Gate:
    """Holds the next preparation of ``rig``'s slot until ``go`` is set (an operator's
    switch in progress), then prepares as before, or refuses as ``refuse`` says."""

    def __init__(self, rig: Rig, refuse: bool = False) -> None:  # noqa: F811
        self.entered, self.go = threading.Event(), threading.Event()
        self._prepare, self._refuse, self._slot = rig.slot.prepare, refuse, rig.slot
        rig.slot.prepare = self  # type: ignore[method-assign]

    def __call__(self, label: str, *args: Any, **kwargs: Any) -> tuple[Any, EngineHandle]:
        self._slot.prepare = self._prepare  # type: ignore[method-assign]  (once)
        self.entered.set()
        assert self.go.wait(HANG_S)
        if self._refuse:
            raise RuntimeNotAvailableError(label, "its library failed to load")
        return self._prepare(label, *args, **kwargs)  # type: ignore[no-any-return]


def switching(rig: Rig, label: str) -> queue.Queue[Reply]:  # noqa: F811
    """An operator's ``runtime.switch`` of ``m`` to ``label``, left preparing."""
    replies: queue.Queue[Reply] = queue.Queue()
    header = {"model": "m", "runtime": label, "requested_by": "ground"}
    rig.switcher.switch(header, Peer.internal(0, 0), replies.put)
    return replies


def switch_records(rig: Rig) -> list[tuple[str, str]]:  # noqa: F811
    return [
        (payload["requested_by"], payload["outcome"])
        for kind, payload in rig.records
        if kind == "runtime_switch"
    ]


def logged(logs: Iterable[Mapping[str, Any]], event: str) -> list[Mapping[str, Any]]:
    return [line for line in logs if line["event"] == event]


# -- 1. an adoption refused because the model is claimed --------------------------------


@pytest.mark.parametrize("operator_label", ["onnx_trt_ep", "tensorrt"])
def test_an_adoption_met_by_an_operators_switch_in_progress_ends_as_their_choice(
    rig: Rig,  # noqa: F811
    operator_label: str,
) -> None:
    """The build completes while the ground's switch of the model prepares (the model
    claimed).  The adoption waits for the switch, which leaves the model on the
    operator's choice: superseded (entry 249), no alert, no second build.  Before: a
    failed build, alert ``engine_build_failed`` and a rebuild of the engine that exists."""
    rig.rebuilder.on_fallback("m", "engine missing")
    gate = Gate(rig)
    replies = switching(rig, operator_label)
    assert gate.entered.wait(HANG_S)
    with structlog.testing.capture_logs() as logs:
        rig.rebuilder.on_build_finished(Finished("b1", model="m"))
        assert rig.alerts == [] and len(rig.builds) == 1
        assert rig.rebuilder.describe()["m"]["adoption_pending"] is True
        gate.go.set()
        reply = replies.get(timeout=HANG_S)
        wait_until(lambda: logged(logs, "engine_rebuild_superseded"), HANG_S, message="settled")
    assert isinstance(reply, dict) and reply["to_runtime"] == operator_label
    handle = rig.slot.handle
    assert handle is not None and handle.runtime_label == operator_label
    assert not handle.is_fallback  # the operator's engine, not a rebuilt one adopted
    assert switch_records(rig) == [("ground", "switched")]
    assert rig.alerts == [] and len(rig.builds) == 1
    (deferred,) = logged(logs, "engine_rebuild_adoption_deferred")
    assert deferred["build_id"] == "b1" and "already in progress" in deferred["reason"]
    assert rig.rebuilder.describe()["m"] == {
        "state": "idle",
        "attempts": 1,
        "build_id": None,
        "retry_scheduled": False,
        "retry_in_s": None,
        "waiting_for_room": None,
        "waiting_on_build": None,
        "adoption_pending": False,
        "adopted": False,
        "skipped": None,
    }


def test_an_adoption_met_by_an_operators_switch_that_is_refused_is_adopted_after_it(
    rig: Rig,  # noqa: F811
) -> None:
    """The switch in progress fails (its engine cannot be prepared): the model is still
    on the fallback, so the built engine is adopted once the switch ends."""
    rig.rebuilder.on_fallback("m", "engine missing")
    gate = Gate(rig, refuse=True)
    replies = switching(rig, "onnx_trt_ep")
    assert gate.entered.wait(HANG_S)
    rig.rebuilder.on_build_finished(Finished("b1", model="m"))
    gate.go.set()
    assert isinstance(replies.get(timeout=HANG_S), ProtocolError)
    wait_until(lambda: rig.rebuilder.describe()["m"]["adopted"], HANG_S, message="adopted")
    handle = rig.slot.handle
    assert handle is not None and handle.runtime_label == "tensorrt"
    assert switch_records(rig) == [("ground", "refused"), ("inferd: build b1", "switched")]
    assert rig.alerts == [] and len(rig.builds) == 1


def test_an_adoption_met_by_a_failover_in_progress_is_adopted_once_it_ends(
    rig: Rig,  # noqa: F811
) -> None:
    """The operator's TensorRT engine fails over while the engine is rebuilt, and the build
    completes during the failover (claimed, the model ``loading``).  The failover's own
    request for a build (``on_fallback``, still claimed) starts none, and the built engine
    is adopted once the failover ends.  Before: the adoption was refused as "loading", a
    failed build, alerted and rebuilt."""
    rig.rebuilder.on_fallback("m", "engine missing")
    assert isinstance(switching(rig, "tensorrt").get(timeout=HANG_S), dict)
    # What ``ExecutionFailover`` does, in its order: claim, pause the model ...
    assert rig.switcher.claim("m")
    rig.slot.state = "loading"
    rig.rebuilder.on_build_finished(Finished("b1", model="m"))
    assert rig.alerts == []
    assert rig.rebuilder.describe()["m"]["adoption_pending"] is True
    # ... swap to a new fallback on the worker, ask for a build, release the model.
    fallback = EngineHandle(50, "onnx_trt_ep", "0" * 64, SPEC, SPEC, is_fallback=True)
    rig.slot.swap(Released(), fallback, "tensorrt failed while serving")  # type: ignore[arg-type]
    rig.rebuilder.on_fallback("m", "tensorrt failed while serving")
    assert len(rig.builds) == 1  # the engine exists: not built again
    rig.switcher.unclaim("m")
    wait_until(lambda: rig.rebuilder.describe()["m"]["adopted"], HANG_S, message="adopted")
    handle = rig.slot.handle
    assert handle is not fallback and handle is not None and handle.runtime_label == "tensorrt"
    assert switch_records(rig) == [("ground", "switched"), ("inferd: build b1", "switched")]
    assert rig.alerts == [] and len(rig.builds) == 1
    assert rig.rebuilder.describe()["m"]["adoption_pending"] is False


@pytest.mark.parametrize("claimed_tries", [ADOPTION_TRIES - 1, ADOPTION_TRIES])
def test_adoption_tries_are_bounded_and_never_rebuild(claimed_tries: int) -> None:
    """Each try refused as claimed is tried again, at most ``ADOPTION_TRIES`` in all: then
    it is logged as abandoned (WARNING) and raised to the ground as
    ``engine_build_not_adopted`` (before: no alert, so a model left degraded said
    nothing past the journal), with no build (the engine exists: ``runtime.switch``
    adopts it).  A switch with no switcher behind it to say when the
    claim ends (a fake) is tried again at once."""
    tried: list[str] = []
    alerts: list[Alert] = []
    builds: list[dict[str, Any]] = []

    def switch(model: str, label: str, requested_by: str) -> dict[str, Any]:
        tried.append(requested_by)
        if len(tried) <= claimed_tries:
            raise ModelClaimedError(Code.FAILED_PRECONDITION, "a switch is in progress")
        return {}

    rebuilder = FallbackRebuilder(
        start_build=starting(builds),
        switch=switch,
        alert=alerts.append,
        can_build=lambda: True,
        backoff_s=0.0,
        max_attempts=3,
    )
    rebuilder.on_fallback("demo", "engine missing")
    with structlog.testing.capture_logs() as logs:
        rebuilder.on_build_finished(Finished("b1"))
    rebuilder.stop()
    assert len(builds) == 1
    assert len(tried) == min(claimed_tries + 1, ADOPTION_TRIES)
    abandoned = logged(logs, "engine_rebuild_adoption_abandoned")
    adopted = claimed_tries < ADOPTION_TRIES
    if adopted:
        assert alerts == []
    else:
        (alert,) = alerts
        assert (alert.level, alert.code, alert.fields) == (
            "WARNING",
            "engine_build_not_adopted",
            {"model": "demo", "build_id": "b1"},
        )
        assert "a switch is in progress" in alert.message and "runtime.switch" in alert.message
        assert alert.code in pinned_alert_codes()
    assert rebuilder.describe()["demo"]["adopted"] is adopted
    assert len(abandoned) == (0 if adopted else 1)
    assert len(logged(logs, "engine_rebuild_adoption_deferred")) == min(
        claimed_tries, ADOPTION_TRIES - 1
    )
    if abandoned:
        assert abandoned[0]["log_level"] == "warning" and abandoned[0]["build_id"] == "b1"


# -- 2. a retry scheduled before an operator's switch -----------------------------------


@pytest.mark.parametrize("operator_label", ["onnx_trt_ep", "tensorrt"])
def test_an_operators_switch_cancels_a_retry_not_yet_started(
    rig: Rig,  # noqa: F811
    operator_label: str,
) -> None:
    """A build failed and its retry waits out the backoff; the ground then switches the
    model.  The retry is cancelled and logged, and a timer that fires as it is cancelled
    starts nothing.  A later failover asks for a build again.  Before: the retry stayed
    scheduled and started a build whose engine would not be adopted (GPU time spent)."""
    # A retry's backoff that never fires by itself in this test.
    rebuilder = rebuilder_of(rig.switcher, rig.alerts, rig.builds, backoff_s=HANG_S * 10)
    try:
        rebuilder.on_fallback("m", "engine missing")
        rebuilder.on_build_finished(Finished("b1", model="m", state="failed", error="boom"))
        assert rebuilder.describe()["m"]["retry_scheduled"] is True
        timer = rebuilder._models["m"].timer
        assert timer is not None
        with structlog.testing.capture_logs() as logs:
            assert isinstance(switching(rig, operator_label).get(timeout=HANG_S), dict)
        assert rebuilder.describe()["m"]["retry_scheduled"] is False
        assert timer.finished.is_set()  # cancelled
        (line,) = logged(logs, "engine_rebuild_retry_cancelled")
        assert line["model"] == "m" and line["attempts"] == 1
        timer.function(*timer.args, **timer.kwargs)  # it fired as it was cancelled
        assert len(rig.builds) == 1
        assert [alert.code for alert in rig.alerts] == ["engine_build_failed"]  # the build's
        # The operator's engine fails over: the rule lifts, and the model is rebuilt.
        fallback = EngineHandle(50, "onnx_trt_ep", "0" * 64, SPEC, SPEC, is_fallback=True)
        rig.slot.swap(Released(), fallback, "tensorrt failed while serving")  # type: ignore[arg-type]
        rebuilder.on_fallback("m", "tensorrt failed while serving")
        assert len(rig.builds) == 2
    finally:
        rebuilder.stop()
