"""Flight data recorder: kinds, framing, group commit, rotation, retention,
torn tails, corruption and write failures."""

from __future__ import annotations

import errno
import io
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from inferd.cli.fdr import dump, parse_since, verify
from inferd.config import FdrConfig
from inferd.fdr import framing
from inferd.fdr.kinds import KINDS, RecordPayloadError, validate
from inferd.fdr.reader import ReadReport, list_segments, read_records
from inferd.fdr.writer import FlightRecorder
from tests.conftest import REPO, wait_until

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
