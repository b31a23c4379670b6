"""Review 5 of the flight data recorder, finding 2: a segment name with the largest
index, or a newest record with the largest seq, left the recorder nothing to go on
from, and it dropped every record, for good (a descriptor and an empty file leaked
at each try).  It now refuses to start, and the daemon serves without it
(``fdr_unavailable``, naming why); the reader calls a seq outside 1..2**63-1
corruption, as ``record.json`` says."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import structlog

from inferd.cli.fdr import verify
from inferd.fdr import framing, segments
from inferd.fdr.reader import ReadReport, read_records
from inferd.fdr.segments import LOCK_NAME
from inferd.fdr.writer import FlightRecorder
from inferd.startup import start_recorder
from tests.unit.fdr.conftest import segment_with_seqs
from tests.unit.fdr.test_fdr import config, miss


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_segment_named_for_the_largest_index_refuses_the_start(tmp_path: Path) -> None:
    """Before: start() took it, the next index (2**64) failed every write with
    struct.error after its file was opened: a descriptor and an empty file each try."""
    directory = tmp_path / "fdr"
    directory.mkdir(mode=0o750)
    name = f"seg-{framing.MAX_SEGMENT_INDEX}.fdr"
    (directory / name).write_bytes(b"")
    fdr = FlightRecorder(config(directory), boot_id="b")
    with structlog.testing.capture_logs() as logs:
        error = start_recorder(fdr, directory)
    assert error is not None and name in error and "no index to go on from" in error, error
    (said,) = [line for line in logs if line["event"] == "fdr_unavailable"]
    assert said["exc_info"] is False  # what is wrong is named: no traceback
    assert sorted(p.name for p in directory.iterdir()) == [LOCK_NAME, name]  # nothing else
    fdr.record("deadline_miss", miss(1))  # a recorder that did not start drops, counted
    assert fdr.status()["records_dropped"] == 1


def test_an_index_no_header_holds_costs_no_descriptor_and_no_file(tmp_path: Path) -> None:
    """The header is encoded before the file is opened (before: struct.error after
    the open, the descriptor leaked and the empty file left)."""
    before = _open_descriptors()
    with pytest.raises(ValueError, match="past 18446744073709551615"):
        segments.create(tmp_path, framing.MAX_SEGMENT_INDEX + 1, 0)
    assert _open_descriptors() == before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seq", [0, -7, 2**63, 2**64 - 1])
def test_a_seq_outside_the_record_range_is_corruption(tmp_path: Path, seq: int) -> None:
    """record.json says 1..2**63-1; before, the reader took any and verify said OK."""
    segment_with_seqs(tmp_path, 5, seq, 6)
    report = ReadReport()
    assert [record.seq for record in read_records(tmp_path, report)] == [5, 6]
    assert [d.reason for d in report.corrupt] == ["undecodable body: seq out of range"]
    assert verify(tmp_path, as_json=False, out=io.StringIO()) == 1


def test_the_recorder_resumes_after_the_last_sane_record(tmp_path: Path) -> None:
    """A newest record with seq 2**64-1: before, the next seq (2**64) could not be
    packed, and every record was dropped (wait_durable False, dropped 1)."""
    directory = tmp_path / "fdr"
    segment_with_seqs(directory, 5, 2**64 - 1)
    fdr = FlightRecorder(config(directory), boot_id="b")
    fdr.start()
    try:
        fdr.record("deadline_miss", miss(2))
        assert fdr.wait_durable(5), fdr.status()
    finally:
        fdr.stop()
    assert fdr.records_dropped == 0
    assert [record.seq for record in read_records(directory)] == [5, 6]


def test_a_newest_record_with_the_largest_seq_refuses_the_start(tmp_path: Path) -> None:
    """Nothing is numbered past 2**63-1, which the reader would call corrupt."""
    directory = tmp_path / "fdr"
    segment_with_seqs(directory, 2**63 - 1)
    fdr = FlightRecorder(config(directory), boot_id="b")
    error = start_recorder(fdr, directory)
    assert error is not None and "has seq 9223372036854775807" in error, error
    assert sorted(p.name for p in directory.iterdir()) == [LOCK_NAME, framing.segment_name(1)]
