"""What a datagram a ``udpin:`` hook received says about its sender, read without
pymavlink (the hook reads each datagram on its own thread, and pymavlink is
imported only when a hook is built).

``is_mavlink``: whole MAVLink frames, back to back (magic byte and lengths).
``has_heartbeat``: that, and at least one of them a HEARTBEAT whose checksum is
right.  Only the second teaches a ground station: an 8-byte datagram
``b"\\xfe\\x00" + 6 zero bytes`` is whole frames, and 8 of them from 8 ports
pushed the real station out of the 8 answered.  A checksum needs the message's
``CRC_EXTRA`` (a seed of its fields' layout), so one message is checked, the
one every ground station sends: QGroundControl, Mission Planner and MAVProxy
send HEARTBEAT at 1 Hz on each link unless told not to.  This raises the bar
against junk, a port scan or another protocol on a shared radio network; it
is no authentication: anyone who can reach the port and writes MAVLink can send
a HEARTBEAT, and a spoofed source address defeats any check made inside the
datagram (MAVLink 2 signing, not checked here, is the answer to that).
"""

from __future__ import annotations

_V1_MAGIC, _V2_MAGIC = 0xFE, 0xFD
#: MAVLink 2's incompat flag for a signed frame, which carries 13 more bytes.
_V2_SIGNED = 0x01
#: HEARTBEAT: message id 0, 9 bytes of payload (MAVLink 2 drops trailing zero
#: bytes, so fewer there), ``CRC_EXTRA`` 50 (common.xml, as in every dialect).
_HEARTBEAT_ID = 0
_HEARTBEAT_LEN = 9
_HEARTBEAT_CRC_EXTRA = 50


def _frames(data: bytes) -> list[tuple[int, int, int]] | None:
    """Each frame of ``data`` as ``(start, header length, payload length)``; None
    unless ``data`` is whole frames back to back."""
    frames, offset = [], 0
    while offset < len(data):
        left, magic = len(data) - offset, data[offset]
        if magic == _V2_MAGIC and left >= 12:
            frames.append((offset, 10, data[offset + 1]))
            offset += 12 + data[offset + 1] + (13 if data[offset + 2] & _V2_SIGNED else 0)
        elif magic == _V1_MAGIC and left >= 8:
            frames.append((offset, 6, data[offset + 1]))
            offset += 8 + data[offset + 1]
        else:
            return None
    return frames if offset == len(data) > 0 else None


def is_mavlink(data: bytes) -> bool:
    """Whether ``data`` is one or more whole MAVLink frames, back to back: each
    starts with v1's or v2's magic byte and the lengths in their headers end
    exactly where the datagram does."""
    return _frames(data) is not None


def has_heartbeat(data: bytes) -> bool:
    """Whether ``data`` is whole MAVLink frames (``is_mavlink``) and one of them
    is a HEARTBEAT with the right checksum (X.25 over the header after the magic
    byte and the payload, then ``CRC_EXTRA``)."""
    for start, header, length in _frames(data) or ():
        if header == 6:  # v1: a one-byte message id, the whole payload
            msgid, fits = data[start + 5], length == _HEARTBEAT_LEN
        else:  # v2: a three-byte one, little-endian
            msgid = int.from_bytes(data[start + 7 : start + 10], "little")
            fits = 0 < length <= _HEARTBEAT_LEN
        if msgid != _HEARTBEAT_ID or not fits:
            continue
        end = start + header + length
        crc = x25_crc(data[start + 1 : end] + bytes([_HEARTBEAT_CRC_EXTRA]))
        if crc == int.from_bytes(data[end : end + 2], "little"):
            return True
    return False


def x25_crc(data: bytes) -> int:
    """MAVLink's checksum: CRC-16/MCRF4XX (X.25, initial 0xFFFF, not inverted)."""
    crc = 0xFFFF
    for byte in data:
        tmp = byte ^ (crc & 0xFF)
        tmp = (tmp ^ (tmp << 4)) & 0xFF
        crc = (crc >> 8) ^ (tmp << 8) ^ (tmp << 3) ^ (tmp >> 4)
    return crc & 0xFFFF
