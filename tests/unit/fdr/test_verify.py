"""``inferd fdr verify`` tells a crash's torn tail from damage: a complete last
frame whose length field is damaged is corruption, and so is a CRC-valid body that
is not a record; ``dump`` and ``export`` skip such a body instead of a traceback."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from inferd.cli.fdr import dump, export, verify
from inferd.fdr import framing
from inferd.fdr.reader import ReadReport, list_segments, read_records
from tests.conftest import written_recorder


def damaged_last_length(directory: Path) -> tuple[Path, int]:
    """One bit of the last frame's length flipped (+65536, under MAX_BODY_BYTES): every
    byte of the frame is there and its CRC matches them."""
    (segment,) = list_segments(directory)
    data = bytearray(segment.read_bytes())
    last = bytes(data).rfind(framing.SYNC)
    data[last + 6] ^= 0x01
    segment.write_bytes(bytes(data))
    return segment, last


def test_a_complete_last_frame_with_a_damaged_length_is_corruption(tmp_path: Path) -> None:
    fdr = written_recorder(tmp_path / "fdr", 20)
    _segment, last = damaged_last_length(fdr)
    report = ReadReport()
    assert [r.seq for r in read_records(fdr, report)] == list(range(1, 20))
    assert not report.torn_tails
    assert [d.offset for d in report.corrupt] == [last]
    assert "damaged length" in report.corrupt[0].reason
    out = io.StringIO()
    assert verify(fdr, as_json=False, out=out) == 1, out.getvalue()


def test_a_damaged_length_followed_by_a_torn_frame_is_corruption_too(tmp_path: Path) -> None:
    """The crash came after the damage: the damaged frame ends where the torn one's
    sync marker begins."""
    fdr = written_recorder(tmp_path / "fdr", 20)
    segment, _last = damaged_last_length(fdr)
    torn = framing.encode_frame(b"\x80" * 40)[:30]
    segment.write_bytes(segment.read_bytes() + torn)
    assert verify(fdr, as_json=False, out=io.StringIO()) == 1


def test_a_crash_cut_at_every_byte_of_the_last_frame_is_still_a_torn_tail(
    tmp_path: Path,
) -> None:
    source = written_recorder(tmp_path / "source", 3)
    (segment,) = list_segments(source)
    data = segment.read_bytes()
    last = data.rfind(framing.SYNC)
    for cut in range(last + 1, len(data)):
        target = tmp_path / f"cut{cut}"
        target.mkdir()
        (target / segment.name).write_bytes(data[:cut])
        report = ReadReport()
        assert [r.seq for r in read_records(target, report)] == [1, 2]
        assert len(report.torn_tails) == 1 and not report.is_corrupt, cut


def body(**changes: Any) -> bytes:
    fields: dict[str, Any] = {
        "kind": "deadline_miss",
        "schema_version": 1,
        "seq": 1,
        "wall_ns": 1_700_000_000_000_000_000,
        "mono_ns": 5,
        "boot_id": "b",
        "payload": {"model": "demo", "count": 1, "window_s": 1.0},
    }
    return msgpack.packb({**fields, **changes}, use_bin_type=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "changes",
    [
        {"seq": "1"},
        {"seq": True},
        {"wall_ns": 1.5},
        {"mono_ns": None},
        {"schema_version": [1]},
        {"boot_id": 7},
        {"payload": {b"model": "demo"}},
        {"payload": {"nested": {b"key": 1}}},
        {"payload": {"ext": msgpack.ExtType(5, b"x")}},
    ],
    ids=repr,
)
def test_a_crc_valid_body_with_fields_of_the_wrong_type_is_corruption_not_a_traceback(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    fdr = written_recorder(tmp_path / "fdr", 2)
    (segment,) = list_segments(fdr)
    segment.write_bytes(segment.read_bytes() + framing.encode_frame(body(**changes)))
    report = ReadReport()
    assert [r.seq for r in read_records(fdr, report)] == [1, 2]
    assert [d.reason for d in report.corrupt] == ["undecodable body"]
    assert verify(fdr, as_json=True, out=io.StringIO()) == 1
    out, err = io.StringIO(), io.StringIO()
    assert dump(fdr, kinds=[], since_wall_ns=None, as_json=True, out=out, err=err) == 0
    assert [json.loads(line)["seq"] for line in out.getvalue().splitlines()] == [1, 2]
    assert dump(fdr, kinds=[], since_wall_ns=None, as_json=False, out=out, err=err) == 0
    if changes.get("payload") is not None:
        pytest.importorskip("mcap")
        assert export(fdr, tmp_path / "x.mcap", kinds=[], since_wall_ns=None, err=err) == 0


def test_a_body_of_the_right_types_is_a_record(tmp_path: Path) -> None:
    fdr = written_recorder(tmp_path / "fdr", 1)
    (segment,) = list_segments(fdr)
    payload = {"model": "demo", "count": 2, "window_s": 1.0, "raw": b"\x00", "list": [None, True]}
    segment.write_bytes(segment.read_bytes() + framing.encode_frame(body(seq=2, payload=payload)))
    report = ReadReport()
    assert [r.payload for r in read_records(fdr, report)][-1] == payload
    assert not report.is_corrupt
