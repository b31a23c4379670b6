"""The fdr alert hook when the recorder would refuse an alert's payload, and when
there is no recorder (``inferd.alerts.hooks.FdrAlertHook``).

Before DESIGN.md 294: an alert whose text held a lone surrogate (``os.fsdecode``
of a non-UTF-8 file name) or whose body was over 1 MiB left no FDR record, only
a hook failure logged once per window; and with the recorder lost at start every
alert counted as ``sent`` by the ``fdr`` hook.  Now the dispatcher sanitises
such an alert (``alerts.sanitise``) for every hook and the record carries its
``sanitised`` marker; the hook itself only cuts a record a segment cannot hold
to its smallest copy."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from inferd.alerts import AlertDispatcher, FdrAlertHook
from inferd.config import FdrConfig
from inferd.fdr.kinds import RecordPayloadError
from inferd.fdr.reader import read_records
from inferd.fdr.writer import FlightRecorder
from inferd.types import Alert

SCHEMA = json.loads(
    (Path(__file__).parents[3] / "schemas" / "fdr" / "alert.json").read_text(encoding="utf-8")
)
#: A path as ``os.fsdecode`` gives it for a Latin-1 file name: a lone surrogate.
ENGINE = os.fsdecode(b"/var/lib/inferd/engines/det\xe9ctor.engine")


def _recorder(directory: Path, **limits: Any) -> FlightRecorder:
    recorder = FlightRecorder(FdrConfig(directory=directory, fsync_interval_ms=5, **limits))
    recorder.start()
    return recorder


@pytest.fixture
def recorder(tmp_path: Path) -> Iterator[FlightRecorder]:
    recorder = _recorder(tmp_path / "fdr")
    yield recorder
    recorder.stop(5)


def _alert_records(recorder: FlightRecorder) -> list[dict[str, Any]]:
    assert recorder.wait_durable(5)
    directory = Path(recorder.status()["directory"])
    records = [dict(record.payload) for record in read_records(directory, kinds=("alert",))]
    for payload in records:  # what the schema says, every key described
        jsonschema.validate(payload, SCHEMA)
        assert sorted(set(payload) - set(SCHEMA["properties"])) == []
        json.dumps(payload)  # what every consumer of a record does with it
    return records


def test_an_alert_the_recorder_cannot_encode_is_recorded_sanitised(
    recorder: FlightRecorder,
) -> None:
    dispatcher = AlertDispatcher([FdrAlertHook(recorder.record)])
    dispatcher(Alert("ERROR", "model_unavailable", f"cannot open {ENGINE}", {"model": "detector"}))
    failover = {"model": "cam", "engine": ENGINE, "quarantined": None, "failures": 3}
    dispatcher(Alert("ERROR", "tensorrt_execution_failover", "failed over", failover))
    long_message = "cannot serve: " + "y" * (1 << 20)  # over the 1 MiB record limit
    dispatcher(Alert("ERROR", "model_unavailable", long_message, {"model": "big"}))
    dispatcher(Alert("ERROR", "model_unavailable", "plain text", {"model": "other"}))

    records = _alert_records(recorder)
    assert [record["fields"].get("model") for record in records] == [
        "detector",
        "cam",
        "big",
        "other",
    ]  # before: ["other"]
    surrogate, field, long, plain = records
    escaped = "/var/lib/inferd/engines/det\\udce9ctor.engine"
    assert surrogate["message"] == f"cannot open {escaped}"
    assert surrogate["sanitised"] == {
        "reason": "a lone surrogate (not UTF-8)",
        "changed": ["message"],
    }
    assert field["fields"] == {**failover, "engine": escaped}
    assert field["sanitised"] == {
        "reason": "a lone surrogate (not UTF-8)",
        "changed": ["fields.engine"],
    }
    assert long["message"].startswith("cannot serve: yyy")
    assert long["message"].endswith(f" [cut: {14 + (1 << 20)} characters]")
    assert len(long["message"]) < 4200
    assert long["sanitised"] == {"reason": "a string over its limit", "changed": ["message"]}
    assert "sanitised" not in plain
    hook = dispatcher.status()["hooks"]["fdr"]
    assert (hook["sent"], hook["failures"]) == (4, 0)  # before: (1, 3)


def test_values_msgpack_cannot_pack_are_recorded_as_their_repr(recorder: FlightRecorder) -> None:
    nested: dict[str, Any] = {"level": 0}
    deepest = nested
    for level in range(1, 8):
        deepest["below"] = deepest = {"level": level}
    fields = {
        "model": "demo",
        "providers": ["TensorrtExecutionProvider", "CPUExecutionProvider"],
        "path": Path("/models/demo.onnx"),  # msgpack packs no Path
        "huge": 1 << 70,
        "ids": {1: "a"},  # a map key that is no string
        "nested": nested,
        "blob": b"\x00\xff",
    }
    AlertDispatcher([FdrAlertHook(recorder.record)])(
        Alert("WARNING", "provider_degraded", "degraded", fields)
    )

    (record,) = _alert_records(recorder)
    assert record["fields"]["model"] == "demo"
    assert record["fields"]["providers"] == fields["providers"]  # what was fine is kept
    assert record["fields"]["path"] == "PosixPath('/models/demo.onnx')"
    assert record["fields"]["huge"] == str(1 << 70)
    assert record["fields"]["ids"] == {"1": "a"}
    kept = record["fields"]["nested"]["below"]["below"]  # three levels of maps are kept
    assert kept["level"] == 2
    assert isinstance(kept["below"], str)  # the fourth: its (bounded) repr
    assert kept["below"].endswith("'level': 4}, 'level': 3}")
    assert record["fields"]["blob"] == repr(b"\x00\xff")
    assert sorted(record["sanitised"]["changed"]) == [
        "fields.blob",
        "fields.huge",
        "fields.ids",
        "fields.nested",
        "fields.path",
    ]
    assert record["sanitised"]["reason"] == (
        "a value msgpack cannot pack; a map key that is not a string; nested deeper than 3 levels"
    )


def test_a_payload_refused_without_the_dispatcher_is_recorded_as_the_smallest_copy(
    recorder: FlightRecorder,
) -> None:
    """The hook sanitises nothing itself (the dispatcher does, for every hook): what
    the recorder refuses is recorded as level, code and the start of the message."""
    fields = {"model": "demo", "path": Path("/models/demo.onnx")}
    FdrAlertHook(recorder.record).alert("WARNING", "provider_degraded", "degraded", fields)
    (record,) = _alert_records(recorder)
    assert (record["message"], record["fields"]) == ("degraded", {})
    assert record["sanitised"]["changed"] == ["fields"]
    assert "PosixPath" in record["sanitised"]["reason"]  # the recorder's own refusal


def test_a_segment_too_small_for_the_sanitised_copy_gets_the_smallest(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path / "fdr", segment_max_bytes=4096, max_total_bytes=8192)
    try:
        fields = {f"k{index}": "v" * 900 for index in range(300)}
        AlertDispatcher([FdrAlertHook(recorder.record)])(
            Alert("CRITICAL", "big", "m" * 5000, fields)
        )
        (record,) = _alert_records(recorder)
    finally:
        recorder.stop(5)
    assert record["fields"] == {}
    assert record["message"] == "m" * 200 + " [cut: 5000 characters]"  # the length as raised
    assert (record["level"], record["code"]) == ("CRITICAL", "big")
    assert record["sanitised"]["changed"] == ["message", "fields"]
    reason = record["sanitised"]["reason"]  # the dispatcher's, then the recorder's
    assert reason.startswith("a string over its limit; over 64 values; alert: record is ")
    assert reason.endswith("a segment (fdr.segment_max_bytes 4096) holds 4068 after its header")


def test_the_smallest_copy_names_fields_once_for_all_it_left_out(tmp_path: Path) -> None:
    """The dispatcher names each field it changed (100 here, 1.3 KB of names);
    the smallest copy, which leaves them all out, says ``fields`` once, so it still
    fits the smallest segment allowed."""
    recorder = _recorder(tmp_path / "fdr", segment_max_bytes=1024, max_total_bytes=8192)
    try:
        fields = {f"engine{index}": f"{ENGINE}.{index}" for index in range(60)}
        dispatcher = AlertDispatcher([FdrAlertHook(recorder.record)])
        dispatcher(Alert("ERROR", "engines_unreadable", "many", fields))
        (record,) = _alert_records(recorder)
    finally:
        recorder.stop(5)
    assert (record["message"], record["fields"]) == ("many", {})
    assert record["sanitised"]["changed"] == ["fields"]  # before: the 60 names, refused
    assert record["sanitised"]["reason"].startswith("a lone surrogate (not UTF-8); alert: ")
    assert dispatcher.status()["hooks"]["fdr"]["failures"] == 0


def test_an_alert_no_copy_of_which_can_be_recorded_fails_the_hook() -> None:
    def refuse(kind: str, payload: Mapping[str, Any]) -> None:  # a RecordSink that refuses all
        raise RecordPayloadError(f"{kind}: record is 4096 bytes; a segment holds 1000")

    dispatcher = AlertDispatcher([FdrAlertHook(refuse)])
    dispatcher(Alert("ERROR", "model_unavailable", "x", {"model": "demo"}))
    hook = dispatcher.status()["hooks"]["fdr"]
    assert (hook["sent"], hook["failures"]) == (0, 1)
    assert "alert record dropped" in hook["last_error"]


def test_after_fdr_unavailable_every_alert_fails_the_fdr_hook() -> None:
    """The daemon raises ``fdr_unavailable`` when it serves without its recorder
    (and then records nothing): before, the hook counted every alert as sent."""
    records: list[tuple[str, Mapping[str, Any]]] = []
    hook = FdrAlertHook(lambda kind, payload: records.append((kind, payload)))
    dispatcher = AlertDispatcher([hook])
    dispatcher(Alert("INFO", "note", "before", {}))
    error = "cannot start the flight data recorder: ValueError: segment 1 is not newer than 1"
    dispatcher(Alert("ERROR", "fdr_unavailable", error, {"directory": "/var/lib/inferd/fdr"}))
    dispatcher(Alert("CRITICAL", "engine_worker_died", "example", {"queued": 0}))
    status = dispatcher.status()["hooks"]["fdr"]
    assert (status["sent"], status["failures"]) == (1, 2)  # before: (3, 0)
    assert status["last_error"] == repr(
        ConnectionError(f"the flight data recorder is not running: {error}")
    )
    assert [payload["code"] for _kind, payload in records] == ["note"]
