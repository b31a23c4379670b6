"""The MAVLink hook on a ``udpin:`` (or ``udp:``) endpoint, over real UDP sockets.

pymavlink (2.4.40 to 2.4.50, ``mavudp``) answers on such an endpoint every
address it has heard a datagram from (``clients``), never forgets one
(``udp_timeout`` 0), and sends to nobody, silently, before it heard anyone.
The hook now answers the 8 peers it heard from last and fails an alert it has
nobody to send to.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.types import Alert
from tests.conftest import HANG_S, wait_until


def _heartbeat() -> bytes:
    from pymavlink.dialects.v20 import common

    mav = common.MAVLink(None, srcSystem=255, srcComponent=190)
    message = mav.heartbeat_encode(common.MAV_TYPE_GCS, common.MAV_AUTOPILOT_INVALID, 0, 0, 0)
    return bytes(message.pack(mav))


def _text(datagram: bytes) -> str:
    from pymavlink.dialects.v20 import common

    (message,) = common.MAVLink(None).parse_buffer(datagram) or []
    return str(message.text)


@pytest.fixture
def udpin_hook() -> Iterator[MavlinkAlertHook]:
    hook = MavlinkAlertHook("udpin:127.0.0.1:0")  # pymavlink binds; the kernel picks the port
    yield hook
    hook.close()


def _ground_station() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(HANG_S)
    return sock


def _sends(hook: MavlinkAlertHook) -> bool:
    try:
        hook.alert("NOTICE", "probe", "is anyone there", {})
    except ConnectionError:
        return False
    return True


def test_udpin_alerts_before_a_ground_station_was_heard_are_failures_not_sent(
    udpin_hook: MavlinkAlertHook,
) -> None:
    dispatcher = AlertDispatcher([udpin_hook], rate_limit_s=0)
    with capture_logs():  # not the console renderer's traceback (seconds)
        dispatcher(Alert("CRITICAL", "engine_worker_died", "nobody is listening yet"))
    status = dispatcher.status()["hooks"]["mavlink"]
    assert (status["sent"], status["failures"]) == (0, 1), status
    assert "no ground station" in status["last_error"]

    ground = _ground_station()
    try:
        ground.sendto(_heartbeat(), udpin_hook._connection.port.getsockname())
        wait_until(lambda: _sends(udpin_hook), message="the hook learning the ground station")
        # The alert that failed was held: it reaches the station first, late (link_backlog).
        late = _text(ground.recv(512)) + _text(ground.recv(512))
        assert late.startswith("engine_worker_died: nobody is listening yet ("), late
        assert late.endswith(" s late)"), late
        assert _text(ground.recv(512)) == "probe: is anyone there"
    finally:
        ground.close()


def test_udpin_answers_a_bounded_set_of_the_newest_peers(udpin_hook: MavlinkAlertHook) -> None:
    hook_socket = udpin_hook._connection.port
    peers = [_ground_station() for _ in range(32)]
    try:
        for peer in peers:  # the oldest first: a ground station restarting on new ports
            peer.sendto(_heartbeat(), hook_socket.getsockname())
        newest = peers[-1]
        newest.setblocking(False)

        def newest_heard() -> bool:
            udpin_hook.alert("WARNING", "probe", "who hears this", {})
            try:
                return bool(newest.recv(512))
            except BlockingIOError:
                return False

        # The hook reads its socket in order: the newest heard, every peer is.
        wait_until(newest_heard, message="the newest peer receiving an alert")
        newest.settimeout(HANG_S)
        udpin_hook.alert("WARNING", "counted", "who hears this", {})
        for peer in peers:  # after the alert, from the same socket: it arrives last
            hook_socket.sendto(b"sentinel", peer.getsockname())
        heard = [_counted_before_sentinel(peer) for peer in peers]
    finally:
        for peer in peers:
            peer.close()
    assert sum(heard) <= 8, f"one alert went to {sum(heard)} of {len(peers)} peers"
    assert heard[-8:] == [1] * 8  # the newest ones


def _counted_before_sentinel(peer: socket.socket) -> int:
    count = 0
    while (datagram := peer.recv(512)) != b"sentinel":
        count += _text(datagram).startswith("counted:")
    return count
