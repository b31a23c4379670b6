"""Every daemon build has a deadline (``builds.max_duration_s``, or a shorter
``timeout_s`` of its ``build.start``), enforced by the daemon: at it the build is
cancelled with source ``timeout`` (status, terminal ``build`` event and FDR record
say so), and a child that ignores the cancel is killed after the grace.  Before,
nothing bounded a build: a hung one held its child, its model's one build and its
GPU memory until an operator's ``build.cancel``.

The supervisor runs real simulated build children here (no daemon): a slow
simulated build and a deadline of a fraction of a second, waited for by the
build's own end, never by a sleep."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from inferd.config import BuildsConfig
from inferd.engine_build.build_record import Build, BuildFinished, describe
from inferd.engine_build.supervisor import BuildManager
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S
from tests.integration.test_daemon_builds import OPERATOR
from tests.integration.test_review2_build_supervisor import _gone, _manager
from tests.integration.test_schemas import assert_valid

pytestmark = pytest.mark.integration

#: Seconds per simulated step: the build runs for many seconds, the deadline 0.2 s.
SLOW = {"step_s": 0.2}
DEADLINE_S = 0.2


def _start(manager: BuildManager, **arguments: Any) -> tuple[dict[str, Any], Build]:
    header = {"model": "demo", "builder": "simulated", "simulation": SLOW, **arguments}
    reply = manager.start(header, OPERATOR)
    return reply, manager._get(reply["build_id"])


def _files_left(tmp_path: Path) -> list[str]:
    root = tmp_path / "state" / "builds" / "demo"
    return sorted(p.name for p in root.rglob("*") if p.is_file() and ".build.json" not in p.name)


def test_a_build_past_its_timeout_is_cancelled_with_source_timeout(
    tmp_path: Path, demo_model: Path
) -> None:
    published: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    finished: list[BuildFinished] = []
    manager = _manager(
        tmp_path,
        demo_model,
        grace_s=HANG_S,
        published=published,
        records=records,
        finished=finished,
    )
    reply, build = _start(manager, timeout_s=DEADLINE_S)
    assert reply["deadline_s"] == DEADLINE_S
    assert build.done.wait(HANG_S), "the build ran past its deadline"
    status = describe(build)
    assert status["state"] == "cancelled" and status["cancel_source"] == "timeout"
    assert status["escalated"] is False  # it stopped by itself: no kill was needed
    assert status["deadline_s"] == DEADLINE_S
    assert status["cancel_reason"] == "the build ran past its deadline of 0.2 s (timeout_s)"
    assert_valid(
        "build_status_reply.json#/$defs/ok",
        {"v": 1, "id": 1, "ok": True, "result": {"build": status}},
    )
    terminal = published[-1]
    assert terminal["type"] == "cancelled" and terminal["detail"]["cancelSource"] == "timeout"
    assert "deadline" in terminal["detail"]["cancelReason"]
    (record,) = records
    assert record["outcome"] == "cancelled" and record["cancel_source"] == "timeout"
    assert record["deadline_s"] == DEADLINE_S and record["cleanup_status"] == "cleaned"
    assert [(f.state, f.cancel_source) for f in finished] == [("cancelled", "timeout")]
    assert _files_left(tmp_path) == []


def test_a_child_ignoring_the_deadlines_cancel_is_killed_after_the_grace(
    tmp_path: Path, demo_model: Path
) -> None:
    """The deadline is the daemon's, not the child's: a child that never stops by
    itself is killed with its process group, and what it wrote is removed."""
    grace_s = 0.5
    published: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    manager = _manager(
        tmp_path,
        demo_model,
        grace_s=grace_s,
        published=published,
        records=records,
        limits=BuildsConfig(max_duration_s=DEADLINE_S),
    )
    reply, build = _start(manager, simulation={**SLOW, "ignore_cancel": True})
    assert reply["deadline_s"] == DEADLINE_S  # builds.max_duration_s: no timeout_s
    assert build.done.wait(HANG_S), "a child ignoring cancel outlived its deadline"
    status = describe(build)
    assert status["state"] == "cancelled" and status["cancel_source"] == "timeout"
    assert status["escalated"] is True and build.exit_code == -signal.SIGKILL
    assert "(builds.max_duration_s)" in status["cancel_reason"]
    assert status["cancel_to_exit_ms"] >= grace_s * 1000
    assert _gone(reply["pid"])
    assert published[-1]["detail"]["escalated"] is True
    (record,) = records
    assert record["cancel_source"] == "timeout" and record["escalated"] is True
    assert _files_left(tmp_path) == []


@pytest.mark.parametrize(
    ("timeout_s", "got"),
    [
        (0, "got 0"),
        (-1.0, "got -1.0"),
        (float("nan"), "got nan"),
        (float("inf"), "got inf"),
        (3600.5, "got 3600.5"),
        (True, "got a bool"),
        ("60", "got a str"),
    ],
)
def test_a_timeout_that_does_not_shorten_the_bound_is_refused_and_starts_nothing(
    tmp_path: Path, demo_model: Path, timeout_s: object, got: str
) -> None:
    limits = BuildsConfig(max_duration_s=3600, start_burst=1)
    manager = _manager(tmp_path, demo_model, limits=limits)
    with pytest.raises(ProtocolError) as refused:
        manager.start({"model": "demo", "builder": "simulated", "timeout_s": timeout_s}, OPERATOR)
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert refused.value.message == (
        "'timeout_s' must be a number of seconds more than 0 and at most 3600 "
        f"(builds.max_duration_s, which it may only shorten), {got}"
    )
    listing = manager.status({})
    assert listing["builds"] == [] and listing["max_duration_s"] == 3600
    # The peer's one start was not taken: refused before the admission.
    assert manager.admission.start_limit.retry_after(OPERATOR.key) is None
