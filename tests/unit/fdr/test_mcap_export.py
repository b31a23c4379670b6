"""``inferd fdr export --mcap``: records written by the real recorder, exported,
then read back with the ``mcap`` package's reader as Foxglove would open it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from mcap.reader import make_reader

from inferd.cli.main import main
from inferd.fdr.kinds import KINDS
from inferd.fdr.reader import ReadReport, Record, list_segments, read_records
from inferd.fdr.writer import FlightRecorder
from tests.conftest import REPO
from tests.unit.fdr.test_fdr import EXAMPLES, config

SCHEMAS = REPO / "schemas" / "fdr"


def record_flight(directory: Path) -> list[Record]:
    """Every kind once on boot A, then the daemon restarted (boot B) and a few more."""
    wall = iter(range(1_700_000_000_000_000_000, 1_800_000_000_000_000_000, 1_000_003))
    for boot, kinds in (("boot-a", sorted(KINDS)), ("boot-b", ["alert", "deadline_miss"])):
        mono = iter(range(5_000, 10**12, 977))
        recorder = FlightRecorder(
            config(directory),
            wall_clock=lambda: next(wall),
            mono_clock=lambda: next(mono),  # noqa: B023 (used before the loop moves on)
            boot_id=boot,
        )
        recorder.start()
        for kind in kinds:
            recorder.record(kind, EXAMPLES[kind])
        recorder.stop()
    return list(read_records(directory))


def exported(path: Path) -> Iterator[tuple[Any, Any, Any]]:
    with path.open("rb") as stream:
        yield from make_reader(stream, validate_crcs=True).iter_messages(log_time_order=False)


def metadata(path: Path) -> list[tuple[str, dict[str, str]]]:
    with path.open("rb") as stream:
        return [(m.name, dict(m.metadata)) for m in make_reader(stream).iter_metadata()]


def test_every_record_reads_back_with_its_kind_time_payload_and_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = record_flight(tmp_path / "fdr")
    assert len(records) == len(KINDS) + 2
    out = tmp_path / "flight.mcap"
    assert main(["fdr", "export", "--mcap", str(out), "--dir", str(tmp_path / "fdr")]) == 0
    assert f"wrote {len(records)} record(s) to {out}" in capsys.readouterr().err

    messages = list(exported(out))
    assert len(messages) == len(records)
    for record, (schema, channel, message) in zip(records, messages, strict=True):
        assert channel.topic == f"/inferd/{record.kind}"
        assert channel.message_encoding == "json"
        assert channel.metadata == {"schema_version": str(record.schema_version)}
        assert message.log_time == message.publish_time == record.wall_ns
        assert message.sequence == record.seq
        payload = json.loads(message.data)
        assert payload == record.payload
        assert schema.encoding == "jsonschema" and schema.name == record.kind
        assert schema.data == (SCHEMAS / f"{record.kind}.json").read_bytes()
        jsonschema.validate(payload, json.loads(schema.data))
    with out.open("rb") as stream:
        summary = make_reader(stream).get_summary()
    assert summary is not None and summary.statistics is not None
    assert summary.statistics.message_count == len(records)
    assert len(summary.channels) == len(KINDS)  # one channel per kind

    by_name: dict[str, list[dict[str, str]]] = {}
    for name, data in metadata(out):
        by_name.setdefault(name, []).append(data)
    (inferd,) = by_name["inferd"]
    assert inferd["daemon_versions"] == EXAMPLES["daemon_lifecycle"]["version"]
    assert inferd["records"] == str(len(records)) and inferd["skipped_bytes"] == "0"
    assert inferd["source_directory"] == str(tmp_path / "fdr")
    boots = {boot["boot_id"]: boot for boot in by_name["inferd.boot"]}
    first_b = next(r for r in records if r.boot_id == "boot-b")
    assert boots["boot-b"] == {
        "boot_id": "boot-b",
        "first_seq": str(first_b.seq),
        "last_seq": str(records[-1].seq),
        "first_wall_ns": str(first_b.wall_ns),
        "first_mono_ns": str(first_b.mono_ns),
        "records": "2",
    }
    assert boots["boot-a"]["records"] == str(len(KINDS))


def test_kind_and_since_select_records(tmp_path: Path) -> None:
    records = record_flight(tmp_path / "fdr")
    out = tmp_path / "alerts.mcap"
    since = str(records[3].wall_ns / 1e9)
    args = ["fdr", "export", "--mcap", str(out), "--dir", str(tmp_path / "fdr"), "--since", since]
    assert main([*args, "--kind", "alert"]) == 0
    got = [json.loads(message.data) for _, _, message in exported(out)]
    wanted = [r.payload for r in records if r.kind == "alert" and r.wall_ns >= records[3].wall_ns]
    assert got == wanted and len(got) == 1  # boot A's alert came before --since


def test_corrupt_and_torn_segments_are_skipped_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "fdr"
    record_flight(directory)
    first, last = list_segments(directory)[0], list_segments(directory)[-1]
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte inside one record
    first.write_bytes(bytes(data))
    last.write_bytes(last.read_bytes()[:-7])  # the writer died mid-frame
    report = ReadReport()
    intact = list(read_records(directory, report))
    assert report.corrupt and report.torn_tails

    out = tmp_path / "damaged.mcap"
    assert main(["fdr", "export", "--mcap", str(out), "--dir", str(directory)]) == 0
    err = capsys.readouterr().err
    assert f"wrote {len(intact)} record(s)" in err
    assert "1 torn tail(s), 1 corrupt region(s)" in err
    got = [(c.topic, m.sequence, json.loads(m.data)) for _, c, m in exported(out)]
    assert got == [(f"/inferd/{r.kind}", r.seq, r.payload) for r in intact]
    (inferd,) = [data for name, data in metadata(out) if name == "inferd"]
    assert int(inferd["skipped_bytes"]) == report.skipped_bytes > 0
    assert (inferd["torn_tails"], inferd["corrupt_regions"]) == ("1", "1")


def test_a_kind_without_a_schema_gets_a_schemaless_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An older or newer daemon's kind this package has no schema for still exports."""
    from inferd.fdr import mcap_export

    record_flight(tmp_path / "fdr")
    monkeypatch.setattr(
        mcap_export, "payload_schema", lambda kind: None if kind == "alert" else b"{}"
    )
    out = tmp_path / "flight.mcap"
    assert main(["fdr", "export", "--mcap", str(out), "--dir", str(tmp_path / "fdr")]) == 0
    assert "no schema for alert" in capsys.readouterr().err
    alerts = [
        (schema, message) for schema, c, message in exported(out) if c.topic.endswith("alert")
    ]
    assert alerts and all(schema is None for schema, _ in alerts)


def test_the_shipped_schemas_are_the_repository_s(tmp_path: Path) -> None:
    from inferd.fdr.mcap_export import payload_schema

    for kind in KINDS:
        assert payload_schema(kind) == (SCHEMAS / f"{kind}.json").read_bytes()
    assert payload_schema("../../../etc/passwd") is None
    assert payload_schema("no_such_kind") is None


def test_a_missing_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.mcap"
    assert main(["fdr", "export", "--mcap", str(out), "--dir", str(tmp_path / "none")]) == 2
    assert "no recorder directory" in capsys.readouterr().err
    assert not out.exists()
