"""``inferctl top`` shows what the bounds refused (DESIGN.md 210): ``build.start``'s
refusals by code in the builds table's title, the ``shm.sock`` connections refused
over ``shm.max_connections_per_uid`` by uid on the shared-memory line, and the
descriptor guard's floods, with those ended past a fair share, on a line of its own."""

from __future__ import annotations

from typing import Any

from inferd_client.top import TopState
from tests.unit.client.test_top import SHM, screen, status

GUARD = {
    "limit": 65536,
    "threshold": 64512,
    "period_s": 0.5,
    "episodes": 0,
    "connections_ended": 0,
    "share_level": 16384,
    "share_target": 768,
    "share_passes": 0,
    "connections_ended_past_share": 0,
}


def shown(width: int = 160, **document: Any) -> str:
    state = TopState()
    state.on_status({**status(10), **document}, [], at=10.0)
    return screen(state, width)


def line_of(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.lstrip().startswith(start))


def test_build_start_refusals_are_in_the_builds_title_by_code() -> None:
    builds = {"start_refused": {}, "start_limit": {"burst": 2, "refill_s": 30.0, "refused": 0}}
    assert line_of(shown(builds=builds), "builds").strip() == "builds"
    builds["start_refused"] = {"RESOURCE_EXHAUSTED": 3, "NOT_FOUND": 1}
    title = line_of(shown(builds=builds), "builds")
    assert "build.start refused 4 (NOT_FOUND 1, RESOURCE_EXHAUSTED 3)" in title


def test_shm_refusals_over_a_uids_connections_are_shown_by_uid() -> None:
    shm = {**SHM, "refused": {"RESOURCE_EXHAUSTED": 6}, "refused_by_uid": {}}
    line = line_of(shown(shm=shm), "shared memory")
    assert "6 refused" in line and "uid" not in line
    shm["refused_by_uid"] = {"1000": 4, "other": 1}
    line = line_of(shown(shm=shm), "shared memory")
    assert "6 refused (5 over a uid's connections: uid 1000: 4, uid other: 1)" in line


def test_the_descriptor_guards_floods_and_fair_share_passes_are_shown() -> None:
    assert "descriptor guard" not in shown()  # an older daemon: no line
    quiet = {"descriptor_guard": GUARD}
    assert line_of(shown(security=quiet), "descriptor guard").strip() == (
        "descriptor guard  no floods"
    )
    flooded = {
        **GUARD,
        "episodes": 2,
        "connections_ended": 9,
        "share_passes": 3,
        "connections_ended_past_share": 5,
    }
    line = line_of(shown(security={"descriptor_guard": flooded}), "descriptor guard")
    assert "2 floods, 9 connections ended, 5 past a fair share in 3 passes" in line


def test_every_count_on_an_80_column_terminal() -> None:
    """The lines wrap rather than lose a count."""
    text = " ".join(
        shown(
            80,
            shm={**SHM, "refused": {"RESOURCE_EXHAUSTED": 6}, "refused_by_uid": {"1000": 5}},
            security={"descriptor_guard": {**GUARD, "episodes": 1, "connections_ended": 4}},
            builds={"start_refused": {"INVALID_ARGUMENT": 2}},
        ).split()
    )
    assert "(5 over a uid's connections: uid 1000: 5)" in text
    assert "1 floods, 4 connections ended, 0 past a fair share in 0 passes" in text
    assert "build.start refused 2 (INVALID_ARGUMENT 2)" in text


def test_shm_denials_by_uid_and_released_regions_are_shown() -> None:
    line = line_of(shown(shm={**SHM, "denied_by_uid": {}, "releasing_regions": 0}), "shared memory")
    assert "denied" not in line and "released" not in line
    shm = {**SHM, "denied_by_uid": {"1001": 2, "other": 1}, "releasing_regions": 3}
    line = line_of(shown(shm=shm), "shared memory")
    assert "3 denied (uid 1001: 2, uid other: 1)" in line
    assert "3 released, not yet unmapped" in line
