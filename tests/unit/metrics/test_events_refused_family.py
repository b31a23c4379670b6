"""The events socket's refused subscriptions are exported as a counter (DESIGN.md 124)."""

from __future__ import annotations

from tests.unit.metrics.test_families import scrape, status


def test_refused_subscriptions_are_a_counter() -> None:
    document = status()
    document["bus"]["events_subscriptions_refused"] = 3
    got = scrape(document)
    assert got[("inferd_events_subscriptions_refused_total", ())] == 3
