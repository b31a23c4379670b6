"""``build.start``'s refusals by code (``status.builds``), the ``shm.sock``
refusals over ``shm.max_connections_per_uid`` by uid (``status.shm.refused_by_uid``)
and every ``shm.sock`` refusal by code (``status.shm.refused``) are exported: the
first were only in ``build.status``, the second had no label, the third was only
in ``status``."""

from __future__ import annotations

from inferd_wire.protocol import Code
from tests.unit.metrics.test_families import scrape, status

SHM = {
    "enabled": True,
    "connections": 2,
    "connections_by_uid": {"1000": 2},
    "max_connections_per_uid": 2,
    "refused_per_uid": 6,
    "refused_by_uid": {"1000": 4, "1001": 1, "other": 1},
    "refused": {"RESOURCE_EXHAUSTED": 6},
    "mapped_bytes": 0,
    "releasing_bytes": 0,
    "requests": 0,
    "in_flight": 0,
    "unroutable_replies": 0,
    "closed_not_reading": 0,
    "closing": {"waiting": 0, "blocked_s": 0, "connections_closed_for_backlog": 0},
}


def test_build_start_refusals_are_a_counter_by_code_with_every_code_present() -> None:
    document = status()
    document["builds"] |= {
        "start_refused": {"RESOURCE_EXHAUSTED": 3, "NOT_FOUND": 1},
        "start_limit": {"burst": 2, "refill_s": 30.0, "refused": 2},
    }
    got = scrape(document)
    refused = {
        dict(labels)["code"]: value
        for (name, labels), value in got.items()
        if name == "inferd_build_start_refused_total"
    }
    assert refused == {code.value: 0 for code in Code} | {"RESOURCE_EXHAUSTED": 3, "NOT_FOUND": 1}
    assert got[("inferd_build_start_rate_limited_total", ())] == 2


def test_shm_refusals_per_uid_carry_the_uid_or_other() -> None:
    document = status()
    document["shm"] = SHM
    got = scrape(document)
    by_uid = {
        labels: value
        for (name, labels), value in got.items()
        if name == "inferd_shm_connections_refused_per_uid_total"
    }
    over = ("code", "RESOURCE_EXHAUSTED")
    assert by_uid == {
        (over, ("uid", "1000")): 4,
        (over, ("uid", "1001")): 1,
        (over, ("uid", "other")): 1,
    }


def test_shm_refusals_by_the_allow_list_carry_the_uid_and_their_code() -> None:
    """``status.shm.denied_by_uid`` (``security.infer_allow`` at accept) is the same
    family's ``PERMISSION_DENIED`` series, beside the per-uid bound's."""
    document = status()
    document["shm"] = {**SHM, "denied_by_uid": {"1000": 2, "4242": 3, "other": 1}}
    denied = {
        dict(labels)["uid"]: value
        for (name, labels), value in scrape(document).items()
        if name == "inferd_shm_connections_refused_per_uid_total"
        and dict(labels)["code"] == "PERMISSION_DENIED"
    }
    assert denied == {"1000": 2, "4242": 3, "other": 1}


def test_shm_refusals_are_a_counter_by_code_with_every_code_present() -> None:
    """``status.shm.refused``: connections refused at accept (``PERMISSION_DENIED``
    for ``security.infer_allow``, ``RESOURCE_EXHAUSTED`` for a bound) and messages
    refused before any model saw them, each code a series from 0 (9 in all)."""
    document = status()
    document["shm"] = {
        **SHM,
        "refused": {"PERMISSION_DENIED": 2, "RESOURCE_EXHAUSTED": 7, "INVALID_ARGUMENT": 1},
    }
    refused = {
        dict(labels)["code"]: value
        for (name, labels), value in scrape(document).items()
        if name == "inferd_shm_refused_total"
    }
    assert refused == {code.value: 0 for code in Code} | {
        "PERMISSION_DENIED": 2,
        "RESOURCE_EXHAUSTED": 7,
        "INVALID_ARGUMENT": 1,
    }
