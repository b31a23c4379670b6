"""Flight data recorder: kinds, framing, group commit, rotation, retention,
torn tails, corruption and write failures."""

from __future__ import annotations

import errno
import io
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from structlog.testing import capture_logs

from inferd.cli.fdr import dump, parse_since, verify
from inferd.config import FdrConfig
from inferd.fdr import framing
from inferd.fdr.kinds import KINDS, RecordPayloadError, validate
from inferd.fdr.reader import ReadReport, list_segments, read_records
from inferd.fdr.writer import FlightRecorder
from tests.conftest import HANG_S, REPO, wait_until

SCHEMAS = REPO / "schemas" / "fdr"

#: One valid payload per kind (also validated against schemas/fdr/).
EXAMPLES: dict[str, dict[str, Any]] = {
    "fallback_to_onnx_trt_ep": {
        "model": "demo",
        "configured_runtime": "tensorrt",
        "reason": "no tensorrt",
        "active_providers": ["CPU"],
    },
    "ort_cache_unavailable": {
        "model": "demo",
        "reason": "runtime.ort_trt_cache_dir /var/lib/inferd/ort_trt_cache/0123 cannot be "
        "created: Read-only file system",
        "staged_engines": [],
    },
    "provider_degraded": {
        "model": "demo",
        "degradation": "no_tensorrt_ep",
        "requested": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
        "active": ["CUDAExecutionProvider", "CPUExecutionProvider"],
        "missing": {"TensorrtExecutionProvider": "not_created"},
        "refused": False,
        "staged_engine_unused": None,
    },
    "thermal_transition": {
        "throttle_active": True,
        "previous": False,
        "cpu_temp_c": 91.0,
        "gpu_temp_c": None,
        "threshold_c": 90.0,
        "source": "sysfs",
        "reason": "cpu 91.0 C >= 90.0 C",
    },
    "runtime_switch": {
        "model": "demo",
        "from_runtime": "tensorrt",
        "to_runtime": "onnx_trt_ep",
        "requested_by": "operator",
        "outcome": "switched",
        "reason": None,
    },
    "runtime_switch_refusals": {
        "model": "demo",
        "reason": "cannot prepare tensorrt: no engine; onnx_trt_ep keeps serving",
        "count": 41,
        "window_s": 10.0,
    },
    "engine_refused": {"engine": "x.engine", "step": "sidecar", "reason": "missing"},
    "engine_build": {"model": "demo", "outcome": "cancelled", "duration_s": 1.5},
    "daemon_lifecycle": {
        "event": "start",
        "version": "0.1.0",
        "config_fingerprint": "abc",
        "pid": 42,
    },
    "deadline_miss": {"model": "demo", "count": 3, "window_s": 10.0},
    "alert": {"level": "WARNING", "code": "x", "message": "m", "fields": {}, "suppressed": 0},
    "fdr_retention": {
        "deleted_segments": ["seg-0000000001.fdr"],
        "deleted_bytes": 10,
        "max_total_bytes": 100,
    },
    "fdr_dropped": {"dropped": 2, "reason": "queue full"},
    "build_artifact_removed": {
        "model": "demo",
        "build_id": "b1-0a1b2c",
        "files": ["builds/demo/demo.b1-0a1b2c.simulated.engine"],
        "bytes": 506102,
        "reason": "max_count",
    },
    "build_concluded_at_start": {
        "build_id": "b3-0a1b2c",
        "engine": "/var/lib/inferd/engines/demo.engine",
        "summary": "/var/lib/inferd/engines/demo.engine.b3-0a1b2c.build.json",
        "decision": "trusted",
        "note": "recorded in /var/lib/inferd/engines/manifest.json",
        "outcome": "completed",
        "cleanup_status": "cleaned",
    },
    "watchdog_withheld": {
        "threads": {
            "engine_worker": {
                "reason": "overran",
                "silent_s": 612.0,
                "operation": "loading demo (onnx_trt_ep)",
                "elapsed_s": 612.0,
                "allowed_s": 600.0,
            }
        },
        "silence_limit_s": 5.0,
        "watchdog_s": 10.0,
    },
}

