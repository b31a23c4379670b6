"""One recorder a directory: a second ``FlightRecorder`` (another daemon pointed at the
same ``fdr.directory``) does not start, says why, and the first's records stay.
Before, both started: the second's size cap deleted the first's open segment, whose
records it kept counting durable, and both wrote seq 1, 2... (review R4, F1: two real
daemons, "duplicate seqs: [4]"; two recorders, "B durable after: True", "B's records on
disk: []")."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import structlog

from inferd.fdr.queued import RecordDroppedError
from inferd.fdr.reader import read_records
from inferd.fdr.writer import FlightRecorder
from inferd.startup import start_recorder
from inferd.supervision.instance import InstanceLock
from tests.conftest import HANG_S
from tests.unit.fdr.test_fdr import config, miss


def test_a_second_recorder_in_one_directory_does_not_start(tmp_path: Path) -> None:
    first = FlightRecorder(config(tmp_path), boot_id="a")
    first.start()
    second = FlightRecorder(config(tmp_path), boot_id="b")
    with structlog.testing.capture_logs() as logs:
        error = start_recorder(second, tmp_path)
    assert error is not None and "another inferd records into" in error, error
    (said,) = [line for line in logs if line["event"] == "fdr_unavailable"]
    assert said["exc_info"] is False  # named, no traceback
    second.record("deadline_miss", miss(2))  # dropped and counted, never written
    assert second.status()["records_dropped"] == 1
    first.record("deadline_miss", miss(1))
    assert first.wait_durable(5)
    first.stop()
    assert [r.seq for r in read_records(tmp_path)] == [1]
    # Once the first has stopped, a recorder starts there and goes on from its seq.
    third = FlightRecorder(config(tmp_path), boot_id="c")
    assert start_recorder(third, tmp_path) is None
    third.record("deadline_miss", miss(3))
    assert third.wait_durable(5)
    third.stop()
    assert [r.seq for r in read_records(tmp_path)] == [1, 2]


def test_a_record_offered_as_the_recorder_stops_is_refused_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer that checked ``_stopped`` just before the stop, then queued after the
    writer's last drain, left its record in a queue no one reads: not written, not
    counted, and the ``fdr`` alert hook counted the alert sent (review R4, F6).  The
    writer now closes the queue after its last drain: the record is refused there."""
    fdr = FlightRecorder(config(tmp_path), boot_id="a")
    fdr.start()
    fdr.stop()
    monkeypatch.setattr(fdr._stopped, "is_set", lambda: False)  # its check came first
    with pytest.raises(RecordDroppedError, match="recorder stopped"):
        fdr.record_alert("deadline_miss", miss(1))
    status = fdr.status()
    assert (status["records_dropped"], status["queue_depth"]) == (1, 0)


def test_a_record_offered_while_the_writer_closes_its_segment_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue was closed only after the writer's last drain and its segment's last
    ``fdatasync``: a record offered meanwhile was accepted, then dropped, and the hook
    counted its alert sent (review R5, F9).  ``stop`` now closes the queue first."""
    fdr = FlightRecorder(config(tmp_path), boot_id="a")
    fdr.start()
    inside, go = threading.Event(), threading.Event()
    close_segment = fdr._close_segment

    def slow_close() -> None:  # the last fdatasync of a slow card
        inside.set()
        go.wait(HANG_S)
        close_segment()

    monkeypatch.setattr(fdr, "_close_segment", slow_close)
    stopper = threading.Thread(target=fdr.stop)
    stopper.start()
    assert inside.wait(HANG_S)
    monkeypatch.setattr(fdr._stopped, "is_set", lambda: False)  # its check came first
    with pytest.raises(RecordDroppedError, match="recorder stopped"):
        fdr.record_alert("deadline_miss", miss(1))
    go.set()
    stopper.join(HANG_S)
    assert fdr.status()["records_dropped"] == 1


def test_a_recorder_in_the_runtime_dir_is_not_locked_out_by_its_own_daemon(
    tmp_path: Path,
) -> None:
    """``fdr.directory`` = the runtime dir: the instance lock and the recorder's were one
    file, and ``flock`` refused the recorder its own daemon's lock ("another inferd
    records into ..."; review R5, F6).  The recorder's is ``fdr.lock``."""
    lock = InstanceLock(tmp_path, [])
    lock.acquire()
    try:
        fdr = FlightRecorder(config(tmp_path), boot_id="a")
        assert start_recorder(fdr, tmp_path) is None
        fdr.stop()
    finally:
        lock.release()
