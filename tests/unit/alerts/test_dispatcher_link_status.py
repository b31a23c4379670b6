"""``status.alerts.hooks.mavlink.link``: the ground link's state, read from the hook
through the dispatcher, so an operator sees a down link before an alert fails
(DESIGN.md 298, 301)."""

from __future__ import annotations

from inferd.alerts import AlertDispatcher
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.types import Alert
from tests.integration.test_schemas import assert_valid
from tests.unit.alerts.test_mavlink_held_alerts import HOOK_STATUS


def test_status_shows_a_link_with_no_station_then_up_once_one_is_heard() -> None:
    hook = MavlinkAlertHook("udpin:127.0.0.1:0")
    dispatcher = AlertDispatcher([hook])
    try:
        link = dispatcher.status()["hooks"]["mavlink"]["link"]
        assert (link["state"], link["destinations"]) == ("no_peer", 0)
        dispatcher(Alert("ERROR", "model_unavailable", "cannot open", {"model": "m"}))
        status = dispatcher.status()
        assert status["hooks"]["mavlink"]["failures"] == 1
        assert status["hooks"]["mavlink"]["link"]["waiting"] == 1  # held for a station
        assert_valid(HOOK_STATUS, status["hooks"]["mavlink"])
    finally:
        dispatcher.close()
