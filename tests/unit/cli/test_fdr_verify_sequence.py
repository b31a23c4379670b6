"""``inferd fdr verify`` finds the damage the seqs show: whole records missing that no
``fdr_dropped`` counts (a closed segment cut at a frame's end, or removed) and records
out of order (a segment's frames appended to another, a segment renamed).  Before,
each of these was "OK", exit 0: only frames that fail their CRC counted (review R4, F3:
a segment truncated mid-recording "OK ... seq gaps: 1"; one removed "OK")."""

from __future__ import annotations

import errno
import io
import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from inferd.cli.fdr import verify
from inferd.fdr.reader import list_segments, read_records
from inferd.fdr.writer import FlightRecorder
from tests.unit.fdr.test_fdr import SteppedClock, config, miss


def _recording(directory: Path, count: int = 100) -> list[Path]:
    """``count`` records over several segments, stopped cleanly: its segments."""
    fdr = FlightRecorder(config(directory, segment_max_bytes=4096))
    fdr.start()
    for index in range(count):
        fdr.record("deadline_miss", miss(index + 1))
    assert fdr.wait_durable(5)
    fdr.stop()
    segments = list_segments(directory)
    assert len(segments) >= 4
    return segments


def _verified(directory: Path) -> tuple[int, dict[str, Any]]:
    out = io.StringIO()
    code = verify(directory, as_json=True, out=out)
    return code, json.loads(out.getvalue())


def test_a_clean_recording_is_ok(tmp_path: Path) -> None:
    _recording(tmp_path)
    assert _verified(tmp_path) == (0, _verified(tmp_path)[1])
    assert _verified(tmp_path)[1]["sequence_damage"] == []


def test_a_closed_segment_cut_at_a_frames_end_is_damage(tmp_path: Path) -> None:
    second = _recording(tmp_path)[1]
    offsets = [r.offset for r in read_records(tmp_path) if r.segment == second.name]
    os.truncate(second, offsets[len(offsets) // 2])  # whole frames gone, no torn tail
    code, result = _verified(tmp_path)
    assert code == 1 and result["ok"] is False and result["torn_tails"] == []
    (said,) = result["sequence_damage"]
    assert said.endswith(f"missing after {second.name}: no fdr_dropped counts them")


def test_a_removed_segment_is_damage(tmp_path: Path) -> None:
    _recording(tmp_path)[2].unlink()
    code, result = _verified(tmp_path)
    assert code == 1 and "no fdr_dropped counts them" in result["sequence_damage"][0]


def test_records_out_of_order_are_damage(tmp_path: Path) -> None:
    segments = _recording(tmp_path)
    with segments[2].open("ab") as appended:  # segment 1's frames, after its header
        appended.write(segments[0].read_bytes()[_header_size(tmp_path, segments[0]) :])
    code, result = _verified(tmp_path)
    assert code == 1 and "records out of order" in result["sequence_damage"][0]
    out = io.StringIO()
    assert verify(tmp_path, as_json=False, out=out) == 1
    assert out.getvalue().startswith("CORRUPT:") and "records out of order" in out.getvalue()


def _header_size(directory: Path, segment: Path) -> int:
    return min(r.offset for r in read_records(directory) if r.segment == segment.name)


def test_records_a_failed_write_lost_and_reported_are_no_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Numbered, then lost when their write failed: the seqs have a gap, and the
    ``fdr_dropped`` record after it counts them."""
    clock = SteppedClock()
    fdr = FlightRecorder(config(tmp_path), mono_clock=clock)
    fdr.start()
    fdr.record("deadline_miss", miss(1))
    assert fdr.wait_durable(5)
    real = os.write
    failing = [True]

    def write(fd: int, data: Any) -> int:
        if failing[0]:
            failing[0] = False
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    for index in range(3):
        fdr.record("deadline_miss", miss(index + 2))
    assert not fdr.wait_durable(5)  # their write failed: lost, counted
    clock.advance(1.01)
    fdr.record("deadline_miss", miss(5))
    assert fdr.wait_durable(5)
    fdr.stop()
    records = list(read_records(tmp_path))
    assert "fdr_dropped" in [record.kind for record in records]
    assert any(b.seq > a.seq + 1 for a, b in itertools.pairwise(records))  # a gap
    assert _verified(tmp_path)[0] == 0