#: Payloads with the optional fields EXAMPLES leaves out (validated the same way).
MORE_EXAMPLES: list[tuple[str, dict[str, Any]]] = [
    (
        "daemon_lifecycle",
        {
            "event": "start_failed",
            "version": "0.1.0",
            "config_fingerprint": "abc",
            "pid": 42,
            "state": "starting",  # as the daemon writes every lifecycle record
            "error": "Address already in use",
            "step": "publisher.bind",
        },
    ),
]


def config(directory: Path, **overrides: Any) -> FdrConfig:
    values: dict[str, Any] = {"directory": directory, "fsync_interval_ms": 50}
    values.update(overrides)
    return FdrConfig(**values)


@pytest.fixture
def recorder(tmp_path: Path) -> Iterator[FlightRecorder]:
    fdr = FlightRecorder(config(tmp_path / "fdr"), boot_id="boot-a")
    fdr.start()
    yield fdr
    fdr.stop()


def miss(count: int) -> dict[str, Any]:
    return {"model": "demo", "count": count, "window_s": 10.0}


def test_every_kind_has_an_example_and_a_matching_schema() -> None:
    assert set(EXAMPLES) == set(KINDS)
    record = json.loads((SCHEMAS / "record.json").read_text())
    assert sorted(record["properties"]["kind"]["enum"]) == sorted(KINDS)
    for name, kind in KINDS.items():
        schema = json.loads((SCHEMAS / f"{name}.json").read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert sorted(schema["required"]) == sorted(kind.required), name
        jsonschema.validate(EXAMPLES[name], schema)


@pytest.mark.parametrize(("kind", "payload"), [*EXAMPLES.items(), *MORE_EXAMPLES])
def test_every_field_of_an_example_is_described(kind: str, payload: dict[str, Any]) -> None:
    """Extra fields are allowed (``additionalProperties``), so a field the daemon
    writes and its schema does not describe would pass validation unseen."""
    schema = json.loads((SCHEMAS / f"{kind}.json").read_text())
    jsonschema.validate(payload, schema)
    assert sorted(set(payload) - set(schema["properties"])) == []


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_refuses_a_payload_missing_a_required_key(
    kind: str, recorder: FlightRecorder
) -> None:
    for key in KINDS[kind].required:
        payload = {k: v for k, v in EXAMPLES[kind].items() if k != key}
        with pytest.raises(RecordPayloadError, match=f"misses required key\\(s\\) \\['{key}'\\]"):
            recorder.record(kind, payload)
    recorder.record(kind, EXAMPLES[kind])
    assert recorder.wait_durable(5)
    assert [r.kind for r in read_records(Path(recorder.status()["directory"]))] == [kind]


def test_unknown_kind_and_bad_payload_types_are_refused(recorder: FlightRecorder) -> None:
    with pytest.raises(RecordPayloadError, match="unknown FDR record kind"):
        recorder.record("nope", {})
    with pytest.raises(RecordPayloadError, match="string keys"):
        validate("deadline_miss", {1: "x"})  # type: ignore[dict-item]


def test_records_read_back_with_every_body_field(tmp_path: Path) -> None:
    clock = iter(range(1000, 10_000, 7))
    fdr = FlightRecorder(
        config(tmp_path), wall_clock=lambda: next(clock), mono_clock=lambda: 5, boot_id="boot-b"
    )
    fdr.start()
    fdr.record("deadline_miss", miss(1))
    fdr.stop()
    (record,) = list(read_records(tmp_path))
    assert (record.kind, record.schema_version, record.seq, record.mono_ns, record.boot_id) == (
        "deadline_miss",
        1,
        1,
        5,
        "boot-b",
    )
    assert record.payload == miss(1)
    assert record.wall_ns >= 1000
    body = json.loads((SCHEMAS / "record.json").read_text())
    jsonschema.validate(
        {k: v for k, v in record.as_dict().items() if k not in ("segment", "offset")}, body
    )


def test_seq_is_monotonic_across_segments_and_restarts(tmp_path: Path) -> None:
    small = config(tmp_path, segment_max_bytes=1024, max_total_bytes=1 << 20)
    for run in range(3):
        fdr = FlightRecorder(small, boot_id=f"boot-{run}")
        fdr.start()
        for index in range(40):
            fdr.record("deadline_miss", miss(index + 1))
        fdr.stop()
    records = list(read_records(tmp_path))
    assert [r.seq for r in records] == list(range(1, 121))
    assert len(list_segments(tmp_path)) > 3
    assert {r.boot_id for r in records} == {"boot-0", "boot-1", "boot-2"}
    names = [p.name for p in list_segments(tmp_path)]
    assert names == sorted(names) and all(framing.segment_index(n) for n in names)


def test_group_commit_syncs_critical_kinds_at_once_and_others_on_the_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real(fd))[1])
    fdr = FlightRecorder(config(tmp_path, fsync_interval_ms=60_000))
    fdr.start()
    for index in range(50):
        fdr.record("deadline_miss", miss(index + 1))
    assert fdr.wait_durable(5)  # a waiter forces the sync
    deadline_syncs = len(syncs)
    fdr.record("deadline_miss", miss(99))
    # Written in a batch of its own (so a sync of it would come before the next record's) ...
    wait_until(lambda: fdr.status()["records_written"] == 51, message="record 51 written")
    fdr.record("daemon_lifecycle", EXAMPLES["daemon_lifecycle"])
    # ... and once the critical record is durable, exactly one sync covered both:
    # a non-critical record waits for the interval, a critical one is synced at once.
    wait_until(lambda: fdr.status()["durable_seq"] == 52, message="record 52 synced")
    assert len(syncs) == deadline_syncs + 1, "a non-critical record must wait for the interval"
    fdr.stop()


