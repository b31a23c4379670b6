"""On-disk format of the flight data recorder.

A segment file is a 28-byte header followed by frames::

    header  magic "INFERDR1" | segment index u64 | created wall ns u64 | crc32c(previous 24) u32
    frame   sync a5 5a c3 3c | body length u32 | crc32c(body) u32 | body (msgpack map)

All integers little-endian.  The sync marker lets a reader find the next frame
after a corrupt region (as PX4 ULog's sync message does); CRC32C (Castagnoli,
as in LevelDB and RocksDB) rejects damaged bodies, which ULog and ArduPilot
logs cannot detect.  A record body is a msgpack map with ``kind``,
``schema_version``, ``seq``, ``wall_ns``, ``mono_ns``, ``boot_id`` and
``payload``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import msgpack

SEGMENT_MAGIC = b"INFERDR1"
SEGMENT_HEADER = struct.Struct("<8sQQI")
SYNC = b"\xa5\x5a\xc3\x3c"
FRAME_HEADER = struct.Struct("<4sII")
#: A record describes an event; anything larger is corruption, not data.
MAX_BODY_BYTES = 1024 * 1024
SEGMENT_SUFFIX = ".fdr"


def crc32c(data: bytes) -> int:
    import google_crc32c

    return int(google_crc32c.value(data))


def segment_name(index: int) -> str:
    return f"seg-{index:010d}{SEGMENT_SUFFIX}"


def segment_index(name: str) -> int | None:
    if not (name.startswith("seg-") and name.endswith(SEGMENT_SUFFIX)):
        return None
    digits = name[4 : -len(SEGMENT_SUFFIX)]
    return int(digits) if digits.isdigit() else None


def encode_segment_header(index: int, created_wall_ns: int) -> bytes:
    partial = SEGMENT_MAGIC + struct.pack("<QQ", index, created_wall_ns)
    return partial + struct.pack("<I", crc32c(partial))


def decode_segment_header(data: bytes) -> tuple[int, int]:
    """(index, created wall ns); ValueError if the header is missing or damaged."""
    if len(data) < SEGMENT_HEADER.size:
        raise ValueError("segment header is truncated")
    magic, index, created, checksum = SEGMENT_HEADER.unpack_from(data)
    if magic != SEGMENT_MAGIC:
        raise ValueError(f"bad segment magic {magic!r}")
    if crc32c(data[: SEGMENT_HEADER.size - 4]) != checksum:
        raise ValueError("segment header CRC mismatch")
    return index, created


def encode_body(record: Mapping[str, Any]) -> bytes:
    return msgpack.packb(record, use_bin_type=True)  # type: ignore[no-any-return]


def encode_frame(body: bytes) -> bytes:
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"record body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}")
    return FRAME_HEADER.pack(SYNC, len(body), crc32c(body)) + body
