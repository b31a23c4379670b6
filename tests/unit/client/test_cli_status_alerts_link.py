"""``inferctl status`` shows the ground link's state on its ``alerts`` line, as
OPERATIONS.md says a pre-flight check reads it (``no_peer``: no ground station
heard yet); before, the line was only ``raised N, sent M`` (the second alert
review's F7)."""

from __future__ import annotations

import re
from typing import Any

from inferd_client import cli_format

NO_PEER = {
    "state": "no_peer",
    "destinations": 0,
    "error": None,
    "ignored": 0,
    "waiting": 2,
    "held": 2,
    "replayed": 0,
    "expired": 0,
    "overflowed": 0,
    "dropped_at_close": 0,
}


def _alerts_line(alerts: dict[str, Any]) -> str:
    status = {"daemon": {}, "models": [], "alerts": alerts}
    (line,) = [line for line in cli_format.status(status) if line.startswith("alerts:")]
    return re.sub(r"^alerts: +", "", line)


def test_the_alerts_line_shows_each_links_state_and_what_it_holds() -> None:
    hooks = {
        "pub": {"sent": 2, "failures": 0, "last_error": None},
        "mavlink": {"sent": 0, "failures": 2, "last_error": "x", "link": NO_PEER},
    }
    line = _alerts_line({"raised": 2, "sent": 2, "hooks": hooks})
    assert line == "raised 2, sent 2; mavlink: no_peer, 2 waiting"  # before: "raised 2, sent 2"


def test_a_link_that_is_down_says_why_and_one_that_is_up_holds_nothing() -> None:
    down = {**NO_PEER, "state": "unresolved", "waiting": 0, "error": "gcs.local: not found"}
    assert _alerts_line({"raised": 1, "sent": 1, "hooks": {"mavlink": {"link": down}}}) == (
        "raised 1, sent 1; mavlink: unresolved (gcs.local: not found)"
    )
    up = {**NO_PEER, "state": "up", "waiting": 0}
    assert _alerts_line({"hooks": {"mavlink": {"link": up}}}) == "raised 0, sent 0; mavlink: up"


def test_the_daemons_text_on_the_line_reaches_no_terminal_raw() -> None:
    """The error is the daemon's text (a resolver's message, a host name)."""
    hostile = {**NO_PEER, "state": "no_peer\x1b[2J", "error": "bad\x1b]0;owned\x07host"}
    line = _alerts_line({"raised": 1, "sent": 1, "hooks": {"mavlink\x1b[31m": {"link": hostile}}})
    assert "\x1b" not in line and "\x07" not in line
    assert line.startswith("raised 1, sent 1; mavlink")