def test_rotation_and_size_cap_delete_oldest_segments_and_record_it(tmp_path: Path) -> None:
    fdr = FlightRecorder(config(tmp_path, segment_max_bytes=2048, max_total_bytes=6144))
    fdr.start()
    for index in range(200):
        fdr.record("deadline_miss", miss(index + 1))
    fdr.stop()
    segments = list_segments(tmp_path)
    assert sum(p.stat().st_size for p in segments) <= 6144
    assert framing.segment_index(segments[0].name) > 1, "oldest segments were deleted"
    retention = list(read_records(tmp_path, kinds=["fdr_retention"]))
    assert retention and retention[-1].payload["max_total_bytes"] == 6144
    assert fdr.status()["segments_deleted"] >= 1
    seqs = [r.seq for r in read_records(tmp_path)]
    assert seqs == sorted(seqs) and seqs[-1] == fdr.status()["durable_seq"]


def write_records(directory: Path, count: int) -> list[int]:
    fdr = FlightRecorder(config(directory))
    fdr.start()
    for index in range(count):
        fdr.record("deadline_miss", miss(index + 1))
    fdr.stop()
    return [r.seq for r in read_records(directory)]


def test_torn_tail_at_every_cut_point_is_handled(tmp_path: Path) -> None:
    source = tmp_path / "source"
    write_records(source, 3)
    (segment,) = list_segments(source)
    data = segment.read_bytes()
    last_offset = [r.offset for r in read_records(source)][-1]
    for cut in range(last_offset + 1, len(data)):
        target = tmp_path / f"cut{cut}"
        target.mkdir()
        (target / segment.name).write_bytes(data[:cut])
        report = ReadReport()
        assert [r.seq for r in read_records(target, report)] == [1, 2]
        assert len(report.torn_tails) == 1 and not report.is_corrupt
        assert verify(target, as_json=True, out=io.StringIO()) == 0


def test_byte_flips_lose_only_the_records_they_touch(tmp_path: Path) -> None:
    source = tmp_path / "source"
    write_records(source, 200)
    (segment,) = list_segments(source)
    records = list(read_records(source))
    spans = [
        (r.offset, (records[i + 1].offset if i + 1 < len(records) else segment.stat().st_size))
        for i, r in enumerate(records)
    ]
    rng = random.Random(1234)
    for trial in range(20):
        data = bytearray(segment.read_bytes())
        flips = sorted(rng.sample(range(spans[10][0], spans[-10][0]), rng.randint(1, 4)))
        for position in flips:
            data[position] ^= 1 << rng.randrange(8)
        target = tmp_path / f"flip{trial}"
        target.mkdir()
        (target / segment.name).write_bytes(bytes(data))
        report = ReadReport()
        survived = {r.seq for r in read_records(target, report)}
        touched = {
            records[i].seq for i, (lo, hi) in enumerate(spans) if any(lo <= p < hi for p in flips)
        }
        assert survived == {r.seq for r in records} - touched, (trial, flips)
        assert report.is_corrupt and report.skipped_bytes > 0
        assert verify(target, as_json=True, out=io.StringIO()) == 1


