"""Review 4 of the flight data recorder: the reader's memory on a hostile file,
a fuzz of the reader over a real recorder file, and a restart after a crash's
torn tail."""

from __future__ import annotations

import io
import os
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferd.cli.fdr import dump, verify
from inferd.config import FdrConfig
from inferd.fdr import framing, reader
from inferd.fdr.reader import ReadReport, Record, list_segments, read_records
from inferd.fdr.writer import FlightRecorder
from tests.conftest import examples


def _record_to(directory: Path, first: int, count: int) -> None:
    fdr = FlightRecorder(FdrConfig(directory=directory, fsync_interval_ms=50), boot_id="boot-r4")
    fdr.start()
    for index in range(first, first + count):
        fdr.record("deadline_miss", {"model": "demo", "count": index, "window_s": 10.0})
    fdr.stop()


def test_a_segment_larger_than_the_writer_makes_is_read_only_that_far(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of gigabytes under a segment's name was read whole (and its zero tail
    copied once more): 2x its size in memory, in ``inferd fdr`` and at the
    daemon's start.  The reader reads no more than the largest segment (the
    config's ceiling, made small here) and calls the rest corruption."""
    directory = tmp_path / "fdr"
    _record_to(directory, 1, 40)
    (segment,) = list_segments(directory)
    written = segment.stat().st_size
    records = list(read_records(directory))
    cap = records[30].offset + 5  # inside record 31's frame
    with segment.open("ab") as handle:
        handle.truncate(written + 1024 * 1024)  # zeros, as a preallocated tail
    monkeypatch.setattr(reader, "MAX_FDR_SEGMENT_BYTES", cap, raising=False)
    read_sizes: list[int] = []
    real_open = reader.open_regular_file

    def spying_open(path: Path, **kwargs: Any) -> Any:
        handle, info = real_open(path, **kwargs)
        real_read, real_readall = handle.read, handle.readall

        def read(size: int = -1) -> bytes:
            data = real_read(size)
            read_sizes.append(len(data))
            return data

        def readall() -> bytes:
            data = real_readall()
            read_sizes.append(len(data))
            return data

        handle.read, handle.readall = read, readall  # type: ignore[method-assign]
        return handle, info

    monkeypatch.setattr(reader, "open_regular_file", spying_open)
    report = ReadReport()
    assert [r.seq for r in read_records(directory, report)] == [r.seq for r in records[:30]]
    assert read_sizes and max(read_sizes) <= cap
    assert not report.torn_tails  # the cut frame is no crash's
    assert [(d.offset, d.length) for d in report.corrupt] == [
        (records[30].offset, 5),
        (cap, written + 1024 * 1024 - cap),
    ]
    assert verify(directory, as_json=False, out=(out := io.StringIO())) == 1
    assert f"@{cap} " in out.getvalue() and "the most a segment holds" in out.getvalue()


def test_a_zero_filled_tail_is_not_copied_to_be_told_from_damage(tmp_path: Path) -> None:
    """The zeros after a torn frame were found with ``data[offset:].rstrip()`` and
    the frame checked on ``data[:zeros_from]``: two more copies of the file."""
    directory = tmp_path / "fdr"
    _record_to(directory, 1, 10)
    (segment,) = list_segments(directory)
    data = segment.read_bytes()
    before = [r.seq for r in read_records(directory) if r.offset + 13 < 512]
    size = 16 * 1024 * 1024
    # a power cut: the frame across the first sector's end cut there, zeros after
    segment.write_bytes(data[:512] + bytes(size - 512))
    tracemalloc.start()
    try:
        report = ReadReport()
        seqs = [r.seq for r in read_records(directory, report)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seqs == before[:-1] and len(report.torn_tails) == 1 and not report.is_corrupt
    assert peak < size + 2 * 1024 * 1024, peak  # the file once, not three times


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, list[Record]]:
    directory = tmp_path_factory.mktemp("fuzz") / "fdr"
    _record_to(directory, 1, 12)
    (segment,) = list_segments(directory)
    return segment.read_bytes(), list(read_records(directory))


@settings(
    max_examples=examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_fuzz_truncations_and_byte_flips_of_a_real_segment(
    recorded: tuple[bytes, list[Record]], data: st.DataObject
) -> None:
    """Whatever a cut or flipped bytes do to a recorder file, the reader and the
    tools raise nothing, and every record whose frame lies wholly before the
    first damaged byte is read."""
    original, records = recorded
    damaged = bytearray(original)
    cut = data.draw(st.integers(0, len(original)), label="cut")
    flips = data.draw(st.lists(st.integers(0, len(original) - 1), max_size=4), label="flips")
    for position in flips:
        damaged[position] ^= data.draw(st.integers(1, 255), label="xor")
    # Two flips of one byte may cancel out: only a byte that differs is damaged.
    damaged_from = min([cut, *(p for p in flips if damaged[p] != original[p])])
    del damaged[cut:]
    ends = [r.offset for r in records[1:]] + [len(original)]
    intact = [r.seq for r, end in zip(records, ends, strict=True) if end <= damaged_from]
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        (directory / framing.segment_name(1)).write_bytes(bytes(damaged))
        report = ReadReport()
        seqs = [r.seq for r in read_records(directory, report)]
        assert seqs[: len(intact)] == intact
        if damaged_from < len(original):
            assert report.skipped_bytes > 0 or len(seqs) < len(records)
        assert verify(directory, as_json=True, out=io.StringIO()) in (0, 1)
        assert dump(directory, kinds=[], since_wall_ns=None, as_json=False, out=io.StringIO()) == 0


def test_a_restart_after_a_torn_tail_writes_a_new_segment_the_reader_reads_whole(
    tmp_path: Path,
) -> None:
    """A crash cut the last frame; the next run must not append after the
    garbage (its records would be read as corruption after a bad frame)."""
    directory = tmp_path / "fdr"
    _record_to(directory, 1, 5)
    (first,) = list_segments(directory)
    before = list(read_records(directory))
    with first.open("r+b") as handle:
        handle.truncate(before[-1].offset + 9)  # the last frame cut inside its header
    torn_size = first.stat().st_size
    _record_to(directory, 6, 5)
    assert first.stat().st_size == torn_size  # never appended to
    report = ReadReport()
    after = list(read_records(directory, report))
    assert [r.payload["count"] for r in after] == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert [r.seq for r in after] == list(range(1, 10))  # the seq resumes after the last read
    assert len(report.torn_tails) == 1 and not report.is_corrupt
    assert verify(directory, as_json=False, out=io.StringIO()) == 0
    assert os.path.getsize(first) == torn_size
