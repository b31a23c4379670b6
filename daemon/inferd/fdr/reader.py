"""Read recorder segments back, in order, surviving crashes and corruption.

* A frame cut off by the end of its file (the writer died mid-write) is a *torn
  tail*: reading that segment stops there cleanly.  So is one followed only by zeros
  to the end (blocks a power cut left unwritten): a crash's leftovers, not damage.
* A frame whose sync marker, length, CRC or body is wrong is *corruption*:
  the reader scans forward for the next sync marker whose frame checks out,
  and reports the bytes it skipped.  Only the damaged records are lost.  A frame
  whose length runs past the end while its CRC matches the bytes up to the end
  (or to the next sync marker) was written whole: its length field is damaged,
  which is corruption, not a torn tail.  A CRC-valid body that is not a record
  (a field of the wrong type, a map key that is not a string, a payload nested
  deeper than the recorder writes, which ``json.dumps`` could not write) is
  corruption too: every record the reader hands on has a JSON form, and a seq in
  1..2**63-1.  Such a frame was written whole: the search goes on from its end.
* A segment is opened without following a symlink (the FDR directory is the
  daemon's own): a symlink, or anything but a regular file, under a segment's
  name is listed, so its index is never reused, and read as an *unreadable
  segment* whose reason names it; what it points at is never read.  One listed
  and then deleted before it is opened (the size cap of a recorder writing
  meanwhile) is skipped: it is not damage.
* A segment is read only as far as the largest one the writer makes
  (``MAX_FDR_SEGMENT_BYTES``); what lies past that is corruption, never read."""

from __future__ import annotations

import json
import math
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from inferd.config.ceilings import MAX_FDR_SEGMENT_BYTES
from inferd.fdr.framing import (
    FRAME_HEADER,
    MAX_BODY_BYTES,
    MAX_PAYLOAD_DEPTH,
    MAX_SEQ,
    SEGMENT_HEADER,
    SYNC,
    TOO_DEEP,
    crc32c,
    decode_segment_header,
    segment_index,
)
from inferd.fdr.span_crc import SpanCrc
from inferd.owned_files import open_regular_file

_BODY_KEYS = ("kind", "schema_version", "seq", "wall_ns", "mono_ns", "boot_id", "payload")


@dataclass(frozen=True)
class Record:
    kind: str
    schema_version: int
    seq: int
    wall_ns: int
    mono_ns: int
    boot_id: str
    payload: dict[str, Any]
    segment: str
    offset: int

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in (*_BODY_KEYS, "segment", "offset")}


@dataclass(frozen=True)
class Damage:
    segment: str
    offset: int
    length: int
    reason: str


@dataclass
class ReadReport:
    """What a read found besides records."""

    segments: int = 0
    records: int = 0
    torn_tails: list[Damage] = field(default_factory=list)
    corrupt: list[Damage] = field(default_factory=list)
    unreadable_segments: list[Damage] = field(default_factory=list)
    left_out_of_shown_boots: int = 0  # left out by ``since_wall_ns``: shown or last boot

    @property
    def skipped_bytes(self) -> int:
        return sum(d.length for d in (*self.torn_tails, *self.corrupt, *self.unreadable_segments))

    @property
    def is_corrupt(self) -> bool:
        """Damage other than torn tails (which a crash leaves behind legitimately)."""
        return bool(self.corrupt or self.unreadable_segments)

    def as_dict(self) -> dict[str, Any]:
        return {
            "segments": self.segments,
            "records": self.records,
            "skipped_bytes": self.skipped_bytes,
            "torn_tails": [d.__dict__ for d in self.torn_tails],
            "corrupt": [d.__dict__ for d in self.corrupt],
            "unreadable_segments": [d.__dict__ for d in self.unreadable_segments],
        }


def json_default(value: Any) -> Any:
    """``json.dumps``'s ``default`` for payloads: bytes as hex; anything else an error."""
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot encode {type(value).__name__}")


