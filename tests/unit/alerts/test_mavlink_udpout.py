"""The MAVLink hook on a ``udpout:`` endpoint that names its ground station by host name.

pymavlink (2.4.40 to 2.4.50, ``mavudp.write``) resolves the name with
``socket.gethostbyname`` in the first ``write``: on the thread that raised the
alert (the engine worker, a failover thread).  When that fails it swallows the
error and from then on hands the name to ``sendto``, which resolves it again in
every send: with the ground link down (no route to the DNS server) every alert
waited out the resolver's timeouts, and counted as sent.  The hook now resolves
the name once, on a thread of its own; until then an alert fails.
"""

from __future__ import annotations

import socket
import threading

import pytest
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.types import Alert
from tests.conftest import HANG_S, wait_until

RAISER = "alert-raiser"


def _text(datagram: bytes) -> str:
    from pymavlink.dialects.v20 import common

    (message,) = common.MAVLink(None).parse_buffer(datagram) or []
    return str(message.text)


def test_udpout_never_resolves_its_host_on_the_thread_raising_the_alert(
    monkeypatch: pytest.MonkeyPatch, udp_listener: socket.socket
) -> None:
    callers: list[str] = []
    resolving, release = threading.Event(), threading.Event()

    def resolver_without_a_route(name: str) -> str:
        callers.append(threading.current_thread().name)
        resolving.set()
        release.wait(HANG_S)  # what a resolver does while no DNS server answers
        return "127.0.0.1"

    monkeypatch.setattr(socket, "gethostbyname", resolver_without_a_route)
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:ground-station.example:{port}")
    dispatcher = AlertDispatcher([hook], rate_limit_s=0)
    raiser = threading.Thread(
        target=dispatcher, args=(Alert("CRITICAL", "first", "while resolving"),), name=RAISER
    )
    try:
        with capture_logs():
            raiser.start()
            assert resolving.wait(HANG_S)
            assert RAISER not in callers, "the alert waited for the host name's resolution"
            raiser.join(HANG_S)
            assert not raiser.is_alive()
        status = dispatcher.status()["hooks"]["mavlink"]
        assert (status["sent"], status["failures"]) == (0, 1), status
        assert "not resolved yet" in status["last_error"]
        release.set()

        def sends() -> bool:
            try:
                hook.alert("NOTICE", "resolved", "ground station found", {})
            except ConnectionError:
                return False
            return True

        wait_until(sends, message="the hook sending once the name resolved")
        # The alerts that failed were held: they reach the station first, late (link_backlog).
        texts = [_text(udp_listener.recv(512))]
        while texts[-1] != "resolved: ground station found":
            texts.append(_text(udp_listener.recv(512)))
        assert texts[0].startswith("first: while resolving (") and texts[0].endswith(" s late)")
        assert callers == [callers[0]] and callers[0] != RAISER  # resolved once
    finally:
        release.set()
        raiser.join(HANG_S)
        dispatcher.close()


def test_udpout_to_a_host_that_does_not_resolve_fails_each_alert_naming_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_such_host(name: str) -> str:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "gethostbyname", no_such_host)
    hook = MavlinkAlertHook("udpout:ground-station.example:14550")
    dispatcher = AlertDispatcher([hook], rate_limit_s=0)

    def last_error() -> str:
        with capture_logs():
            dispatcher(Alert("ERROR", "lost", "nobody to send to"))
        return str(dispatcher.status()["hooks"]["mavlink"]["last_error"])

    try:
        last_error()
        status = dispatcher.status()["hooks"]["mavlink"]
        assert (status["sent"], status["failures"]) == (0, 1), status
        wait_until(lambda: "Name or service not known" in last_error(), message="why")
        assert dispatcher.status()["hooks"]["mavlink"]["sent"] == 0
    finally:
        dispatcher.close()
