"""The two leftovers of the reader's review 4 (DESIGN entry 230): the CPU cost of
resynchronising over a span packed with sync markers, and ``--since`` at an
exact ISO instant."""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferd.cli.fdr import dump, parse_since
from inferd.fdr import framing, reader, span_crc
from inferd.fdr.reader import ReadReport, read_records
from tests.conftest import examples


def _body(seq: int, wall_ns: int = 1) -> bytes:
    return framing.encode_body(
        {
            "kind": "deadline_miss",
            "schema_version": 1,
            "seq": seq,
            "wall_ns": wall_ns,
            "mono_ns": 1,
            "boot_id": "boot-resync",
            "payload": {"model": "demo", "count": seq},
        }
    )


def _write_segment(directory: Path, frames: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / framing.segment_name(1)
    path.write_bytes(framing.encode_segment_header(1, 0) + frames)
    return path


def _hostile(count: int, rng: random.Random) -> bytes:
    """Sync markers 13 bytes apart, each a frame header claiming a body of 64 KiB
    or 1 MiB with a wrong CRC, its body's first byte a 7-key map's (0x87): what
    passes every check but the CRC."""
    out = bytearray()
    for _index in range(count):
        length = rng.choice((64 * 1024, framing.MAX_BODY_BYTES))
        out += framing.FRAME_HEADER.pack(framing.SYNC, length, 0xDEADBEEF) + b"\x87"
    return bytes(out)


class _HashedBytes:
    """Counts the bytes google_crc32c hashes (the reader's CRCs and ``SpanCrc``'s)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.total = 0
        real_value, real_extend = google_crc32c.value, google_crc32c.extend

        def value(data: bytes) -> Any:
            self.total += len(data)
            return real_value(data)

        def extend(crc: int, data: bytes) -> Any:
            self.total += len(data)
            return real_extend(crc, data)

        monkeypatch.setattr(google_crc32c, "value", value)
        monkeypatch.setattr(google_crc32c, "extend", extend)


def test_a_span_crc_is_the_crc_of_the_span() -> None:
    rng = random.Random(7)
    data = rng.randbytes(3 * 1024 * 1024 + 77)
    origin = 1000
    spans = span_crc.SpanCrc(data, origin)
    lengths = (0, 1, 511, 512, 513, 1023, 1024, 1025, framing.MAX_BODY_BYTES)
    for _index in range(2000):
        start = rng.randrange(origin, len(data))
        length = rng.choice((*lengths, rng.randrange(framing.MAX_BODY_BYTES + 1)))
        end = min(len(data), start + length)
        assert spans.crc(start, end) == google_crc32c.value(data[start:end]), (start, end)
    with pytest.raises(ValueError, match="outside"):
        spans.crc(origin - 1, origin + 10)


def test_resynchronising_over_packed_sync_markers_hashes_a_bounded_number_of_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each marker claimed up to 1 MiB and was CRC-checked on its own: a segment
    packed with them cost up to 1 MiB of CRC per 13 bytes (8.5 s a MiB).  Now
    the bytes hashed are the segment's plus at most 1 KiB a marker, and the
    valid frames after the hostile span are all read."""
    rng = random.Random(1)
    after = b"".join(framing.encode_frame(_body(seq)) for seq in range(2, 40))
    frames = framing.encode_frame(_body(1)) + _hostile(20_000, rng) + after
    segment = _write_segment(tmp_path / "fdr", frames)
    hashed = _HashedBytes(monkeypatch)
    report = ReadReport()
    assert [record.seq for record in read_records(tmp_path / "fdr", report)] == list(range(1, 40))
    assert len(report.corrupt) == 1 and not report.torn_tails
    # each byte once for the prefix CRCs, then at most two grid cells a marker tried
    # (and the advance tables, 32 cells, if not built yet): before, up to 1 MiB each
    size = segment.stat().st_size
    bound = size + (20_000 + 40 + 32) * 2 * span_crc._GRID
    assert hashed.total <= bound, f"{hashed.total} bytes hashed for a {size}-byte segment"


def _reference_next_good_frame(name: str, data: bytes, start: int, *_spans: Any) -> int | None:
    """The resynchronisation by its definition: the first marker whose frame is a record."""
    position = data.find(framing.SYNC, start)
    while position != -1:
        if isinstance(reader._frame_at(name, data, position), reader.Record):
            return position
        position = data.find(framing.SYNC, position + 1)
    return None


def _read(directory: Path) -> tuple[list[tuple[int, int]], dict[str, Any]]:
    report = ReadReport()
    records = [(record.seq, record.offset) for record in read_records(directory, report)]
    return records, report.as_dict()


@st.composite
def _damaged_segments(draw: st.DrawFn) -> bytes:
    """Valid frames, a hostile span (markers claiming bodies that reach over the
    valid frames after it, some with a CRC that matches an undecodable body),
    then valid frames, some inside what the hostile markers claim."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    out = bytearray(b"".join(framing.encode_frame(_body(seq)) for seq in range(3)))
    seq = 3
    for _piece in range(draw(st.integers(1, 6))):
        for _marker in range(rng.randrange(1, 40)):
            length = rng.choice((1, 13, 200, 5000, framing.MAX_BODY_BYTES, 2**32 - 1))
            filler = rng.choice((b"\x87", b"\x87\xa4kind", b"", rng.randbytes(rng.randrange(20))))
            checksum = rng.randrange(2**32)
            if rng.random() < 0.2:  # a CRC-valid body that is no record
                filler = b"\x87\x00" + rng.randbytes(rng.randrange(10))
                length, checksum = len(filler), google_crc32c.value(filler)
            out += framing.FRAME_HEADER.pack(framing.SYNC, length, checksum) + filler
        for _valid in range(rng.randrange(0, 4)):
            out += framing.encode_frame(_body(seq))
            seq += 1
    return bytes(out)


@settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(frames=_damaged_segments())
def test_every_frame_after_a_hostile_span_is_found_as_by_trying_every_marker(
    tmp_path: Path, frames: bytes
) -> None:
    """The bounded resynchronisation finds what trying each marker's frame in full
    finds: the same records at the same offsets, the same damage."""
    directory = tmp_path / f"fdr-{google_crc32c.value(frames)}"
    _write_segment(directory, frames)
    found = _read(directory)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reader, "_next_good_frame", _reference_next_good_frame)
        assert found == _read(directory)


def _records_at(wall_ns: list[int]) -> Iterator[bytes]:
    for seq, wall in enumerate(wall_ns, start=1):
        yield framing.encode_frame(_body(seq, wall))


def test_an_iso_since_includes_a_record_at_exactly_its_instant(tmp_path: Path) -> None:
    """``--since 2026-05-04T12:34:56.123457Z`` went through ``timestamp() * 1e9``:
    ...123457024 ns, which left out the records at ...123457000 and ...123457001.
    Records at or after the instant are dumped (as ``read_records`` filters)."""
    instant = 1_777_898_096_123_457_000
    since = parse_since("2026-05-04T12:34:56.123457Z")
    assert since == instant
    assert parse_since("2026-05-04T14:34:56.123457+02:00") == instant
    assert parse_since("1969-12-31T23:59:59.999999Z") == -1000
    walls = [instant - 1, instant, instant + 1, instant + 24, instant + 1000]
    _write_segment(tmp_path / "fdr", b"".join(_records_at(walls)))
    out = io.StringIO()
    dump(tmp_path / "fdr", kinds=[], since_wall_ns=since, as_json=True, out=out, err=io.StringIO())
    dumped = [line for line in out.getvalue().splitlines() if line]
    assert len(dumped) == 4
    assert all(f'"wall_ns": {wall},' in line for line, wall in zip(dumped, walls[1:], strict=True))
