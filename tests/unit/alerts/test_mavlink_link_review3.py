"""Review 3 of the MAVLink link (F1, F2): a ``udp*:`` link's ``unreachable`` ends
when the route is back, and a route lookup that disagrees with the sends cannot
make the link's thread spin.

F1: a ``udpin:`` link cleared ``no_route`` only on a send that got through.  Once
the alerts held during an outage expired (60 s), the station's heartbeats came
back and nothing cleared it: ``status`` read ``unreachable`` and
``inferd_alerts_link_up`` 0 on a healthy link, until some alert happened to be
sent (``r1_udpin_stale_unreachable.py``).  Now a heartbeat heard while it is set
looks for the route to the stations (a UDP ``connect``) and clears it.

F2: with the route lookup succeeding while ``sendto`` failed no-route, the
``udpout:`` thread looked, called the hook up, the replay failed and woke it
again at once: 19,219 looks and 19,665 ``mavlink_udp_no_route`` WARNING lines a
second (``r2_probe_ok_send_unreachable_spin.py``).  Now the thread never looks
again sooner than ``NO_ROUTE_RETRY_S`` after a look, and the line is logged
once per outage, which a send getting through ends, not a route seen back.
"""

from __future__ import annotations

import errno
import itertools
import socket
import time
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.alerts import udp_link
from inferd.alerts.mavlink import MavlinkAlertHook
from tests.conftest import wait_until
from tests.unit.alerts.conftest import FakeClock
from tests.unit.alerts.test_mavlink_no_route import Route, route, station  # noqa: F401
from tests.unit.alerts.test_mavlink_udpin import _heartbeat, _text

RETRY_S = 0.05


def test_a_udpin_link_reads_up_again_at_a_heartbeat_once_its_route_is_back_with_nothing_held(
    route: Route,  # noqa: F811
    station: socket.socket,  # noqa: F811
) -> None:
    clock = FakeClock()
    hook = MavlinkAlertHook("udpin:127.0.0.1:0", clock=clock)
    address = hook._connection.port.getsockname()
    try:
        station.sendto(_heartbeat(), address)
        wait_until(lambda: hook.status()["state"] == "up", message="the station heard")
        route.down()
        with capture_logs() as logs, pytest.raises(ConnectionError, match="held, sent late"):
            hook.alert("ERROR", "model_unavailable", "det", {})
        clock.now += 61  # the outage outlasts the held alert
        link = hook.status()
        assert (link["state"], link["waiting"], link["expired"]) == ("unreachable", 0, 1)
        looks = route.looks
        station.sendto(_heartbeat(), address)  # heard while the route is still down
        wait_until(lambda: route.looks > looks, message="the route looked for at a heartbeat")
        assert hook.status()["state"] == "unreachable" and not hook.connected
        route.up.set()
        station.sendto(_heartbeat(), address)  # the route is back: no alert follows
        wait_until(lambda: hook.status()["state"] == "up", message="up at the next heartbeat")
        link = hook.status()
        assert (link["error"], link["destinations"], hook.connected) == (None, 1, True)
        with capture_logs():
            hook.alert("INFO", "after", "the route is back", {})
        assert _text(station.recv(512)) == "after: the route is back"
    finally:
        hook.close()
    assert [line["event"] for line in logs].count("mavlink_udp_no_route") == 1


def test_a_udpout_route_look_that_says_yes_while_sends_say_no_neither_spins_nor_floods(
    route: Route,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(udp_link, "NO_ROUTE_RETRY_S", RETRY_S)
    looked_at: list[float] = []

    def probe_says_routed(family: int, address: tuple[Any, ...]) -> None:
        looked_at.append(time.monotonic())  # policy routing: connect finds a route...

    monkeypatch.setattr(udp_link, "_probe_route", probe_says_routed)
    route.down(OSError(errno.EHOSTUNREACH, "No route to host"))  # ...sendto does not
    with capture_logs() as logs:
        hook = MavlinkAlertHook("udpout:127.0.0.1:9")
        try:
            with pytest.raises(ConnectionError, match="held, sent late"):
                hook.alert("ERROR", "refused", "by policy", {})
            wait_until(lambda: len(looked_at) >= 5, message="looks on the link's thread")
        finally:
            hook.close()
    # looked_at[0]: the hook opening; [1]: the thread's first look, at once.
    gaps = [later - earlier for earlier, later in itertools.pairwise(looked_at[1:5])]
    # Paced from the start of each try: half of it leaves room for a slow thread.
    assert min(gaps) >= RETRY_S / 2, gaps  # was 0.2-3.5 ms apart
    assert [line["event"] for line in logs].count("mavlink_udp_no_route") == 1, len(logs)
