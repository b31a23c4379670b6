"""The bounds whose counts ``status`` reports are exported too: refused
``runtime.switch`` (DESIGN.md 199), the descriptor guard (202), ``shm.sock``
connections per uid (203) and the bytes the recorder's queue holds (189)."""

from __future__ import annotations

from tests.unit.metrics.test_families import scrape, status


def test_switch_refusals_and_the_descriptor_guard_are_counters() -> None:
    document = status()
    security = document["security"]
    security["switch_limit"]["refused"] = 7
    security["descriptor_guard"].update(
        episodes=2, connections_ended=4093, share_passes=3, connections_ended_past_share=1200
    )
    got = scrape(document)
    assert got[("inferd_runtime_switch_rate_limited_total", ())] == 7
    assert got[("inferd_descriptor_guard_episodes_total", ())] == 2
    assert got[("inferd_descriptor_guard_connections_ended_total", ())] == 4093
    assert got[("inferd_descriptor_guard_share_passes_total", ())] == 3
    assert got[("inferd_descriptor_guard_connections_ended_past_share_total", ())] == 1200


def test_no_descriptor_guard_series_before_the_daemon_started() -> None:
    document = status()
    document["security"]["descriptor_guard"] = None  # the schema's "before the daemon started"
    names = {name for name, _ in scrape(document)}
    assert not any(name.startswith("inferd_descriptor_guard") for name in names)
    assert "inferd_runtime_switch_rate_limited_total" in names


def test_shm_connections_per_uid_carry_only_the_uids_present() -> None:
    document = status()
    document["shm"] = {
        "enabled": True,
        "connections": 9,
        "connections_by_uid": {"1000": 8, "1001": 1},
        "max_connections_per_uid": 8,
        "refused_per_uid": 3,
        "refused_by_uid": {"1000": 3},
        "mapped_bytes": 0,
        "releasing_bytes": 0,
        "requests": 0,
        "in_flight": 0,
        "unroutable_replies": 0,
        "closed_not_reading": 0,
        "refused": {},
        "closing": {"waiting": 0, "blocked_s": 0, "connections_closed_for_backlog": 0},
    }
    got = scrape(document)
    by_uid = {labels: value for (name, labels), value in got.items() if name.endswith("_by_uid")}
    assert by_uid == {(("uid", "1000"),): 8, (("uid", "1001"),): 1}
    assert got[("inferd_shm_max_connections_per_uid", ())] == 8
    refused = (("code", "RESOURCE_EXHAUSTED"), ("uid", "1000"))
    assert got[("inferd_shm_connections_refused_per_uid_total", refused)] == 3


def test_the_recorders_queue_bytes_are_a_gauge() -> None:
    document = status()
    document["fdr"]["queue_bytes"] = 15 << 20
    assert scrape(document)[("inferd_fdr_queue_bytes", ())] == 15 << 20