class SteppedClock:
    """A monotonic clock (ns) that moves only when the test says time has passed."""

    def __init__(self) -> None:
        self.now_ns = time.monotonic_ns()

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += int(seconds * 1e9)


def test_failing_disk_drops_counts_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SteppedClock()
    fdr = FlightRecorder(config(tmp_path), mono_clock=clock)
    fdr.start()
    fdr.record("deadline_miss", miss(1))
    assert fdr.wait_durable(5)
    real_write = os.write
    failing = True

    def write(fd: int, data: Any) -> int:
        if failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    for index in range(5):
        fdr.record("deadline_miss", miss(index + 2))  # never raises, never blocks
    assert not fdr.wait_durable(5)
    status = fdr.status()
    assert status["records_dropped"] == 5
    assert "No space left" in (status["last_error"] or "")
    failing = False

    fdr.record("deadline_miss", miss(6))  # within the second of back-off: dropped
    wait_until(lambda: fdr.status()["records_dropped"] == 6, message="the back-off dropping")
    clock.advance(1.01)  # the writer backs off for a second after a failure
    fdr.record("deadline_miss", miss(7))
    assert fdr.wait_durable(5)
    fdr.stop()
    records = list(read_records(tmp_path))
    assert [r.kind for r in records] == ["deadline_miss", "fdr_dropped", "deadline_miss"]
    assert records[1].payload["dropped"] == 6
    assert len(list_segments(tmp_path)) == 2, "a failed segment is never appended to again"


def test_full_queue_drops_without_blocking(tmp_path: Path) -> None:
    fdr = FlightRecorder(config(tmp_path, queue_capacity=3))  # not started: nothing drains
    for index in range(5):
        fdr.record("deadline_miss", miss(index + 1))
    assert fdr.status()["records_dropped"] == 2
    fdr.start()
    assert fdr.wait_durable(5)
    fdr.stop()
    kinds = [r.kind for r in read_records(tmp_path)]
    assert kinds.count("deadline_miss") == 3 and kinds[0] == "fdr_dropped"


def test_dump_filters_by_kind_and_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    times = iter([1_000_000_000_000, 2_000_000_000_000, 3_000_000_000_000])
    fdr = FlightRecorder(config(tmp_path), wall_clock=lambda: next(times))
    fdr.start()  # records take the first two timestamps, the segment header the third
    fdr.record("deadline_miss", miss(1))
    fdr.record("daemon_lifecycle", EXAMPLES["daemon_lifecycle"])
    fdr.stop()

    out = io.StringIO()
    dump(tmp_path, kinds=["daemon_lifecycle"], since_wall_ns=None, as_json=True, out=out)
    (line,) = out.getvalue().splitlines()
    assert json.loads(line)["kind"] == "daemon_lifecycle"
    out = io.StringIO()
    dump(tmp_path, kinds=[], since_wall_ns=1_500_000_000_000, as_json=False, out=out)
    assert "daemon_lifecycle" in out.getvalue() and "deadline_miss" not in out.getvalue()


def test_parse_since() -> None:
    now = 10_000 * 10**9
    assert parse_since("15m", now) == now - 900 * 10**9
    assert parse_since("2h", now) == now - 7200 * 10**9
    assert parse_since("1700000000", now) == 1_700_000_000 * 10**9
    assert parse_since("2026-01-01T00:00:00Z", now) == parse_since("2026-01-01T00:00:00", now)
    with pytest.raises(ValueError, match="--since"):
        parse_since("yesterday", now)


