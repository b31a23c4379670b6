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

import functools
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
#: The header's u64: a name with a larger index is not a segment the writer made.
MAX_SEGMENT_INDEX = 2**64 - 1
#: The largest seq a record holds (``record.json``: 1 up to this, msgpack's int64):
#: the reader calls a body with another one undecodable, so none is ever resumed from.
MAX_SEQ = 2**63 - 1


def crc32c(data: bytes) -> int:
    import google_crc32c

    return int(google_crc32c.value(data))


def segment_name(index: int) -> str:
    return f"seg-{index:010d}{SEGMENT_SUFFIX}"


def segment_index(name: str) -> int | None:
    if not (name.startswith("seg-") and name.endswith(SEGMENT_SUFFIX)):
        return None
    digits = name[4 : -len(SEGMENT_SUFFIX)]
    # ASCII only: str.isdigit() takes "²", which int() refuses, and "٣", which it reads as 3
    if not (digits.isascii() and digits.isdigit()):
        return None
    index = int(digits)
    return index if index <= MAX_SEGMENT_INDEX else None


def encode_segment_header(index: int, created_wall_ns: int) -> bytes:
    if index > MAX_SEGMENT_INDEX:  # a name made by hand, past every one the writer makes
        raise ValueError(f"segment index {index} is past {MAX_SEGMENT_INDEX}, the header's largest")
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
    return _pack(record)


def _pack(item: Any) -> bytes:
    return msgpack.packb(item, use_bin_type=True)  # type: ignore[no-any-return]


#: The most bytes a seq takes in a body (msgpack's uint64: a marker and 8 bytes).
MAX_SEQ_BYTES = 9
_SEQ_KEY = _pack("seq")


def encode_body_parts(
    kind: str, schema_version: int, wall_ns: int, mono_ns: int, boot_id: str, payload: Any
) -> tuple[bytes, bytes]:
    """A record body without its seq: the bytes before and after the seq's value.

    The seq is assigned at write time, on the writer's thread, but the payload is
    encoded once, by the caller, who learns there that it cannot be (TypeError,
    ValueError, OverflowError).  msgpack is a stream: ``join_body`` gives what
    ``encode_body`` gives for the whole map, keys in this order.  Each part is
    packed as a small map (one msgpack call, not one per item) whose one-byte
    fixmap marker is then cut off."""
    tail = _pack({"wall_ns": wall_ns, "mono_ns": mono_ns, "boot_id": boot_id, "payload": payload})
    return _body_head(kind, schema_version), tail[1:]


@functools.cache  # one per registered kind
def _body_head(kind: str, schema_version: int) -> bytes:
    head = _pack({"kind": kind, "schema_version": schema_version})
    return b"\x87" + head[1:] + _SEQ_KEY  # 0x87: a fixmap of the 7 body keys


def encode_record_parts(
    kind: str,
    schema_version: int,
    wall_ns: int,
    mono_ns: int,
    boot_id: str,
    payload: Any,
    *,
    segment_max_bytes: int,
) -> tuple[bytes, bytes]:
    """``encode_body_parts``, checked: ValueError if the payload cannot be
    encoded, or if the record, whatever its seq, is over MAX_BODY_BYTES or would
    not fit an empty segment (no segment may outgrow ``segment_max_bytes``)."""
    try:
        head, tail = encode_body_parts(kind, schema_version, wall_ns, mono_ns, boot_id, payload)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"payload cannot be encoded: {exc}") from exc
    unreadable = _unreadable(payload)
    if unreadable is not None:
        raise ValueError(
            f"payload cannot be encoded: {unreadable} (the reader would take the record "
            "for corruption)"
        )
    body = len(head) + MAX_SEQ_BYTES + len(tail)
    if body > MAX_BODY_BYTES:
        raise ValueError(f"record body is {body} bytes; the limit is {MAX_BODY_BYTES}")
    room = segment_max_bytes - SEGMENT_HEADER.size
    if FRAME_HEADER.size + body > room:
        raise ValueError(
            f"record is {FRAME_HEADER.size + body} bytes; a segment (fdr.segment_max_bytes "
            f"{segment_max_bytes}) holds {room} after its header"
        )
    return head, tail


#: Values the walk below need not look into (their subclasses are looked at).
_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})
_EXT_TYPES = (msgpack.ExtType, msgpack.Timestamp)  # ExtType is a tuple
#: The deepest a value may lie below its payload (the payload's own items are at
#: 1).  msgpack's packer took 511 levels before 1.2.0 and 1,024 since; the reader
#: refuses deeper ones, which ``json.dumps`` (every consumer of a record) cannot
#: write past ~1,000 (RecursionError).  No record kind nests more than a few.
MAX_PAYLOAD_DEPTH = 511
TOO_DEEP = f"payload nested deeper than {MAX_PAYLOAD_DEPTH} levels"


def _unreadable(payload: Any) -> str | None:
    """Why the reader would not take ``payload``, once encoded, for a record: a map
    key that is not a string, an ext type or Timestamp, or nesting deeper than
    MAX_PAYLOAD_DEPTH; None when it would.  Called once msgpack encoded it, so it
    is a finite tree (msgpack refuses cycles).  Level by level, in a loop (not
    ``all()`` over a generator): about 1 us for an alert's payload."""
    level = [payload]
    for _depth in range(MAX_PAYLOAD_DEPTH + 1):
        below: list[Any] = []
        for item in level:
            if type(item) in _SCALARS:
                continue
            if isinstance(item, _EXT_TYPES):
                return "a msgpack ext type or Timestamp"
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str):
                        return "a map key that is not a string"
                below.extend(item.values())
            elif isinstance(item, (list, tuple)):
                below.extend(item)
        if not below:
            return None
        level = below
    return TOO_DEEP


def join_body(head: bytes, seq: int, tail: bytes) -> bytes:
    return head + _pack(seq) + tail


def encode_frame(body: bytes) -> bytes:
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"record body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}")
    return FRAME_HEADER.pack(SYNC, len(body), crc32c(body)) + body
