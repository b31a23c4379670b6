"""Which datagrams teach a ``udpin:`` hook a ground station, and IPv6 endpoints,
over real sockets.

A ``udpin:`` hook took any datagram's sender for a ground station: 8 datagrams of
``b"hello"`` from 8 ports (a port scan, another protocol on a shared radio
network) pushed the real station out of the 8 answered, and the next CRITICAL
alert went only to them, counted as sent.  Only datagrams made of whole MAVLink
frames teach a station now; the others are counted (``ignored``).

``udpout:[::1]:14550``, ``udpin:[::]:14550`` and ``tcp:[::1]:5760`` passed the
config's check, then pymavlink (IPv4 only) refused the UDP ones at start and the
TCP one never connected (``getaddrinfo`` given ``[::1]``).  The hook now opens an
IPv6 socket for a bracketed address; an unbracketed IPv6 address (ambiguous) and
anything else in brackets are refused at config load.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.alerts.udp_link import MAX_UDP_PEERS
from inferd.errors import ConfigError
from tests.conftest import HANG_S, wait_until
from tests.unit.alerts.test_mavlink_udpin import _ground_station, _heartbeat, _text
from tests.unit.config.test_mavlink_endpoint_config import load_with_endpoint


def _heartbeat_v1() -> bytes:
    from pymavlink.dialects.v10 import common

    mav = common.MAVLink(None, srcSystem=255, srcComponent=190)
    message = mav.heartbeat_encode(common.MAV_TYPE_GCS, common.MAV_AUTOPILOT_INVALID, 0, 0, 0)
    return bytes(message.pack(mav))


def _signed(frame: bytes) -> bytes:
    """A MAVLink 2 frame with the signed flag and its 13-byte signature."""
    return frame[:2] + bytes([frame[2] | 0x01]) + frame[3:] + bytes(13)


@pytest.mark.parametrize(
    ("datagram", "mavlink"),
    [
        (_heartbeat(), True),
        (_heartbeat_v1(), True),
        (_signed(_heartbeat()), True),
        (_heartbeat() + _heartbeat_v1(), True),  # a router's batch of frames
        (b"", False),
        (b"hello", False),
        (_heartbeat()[:-1], False),  # torn
        (_heartbeat() + b"\0", False),  # trailing bytes
        (_signed(_heartbeat())[:-13], False),  # signed, no signature
        (b"\xfd" + bytes(11), True),  # a frame with an empty payload is 12 bytes
        (b"\xfd" + bytes(10), False),
        (b"\xfe\x09" + bytes(6), False),  # v1 header saying 9 bytes of payload, with none
    ],
)
def test_is_mavlink_takes_whole_frames_only(datagram: bytes, mavlink: bool) -> None:
    from inferd.alerts.udp_link import is_mavlink

    assert is_mavlink(datagram) is mavlink


@pytest.fixture
def udpin_hook() -> Iterator[MavlinkAlertHook]:
    hook = MavlinkAlertHook("udpin:127.0.0.1:0")
    yield hook
    hook.close()


def test_datagrams_that_are_not_mavlink_never_push_the_ground_station_out(
    udpin_hook: MavlinkAlertHook,
) -> None:
    address = udpin_hook._connection.port.getsockname()
    station = _ground_station()
    scanners = [_ground_station() for _ in range(MAX_UDP_PEERS)]
    try:
        station.sendto(_heartbeat(), address)
        for scanner in scanners:  # sent before the alert: the hook reads them all first
            scanner.sendto(b"hello", address)
        udpin_hook.alert("CRITICAL", "engine_worker_died", "one alert", {})
        assert _text(station.recv(512)) == "engine_worker_died: one alert"
        link = udpin_hook.status()
        assert (link["destinations"], link["ignored"]) == (1, MAX_UDP_PEERS)
        for scanner in scanners:
            scanner.setblocking(False)
            with pytest.raises(BlockingIOError):
                scanner.recv(512)
    finally:
        station.close()
        for scanner in scanners:
            scanner.close()


def test_junk_alone_teaches_no_station(udpin_hook: MavlinkAlertHook) -> None:
    address = udpin_hook._connection.port.getsockname()
    scanner = _ground_station()
    try:
        scanner.sendto(b"\xfd not a frame", address)
        wait_until(lambda: udpin_hook.status()["ignored"] == 1, message="the datagram read")
        assert udpin_hook.status()["state"] == "no_peer"
        with capture_logs(), pytest.raises(ConnectionError, match="nobody to answer"):
            udpin_hook.alert("ERROR", "nobody", "heard yet", {})
    finally:
        scanner.close()


# -- IPv6 ----------------------------------------------------------------------------------


@pytest.fixture
def ipv6() -> None:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:  # a host or container without IPv6 loopback
        pytest.skip(f"no IPv6 loopback here: {exc}")


@pytest.mark.usefixtures("ipv6")
def test_udpout_to_an_ipv6_address_reaches_the_station() -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as station:
        station.bind(("::1", 0))
        station.settimeout(HANG_S)
        hook = MavlinkAlertHook(f"udpout:[::1]:{station.getsockname()[1]}")
        try:
            assert hook.status()["state"] == "up"
            hook.alert("WARNING", "over_ipv6", "udpout", {})
            assert _text(station.recv(512)) == "over_ipv6: udpout"
        finally:
            hook.close()


@pytest.mark.usefixtures("ipv6")
def test_udpin_on_an_ipv6_address_answers_the_station_it_heard() -> None:
    hook = MavlinkAlertHook("udpin:[::1]:0")
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as station:
            station.bind(("::1", 0))
            station.settimeout(HANG_S)
            station.sendto(_heartbeat(), hook._connection.port.getsockname())
            wait_until(lambda: hook.connected, message="the IPv6 station heard")
            hook.alert("WARNING", "over_ipv6", "udpin", {})
            assert _text(station.recv(512)) == "over_ipv6: udpin"
    finally:
        hook.close()


@pytest.mark.usefixtures("ipv6")
def test_tcp_to_an_ipv6_address_connects_and_sends() -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as server:
        server.bind(("::1", 0))
        server.listen(1)
        server.settimeout(HANG_S)
        hook = MavlinkAlertHook(f"tcp:[::1]:{server.getsockname()[1]}")
        try:
            connection, _ = server.accept()
            connection.settimeout(HANG_S)
            wait_until(lambda: hook.connected, message="the IPv6 connection")
            hook.alert("WARNING", "over_ipv6", "tcp", {})
            assert _text(connection.recv(512)) == "over_ipv6: tcp"
            connection.close()
        finally:
            hook.close()


@pytest.mark.parametrize(
    "endpoint",
    ["udpout:[::1]:14550", "udpin:[::]:14550", "udp:[::]:14550", "tcp:[::1]:5760"],
)
def test_a_bracketed_ipv6_endpoint_loads(tmp_path: Path, endpoint: str) -> None:
    assert load_with_endpoint(tmp_path, endpoint).alerts.mavlink_endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    [
        "udpout:::1:14550",  # ambiguous: which colon starts the port?
        "tcp:fe80::1:5760",
        "udpout:[::1:14550",
        "udpout:::1]:14550",
        "udpout:[gcs.local]:14550",
        "udpout:[127.0.0.1]:14550",
        "udpin:[]:14550",
    ],
)
def test_an_ipv6_endpoint_out_of_brackets_or_else_in_them_is_refused_at_load(
    tmp_path: Path, endpoint: str
) -> None:
    with pytest.raises(ConfigError, match=r"alerts\.mavlink_endpoint: .*IPv6 HOST in brackets"):
        load_with_endpoint(tmp_path, endpoint)
