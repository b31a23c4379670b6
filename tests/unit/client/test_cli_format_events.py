"""``inferctl status`` shows the events socket's refused subscriptions next to the
events published and dropped (DESIGN.md 124)."""

from __future__ import annotations

from inferd_client import cli_format


def test_the_bus_line_counts_refused_subscriptions() -> None:
    result = {
        "daemon": {"version": "0.1.0", "pid": 7, "state": "serving", "uptime_s": 3.5},
        "models": [],
        "thermal": {"available": False},
        "fdr": {"enabled": False},
        "bus": {"events_published": 12, "events_dropped": 1, "events_subscriptions_refused": 3},
        "alerts": {},
    }
    text = "\n".join(cli_format.status(result))
    assert "events published 12 (dropped 1), subscriptions refused 3" in text
