"""Alerts a MAVLink link held go out before any newer alert, over real sockets.

OPERATIONS.md promised "oldest first and before any newer alert", and two windows
broke it (review F5): the hook looked at the link's state, then sent; a link that
got its destination in between (the resolver, the TCP thread, the peers thread)
took the new alert first, the held one following it ``(N s late)``
(``r6_order_race.py``).  And a replay the link refused (a full send buffer) left
the held alert behind a new one the link then took.  Now every alert tries the
held ones first whatever the state, and while any is still held the new one is
held behind it.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.alerts import mavlink
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.alerts.udp_link import UdpSocket
from tests.conftest import HANG_S, wait_until
from tests.unit.alerts.test_mavlink_udpin import _ground_station, _heartbeat, _text


@pytest.fixture
def station() -> Iterator[socket.socket]:
    sock = _ground_station()
    yield sock
    sock.close()


class FullBuffer:
    """A real UDP socket whose ``sendto`` fails ``BlockingIOError`` (the kernel's
    answer for a full send buffer on a non-blocking socket) while ``refuse`` says."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.lock = threading.Lock()
        #: Sends to refuse: None for every one, else how many more.
        self.refuse: int | None = 0
        self.refused = 0

    def sendto(self, data: bytes, address: Any) -> int:
        with self.lock:
            if self.refuse is None or self.refuse > 0:
                self.refuse = None if self.refuse is None else self.refuse - 1
                self.refused += 1
                raise BlockingIOError(11, "Resource temporarily unavailable")
        return self._sock.sendto(data, address)

    def __getattr__(self, name: str) -> Any:  # fileno, recvfrom, getsockname, close...
        return getattr(self._sock, name)


def _codes(station: socket.socket, count: int) -> list[str]:
    """The codes of the next ``count`` texts (each one datagram: under 50 characters)."""
    return [_text(station.recv(512)).split(":")[0] for _ in range(count)]


def test_a_held_alert_whose_replay_the_link_refused_still_goes_before_a_newer_one(
    monkeypatch: pytest.MonkeyPatch, station: socket.socket
) -> None:
    sockets: list[FullBuffer] = []

    class FullBufferUdpSocket(UdpSocket):
        def __init__(self, endpoint: str) -> None:
            super().__init__(endpoint)
            sockets.append(FullBuffer(self.port))
            self.port: Any = sockets[-1]

    monkeypatch.setattr(mavlink, "UdpSocket", FullBufferUdpSocket)
    hook = MavlinkAlertHook("udpin:127.0.0.1:0")
    (sock,) = sockets
    try:
        with capture_logs(), contextlib.suppress(ConnectionError):
            hook.alert("ERROR", "first", "unheard", {})
        assert hook.status()["waiting"] == 1
        sock.refuse = None
        with capture_logs():
            station.sendto(_heartbeat(), sock.getsockname())  # the replay: refused
            wait_until(lambda: sock.refused >= 1, message="the refused replay")
            with sock.lock:
                sock.refuse = 1  # the buffer drains after one more refusal
            with contextlib.suppress(ConnectionError):  # held behind "first" now
                hook.alert("WARNING", "second", "behind", {})
            hook.alert("WARNING", "third", "on time", {})
            codes = _codes(station, 3)
    finally:
        hook.close()
    assert codes == ["first", "second", "third"]
    link = hook.status()
    assert (link["waiting"], link["replayed"]) == (0, link["held"])


class Resolver:
    """Answers the link's name lookup once the test says so."""

    def __init__(self) -> None:
        self.answers: queue.Queue[str] = queue.Queue()

    def __call__(self, name: str) -> str:
        return self.answers.get(timeout=HANG_S)


def test_a_link_that_gets_its_destination_while_an_alert_is_raised_sends_the_held_first(
    monkeypatch: pytest.MonkeyPatch, udp_listener: socket.socket
) -> None:
    resolver = Resolver()
    monkeypatch.setattr(socket, "gethostbyname", resolver)
    hook = MavlinkAlertHook(f"udpout:ground-station.example:{udp_listener.getsockname()[1]}")
    try:
        with capture_logs(), pytest.raises(ConnectionError, match="not resolved yet"):
            hook.alert("ERROR", "first", "unresolved", {})
        looked: Callable[[], tuple[str, int, str | None]] = hook._link_state

        def resolved_right_after_the_look() -> tuple[str, int, str | None]:
            state = looked()
            if state[0] != "up":  # the resolver finishes in the window
                resolver.answers.put("127.0.0.1")
                wait_until(lambda: hook._out is not None and hook._out._address is not None)
            return state

        monkeypatch.setattr(hook, "_link_state", resolved_right_after_the_look)
        with capture_logs():
            with contextlib.suppress(ConnectionError):  # held behind "first"
                hook.alert("WARNING", "second", "resolving", {})
            resolver.answers.put("127.0.0.1")  # if no look let it answer yet
            codes = _codes(udp_listener, 2)
    finally:
        resolver.answers.put("127.0.0.1")
        hook.close()
    assert codes == ["first", "second"]
