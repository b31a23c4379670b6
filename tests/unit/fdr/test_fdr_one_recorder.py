"""One recorder a directory: a second ``FlightRecorder`` (another daemon pointed at the
same ``fdr.directory``) does not start, says why, and the first's records stay.
Before, both started: the second's size cap deleted the first's open segment, whose
records it kept counting durable, and both wrote seq 1, 2... (review R4, F1: two real
daemons, "duplicate seqs: [4]"; two recorders, "B durable after: True", "B's records on
disk: []")."""

from __future__ import annotations

from pathlib import Path

import structlog

from inferd.fdr.reader import read_records
from inferd.fdr.writer import FlightRecorder
from inferd.startup import start_recorder
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
