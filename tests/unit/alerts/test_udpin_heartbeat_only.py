"""A ``udpin:`` hook learns a ground station only from a HEARTBEAT whose checksum is
right, over real sockets.

Whole frames were enough (magic byte and lengths): ``b"\\xfe\\x00"`` and 6 zero
bytes is a "frame", and 8 of them from 8 ports pushed the real station out of the
8 answered, so the next CRITICAL alert went only to them, counted as sent (review
F9, ``r3_udpin_crafted.py``: "GCS received the alert: False").  Ground stations
send HEARTBEAT at 1 Hz, so that is what teaches one now, checked with
HEARTBEAT's ``CRC_EXTRA`` (50).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.alerts.udp_link import MAX_UDP_PEERS
from tests.conftest import wait_until
from tests.unit.alerts.test_mavlink_link_endpoints import _heartbeat_v1
from tests.unit.alerts.test_mavlink_udpin import _ground_station, _heartbeat, _text

#: A v1 "frame" with no payload and a zero checksum: whole, and no HEARTBEAT.
CRAFTED_V1 = b"\xfe\x00" + bytes(6)
#: The same in MAVLink 2: message id 0 (HEARTBEAT's), no payload, a zero checksum.
CRAFTED_V2 = b"\xfd\x00" + bytes(10)


def _statustext() -> bytes:
    from pymavlink.dialects.v20 import common

    mav = common.MAVLink(None, srcSystem=255, srcComponent=190)
    return bytes(mav.statustext_encode(common.MAV_SEVERITY_INFO, b"hello").pack(mav))


def _command_long() -> bytes:
    from pymavlink.dialects.v20 import common

    mav = common.MAVLink(None, srcSystem=255, srcComponent=190)
    message = mav.command_long_encode(1, 1, common.MAV_CMD_REQUEST_MESSAGE, 0, 0, 0, 0, 0, 0, 0, 0)
    return bytes(message.pack(mav))


def _flipped(frame: bytes, index: int) -> bytes:
    return frame[:index] + bytes([frame[index] ^ 0x01]) + frame[index + 1 :]


def _signed_heartbeat() -> bytes:
    """A MAVLink 2 HEARTBEAT signed by pymavlink (the signed flag is under the checksum)."""
    from pymavlink.dialects.v20 import common

    mav = common.MAVLink(None, srcSystem=255, srcComponent=190)
    mav.signing.secret_key = bytes(range(32))
    mav.signing.sign_outgoing = True
    message = mav.heartbeat_encode(common.MAV_TYPE_GCS, common.MAV_AUTOPILOT_INVALID, 0, 0, 0)
    frame = bytes(message.pack(mav))
    assert frame[2] & 0x01 and len(frame) == 21 + 13, frame
    return frame


def _zero_payload_heartbeat() -> bytes:
    """A MAVLink 2 HEARTBEAT whose payload pymavlink cut to one byte (trailing zeros)."""
    from pymavlink.dialects.v20 import common

    mav = common.MAVLink(None, srcSystem=255, srcComponent=190)
    message = mav.heartbeat_encode(common.MAV_TYPE_GCS, 0, 0, 0, 0, mavlink_version=0)
    return bytes(message.pack(mav))


@pytest.mark.parametrize(
    ("datagram", "teaches"),
    [
        (_heartbeat(), True),
        (_heartbeat_v1(), True),
        (_signed_heartbeat(), True),  # the signature is not checked (no key)
        (_zero_payload_heartbeat(), True),
        (_statustext() + _heartbeat(), True),  # a router's batch
        (CRAFTED_V1, False),
        (CRAFTED_V2, False),
        (_statustext(), False),
        (_command_long(), False),
        (_flipped(_heartbeat(), len(_heartbeat()) - 1), False),  # a checksum byte
        (_flipped(_heartbeat(), 12), False),  # a payload byte
        (_flipped(_heartbeat_v1(), 8), False),
        (_heartbeat() + b"\0", False),  # not whole frames
        (b"", False),
    ],
)
def test_only_a_heartbeat_with_the_right_checksum_teaches(datagram: bytes, teaches: bool) -> None:
    from inferd.alerts.mavlink_frames import has_heartbeat

    assert has_heartbeat(datagram) is teaches


def test_the_checksum_is_pymavlinks() -> None:
    from pymavlink.mavutil import x25crc

    from inferd.alerts.mavlink_frames import x25_crc

    rng = random.Random(298)
    for size in (0, 1, 2, 9, 10, 50, 255):
        data = bytes(rng.randrange(256) for _ in range(size))
        assert x25_crc(data) == x25crc(data).crc, data


@pytest.fixture
def udpin_hook() -> Iterator[MavlinkAlertHook]:
    hook = MavlinkAlertHook("udpin:127.0.0.1:0")
    yield hook
    hook.close()


def test_crafted_frames_from_8_ports_never_push_the_ground_station_out(
    udpin_hook: MavlinkAlertHook,
) -> None:
    address = udpin_hook._connection.port.getsockname()
    station = _ground_station()
    senders = [_ground_station() for _ in range(MAX_UDP_PEERS)]
    try:
        station.sendto(_heartbeat(), address)
        wait_until(lambda: udpin_hook.status()["state"] == "up", message="the station heard")
        for index, sender in enumerate(senders):  # read by the hook before the alert
            sender.sendto(CRAFTED_V1 if index % 2 else CRAFTED_V2, address)
        udpin_hook.alert("CRITICAL", "engine_worker_died", "one alert", {})
        assert _text(station.recv(512)) == "engine_worker_died: one alert"
        link = udpin_hook.status()
        assert (link["destinations"], link["ignored"]) == (1, MAX_UDP_PEERS)
    finally:
        station.close()
        for sender in senders:
            sender.close()


def test_mavlink_that_is_no_heartbeat_teaches_no_station(udpin_hook: MavlinkAlertHook) -> None:
    sender = _ground_station()
    try:
        sender.sendto(_command_long(), udpin_hook._connection.port.getsockname())
        wait_until(lambda: udpin_hook.status()["ignored"] == 1, message="the datagram read")
        assert udpin_hook.status()["state"] == "no_peer"
    finally:
        sender.close()
