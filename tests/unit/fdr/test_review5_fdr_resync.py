"""Review 5 of the flight data recorder, finding 1: frames nested inside each
other, every one CRC-valid and none a record, made the reader's resynchronisation
decode a body at every sync marker (2.2 s a MiB; also at the daemon's start,
which reads its newest segment for the seq to go on from)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from inferd.fdr import framing, segments
from inferd.fdr.reader import ReadReport, read_records
from tests.unit.fdr.conftest import record_frame

#: Nested candidates: 13 bytes each, the first claiming a body of ~39 KB.
_NESTED = 3000


def _nested_candidates(count: int) -> bytes:
    """``count`` frames 13 bytes apart (a header and 0x87, a 7-key map's first
    byte), each one's body all the bytes after its header: every CRC matches,
    no body decodes (its second byte, a sync marker's, is no map key)."""
    body = b"\x87"
    for _ in range(count - 1):
        header = framing.FRAME_HEADER.pack(framing.SYNC, len(body), framing.crc32c(body))
        body = b"\x87" + header + body
    return framing.FRAME_HEADER.pack(framing.SYNC, len(body), framing.crc32c(body)) + body


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every body the reader hands to msgpack."""
    lengths: list[int] = []
    real = msgpack.unpackb

    def counting(body: bytes, **kwargs: Any) -> Any:
        lengths.append(len(body))
        return real(body, **kwargs)

    monkeypatch.setattr(msgpack, "unpackb", counting)  # the module the reader calls it on
    return lengths


def test_nested_crc_valid_candidates_are_each_decoded_at_most_once(
    tmp_path: Path, decoded: list[int]
) -> None:
    """Before: 1,500x the file's bytes handed to msgpack here (~10,000x for the
    review's 20,000 candidates); now at most 2x, and the record after them is read."""
    chain = _nested_candidates(_NESTED)
    data = framing.encode_segment_header(1, 0) + chain + record_frame(9)
    # every candidate's CRC matches (the outermost one covers all the others)
    _sync, length, checksum = framing.FRAME_HEADER.unpack_from(chain)
    assert framing.crc32c(chain[framing.FRAME_HEADER.size :][:length]) == checksum
    (tmp_path / framing.segment_name(1)).write_bytes(data)
    report = ReadReport()
    assert [record.seq for record in read_records(tmp_path, report)] == [9]
    assert sum(decoded) <= 2 * len(data), f"{sum(decoded)} bytes decoded for {len(data)}"
    ((offset, skipped, reason),) = [(d.offset, d.length, d.reason) for d in report.corrupt]
    assert (offset, skipped) == (framing.SEGMENT_HEADER.size, len(chain))
    assert reason.startswith("undecodable body")


def test_the_recorder_start_reads_past_them_once(tmp_path: Path, decoded: list[int]) -> None:
    """``segments.last_seq`` (the start's read of the newest segment) resumes after
    the record behind them, at the same cost."""
    data = framing.encode_segment_header(2, 0) + _nested_candidates(_NESTED) + record_frame(77)
    path = tmp_path / framing.segment_name(2)
    path.write_bytes(data)
    assert segments.last_seq([path]) == 77
    assert sum(decoded) <= 2 * len(data), f"{sum(decoded)} bytes decoded for {len(data)}"


def test_a_record_behind_a_crc_valid_undecodable_frame_is_still_found(tmp_path: Path) -> None:
    """The search goes on from such a frame's end, not past what follows it."""
    junk = b"\x87\x00\x01"
    data = (
        framing.encode_segment_header(1, 0)
        + record_frame(1)
        + framing.FRAME_HEADER.pack(framing.SYNC, len(junk), framing.crc32c(junk))
        + junk
        + record_frame(2)
    )
    (tmp_path / framing.segment_name(1)).write_bytes(data)
    report = ReadReport()
    assert [record.seq for record in read_records(tmp_path, report)] == [1, 2]
    assert [d.length for d in report.corrupt] == [framing.FRAME_HEADER.size + len(junk)]
