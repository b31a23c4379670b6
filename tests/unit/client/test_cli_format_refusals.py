"""``inferctl status`` shows ``build.start``'s refusals by code (``status.builds``)
and the shm refusals over ``shm.max_connections_per_uid`` by uid."""

from __future__ import annotations

import re

from inferd_client import cli_format


def test_status_shows_build_start_refusals_by_code_and_its_rate() -> None:
    builds = {
        "start_refused": {"RESOURCE_EXHAUSTED": 3, "NOT_FOUND": 1},
        "start_limit": {"burst": 2, "refill_s": 30.0, "refused": 2},
    }
    text = "\n".join(cli_format.status({"models": [], "builds": builds}))
    assert re.search(
        r"^builds: +build.start refused 4 \(NOT_FOUND 1, RESOURCE_EXHAUSTED 3\), "
        r"rate limited 2 \(burst 2, one every 30 s\)$",
        text,
        re.M,
    )
    none = {**builds, "start_refused": {}, "start_limit": {**builds["start_limit"], "refused": 0}}
    text = "\n".join(cli_format.status({"models": [], "builds": none}))
    assert "build.start refused 0, rate limited 0 (burst 2, one every 30 s)" in text


def test_the_shm_refusals_per_uid_are_shown_by_uid() -> None:
    shm = {"enabled": True, "regions": [], "connections_by_uid": {}, "max_connections_per_uid": 8}
    refused = {"refused_per_uid": 4, "refused_by_uid": {"1000": 3, "other": 1}}
    text = "\n".join(cli_format.status({"models": [], "shm": {**shm, **refused}}))
    assert (
        "  connections per uid (at most 8): none; 4 refused over it (uid 1000: 3, uid other: 1)"
        in text
    )


def test_the_shm_denials_by_uid_and_released_regions_are_shown() -> None:
    shm = {"enabled": True, "regions": [], "connections_by_uid": {}, "max_connections_per_uid": 8}
    quiet = "\n".join(cli_format.status({"models": [], "shm": shm}))
    assert "denied" not in quiet and "released" not in quiet
    more = {"denied_by_uid": {"1001": 2}, "releasing_regions": 2, "releasing_bytes": 8192}
    text = "\n".join(cli_format.status({"models": [], "shm": {**shm, **more}}))
    assert "  connections denied (PERMISSION_DENIED): uid 1001: 2" in text
    assert "  released, not yet unmapped: 2 regions, 8.0 KiB" in text
