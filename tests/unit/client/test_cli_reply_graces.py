"""``inferctl status``'s line for the reply budget's release graces (DESIGN.md 251,
280): what they cost the sender, in one line under the bus's."""

from __future__ import annotations

import re
from typing import Any

from inferd_client import cli_format


def status_text(replies: dict[str, Any]) -> str:
    return "\n".join(cli_format.status({"models": [], "bus": {"replies": replies}}))


def test_the_graces_waited_ran_out_and_held_off_are_one_line() -> None:
    graces = {
        "waited": 7,
        "ran_out": 5,
        "held_off": {"peer_budget": 3, "total_budget": 1},
        "waited_s": 0.105,
    }
    text = status_text({"dropped": 9, "graces": graces})
    assert re.search(
        r"^reply grace: +waited 7 \(5 ran out\), 105\.0 ms; "
        r"held off 3 per client, 1 for the total$",
        text,
        re.M,
    ), text
    assert "1.25 s;" in status_text({"graces": {**graces, "waited_s": 1.25}})


def test_a_daemon_that_does_not_count_them_says_so() -> None:
    assert re.search(r"^reply grace: +not reported$", status_text({"dropped": 0}), re.M)