def test_steady_records_during_a_failure_do_not_extend_the_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer retries one second after the failure even while records keep
    coming, and status keeps the failure's cause, not "backing off"."""
    real_write = os.write
    failing = [True]

    def write(fd: int, data: Any) -> int:
        if failing[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    clock = SteppedClock()
    fdr = FlightRecorder(config(tmp_path), mono_clock=clock)
    fdr.start()
    fdr.record("deadline_miss", miss(1))
    wait_until(lambda: fdr.status()["records_dropped"] == 1, message="the first write failing")
    failing[0] = False
    for count in range(2, 11):  # a record every 0.1 s for 0.9 s: each one dropped
        clock.advance(0.1)
        fdr.record("deadline_miss", miss(count))
        wait_until(lambda n=count: fdr.status()["records_dropped"] == n, message="a drop")
        assert "No space left" in (fdr.status()["last_error"] or "")
        assert fdr.status()["records_written"] == 0
    clock.advance(0.11)  # one second after the failure, whatever came in between
    fdr.record("deadline_miss", miss(11))
    assert fdr.wait_durable(5), "the recorder never resumed"
    fdr.stop()
    kinds = [r.kind for r in read_records(tmp_path)]
    assert kinds == ["fdr_dropped", "deadline_miss"]


def test_durable_seq_at_rotation_counts_only_written_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a frame forces a rotation, the closed segment's sync must not claim
    that frame (it goes to the next segment): durable_seq never runs ahead of
    what is on disk."""
    seen: list[tuple[int, int]] = []  # (new segment index, durable_seq when it opened)
    original = FlightRecorder._open_segment

    def open_segment(self: FlightRecorder) -> Any:
        seen.append((self._next_index, self.durable_seq))
        return original(self)

    monkeypatch.setattr(FlightRecorder, "_open_segment", open_segment)
    fdr = FlightRecorder(config(tmp_path, segment_max_bytes=1024, max_total_bytes=1 << 20))
    fdr.start()
    for index in range(60):
        fdr.record("deadline_miss", miss(index + 1))
    fdr.stop()
    by_segment: dict[str, list[int]] = {}
    for record in read_records(tmp_path):
        by_segment.setdefault(record.segment, []).append(record.seq)
    assert len(seen) > 2
    for index, durable in seen[1:]:
        closed = [
            seq
            for name, seqs in by_segment.items()
            if framing.segment_index(name) < index
            for seq in seqs
        ]
        assert durable == max(closed), (index, durable, max(closed))


# -- what the writer thread must survive, and what it must report (review findings) ----------
ALERT = EXAMPLES["alert"]


def alert(message_bytes: int) -> dict[str, Any]:
    return {**ALERT, "message": "x" * message_bytes}


def test_the_body_is_encoded_in_two_parts_around_the_seq_as_one_map() -> None:
    """The caller encodes a record once; the writer adds the seq: same bytes as before."""
    head, tail = framing.encode_body_parts("alert", 1, 7, 8, "boot", ALERT)
    for seq in (1, 127, 128, 65_536, 2**40):
        whole = {"kind": "alert", "schema_version": 1, "seq": seq}
        whole.update(wall_ns=7, mono_ns=8, boot_id="boot", payload=ALERT)
        assert framing.join_body(head, seq, tail) == framing.encode_body(whole)


def test_a_payload_msgpack_cannot_encode_is_refused_in_the_caller(tmp_path: Path) -> None:
    """It used to be encoded on the writer thread, whose TypeError killed it: the
    good records around it and every later one were lost, status said nothing."""
    fdr = FlightRecorder(config(tmp_path), boot_id="b")
    fdr.start()
    try:
        fdr.record("deadline_miss", miss(1))
        with pytest.raises(RecordPayloadError, match="alert: payload cannot be encoded"):
            fdr.record("alert", {**ALERT, "fields": {"path": Path("/x")}})
        with pytest.raises(RecordPayloadError, match="cannot be encoded"):
            fdr.record("deadline_miss", {**miss(1), "count": 2**70})
        fdr.record("daemon_lifecycle", EXAMPLES["daemon_lifecycle"])
        assert fdr.wait_durable(5), fdr.status()
    finally:
        fdr.stop()
    assert [r.kind for r in read_records(tmp_path)] == ["deadline_miss", "daemon_lifecycle"]
    assert fdr.status()["records_dropped"] == 0


def test_a_record_over_max_body_bytes_is_refused_in_the_caller(tmp_path: Path) -> None:
    fdr = FlightRecorder(config(tmp_path), boot_id="b")
    fdr.start()
    try:
        with pytest.raises(
            RecordPayloadError, match=r"alert: record body is \d+ bytes; the limit is"
        ):
            fdr.record("alert", alert(framing.MAX_BODY_BYTES))
        fdr.record("daemon_lifecycle", EXAMPLES["daemon_lifecycle"])
        assert fdr.wait_durable(5), fdr.status()
    finally:
        fdr.stop()
    assert [r.kind for r in read_records(tmp_path)] == ["daemon_lifecycle"]


def test_an_unexpected_error_on_the_writer_thread_is_dropped_counted_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a batch raises, the thread goes on: its records are dropped and
    counted, status says why, and an fdr_dropped record marks the gap."""
    real = framing.encode_frame
    failures = [1]

    def encode_frame(body: bytes) -> bytes:
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("a bug")
        return real(body)

    monkeypatch.setattr(framing, "encode_frame", encode_frame)
    clock = SteppedClock()
    fdr = FlightRecorder(config(tmp_path), mono_clock=clock)
    fdr.start()
    try:
        fdr.record("deadline_miss", miss(1))
        assert not fdr.wait_durable(5)
        assert fdr.status()["records_dropped"] == 1
        assert "write: a bug" in (fdr.status()["last_error"] or "")
        clock.advance(1.01)  # past the back-off that follows any failure
        fdr.record("deadline_miss", miss(2))
        assert fdr.wait_durable(5), fdr.status()
    finally:
        fdr.stop()
    records = list(read_records(tmp_path))
    assert [(r.kind, r.payload.get("dropped")) for r in records] == [
        ("fdr_dropped", 1),
        ("deadline_miss", None),
    ]


def test_fdr_dropped_is_synced_at_once_as_a_critical_kind(tmp_path: Path) -> None:
    """The group commit looked at the batch's records only, never at the drop
    report the writer adds itself: it waited for the interval (here 60 s)."""
    fdr = FlightRecorder(config(tmp_path, fsync_interval_ms=60_000, queue_capacity=1))
    fdr.record("deadline_miss", miss(1))
    fdr.record("deadline_miss", miss(2))  # queue full: dropped, reported when writing resumes
    fdr.start()
    try:
        wait_until(lambda: fdr.status()["records_written"] == 2, message="both frames written")
        records = list(read_records(tmp_path))
        assert [r.kind for r in records] == ["fdr_dropped", "deadline_miss"]
        wait_until(lambda: fdr.status()["durable_seq"] == 2, 5, message="synced at once")
    finally:
        fdr.stop()


def test_stop_honours_its_timeout_when_the_queue_is_full_and_the_disk_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() queued its stop mark without a timeout: with a full queue and the writer
    stuck in fdatasync (a dying SD card) the daemon's stop blocked for ever."""
    gate = threading.Event()
    real = os.fdatasync
    calls = [0]

    def fdatasync(fd: int) -> None:
        calls[0] += 1
        if calls[0] > 1:  # the header's sync passes, the first record's hangs
            gate.wait(30)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    fdr = FlightRecorder(config(tmp_path, queue_capacity=4))
    fdr.start()
    fdr.record("daemon_lifecycle", EXAMPLES["daemon_lifecycle"])
    wait_until(lambda: calls[0] >= 2, message="the writer stuck in fdatasync")
    for index in range(10):
        fdr.record("deadline_miss", miss(index + 1))
    with capture_logs() as logs:
        stopper = threading.Thread(target=fdr.stop, kwargs={"timeout": 0.5}, daemon=True)
        stopper.start()
        stopper.join(5)  # bounds a hang
        stuck = stopper.is_alive()
        gate.set()
        stopper.join(HANG_S)
    assert not stuck, "stop(timeout=0.5) still blocked after 5 s"
    assert [e["timeout_s"] for e in logs if e["event"] == "fdr_writer_did_not_stop"] == [0.5]
    fdr.record("deadline_miss", miss(11))  # after stop: dropped and counted, never queued
    fdr.stop()  # released, the writer drains what was queued and leaves
    kinds = [r.kind for r in read_records(tmp_path)]
    assert kinds == ["daemon_lifecycle", "fdr_dropped", *["deadline_miss"] * 4]
    assert fdr.status()["records_dropped"] == 10 - 4 + 1


def test_a_record_after_stop_is_counted_as_dropped(tmp_path: Path) -> None:
    fdr = FlightRecorder(config(tmp_path))
    fdr.start()
    fdr.stop()
    fdr.record("deadline_miss", miss(1))
    assert fdr.status()["records_dropped"] == 1
    assert not fdr.wait_durable(0.1)  # nothing is written any more


def segment_sizes(directory: Path) -> list[int]:
    return [path.lstat().st_size for path in list_segments(directory)]


def test_no_segment_outgrows_segment_max_bytes_nor_the_directory_max_total_bytes(
    tmp_path: Path,
) -> None:
    """The fdr_retention frame was appended to the new segment with no size check:
    2154 bytes on disk with max_total_bytes 2048, a segment over 1024."""
    fdr = FlightRecorder(config(tmp_path, segment_max_bytes=1024, max_total_bytes=2048))
    fdr.start()
    worst = largest = 0
    try:
        for size in (50, 400, 400, 800, 400, 50, 800, 400, 400, 400, 50, 800, 800, 50):
            fdr.record("alert", alert(size))
            assert fdr.wait_durable(5)
            sizes = segment_sizes(tmp_path)
            worst, largest = max(worst, sum(sizes)), max(largest, *sizes)
    finally:
        fdr.stop()
    assert worst <= 2048, f"{worst} bytes on disk, max_total_bytes is 2048"
    assert largest <= 1024, f"a {largest}-byte segment, segment_max_bytes is 1024"
    assert fdr.status()["segments_deleted"] > 0
    assert list(read_records(tmp_path, kinds=["fdr_retention"]))


def test_a_record_larger_than_a_segment_is_refused_in_the_caller(tmp_path: Path) -> None:
    fdr = FlightRecorder(config(tmp_path, segment_max_bytes=1024, max_total_bytes=2048))
    with pytest.raises(RecordPayloadError, match=r"segment_max_bytes 1024\) holds 996"):
        fdr.record("alert", alert(850))


def test_the_size_cap_holds_across_restarts(tmp_path: Path) -> None:
    """Every run opens a new segment; the cap was applied only at rotation, so
    restarts that never filled a segment grew the directory without bound."""
    small = config(tmp_path, segment_max_bytes=1024, max_total_bytes=2048)
    for run in range(5):
        fdr = FlightRecorder(small, boot_id=f"boot-{run}")
        fdr.start()
        fdr.record("alert", alert(800))
        fdr.stop()
        assert sum(segment_sizes(tmp_path)) <= 2048, (run, segment_sizes(tmp_path))
    named = {
        n
        for r in read_records(tmp_path, kinds=["fdr_retention"])
        for n in r.payload["deleted_segments"]
    }
    assert named and not named & {p.name for p in list_segments(tmp_path)}


def test_segments_the_cap_deleted_before_a_failed_open_are_still_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deletions lived only in the rotation that failed: no fdr_retention."""
    clock = SteppedClock()
    fdr = FlightRecorder(
        config(tmp_path, segment_max_bytes=1024, max_total_bytes=2048), mono_clock=clock
    )
    fdr.start()
    real_open = os.open
    failing = [False]

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if failing[0] and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    try:
        for _ in range(2):  # segment 1 full, segment 2 being written
            fdr.record("alert", alert(800))
            assert fdr.wait_durable(5)
        failing[0] = True
        fdr.record("alert", alert(800))  # rotates: deletes segment 1, cannot open 3
        assert not fdr.wait_durable(5)
        assert fdr.status()["segments_deleted"] == 1 and fdr.status()["records_dropped"] == 1
        failing[0] = False
        clock.advance(1.01)
        fdr.record("deadline_miss", miss(1))
        assert fdr.wait_durable(5), fdr.status()
    finally:
        fdr.stop()
    (retention,) = read_records(tmp_path, kinds=["fdr_retention"])
    assert retention.payload["deleted_segments"] == ["seg-0000000001.fdr"]


def test_wait_durable_is_false_when_a_record_queued_before_it_was_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the marker's own batch could fail it: a record lost in an earlier batch
    (and not yet reported by a durable fdr_dropped) went unnoticed."""
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        if len(data) > framing.SEGMENT_HEADER.size:  # records fail; segment headers pass
            raise OSError(errno.EIO, "Input/output error")
        return real_write(fd, data)

    fdr = FlightRecorder(config(tmp_path))
    fdr.start()
    try:
        monkeypatch.setattr(os, "write", write)
        fdr.record("daemon_lifecycle", EXAMPLES["daemon_lifecycle"])
        wait_until(lambda: fdr.status()["records_dropped"] == 1, message="the drop")
        assert not fdr.wait_durable(5), "the record queued before it was lost"
    finally:
        monkeypatch.setattr(os, "write", real_write)
        fdr.stop()


def test_records_written_but_not_synced_when_fdatasync_fails_are_reported_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed fdatasync what was written since the last sync may not be on
    disk: they were counted as written and no fdr_dropped said otherwise."""
    real = os.fdatasync
    failing = [False]

    def fdatasync(fd: int) -> None:
        if failing[0]:
            failing[0] = False
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    clock = SteppedClock()
    fdr = FlightRecorder(config(tmp_path, fsync_interval_ms=60_000), mono_clock=clock)
    fdr.start()
    try:
        for index in range(3):
            fdr.record("deadline_miss", miss(index + 1))
        wait_until(lambda: fdr.status()["records_written"] == 3, message="three records written")
        failing[0] = True
        assert not fdr.wait_durable(5)  # its sync fails
        assert fdr.status()["records_dropped"] == 3
        clock.advance(1.01)
        fdr.record("deadline_miss", miss(4))
        assert fdr.wait_durable(5), fdr.status()
    finally:
        fdr.stop()
    (dropped,) = read_records(tmp_path, kinds=["fdr_dropped"])
    assert dropped.payload["dropped"] == 3
    assert "fdatasync failed before they were synced" in dropped.payload["reason"]


def test_a_directory_under_a_segment_name_at_start_is_skipped(tmp_path: Path) -> None:
    """list_segments skips directories, so its index was not reserved and the
    recorder retried that O_EXCL name for ever, dropping every record."""
    (tmp_path / framing.segment_name(1)).mkdir()
    fdr = FlightRecorder(config(tmp_path), boot_id="b")
    fdr.start()
    try:
        fdr.record("daemon_lifecycle", EXAMPLES["daemon_lifecycle"])
        assert fdr.wait_durable(5), fdr.status()
    finally:
        fdr.stop()
    assert [p.name for p in list_segments(tmp_path)] == [framing.segment_name(2)]
    assert fdr.status()["records_dropped"] == 0


def test_a_segment_name_taken_while_recording_is_skipped(tmp_path: Path) -> None:
    fdr = FlightRecorder(config(tmp_path, segment_max_bytes=1024, max_total_bytes=1 << 20))
    fdr.start()
    try:
        fdr.record("alert", alert(800))
        assert fdr.wait_durable(5)
        (tmp_path / framing.segment_name(2)).mkdir()  # the name rotation goes to next
        fdr.record("alert", alert(800))
        assert fdr.wait_durable(5), fdr.status()
    finally:
        fdr.stop()
    names = [p.name for p in list_segments(tmp_path)]
    assert names == [framing.segment_name(1), framing.segment_name(3)]
    assert fdr.status()["records_dropped"] == 0


def test_a_failed_write_syncs_what_earlier_writes_left_and_drops_only_its_own_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    failing = [False]

    def write(fd: int, data: Any) -> int:
        if failing[0] and len(data) > framing.SEGMENT_HEADER.size:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    clock = SteppedClock()
    fdr = FlightRecorder(config(tmp_path, fsync_interval_ms=60_000), mono_clock=clock)
    fdr.start()
    for index in range(3):
        fdr.record("deadline_miss", miss(index + 1))
    wait_until(lambda: fdr.status()["records_written"] == 3, message="three written")
    failing[0] = True
    fdr.record("deadline_miss", miss(4))
    wait_until(lambda: fdr.status()["records_dropped"] > 0, message="the drop")
    failing[0] = False
    clock.advance(1.01)
    fdr.record("deadline_miss", miss(5))
    assert fdr.wait_durable(5)
    fdr.stop()
    records = list(read_records(tmp_path))
    on_disk = [r.payload["count"] for r in records if r.kind == "deadline_miss"]
    reported = sum(r.payload["dropped"] for r in records if r.kind == "fdr_dropped")
    assert (on_disk, reported) == ([1, 2, 3, 5], 1)  # nothing counted twice
