"""A background rebuild refused because a build of the same model runs (an operator's:
one build per model at once) waits for that build's end: a trusted engine it made is
adopted as the rebuild's own, any other end asks for the rebuild's own build.  Before,
the refusal (``FAILED_PRECONDITION``) was alerted ``engine_build_failed`` ("could not
start") and dropped: the model stayed on the fallback for the rest of the run unless an
operator switched it (entry 330's "Left")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from inferd.engine_build.build_record import BuildFinished
from inferd.errors import ModelBuildRunningError
from inferd.serving.rebuild import REQUESTED_BY
from inferd.serving.switching import NotPreparedError
from inferd.types import Alert
from inferd_wire.protocol import Code
from tests.conftest import wait_until
from tests.unit.engine_build.test_builds_max_running import (  # noqa: F401  # fixtures
    _Daemon,
    _end,
    _start,
    children,
    daemon,
)
from tests.unit.serving.test_review2_serving import make_rebuilder

#: What the switch raises for an engine it does not find (in ``BUILD_FIXES``).
MISSING = "EngineMissingError"


def test_a_rebuild_waits_for_the_models_running_build_then_builds_its_own(
    daemon: _Daemon,  # noqa: F811
) -> None:
    """A real ``BuildManager``: the operator's build of "a" runs as "a" falls back; the
    rebuild waits (no alert, no attempt), and once the operator cancels their build it
    starts its own."""
    operators = _start(daemon.manager, "a")
    with structlog.testing.capture_logs() as logs:
        assert daemon.rebuilder.on_fallback("a", "no engine for this host") is None
    (waiting,) = [e for e in logs if e["event"] == "engine_rebuild_waiting"]
    assert (waiting["model"], waiting["on"]) == ("a", operators)
    assert "is still running" in waiting["refusal"]
    shown = daemon.rebuilder.describe()["a"]
    assert (shown["state"], shown["waiting_on_build"], shown["attempts"]) == (
        "waiting_for_build",
        operators,
        0,
    )
    assert shown["waiting_for_room"] is None and daemon.alerts == []
    _end(daemon.manager, operators)  # cancelled by its operator: no engine to adopt
    rebuild = wait_until(
        lambda: daemon.rebuilder.describe()["a"]["build_id"], message="the rebuild started"
    )
    build = daemon.manager._get(rebuild)
    assert (build.model, build.requested_by, build.state) == ("a", REQUESTED_BY, "running")
    assert daemon.rebuilder.describe()["a"]["attempts"] == 1 and daemon.alerts == []


def _ended(build_id: str, model: str, state: str, trusted: bool) -> BuildFinished:
    return BuildFinished(
        build_id, model, state, "tensorrt", trusted, None, Path("x"), "ground", None
    )


class _Rig:
    """The real rebuilder; ``build.start`` refuses "m" while ``running`` is set."""

    def __init__(self) -> None:
        self.running: str | None = "b1-op"
        self.started: list[str] = []
        self.switched: list[tuple[str, str, str]] = []
        self.alerts: list[Alert] = []
        self.rebuilder = make_rebuilder(
            self.alerts, start_build=self._start_build, switch=self._switch, backoff_s=3600.0
        )

    def _start_build(self, header: dict[str, Any]) -> dict[str, Any]:
        if self.running is not None:
            raise ModelBuildRunningError(self.running, header["model"])
        self.started.append(header["model"])
        return {"build_id": f"b{len(self.started) + 1}-own"}

    def _switch(self, model: str, runtime: str, requested_by: str) -> dict[str, Any]:
        self.switched.append((model, runtime, requested_by))
        return {}

    def end(self, state: str, trusted: bool, build_id: str = "b1-op", model: str = "m") -> None:
        if build_id == self.running:
            self.running = None
        self.rebuilder.on_build_finished(_ended(build_id, model, state, trusted))


def test_the_models_build_that_made_a_trusted_engine_is_adopted_not_built_again() -> None:
    rig = _Rig()
    assert rig.rebuilder.on_fallback("m", "no engine for this host") is None
    assert ModelBuildRunningError("b1-op", "m").code == Code.FAILED_PRECONDITION
    rig.end("failed", False, build_id="b0-x", model="other")  # another build's end
    assert rig.rebuilder.describe()["m"]["state"] == "waiting_for_build"
    assert rig.started == [] and rig.switched == []
    with structlog.testing.capture_logs() as logs:
        rig.end("completed", True)
    assert [e["build_id"] for e in logs if e["event"] == "engine_rebuild_takes_build"] == ["b1-op"]
    assert rig.switched == [("m", "tensorrt", "inferd: build b1-op")]
    assert rig.started == [] and rig.alerts == []  # adopted: no build of its own
    shown = rig.rebuilder.describe()["m"]
    assert (shown["state"], shown["attempts"], shown["waiting_on_build"]) == ("adopted", 1, None)


def test_the_models_build_that_made_no_trusted_engine_is_followed_by_the_rebuilds_own() -> None:
    for state, trusted in (("failed", False), ("cancelled", False), ("completed", False)):
        rig = _Rig()
        rig.rebuilder.on_fallback("m", "no engine for this host")
        rig.end(state, trusted)
        assert rig.started == ["m"] and rig.switched == [], state
        shown = rig.rebuilder.describe()["m"]
        assert (shown["state"], shown["build_id"], shown["attempts"]) == (
            "building",
            "b2-own",
            1,
        )
        assert rig.alerts == []
        rig.rebuilder.stop()


def test_an_operators_switch_cancels_a_rebuild_waiting_for_the_models_build() -> None:
    rig = _Rig()
    rig.rebuilder.on_fallback("m", "no engine for this host")
    rig.rebuilder.operator_chose("m")
    assert rig.rebuilder.describe()["m"]["state"] == "idle"
    rig.end("completed", True)
    assert rig.started == [] and rig.switched == []  # their choice stands


def test_a_taken_build_whose_engine_is_not_the_models_is_followed_by_the_rebuilds_own() -> None:
    """The operator built with another build config (fp16 for an fp32 model): the switch
    locates the model's own engine and finds none.  Before, the adoption's failure was a
    "background engine build" failed, an attempt used and a retry after the backoff (with
    one attempt: given up, never built; review R3, F1).  Now the rebuild's own build
    starts at once, no alert, the operator's build no attempt."""
    rig = _Rig()
    refused: list[str] = []

    def engine_missing(model: str, runtime: str, requested_by: str) -> dict[str, Any]:
        refused.append(requested_by)
        raise NotPreparedError("no engine for this host (expected demo_fp32.engine)", MISSING)

    rig.rebuilder._switch = engine_missing
    rig.rebuilder.on_fallback("m", "no engine for this host")
    with structlog.testing.capture_logs() as logs:
        rig.end("completed", True)
    assert refused == ["inferd: build b1-op"]
    assert [e["model"] for e in logs if e["event"] == "engine_rebuild_take_failed"] == ["m"]
    assert rig.started == ["m"] and rig.alerts == []
    shown = rig.rebuilder.describe()["m"]
    assert (shown["state"], shown["build_id"], shown["attempts"]) == ("building", "b2-own", 1)
    rig.rebuilder.stop()
