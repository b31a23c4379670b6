"""Third look at the recorder's reader and MCAP export: a payload nested deeper
than the recorder writes is corruption to the reader itself (and the recorder
refuses one, whatever msgpack's own nesting limit); NaN and infinities are JSON
``null`` in the export itself, not only once ``inferd fdr`` cleaned them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgpack
import pytest

from inferd.fdr import framing
from inferd.fdr.kinds import RecordPayloadError
from inferd.fdr.reader import ReadReport, read_records
from inferd.fdr.writer import FlightRecorder
from tests.unit.fdr.test_fdr import config

LIMIT = 511  # framing.MAX_PAYLOAD_DEPTH: the deepest a value lies below its payload


def strict_json(text: str) -> Any:
    """What any JSON parser (jq, JavaScript, Go) reads: no NaN, no Infinity."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def deep_payload_bytes(depth: int) -> bytes:
    """``{"x": [[...[]...]]}`` whose innermost list lies ``depth`` levels below the
    payload, packed by hand: msgpack's packer refuses 512 levels before 1.2.0 and
    1,025 since, and this must not depend on which is installed."""
    return b"\x81" + msgpack.packb("x") + b"\x91" * (depth - 1) + b"\x90"


def body_with_payload(seq: int, payload: bytes) -> bytes:
    fields = {
        "kind": "deadline_miss",
        "schema_version": 1,
        "seq": seq,
        "wall_ns": 1_700_000_000_000_000_000 + seq,
        "mono_ns": seq,
        "boot_id": "b",
    }
    head = b"".join(msgpack.packb(key) + msgpack.packb(value) for key, value in fields.items())
    return b"\x87" + head + msgpack.packb("payload") + payload


def segment_of(directory: Path, payloads: list[bytes]) -> Path:
    directory.mkdir()
    data = framing.encode_segment_header(1, 0)
    for seq, payload in enumerate(payloads, 1):
        data += framing.encode_frame(body_with_payload(seq, payload))
    (directory / framing.segment_name(1)).write_bytes(data)
    return directory


def plain() -> bytes:
    return msgpack.packb({"model": "m", "count": 1, "window_s": 10.0})


def nested(depth: int) -> Any:
    """A payload whose innermost list lies ``depth`` levels below it."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return {"model": "m", "count": 1, "window_s": 10.0, "x": value}


def test_deep_payload_bytes_are_what_the_packer_writes() -> None:
    # the hand-packed bytes are the packer's, where it packs them at all
    assert msgpack.unpackb(deep_payload_bytes(5)) == {"x": [[[[[]]]]]}
    assert msgpack.packb({"x": [[[[[]]]]]}) == deep_payload_bytes(5)


@pytest.mark.parametrize("depth", [LIMIT + 1, 1_000])
def test_the_reader_calls_a_payload_deeper_than_the_recorder_writes_corruption(
    tmp_path: Path, depth: int
) -> None:
    """msgpack reads 1,020 levels and handed them on; json.dumps (every consumer:
    dump, export) raised RecursionError at ~1,000.  Now it is skipped and counted,
    and the frames after it are read."""
    directory = segment_of(tmp_path / "fdr", [plain(), deep_payload_bytes(depth), plain()])
    report = ReadReport()
    records = list(read_records(directory, report))
    assert [r.seq for r in records] == [1, 3]
    assert report.records == 2 and report.is_corrupt and not report.torn_tails
    (damage,) = report.corrupt
    assert f"payload nested deeper than {LIMIT} levels" in damage.reason
    assert damage.offset == records[0].offset + framing.FRAME_HEADER.size + len(
        body_with_payload(1, plain())
    )
    for record in records:
        json.dumps(record.payload)


def test_a_too_deep_payload_in_the_last_frame_is_corruption_not_a_torn_tail(
    tmp_path: Path,
) -> None:
    directory = segment_of(tmp_path / "fdr", [plain(), deep_payload_bytes(LIMIT + 1)])
    report = ReadReport()
    assert [r.seq for r in read_records(directory, report)] == [1]
    assert len(report.corrupt) == 1 and not report.torn_tails


def test_a_payload_as_deep_as_the_recorder_writes_is_read(tmp_path: Path) -> None:
    directory = segment_of(tmp_path / "fdr", [deep_payload_bytes(LIMIT)])
    report = ReadReport()
    (record,) = read_records(directory, report)
    assert not report.is_corrupt
    json.dumps(record.payload)


@pytest.mark.skipif(
    msgpack.version < (1, 2, 0), reason="msgpack before 1.2 refuses 511 levels itself"
)
def test_the_recorder_refuses_a_payload_deeper_than_the_reader_takes(tmp_path: Path) -> None:
    """msgpack 1.2 packs 1,024 levels (511 before): the recorder took a payload of
    600 levels, said it was durable, and the reader then could not hand it on."""
    fdr = FlightRecorder(config(tmp_path), boot_id="b")
    fdr.start()
    try:
        with pytest.raises(RecordPayloadError, match=f"nested deeper than {LIMIT} levels"):
            fdr.record("deadline_miss", nested(LIMIT + 1))
        fdr.record("deadline_miss", nested(LIMIT))
        assert fdr.wait_durable(5)
    finally:
        fdr.stop()
    report = ReadReport()
    (record,) = read_records(tmp_path, report)
    assert not report.is_corrupt and record.payload == nested(LIMIT)


def recorder_with_non_finite_floats(directory: Path) -> Path:
    """What the daemon's own recorder writes: it takes NaN and infinities."""
    fdr = FlightRecorder(config(directory), boot_id="b")
    fdr.start()
    try:
        fdr.record("deadline_miss", {"model": "a", "count": 1, "window_s": math.nan})
        fdr.record(
            "deadline_miss",
            {"model": "b", "count": 2, "window_s": 1.5, "x": {"y": [math.inf, -math.inf, 0.5]}},
        )
        assert fdr.wait_durable(5)
    finally:
        fdr.stop()
    return directory


def test_the_mcap_export_writes_nan_and_infinities_as_null(tmp_path: Path) -> None:
    """``export_mcap`` wrote ``NaN`` and ``Infinity`` (not JSON) into messages; only
    ``inferd fdr export`` cleaned the payloads first."""
    pytest.importorskip("mcap")
    from mcap.reader import make_reader

    from inferd.fdr.mcap_export import export_mcap

    directory = recorder_with_non_finite_floats(tmp_path / "fdr")
    report = ReadReport()
    out = tmp_path / "flight.mcap"
    summary = export_mcap(read_records(directory, report), out, report=report, source="t")
    assert summary.records == 2
    with out.open("rb") as stream:
        messages = [
            strict_json(m.data.decode()) for _s, _c, m in make_reader(stream).iter_messages()
        ]
    assert messages == [
        {"model": "a", "count": 1, "window_s": None},
        {"model": "b", "count": 2, "window_s": 1.5, "x": {"y": [None, None, 0.5]}},
    ]
