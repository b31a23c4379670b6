"""A ``udp*:`` MAVLink link with no route to its ground station yet holds its alerts
and sends them once the route is up, and says ``unreachable`` meanwhile.

At boot the telemetry radio's interface, or its route, often comes up after the
daemon (the units wait for ``network.target`` only).  A ``udpout:<ip>:14550``
link's ``sendto`` then failed ``ENETUNREACH``: the start-time alerts
(``fdr_unavailable``, ``model_unavailable``) were counted as failures and never
sent, and ``status`` read ``up`` with no error (review script
``r4_udpout_no_route.py``, run in a fresh network namespace).  The same for a zone
id naming no interface (``gaierror``).  Here the socket is a real one wrapped to
fail as the kernel does while there is no route, and the route lookup the link
makes in the background fails alike until the test brings the "route" up.
"""

from __future__ import annotations

import errno
import re
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher, mavlink, udp_link
from inferd.alerts.link_backlog import NoDestinationError
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.alerts.udp_link import UdpOut, UdpSocket
from inferd.types import Alert
from tests.conftest import HANG_S, wait_until
from tests.unit.alerts.test_mavlink_udpin import _ground_station, _heartbeat, _text

LATE = r" \(\d+ s late\)"


class Route:
    """Whether the kernel has a route to the ground station: while it has none,
    sends fail with ``error`` and so does the link's route lookup."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.up.set()
        self.error: OSError = OSError(errno.ENETUNREACH, "Network is unreachable")
        self.looks = 0

    def down(self, error: OSError | None = None) -> None:
        if error is not None:
            self.error = error
        self.up.clear()

    def check(self) -> None:
        if not self.up.is_set():
            raise self.error

    def probe(self, family: int, address: tuple[Any, ...]) -> None:
        """``udp_link._probe_route``'s stand-in (the real one: a UDP ``connect``)."""
        self.looks += 1
        self.check()


class RoutedSocket:
    """A real UDP socket whose ``sendto`` fails as the kernel's does while
    ``route`` is down; everything else is the socket's own."""

    def __init__(self, sock: socket.socket, route: Route) -> None:
        self._sock = sock
        self._route = route

    def sendto(self, data: bytes, address: Any) -> int:
        self._route.check()
        return self._sock.sendto(data, address)

    def __getattr__(self, name: str) -> Any:  # fileno, recvfrom, family, close...
        return getattr(self._sock, name)


@pytest.fixture
def route(monkeypatch: pytest.MonkeyPatch) -> Route:
    """Every ``udp*:`` hook built in the test sends through a ``RoutedSocket``."""
    made = Route()

    class RoutedUdpSocket(UdpSocket):
        def __init__(self, endpoint: str) -> None:
            super().__init__(endpoint)
            self.port: Any = RoutedSocket(self.port, made)

    monkeypatch.setattr(mavlink, "UdpSocket", RoutedUdpSocket)
    # raising=False: the tests also run (and fail on behaviour) against the code before.
    monkeypatch.setattr(udp_link, "_probe_route", made.probe, raising=False)
    monkeypatch.setattr(udp_link, "NO_ROUTE_RETRY_S", 0.01, raising=False)  # no 1 s waits
    return made


@pytest.fixture
def ipv6() -> None:
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close()
    except OSError as exc:  # a kernel without IPv6
        pytest.skip(f"no IPv6 sockets here: {exc}")


@pytest.fixture
def station() -> Iterator[socket.socket]:
    sock = _ground_station()
    yield sock
    sock.close()


def test_start_time_alerts_a_udpout_link_had_no_route_for_go_out_once_the_route_is_up(
    route: Route, station: socket.socket
) -> None:
    route.down()  # the radio's interface is not up yet when the daemon starts
    with capture_logs() as logs:
        hook = MavlinkAlertHook(f"udpout:127.0.0.1:{station.getsockname()[1]}")
    dispatcher = AlertDispatcher([hook], rate_limit_s=0)
    try:
        link = hook.status()  # before any alert failed
        assert (link["state"], link["destinations"]) == ("unreachable", 0), link
        assert "Network is unreachable" in str(link["error"]) and not hook.connected
        with capture_logs():
            dispatcher(Alert("CRITICAL", "fdr_unavailable", "recorder down"))
            dispatcher(Alert("ERROR", "model_unavailable", "det: no engine", {"model": "det"}))
        counted = dispatcher.status()["hooks"]["mavlink"]
        assert (counted["sent"], counted["failures"]) == (0, 2), counted
        assert hook.status()["waiting"] == 2
        with capture_logs() as replayed:
            route.up.set()  # no alert follows: the link's own thread sends them
            texts = [_text(station.recv(512)) for _ in range(2)]
            link = hook.status()
    finally:
        dispatcher.close()
    assert re.fullmatch("fdr_unavailable: recorder down" + LATE, texts[0]), texts
    assert re.fullmatch("model_unavailable: det: no engine" + LATE, texts[1]), texts
    assert (link["state"], link["error"], link["replayed"], link["waiting"]) == ("up", None, 2, 0)
    (lost,) = [line for line in logs if line["event"] == "mavlink_udp_no_route"]
    assert "Network is unreachable" in lost["error"]
    assert [line["sent_late"] for line in replayed if line["event"] == "mavlink_alerts_replayed"]


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENETUNREACH, "Network is unreachable"),
        OSError(errno.EHOSTUNREACH, "No route to host"),
        OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"),
        OSError(errno.ENODEV, "No such device"),
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),  # a zone id's
    ],
    ids=["ENETUNREACH", "EHOSTUNREACH", "EADDRNOTAVAIL", "ENODEV", "gaierror"],
)
def test_a_route_lost_after_the_start_holds_the_alert_and_the_next_alert_sends_it_first(
    route: Route, station: socket.socket, error: OSError
) -> None:
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{station.getsockname()[1]}")
    try:
        assert hook.status()["state"] == "up"
        route.down(error)
        with capture_logs(), pytest.raises(ConnectionError, match="held, sent late"):
            hook.alert("CRITICAL", "engine_worker_died", "gone", {})
        link = hook.status()
        assert (link["state"], link["waiting"]) == ("unreachable", 1)
        assert repr(error) in str(link["error"])
        route.up.set()
        with capture_logs():
            hook.alert("WARNING", "after", "the route is back", {})
            texts = [_text(station.recv(512)) for _ in range(2)]
    finally:
        hook.close()
    assert re.fullmatch("engine_worker_died: gone" + LATE, texts[0]), texts
    assert texts[1] == "after: the route is back"


