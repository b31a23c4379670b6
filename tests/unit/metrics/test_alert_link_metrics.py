"""The MAVLink ground link of ``status.alerts.hooks.<hook>.link`` (DESIGN.md 298,
301) as metric families: whether it has a destination now, how many stations it
sends to, and its held alerts, counted by hook; read from a real dispatcher's
``status`` over a real ``udpin:`` link and station.  A hook without a link has no
series, and a link missing a count is a bug that costs the ``alerts`` section
alone (DESIGN.md 281).

Before: no metric said whether the ground link was up, nor counted held alerts."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.config import MetricsConfig
from inferd.metrics import MetricsExporter, families
from inferd.types import Alert, AlertLevel
from tests.unit.alerts.test_mavlink_held_alerts import _address
from tests.unit.alerts.test_mavlink_udpin import _ground_station, _heartbeat, _text
from tests.unit.metrics.test_families import scrape, status
from tests.unit.metrics.test_metrics_sections_left_out import ERRORS, _collected, _errors, _Source

COUNTS = ("held", "replayed", "expired", "overflowed", "dropped_at_close")
LINK = {
    "state": "up",
    "destinations": 2,
    "error": None,
    "ignored": 4,
    "waiting": 0,
    "held": 3,
    "replayed": 2,
    "expired": 1,
    "overflowed": 0,
    "dropped_at_close": 0,
}


class _PubHook:
    """A hook with no link of its own (as the ``pub`` and ``fdr`` hooks)."""

    name = "pub"

    def alert(
        self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]
    ) -> None: ...

    def close(self) -> None: ...


@pytest.fixture
def hook() -> MavlinkAlertHook:
    """A ``udpin:`` hook no ground station has been heard by yet."""
    return MavlinkAlertHook("udpin:127.0.0.1:0")


@pytest.fixture
def dispatcher(hook: MavlinkAlertHook) -> Iterator[AlertDispatcher]:
    made = AlertDispatcher([_PubHook(), hook], rate_limit_s=0)
    yield made
    with capture_logs():  # what it still holds, dropped at close
        made.close()


def _link(samples: dict[Any, float], hook: str = "mavlink") -> dict[str, float]:
    """Each ``inferd_alerts_link_*`` sample of ``hook``, by what follows the prefix."""
    prefix = "inferd_alerts_link_"
    return {
        name.removeprefix(prefix): value
        for (name, labels), value in samples.items()
        if name.startswith(prefix) and labels == (("hook", hook),)
    }


def test_a_link_with_no_station_then_one_heard_is_down_then_up_its_held_alert_counted(
    dispatcher: AlertDispatcher, hook: MavlinkAlertHook
) -> None:
    with capture_logs():  # alert_hook_failed: no station, so held
        dispatcher(Alert("ERROR", "fdr_unavailable", "recorder down"))
    before = scrape(status(alerts=dispatcher.status()))
    station = _ground_station()
    try:
        with capture_logs():
            station.sendto(_heartbeat(), _address(hook))  # the first heartbeat: replayed
            assert _text(station.recv(512)).startswith("fdr_unavailable: recorder down (")
        after = scrape(status(alerts=dispatcher.status()))
    finally:
        station.close()
    zero = dict.fromkeys(("expired_total", "overflowed_total", "dropped_at_close_total"), 0.0)
    assert _link(before) == {
        "up": 0,
        "destinations": 0,
        "ignored_total": 0,
        "waiting": 1,
        "held_total": 1,
        "replayed_total": 0,
        **zero,
    }
    assert _link(after) == {
        "up": 1,
        "destinations": 1,
        "ignored_total": 0,
        "waiting": 0,
        "held_total": 1,
        "replayed_total": 1,
        **zero,
    }
    assert _link(before, "pub") == _link(after, "pub") == {}  # no link, no series


def test_a_closed_link_is_down_and_counts_what_it_dropped_at_close(
    dispatcher: AlertDispatcher,
) -> None:
    with capture_logs():  # alert_hook_failed twice, then dropped at close
        dispatcher(Alert("ERROR", "model_unavailable", "cannot open", {"model": "m"}))
        dispatcher(Alert("ERROR", "model_unavailable", "cannot open", {"model": "n"}))
        dispatcher.close()
    link = _link(scrape(status(alerts=dispatcher.status())))
    assert (link["up"], link["waiting"], link["held_total"]) == (0, 0, 2)
    assert link["dropped_at_close_total"] == 2


def test_each_state_but_up_is_down_and_the_counts_are_the_links() -> None:
    hooks = {
        name: {"sent": 0, "failures": 0, "last_error": None, "link": {**LINK, "state": state}}
        for name, state in (("a", "up"), ("b", "connecting"), ("c", "no_peer"), ("d", "closed"))
    }
    samples = scrape(status(alerts={**status()["alerts"], "hooks": hooks}))
    assert {name: _link(samples, name)["up"] for name in hooks} == {
        "a": 1,
        "b": 0,
        "c": 0,
        "d": 0,
    }
    for name in hooks:
        link = _link(samples, name)
        assert {key: link[f"{key}_total"] for key in COUNTS} == {key: LINK[key] for key in COUNTS}
        assert (link["destinations"], link["ignored_total"]) == (2, 4)
    assert not _link(scrape(status()), "pub")  # the fixture's hook has no link


def test_a_link_missing_a_count_costs_the_alerts_section_alone() -> None:
    broken = {key: value for key, value in LINK.items() if key != "held"}
    hooks = {"mavlink": {"sent": 0, "failures": 0, "last_error": None, "link": broken}}
    document = status(alerts={**status()["alerts"], "hooks": hooks})
    with pytest.raises(KeyError, match="held"):
        list(families.SECTIONS["alerts"](document, {}))
    exporter = MetricsExporter(MetricsConfig(), _Source(document))
    with capture_logs() as logs:
        collected = _collected(exporter)
    assert not [name for name in collected if name.startswith("inferd_alerts_")]
    assert "inferd_daemon_info" in collected and "inferd_events_published" in collected
    assert _errors(collected[ERRORS])["alerts"] == 1
    assert [line["event"] for line in logs] == ["metrics_section_left_out"]
