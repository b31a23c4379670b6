"""Second review of the recorder's reader: reading a directory that a running
recorder prunes (DESIGN.md, second review of the flight data recorder)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from inferd.cli.fdr import verify
from inferd.fdr import reader
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
