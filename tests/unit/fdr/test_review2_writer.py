"""Second review of the recorder's writer: what the caller refuses, a write that
fails part way, segment names the writer cannot have made (DESIGN.md, second
review of the flight data recorder)."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import Any

import msgpack
import pytest

from inferd.cli.fdr import verify
from inferd.fdr import framing
from inferd.fdr.kinds import RecordPayloadError
from inferd.fdr.reader import ReadReport, list_segments, read_records
from inferd.fdr.writer import FlightRecorder
from tests.conftest import wait_until
from tests.unit.fdr.test_fdr import EXAMPLES, SteppedClock, config, miss


def alert(fields: dict[str, Any]) -> dict[str, Any]:
    return {**EXAMPLES["alert"], "fields": fields}


@pytest.mark.parametrize(
    "fields",
    [
        {"by_status": {404: 2}},
        {"peers": [{b"\x01": "x"}]},
        {"key": {None: 1}},
        {"raw": msgpack.ExtType(5, b"x")},
        {"at": msgpack.Timestamp(1, 0)},
    ],
    ids=["int-key", "bytes-key-in-a-list", "nil-key", "ext-type", "timestamp"],
)
def test_a_payload_the_reader_would_call_corrupt_is_refused_in_the_caller(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    """msgpack encodes a nested non-string key or an ext type, so record() took it,
    wait_durable said it was durable, and the reader then called the frame
    "undecodable body": the record was lost and `fdr verify` exited 1."""
    fdr = FlightRecorder(config(tmp_path), boot_id="b")
    fdr.start()
    try:
        with pytest.raises(RecordPayloadError, match="alert: payload cannot be encoded"):
            fdr.record("alert", alert(fields))
        fdr.record("alert", alert({"tuple": (1, 2), "bytes": bytearray(b"\xa5"), "nested": {}}))
        assert fdr.wait_durable(5)
    finally:
        fdr.stop()
    report = ReadReport()
    (record,) = read_records(tmp_path, report)
    assert record.payload["fields"] == {"tuple": [1, 2], "bytes": b"\xa5", "nested": {}}
    assert not report.is_corrupt and fdr.status()["records_dropped"] == 0
    assert verify(tmp_path, as_json=True, out=io.StringIO()) == 0


def test_a_write_that_fails_part_way_keeps_the_frames_it_wrote_whole_and_drops_only_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filling disk write() writes what fits and the next one raises ENOSPC.
    The writer counted the whole batch dropped, though the frames written whole
    were then synced and read back beside the fdr_dropped that counted them."""
    real_write = os.write
    calls = [0]

    def write(fd: int, data: Any) -> int:
        if len(data) <= framing.SEGMENT_HEADER.size:  # segment headers pass
            return real_write(fd, data)
        calls[0] += 1
        if calls[0] == 1:  # the batch of five: two frames and a half fit
            return real_write(fd, bytes(data[: len(data) // 2]))
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    clock = SteppedClock()
    fdr = FlightRecorder(config(tmp_path, fsync_interval_ms=60_000), mono_clock=clock)
    for index in range(5):  # queued before the thread runs: one batch, one write
        fdr.record("deadline_miss", miss(index + 1))
    fdr.start()
    wait_until(lambda: fdr.status()["records_dropped"] > 0, message="the failed write")
    status = fdr.status()
    assert (status["records_written"], status["records_dropped"]) == (2, 3)
    assert status["durable_seq"] == 2
    clock.advance(1.01)
    fdr.record("deadline_miss", miss(6))
    assert fdr.wait_durable(5), fdr.status()
    fdr.stop()
    report = ReadReport()
    records = list(read_records(tmp_path, report))
    on_disk = [r.payload["count"] for r in records if r.kind == "deadline_miss"]
    reported = sum(r.payload["dropped"] for r in records if r.kind == "fdr_dropped")
    assert (on_disk, reported) == ([1, 2, 6], 3)  # nothing counted twice, nothing unreported
    assert len(report.torn_tails) == 1 and not report.is_corrupt  # the half frame


@pytest.mark.parametrize(
    "name",
    ["seg-99999999999999999999.fdr", f"seg-{2**64}.fdr", "seg-\u00b2.fdr", "seg-\u0661.fdr"],
    ids=["20-digits", "2**64", "superscript-two", "arabic-indic-one"],
)
def test_a_file_named_like_no_segment_the_writer_can_make_does_not_stop_the_recorder(
    tmp_path: Path, name: str
) -> None:
    """An index past the header's u64 made every segment open fail (struct.error):
    every record dropped for good.  "²" passes str.isdigit() but not int(): the
    ValueError stopped the recorder's start (the daemon's too) and every reader."""
    (tmp_path / name).write_bytes(b"not a segment")
    fdr = FlightRecorder(config(tmp_path), boot_id="b")
    fdr.start()
    try:
        fdr.record("daemon_lifecycle", EXAMPLES["daemon_lifecycle"])
        assert fdr.wait_durable(5), fdr.status()
    finally:
        fdr.stop()
    assert fdr.status()["records_dropped"] == 0
    assert [p.name for p in list_segments(tmp_path)] == [framing.segment_name(1)]
    assert [r.kind for r in read_records(tmp_path)] == ["daemon_lifecycle"]
    assert verify(tmp_path, as_json=True, out=io.StringIO()) == 0
