"""The recorder's inventory as metrics: ``inferd_fdr_segments_kept``,
``inferd_fdr_kept_bytes`` and the cap, ``inferd_fdr_max_total_bytes``, gauges with
the values ``status.fdr`` gives (a real writer's, in a temporary directory)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from inferd.metrics import families
from tests.unit.fdr.test_fdr_inventory import BIG, SEGMENT, make_segments, recorder
from tests.unit.metrics.test_families import scrape, status

KEPT = ("inferd_fdr_segments_kept", "inferd_fdr_kept_bytes", "inferd_fdr_max_total_bytes")


def test_the_kept_segments_bytes_and_cap_are_gauges_with_statuss_values(tmp_path: Path) -> None:
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 6))
    fdr = recorder(directory, kept=4)
    try:
        for _ in range(3):
            fdr.record("deadline_miss", BIG)
        assert fdr.wait_durable(10.0)
        recorded = {"enabled": True, **fdr.status()}
    finally:
        fdr.stop()
    assert recorded["segments_deleted"] > 0  # the cap deleted: the gauges are after it
    got = scrape(status(fdr=recorded))
    assert got[("inferd_fdr_segments_kept", ())] == recorded["segments_kept"] > 0
    assert got[("inferd_fdr_kept_bytes", ())] == recorded["bytes_kept"] > 0
    assert got[("inferd_fdr_max_total_bytes", ())] == 5 * SEGMENT

    class Collector:
        def collect(self) -> list[object]:
            return families.collect(status(fdr=recorded), {})

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    text = generate_latest(registry).decode()  # OpenMetrics: it carries the unit
    exposed = {family.name: family for family in text_string_to_metric_families(text)}
    units = {name: (exposed[name].type, exposed[name].unit) for name in KEPT}
    assert units == {
        "inferd_fdr_segments_kept": ("gauge", ""),
        "inferd_fdr_kept_bytes": ("gauge", "bytes"),
        "inferd_fdr_max_total_bytes": ("gauge", "bytes"),
    }
    off = scrape(status(fdr={"enabled": False, "error": "disabled by fdr.enabled"}))
    assert not {name for name, _ in off} & set(KEPT)  # a recorder off keeps nothing: absent
