"""The alert families of a real ``AlertDispatcher``'s ``status``: no counter goes
backwards when the rate limit sends a held-back repeat (``flush``), which moves it
from ``suppressed`` to ``sent``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inferd.alerts.dispatcher import AlertDispatcher
from inferd.metrics import families
from inferd.types import Alert
from tests.unit.metrics.test_families import status


def _scrape(dispatcher: AlertDispatcher) -> dict[tuple[str, str], float]:
    """(family type, sample name) -> value of the families of one ``status``."""
    document = status(alerts=dispatcher.status())

    class Collector:
        def collect(self) -> list[object]:
            return families.collect(document, {})

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    text = generate_latest(registry).decode()
    return {
        (family.type, sample.name): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("inferd_alerts_")
    }


def test_no_alert_counter_goes_backwards_when_a_held_back_repeat_is_sent() -> None:
    now = [0.0]
    dispatcher = AlertDispatcher([], rate_limit_s=10.0, clock=lambda: now[0])
    alert = Alert(level="WARNING", code="TEST_REPEAT", message="again", fields={"model": "m"})
    dispatcher(alert)  # sent, opens the window
    dispatcher(alert)  # held back
    held = _scrape(dispatcher)
    now[0] = 11.0
    assert dispatcher.flush() == 1  # the held-back repeat goes out
    flushed = _scrape(dispatcher)
    assert dispatcher.status()["raised"] == 2
    counters = {key: value for key, value in held.items() if key[0] == "counter"}
    assert counters, held
    went_back = {
        key: (value, flushed[key]) for key, value in counters.items() if flushed[key] < value
    }
    assert went_back == {}
    assert flushed[("counter", "inferd_alerts_raised_total")] == 2
    assert flushed[("counter", "inferd_alerts_sent_total")] == 2
    assert held[("gauge", "inferd_alerts_suppressed")] == 1
    assert flushed[("gauge", "inferd_alerts_suppressed")] == 0
