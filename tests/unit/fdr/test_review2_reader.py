"""Second review of the recorder's reader: reading a directory that a running
recorder prunes (DESIGN.md, second review of the flight data recorder)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from inferd.cli.fdr import verify
from inferd.fdr import reader
from inferd.fdr.framing import FRAME_HEADER
from inferd.fdr.reader import ReadReport, list_segments, read_records
from inferd.fdr.writer import FlightRecorder
from tests.unit.fdr.test_fdr import config, miss


def recorded(directory: Path) -> list[Path]:
    fdr = FlightRecorder(config(directory, segment_max_bytes=1024, max_total_bytes=1 << 20))
    fdr.start()
    for index in range(30):
        fdr.record("deadline_miss", miss(index + 1))
    fdr.stop()
    return list_segments(directory)


def test_a_segment_the_size_cap_deletes_while_it_is_read_is_not_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`inferd fdr verify` beside a running daemon: the cap deleted the oldest
    segment between the listing and its open, and verify said CORRUPT ("cannot
    read: No such file or directory") and exited 1 for a healthy recorder."""
    segments = recorded(tmp_path)
    assert len(segments) >= 3
    survivors = {r.seq for r in read_records(tmp_path) if r.segment != segments[0].name}
    real = reader.list_segments

    def listed_then_pruned(directory: Path) -> list[Path]:
        paths = real(directory)
        paths[0].unlink()  # what the recorder's size cap does meanwhile
        return paths

    monkeypatch.setattr(reader, "list_segments", listed_then_pruned)
    report = ReadReport()
    assert {r.seq for r in read_records(tmp_path, report)} == survivors
    assert not report.is_corrupt and report.segments == len(segments) - 1
    recorded(tmp_path / "again")
    out = io.StringIO()
    assert verify(tmp_path / "again", as_json=True, out=out) == 0, out.getvalue()
    assert json.loads(out.getvalue())["unreadable_segments"] == []


@pytest.mark.parametrize("sectors", [1, 2, 3, 4, 5, 6])
def test_zeros_from_a_sector_to_the_end_after_a_cut_frame_are_a_torn_tail(
    tmp_path: Path, sectors: int
) -> None:
    """A power cut under delayed allocation can leave a grown file's last blocks as
    zeros: the data reached the disk up to a sector, the rest of the file reads as
    zeros. What precedes them is whole frames and a cut one (in its header or its
    body, by where the sector falls): a crash's torn tail, which `verify` passes;
    it was called corruption (exit 1)."""
    fdr = FlightRecorder(config(tmp_path, segment_max_bytes=4096, max_total_bytes=1 << 20))
    fdr.start()
    for index in range(30):
        fdr.record("deadline_miss", miss(index + 1))
    fdr.stop()
    first = list_segments(tmp_path)[0]
    for later in list_segments(tmp_path)[1:]:
        later.unlink()  # the crash came while the first segment was written
    frames = list(read_records(tmp_path))
    boundary = sectors * 512
    whole = [r.seq for r in frames if r.offset + len(_frame(first, r.offset)) <= boundary]
    cut = next(r for r in frames if r.offset + len(_frame(first, r.offset)) > boundary)
    first.write_bytes(first.read_bytes()[:boundary] + bytes(4096))
    report = ReadReport()
    assert [r.seq for r in read_records(tmp_path, report)] == whole
    assert not report.is_corrupt, report.corrupt
    [torn] = report.torn_tails
    assert torn.offset == cut.offset
    assert verify(tmp_path, as_json=True, out=io.StringIO()) == 0


def _frame(segment: Path, offset: int) -> bytes:
    """The frame at ``offset`` of ``segment``: its header and body."""
    data = segment.read_bytes()
    length = FRAME_HEADER.unpack_from(data, offset)[1]
    return data[offset : offset + FRAME_HEADER.size + length]


def test_zeros_inside_a_segment_before_later_frames_are_still_corruption(
    tmp_path: Path,
) -> None:
    """Only a tail can be what a crash left: zeros with whole frames after them are
    damage, reported, and the frames after them are still read."""
    segments = recorded(tmp_path)
    last = segments[-1]
    records = [r for r in read_records(tmp_path) if r.segment == last.name]
    assert len(records) >= 2
    data = bytearray(last.read_bytes())
    start, after = records[0].offset, records[1].offset
    data[start:after] = bytes(after - start)
    last.write_bytes(bytes(data))
    report = ReadReport()
    seqs = {r.seq for r in read_records(tmp_path, report)}
    assert records[0].seq not in seqs and records[1].seq in seqs
    assert report.is_corrupt and not report.torn_tails
