"""The recorder's directory is the daemon's own: a symlink under a segment's name is
never followed, by the reader, by the recorder resuming at start, or by the size cap
(DESIGN.md entry 125).  It is listed (so its index is never reused), read as an
unreadable segment whose reason names it, counted by its own size and, when the cap
deletes it, unlinked itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from inferd.config import FdrConfig
from inferd.fdr import framing
from inferd.fdr.reader import ReadReport, list_segments, read_records
from inferd.fdr.writer import FlightRecorder

SYMLINK_REFUSAL = "is a symbolic link, which inferd does not follow in its own directories"


def config(directory: Path, **overrides: Any) -> FdrConfig:
    return FdrConfig(**{"directory": directory, "fsync_interval_ms": 50, **overrides})


def record(directory: Path, count: int, **overrides: Any) -> FlightRecorder:
    fdr = FlightRecorder(config(directory, **overrides), boot_id="boot")
    fdr.start()
    for index in range(count):
        fdr.record("deadline_miss", {"model": "demo", "count": index + 1, "window_s": 10.0})
    fdr.stop()
    return fdr


def planted(tmp_path: Path, records: int) -> tuple[Path, Path, bytes]:
    """An FDR dir holding segment 1 with 3 records, and segment 2 a symlink to a
    valid segment elsewhere with ``records`` records: (the dir, the link, the
    target's bytes)."""
    directory = tmp_path / "fdr"
    record(directory, 3)
    elsewhere = tmp_path / "elsewhere"
    record(elsewhere, records)
    (target,) = list_segments(elsewhere)
    link = directory / framing.segment_name(2)
    link.symlink_to(target)
    return directory, link, target.read_bytes()


def test_the_reader_reports_a_symlinked_segment_and_does_not_read_it(tmp_path: Path) -> None:
    directory, link, _ = planted(tmp_path, 50)
    report = ReadReport()
    assert [r.seq for r in read_records(directory, report)] == [1, 2, 3]
    (unreadable,) = report.unreadable_segments
    assert unreadable.segment == link.name and SYMLINK_REFUSAL in unreadable.reason
    assert report.is_corrupt and report.segments == 2


def test_the_recorder_resumes_without_following_a_symlinked_segment(tmp_path: Path) -> None:
    """Its seq goes on from the real segments (4, not the 51 the link's target would
    give), the link's index stays taken (the next segment is 3), the link and what it
    points at are left as they were, and a warning names it."""
    directory, link, target_bytes = planted(tmp_path, 50)
    with capture_logs() as logs:
        record(directory, 1)
    warnings = [entry for entry in logs if entry["event"] == "fdr_segment_unreadable"]
    assert len(warnings) == 1 and warnings[0]["segment"] == link.name
    assert SYMLINK_REFUSAL in warnings[0]["reason"]
    report = ReadReport()
    records = list(read_records(directory, report))
    assert [(r.seq, r.segment) for r in records][-1] == (4, framing.segment_name(3))
    assert link.is_symlink() and Path(link.readlink()).read_bytes() == target_bytes


def test_the_size_cap_counts_a_symlink_by_its_own_size(tmp_path: Path) -> None:
    """A link to a large file used to count as that file's size (followed by
    ``stat``) and make the cap delete segments; it is the link's few bytes."""
    directory = tmp_path / "fdr"
    directory.mkdir(mode=0o750)
    big = tmp_path / "big"
    big.write_bytes(b"\0" * (1 << 20))
    link = directory / framing.segment_name(1)
    link.symlink_to(big)
    fdr = record(directory, 60, segment_max_bytes=1024, max_total_bytes=1 << 16)
    assert len(list_segments(directory)) > 3, "the recorder rotated"
    assert fdr.status()["segments_deleted"] == 0
    assert link.is_symlink() and big.stat().st_size == 1 << 20
