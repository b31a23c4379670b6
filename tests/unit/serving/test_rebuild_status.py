"""What the background rebuilder does about each model is in ``status``
(``status.builds.rebuilds``), its metrics and ``inferctl status``: before, a rebuild
waiting for ``builds.max_running``, a retry's countdown and a rebuilder that gave up
showed only in the log and the alerts, and ``builds.max_running`` with the builds
running only in ``build.status``.  The real ``FallbackRebuilder`` with a scripted
``build.start``."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inferd.engine_build.build_record import BuildFinished
from inferd.serving.rebuild_state import REBUILD_STATES, RebuiltModel
from inferd.types import Alert
from inferd_client import cli_format
from tests.integration.test_schemas import assert_valid
from tests.unit.metrics.test_families import scrape, status
from tests.unit.serving.test_rebuild_start_faults import _failed, _room
from tests.unit.serving.test_review2_serving import make_rebuilder

BACKOFF_S = 100.0


def _completed(build_id: str, model: str) -> BuildFinished:
    return BuildFinished(
        build_id, model, "completed", "tensorrt", True, None, Path("x"), "inferd", None
    )


def test_a_model_is_shown_through_each_state_of_its_rebuilds() -> None:
    replies: list[Mapping[str, Any] | Exception] = [_room(), {"build_id": "b1"}, {"build_id": "b2"}]

    def start_build(_header: dict[str, Any]) -> dict[str, Any]:
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    alerts: list[Alert] = []
    rebuilder = make_rebuilder(alerts, start_build=start_build, backoff_s=BACKOFF_S, max_attempts=2)

    def shown() -> dict[str, Any]:
        return rebuilder.describe()["m"]

    assert rebuilder.describe() == {}  # no model fell back yet
    # Refused for room: it waits, no attempt used, its reason shown.
    assert rebuilder.on_fallback("m", "no engine for this host") is None
    waiting = shown()
    assert (waiting["state"], waiting["attempts"]) == ("waiting_for_room", 0)
    assert waiting["waiting_for_room"] == "no engine for this host"
    # Another build's end made room: it builds.
    rebuilder.on_build_finished(_failed("b0", "other"))
    building = shown()
    assert (building["state"], building["build_id"], building["attempts"]) == ("building", "b1", 1)
    assert building["waiting_for_room"] is None
    # Its build failed: a retry after the backoff, counting down.
    rebuilder.on_build_finished(_failed("b1", "m"))
    retry = shown()
    assert (retry["state"], retry["retry_scheduled"], retry["build_id"]) == (
        "retry_scheduled",
        True,
        None,
    )
    assert 0 < retry["retry_in_s"] <= BACKOFF_S
    assert BACKOFF_S - retry["retry_in_s"] < 30  # measured from its scheduling, not 0
    # An operator's switch cancels the retry: nothing asked for.
    rebuilder.operator_chose("m")
    idle = shown()
    assert (idle["state"], idle["retry_scheduled"], idle["retry_in_s"]) == ("idle", False, None)
    # A later fallback builds again, and its engine is adopted.
    assert rebuilder.on_fallback("m", "tensorrt failed while serving") is None
    assert (shown()["state"], shown()["build_id"]) == ("building", "b2")
    rebuilder.on_build_finished(_completed("b2", "m"))
    assert (shown()["state"], shown()["adopted"], shown()["attempts"]) == ("adopted", True, 2)
    # Its attempts used, a further fallback gives up, and says so.
    assert rebuilder.on_fallback("m", "tensorrt failed while serving") is not None
    assert (shown()["state"], shown()["attempts"]) == ("gave_up", 2)
    assert [a.code for a in alerts] == ["engine_build_failed", "engine_build_gave_up"]
    rebuilder.stop()


def test_the_first_state_that_holds_is_shown() -> None:
    """A built engine waiting for its adoption is shown so even with a build running;
    a model whose attempts are used but whose engine serves is ``adopted``."""
    finished = _completed("b1", "m")
    timer = threading.Timer(BACKOFF_S, lambda: None)
    assert RebuiltModel(build_id="b2", pending=(finished, 1)).state(3) == "building"
    assert RebuiltModel(pending=(finished, 1), waiting="x").state(3) == "adoption_pending"
    assert RebuiltModel(waiting="x", timer=timer).state(3) == "waiting_for_room"
    assert RebuiltModel(timer=timer, attempts=3).state(3) == "retry_scheduled"
    assert RebuiltModel(adopted=True, attempts=3).state(3) == "adopted"
    assert RebuiltModel(attempts=3).state(3) == "gave_up"
    assert RebuiltModel(attempts=2).state(3) == "idle"
    shown = RebuiltModel(timer=timer, retry_due=50.0).described(3, now=20.0)
    assert shown["retry_in_s"] == 30.0
    assert RebuiltModel(timer=timer, retry_due=50.0).described(3, now=60.0)["retry_in_s"] == 0.0


REBUILDS = {
    "enabled": True,
    "max_attempts": 3,
    "backoff_s": 60.0,
    "models": {
        "det": {
            "state": "retry_scheduled",
            "attempts": 1,
            "build_id": None,
            "retry_scheduled": True,
            "retry_in_s": 41.5,
            "waiting_for_room": None,
            "adoption_pending": False,
            "adopted": False,
        },
        "seg": {
            "state": "waiting_for_room",
            "attempts": 0,
            "build_id": None,
            "retry_scheduled": False,
            "retry_in_s": None,
            "waiting_for_room": "no engine for this host",
            "adoption_pending": False,
            "adopted": False,
        },
    },
}
RUNNING_LIMIT = {"max_running": 2, "running": 2, "refused": 5}


def test_metrics_carry_the_running_builds_and_each_rebuilds_state() -> None:
    document = status()
    document["builds"] |= {"running_limit": RUNNING_LIMIT, "rebuilds": REBUILDS}
    got = scrape(document)
    assert got[("inferd_builds_running", ())] == 2
    assert got[("inferd_builds_max_running", ())] == 2
    assert got[("inferd_build_running_limit_refused_total", ())] == 5
    states = {
        labels: value for (name, labels), value in got.items() if name == "inferd_rebuild_state"
    }
    assert len(states) == 2 * len(REBUILD_STATES)
    assert {labels for labels, value in states.items() if value == 1} == {
        (("model", "det"), ("state", "retry_scheduled")),
        (("model", "seg"), ("state", "waiting_for_room")),
    }
    assert got[("inferd_rebuild_attempts", (("model", "det"),))] == 1
    assert got[("inferd_rebuild_attempts", (("model", "seg"),))] == 0
    # Rebuilds off: no series for them.
    document["builds"]["rebuilds"] = {"enabled": False, "models": {}}
    assert not [key for key in scrape(document) if key[0] == "inferd_rebuild_state"]


def test_inferctl_status_shows_the_running_builds_and_each_rebuild() -> None:
    builds = {
        "start_refused": {},
        "start_limit": {"burst": 2, "refill_s": 30.0, "refused": 0},
        "running_limit": RUNNING_LIMIT,
        "rebuilds": REBUILDS,
    }
    text = "\n".join(cli_format.status({"models": [], "builds": builds}))
    assert "; running 2 of 2 (builds.max_running refused 5)" in text
    assert (
        "rebuilds: det: retry in 41.5 s (1 of 3 attempts); seg: waiting for "
        "builds.max_running (no engine for this host; 0 of 3 attempts)"
    ) in " ".join(text.split())
    off = {**builds, "rebuilds": {"enabled": False, "models": {}}}
    assert "off (runtime.rebuild_on_fallback is false)" in "\n".join(
        cli_format.status({"models": [], "builds": off})
    )
    none = {**builds, "rebuilds": {**REBUILDS, "models": {}}}
    assert "none (no model fell back since start)" in "\n".join(
        cli_format.status({"models": [], "builds": none})
    )


def test_a_start_and_an_adoption_on_their_way_are_shown_as_such() -> None:
    """Between its ``build.start`` and the build id, and while its engine is switched to
    (seconds of TensorRT on a Jetson), a model read ``idle`` or, on its last attempt,
    ``gave_up`` (review R3, F3): a ground rule on ``gave_up`` fired falsely."""
    in_start, go_on = threading.Event(), threading.Event()
    seen: list[str] = []

    def start_build(_header: dict[str, Any]) -> dict[str, Any]:
        in_start.set()
        assert go_on.wait(10)
        return {"build_id": "b1"}

    def switch(*_args: Any) -> dict[str, Any]:
        seen.append(rebuilder.describe()["m"]["state"])
        return {}

    rebuilder = make_rebuilder(
        [], start_build=start_build, switch=switch, backoff_s=BACKOFF_S, max_attempts=1
    )
    asking = threading.Thread(target=rebuilder.on_fallback, args=("m", "engine missing"))
    asking.start()
    assert in_start.wait(10)
    assert rebuilder.describe()["m"]["state"] == "building"  # not gave_up (1 of 1)
    go_on.set()
    asking.join(10)
    rebuilder.on_build_finished(_completed("b1", "m"))
    assert seen == ["adoption_pending"]  # not gave_up while switched to
    assert rebuilder.describe()["m"]["state"] == "adopted"


def test_a_stopped_rebuilder_shows_no_retry_and_a_zero_backoff_is_valid() -> None:
    """``stop`` cancelled the retry timers but left them set: status showed a retry
    that would never run while the daemon stopped (review R3, F5).  And a
    ``rebuild_backoff_s`` of 0, a valid config, made every status reply invalid
    against its schema (F2)."""
    rebuilder = make_rebuilder([], backoff_s=BACKOFF_S)
    rebuilder.on_fallback("m", "engine missing")
    rebuilder.on_build_finished(_failed("b1", "m"))
    assert rebuilder.describe()["m"]["state"] == "retry_scheduled"
    rebuilder.stop()
    shown = rebuilder.describe()["m"]
    assert (shown["state"], shown["retry_scheduled"], shown["retry_in_s"]) == ("idle", False, None)
    section = {"enabled": True, "max_attempts": 3, "backoff_s": 0.0, "models": {"m": shown}}
    assert_valid("status_reply.json#/$defs/builds/properties/rebuilds", section)