def json_text(value: Any) -> str:
    """A record's payload (or ``Record.as_dict()``) as JSON that any parser reads:
    bytes as hex, NaN and infinities as ``null`` (the recorder takes them, and
    ``json.dumps`` writes ``NaN``, which is no JSON).  ``dump --json`` and the MCAP
    export write through this."""
    try:
        return json.dumps(value, default=json_default, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere: copied only then
        return json.dumps(_finite(value), default=json_default, allow_nan=False)


def _finite(value: Any) -> Any:
    """A copy of ``value`` with every NaN and infinity as None (a loop, not recursion)."""
    root = [value]
    pending: list[tuple[Any, Any]] = [(root, 0)]
    while pending:
        parent, slot = pending.pop()
        item = parent[slot]
        if isinstance(item, dict):
            parent[slot] = copy = dict(item)
            pending.extend((copy, key) for key in copy)
        elif isinstance(item, list | tuple):
            parent[slot] = items = list(item)
            pending.extend((items, index) for index in range(len(items)))
        elif isinstance(item, float) and not math.isfinite(item):
            parent[slot] = None
    return root[0]


def list_segments(directory: Path) -> list[Path]:
    """Segment files in write order (by their index): every entry with a segment's
    name but a directory, symlinks included (``lstat``: never followed)."""
    if not directory.is_dir():
        return []
    indexed: list[tuple[int, Path]] = []
    for path in directory.iterdir():
        index = segment_index(path.name)
        if index is None:
            continue
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:  # deleted meanwhile
            continue
        if not stat.S_ISDIR(mode):
            indexed.append((index, path))
    return [path for _index, path in sorted(indexed)]


def read_records(
    directory: Path,
    report: ReadReport | None = None,
    *,
    kinds: Iterable[str] = (),
    since_wall_ns: int | None = None,
) -> Iterator[Record]:
    """Every intact record of every segment, in order; damage goes to ``report``.
    ``OSError`` here, not at the first record, when ``directory`` cannot be listed."""
    report = report if report is not None else ReadReport()
    wanted = {current_kind_name(kind) for kind in kinds}
    return _records(list_segments(directory), report, wanted, since_wall_ns)


def _records(
    paths: list[Path], report: ReadReport, wanted: set[str], since_wall_ns: int | None
) -> Iterator[Record]:
    left_out: dict[str, int] = {}  # by boot: a boot's clock may be set during it
    shown, last = set[str](), ""
    for path in paths:
        for record in read_segment(path, report):
            last = record.boot_id  # the last boot recorded (a flight stamped 1970 shows none)
            if wanted and record.kind not in wanted:
                continue
            if since_wall_ns is not None and record.wall_ns < since_wall_ns:
                left_out[last] = left_out.get(last, 0) + 1
                continue
            shown.add(last)
            yield record
    report.left_out_of_shown_boots = sum(left_out.get(boot, 0) for boot in shown | {last})


def read_segment(path: Path, report: ReadReport) -> Iterator[Record]:
    try:
        handle, info = open_regular_file(path)  # a symlink is refused, naming it
        with handle:
            # never more than the writer can have written: a file of gigabytes
            # under a segment's name must not take that much memory (nor the
            # daemon's start, which reads its newest segment)
            data = handle.read(min(info.st_size, MAX_FDR_SEGMENT_BYTES))  # (a buffer that size)
    except FileNotFoundError:  # listed, then deleted (the size cap of a running recorder)
        return
    except OSError as exc:
        report.segments += 1
        report.unreadable_segments.append(Damage(path.name, 0, 0, f"cannot read: {exc}"))
        return
    report.segments += 1
    try:
        decode_segment_header(data)
    except ValueError as exc:
        if len(data) < SEGMENT_HEADER.size:
            # Created but never fully written: the writer died right after open.
            report.torn_tails.append(Damage(path.name, 0, len(data), str(exc)))
            return
        report.corrupt.append(Damage(path.name, 0, SEGMENT_HEADER.size, str(exc)))
    torn_before = len(report.torn_tails)
    yield from _frames(path.name, data, SEGMENT_HEADER.size, report)
    if info.st_size > MAX_FDR_SEGMENT_BYTES:
        # a frame cut where the read stopped is no crash's tail: the file is damage
        report.corrupt.extend(report.torn_tails[torn_before:])
        del report.torn_tails[torn_before:]
        reason = f"past {MAX_FDR_SEGMENT_BYTES} bytes, the most a segment holds: not read"
        report.corrupt.append(Damage(path.name, len(data), info.st_size - len(data), reason))


def _frames(name: str, data: bytes, offset: int, report: ReadReport) -> Iterator[Record]:
    end = len(data)
    spans: SpanCrc | None = None  # one per segment: its prefix CRCs are hashed once
    while offset < end:
        outcome = _frame_at(name, data, offset)
        if isinstance(outcome, Record):
            report.records += 1
            yield outcome
            offset += FRAME_HEADER.size + _body_length(data, offset)
            continue
        spans = spans if spans is not None else SpanCrc(data, offset + 1)
        resync = _next_good_frame(name, data, _search_from(data, offset, outcome), spans)
        if resync is not None:
            # Something valid follows, so this was damage, not the end of writing
            # (a damaged length field can also point past the end of the file).
            reason = "length runs into later records" if outcome == "torn" else outcome
            report.corrupt.append(Damage(name, offset, resync - offset, reason))
            offset = resync
            continue
        if outcome == "torn":
            report.torn_tails.append(Damage(name, offset, end - offset, "incomplete frame at end"))
        elif not outcome.startswith(_WRITTEN_WHOLE) and _torn_before_zeros(name, data, offset):
            reason = "incomplete frame at end, then zeros the file system never wrote"
            report.torn_tails.append(Damage(name, offset, end - offset, reason))
        else:
            report.corrupt.append(Damage(name, offset, end - offset, outcome))
        return


#: A CRC-valid body that is no record (``_decode``; a reason may follow it).
_UNDECODABLE = "undecodable body"
#: What ``_frame_at`` says of a frame whose CRC matched: it was written whole,
#: whatever zeros end it, so it is never a torn tail.
_WRITTEN_WHOLE = (_UNDECODABLE, "damaged length")
#: The smallest unit a file system writes: the zeros a power cut leaves in a file
#: that grew begin at a multiple of it.
_SECTOR_BYTES = 512


def _search_from(data: bytes, offset: int, outcome: str) -> int:
    """Where the search for the next frame starts after the one at ``offset``: past
    its end when its CRC matched a body that is no record (written whole, so no
    frame starts inside it, and its body is decoded once), else the next byte."""
    if outcome.startswith(_UNDECODABLE):
        return offset + FRAME_HEADER.size + _body_length(data, offset)
    return offset + 1


def _torn_before_zeros(name: str, data: bytes, offset: int) -> bool:
    """Whether the bytes from ``offset`` are a frame cut off (or nothing) followed by
    zeros to the end that begin on a sector: a file system that grew the file but
    never wrote its last blocks before a power cut (delayed allocation) leaves
    them after a torn tail.  A damaged frame whose own last bytes are zeros does
    not start them on a sector but by chance (1 in 512)."""
    written = _zeros_start(data, offset)
    zeros_from = -(-written // _SECTOR_BYTES) * _SECTOR_BYTES  # before it: the frame's own
    if zeros_from >= len(data):
        return False
    if written == offset:
        return True
    if zeros_from - offset > FRAME_HEADER.size + MAX_BODY_BYTES:
        return False  # longer than any frame: whatever it is, it is not one cut off
    # only the frame's bytes are copied (at most a frame), never the file up to them
    return _frame_at(name, data[offset:zeros_from], 0) == "torn"


#: How much of a segment's end ``_zeros_start`` copies at a time.
_ZEROS_SCAN_BYTES = 64 * 1024


def _zeros_start(data: bytes, offset: int) -> int:
    """Where the zeros that end ``data`` begin (``offset`` at the earliest),
    looked for from the end a chunk at a time: ``data[offset:].rstrip()`` would
    copy the whole tail, the size of the file for a zero-filled one."""
    end = len(data)
    while end > offset:
        start = max(offset, end - _ZEROS_SCAN_BYTES)
        kept = len(data[start:end].rstrip(b"\0"))
        if kept:
            return start + kept
        end = start
    return offset


def _body_length(data: bytes, offset: int) -> int:
    return int(FRAME_HEADER.unpack_from(data, offset)[1])


def _frame_at(name: str, data: bytes, offset: int) -> Record | str:
    """The record at ``offset``, ``"torn"`` if the file ends inside a plausible
    frame, or a reason string for corruption."""
    if len(data) - offset < FRAME_HEADER.size:
        return "torn" if SYNC.startswith(data[offset : offset + 4][: len(SYNC)]) else "bad sync"
    sync, length, checksum = FRAME_HEADER.unpack_from(data, offset)
    if sync != SYNC:
        return "bad sync marker"
    if length > MAX_BODY_BYTES:
        return f"implausible length {length}"
    start = offset + FRAME_HEADER.size
    if start + length > len(data):
        if _written_whole(data, start, checksum):
            return f"damaged length {length}: the frame's CRC matches a shorter body"
        return "torn"
    body = data[start : start + length]
    if crc32c(body) != checksum:
        return "CRC mismatch"
    return _decode(name, offset, body)


def _written_whole(data: bytes, start: int, checksum: int) -> bool:
    """Whether the bytes from ``start`` to the end, or to the next sync marker (a torn
    frame written after it), have the CRC ``checksum``: the body is all there and the
    length that runs past the end is damaged.  A crash leaves a prefix of the body,
    whose CRC matches the whole body's with odds of 2**-32: a torn tail is not
    called corruption by this."""
    following = data.find(SYNC, start)
    ends = (len(data),) if following == -1 else (following, len(data))
    return any(crc32c(data[start:end]) == checksum for end in ends)


#: The body fields that are integers (never ``bool``) and strings.
_INT_KEYS = ("schema_version", "seq", "wall_ns", "mono_ns")
_STR_KEYS = ("kind", "boot_id")


def _decode(name: str, offset: int, body: bytes) -> Record | str:
    """The record ``body`` holds, or why it is none (``_UNDECODABLE`` first): its
    fields of the wrong type would be tracebacks in ``dump``, ``verify`` and
    ``export``."""
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return _UNDECODABLE
    if not isinstance(fields, dict) or not all(key in fields for key in _BODY_KEYS):
        return _UNDECODABLE
    if not all(type(fields[key]) is int for key in _INT_KEYS):
        return _UNDECODABLE
    if not 1 <= fields["seq"] <= MAX_SEQ:  # record.json; none is resumed from (start)
        return f"{_UNDECODABLE}: seq out of range"
    if not all(isinstance(fields[key], str) for key in _STR_KEYS):
        return _UNDECODABLE
    if not isinstance(fields["payload"], dict):
        return _UNDECODABLE
    no_json_form = _no_json_form(fields["payload"])
    if no_json_form is not None:
        return no_json_form
    fields["kind"] = current_kind_name(fields["kind"])
    return Record(**{key: fields[key] for key in _BODY_KEYS}, segment=name, offset=offset)


def _no_json_form(payload: Any) -> str | None:
    """Why ``payload`` has no JSON form, or None when it has one: maps with string
    keys, lists, strings, numbers, booleans, nil and bytes (hex in JSON), no value
    deeper than MAX_PAYLOAD_DEPTH below it (msgpack reads 1,020 levels; past
    ~1,000 ``json.dumps`` raises RecursionError).  Not a bytes key, an ext type, a
    msgpack Timestamp.  Level by level, in a loop: no recursion here either."""
    level = [payload]
    for _depth in range(MAX_PAYLOAD_DEPTH + 1):
        below: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                if not all(isinstance(key, str) for key in item):
                    return _UNDECODABLE
                below.extend(item.values())
            elif isinstance(item, list):
                below.extend(item)
            elif item is not None and not isinstance(item, str | bytes | int | float):
                return _UNDECODABLE
        if not below:
            return None
        level = below
    return f"{_UNDECODABLE}: {TOO_DEEP}"


#: Record kinds were written as ``c7.<name>`` before they got user-facing names.
_OLD_KIND_PREFIX = "c7."


def current_kind_name(kind: str) -> str:
    """A kind as this version names it: a recorder file written by an older one says
    ``c7.deadline_miss`` for ``deadline_miss``."""
    return kind.removeprefix(_OLD_KIND_PREFIX)


def _next_good_frame(name: str, data: bytes, start: int, spans: SpanCrc) -> int | None:
    """Offset of the next sync marker that starts a valid frame (a record).  A frame
    whose CRC matches but that holds no record was written whole: no frame starts
    inside it, so the search goes on from its end: a body is decoded at most once
    (frames nested inside each other, each CRC-valid, would cost one per marker)."""
    position = data.find(SYNC, start)
    while position != -1:
        outcome = _record_at(name, data, position, spans)
        if isinstance(outcome, Record):
            return position
        position = data.find(SYNC, position + 1 if outcome is None else outcome)
    return None


#: The first byte of a msgpack map of at least 7 entries (fixmap 0x87-0x8f, map 16,
#: map 32): a body that starts otherwise holds no record's 7 keys.
_RECORD_MAP_MARKERS = frozenset((*range(0x87, 0x90), 0xDE, 0xDF))


def _record_at(name: str, data: bytes, position: int, spans: SpanCrc) -> Record | int | None:
    """``_frame_at``'s record at a sync marker, the end of a frame whose CRC matches a
    body that is no record, or None, for the resynchronisation: a frame running past
    the end is no record (torn or not), a body that is not a map of 7 keys is
    refused from its first byte, and the CRC is the span's (``SpanCrc``), not one
    over up to 1 MiB per marker tried."""
    if len(data) - position < FRAME_HEADER.size:
        return None
    _sync, length, checksum = FRAME_HEADER.unpack_from(data, position)
    start = position + FRAME_HEADER.size
    end = start + length
    if length > MAX_BODY_BYTES or end > len(data) or length == 0:
        return None
    if data[start] not in _RECORD_MAP_MARKERS or spans.crc(start, end) != checksum:
        return None
    outcome = _decode(name, position, data[start:end])
    return outcome if isinstance(outcome, Record) else end