def test_a_send_the_kernel_refuses_for_another_reason_is_not_held(
    route: Route, station: socket.socket
) -> None:
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{station.getsockname()[1]}")
    try:
        route.down(PermissionError(errno.EPERM, "Operation not permitted"))  # a firewall
        with pytest.raises(PermissionError):
            hook.alert("ERROR", "refused", "by a firewall", {})
        link = hook.status()
        assert (link["state"], link["waiting"], link["held"]) == ("up", 0, 0)
    finally:
        hook.close()


def test_a_udpin_link_with_no_route_to_any_station_holds_and_sends_at_the_next_heartbeat(
    route: Route, station: socket.socket
) -> None:
    hook = MavlinkAlertHook("udpin:127.0.0.1:0")
    address = hook._connection.port.getsockname()
    try:
        station.sendto(_heartbeat(), address)
        wait_until(lambda: hook.status()["state"] == "up", message="the station heard")
        route.down(OSError(errno.ENETUNREACH, "Network is unreachable"))
        with capture_logs(), pytest.raises(ConnectionError, match="held, sent late"):
            hook.alert("CRITICAL", "thermal_throttle", "hot", {})
        link = hook.status()
        assert (link["state"], link["destinations"], link["waiting"]) == ("unreachable", 1, 1)
        route.up.set()
        with capture_logs():
            station.sendto(_heartbeat(), address)  # heard again: its route is back
            text = _text(station.recv(512))
        assert re.fullmatch("thermal_throttle: hot" + LATE, text), text
        assert hook.status()["state"] == "up"
    finally:
        hook.close()


@pytest.mark.usefixtures("ipv6")
def test_a_zone_id_naming_no_interface_reads_unreachable_and_holds_its_alerts() -> None:
    # Loaded by the config (a USB radio's interface may appear after the daemon);
    # before, the link read "up" while every alert failed gaierror, unheld.
    with capture_logs():
        hook = MavlinkAlertHook("udpout:[fe80::1%nosuchif0]:14550")
    try:
        link = hook.status()
        assert link["state"] == "unreachable" and not hook.connected
        assert "no network interface named 'nosuchif0'" in str(link["error"])
        with capture_logs(), pytest.raises(NoDestinationError, match="held, sent late"):
            hook.alert("ERROR", "fdr_unavailable", "recorder down", {})
        assert hook.status()["waiting"] == 1
    finally:
        with capture_logs():
            hook.close()


def test_a_zone_id_is_sent_as_its_interfaces_index() -> None:
    # Python ignores the "%lo" of a 2-tuple: the datagram left by whichever
    # interface the kernel picked for a link-local address.
    assert udp_link.sockaddr("fe80::1%lo", 14550) == (
        "fe80::1",
        14550,
        0,
        socket.if_nametoindex("lo"),
    )
    assert udp_link.sockaddr("10.0.0.1", 14550) == ("10.0.0.1", 14550)


def test_the_route_is_looked_for_on_the_links_thread_only_while_it_is_missing(
    route: Route,
) -> None:
    woken = threading.Event()
    route.down()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    routed: Any = RoutedSocket(sock, route)
    with capture_logs():
        link = UdpOut(routed, "127.0.0.1", 9, "udpout:127.0.0.1:9", on_resolved=woken.set)
    try:
        assert link.state[0] == "unreachable"
        wait_until(lambda: route.looks >= 3, message="looks on the link's thread")
        route.up.set()
        assert woken.wait(HANG_S), "the link's destination was not reported"
        assert link.state == ("up", None)
        looks = route.looks
        link.write(b"sent")  # up: nothing more is looked up
        assert route.looks == looks
    finally:
        link.close()
        sock.close()


def test_a_name_that_resolves_while_there_is_no_route_reads_unreachable_until_there_is(
    route: Route, station: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.0.1")  # /etc/hosts
    route.down()
    with capture_logs():
        hook = MavlinkAlertHook(f"udpout:ground-station.example:{station.getsockname()[1]}")
    try:
        wait_until(lambda: hook.status()["state"] != "unresolved", message="the name resolved")
        assert hook.status()["state"] == "unreachable" and not hook.connected
        with capture_logs(), pytest.raises(ConnectionError, match="held, sent late"):
            hook.alert("CRITICAL", "fdr_unavailable", "recorder down", {})
        with capture_logs():
            route.up.set()
            text = _text(station.recv(512))
        assert re.fullmatch("fdr_unavailable: recorder down" + LATE, text), text
        assert hook.status()["state"] == "up"
    finally:
        hook.close()
