"""A newest record just below the largest seq (2**63-1): the recorder starts, and
once it has assigned 2**63-1 it writes nothing more.  Before, it numbered records
past it, which its own reader calls corrupt, and said them durable (review R1, F2).
Now a record past it is a write failure: dropped and counted, never written,
``fdr_write_outage`` raised once, and no segment file opened for it."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from inferd.alerts.dispatcher import AlertDispatcher
from inferd.alerts.hooks import FdrAlertHook
from inferd.cli.fdr import sequence_damage, verify
from inferd.fdr import framing
from inferd.fdr.reader import ReadReport, read_records
from inferd.fdr.writer import FlightRecorder
from inferd.startup import start_recorder
from tests.unit.fdr.conftest import KeptAlerts, segment_with_seqs
from tests.unit.fdr.test_fdr import SteppedClock, config, miss

pytestmark = pytest.mark.usefixtures("quiet_logs")

MAX_SEQ = framing.MAX_SEQ


def _started(directory: Path, clock: SteppedClock) -> tuple[FlightRecorder, KeptAlerts, Any]:
    fdr = FlightRecorder(config(directory), mono_clock=clock, boot_id="b")
    ground = KeptAlerts()
    dispatcher = AlertDispatcher([ground, FdrAlertHook(fdr.record_alert)], rate_limit_s=0)
    assert start_recorder(fdr, directory, dispatcher) is None  # MAX_SEQ - 1: it starts
    return fdr, ground, dispatcher


def _read_back(directory: Path) -> list[int]:
    """The seqs read back; no record may read as corrupt, and verify finds nothing but
    the gap the test's own segment made (seq 5, then 2**63-2: DESIGN.md 360)."""
    report = ReadReport()
    records = list(read_records(directory, report))
    assert [damage.reason for damage in report.corrupt] == []
    assert verify(directory, as_json=False, out=io.StringIO()) == 1
    assert sequence_damage(records) == [
        f"seq 6..{MAX_SEQ - 2} missing after seg-0000000001.fdr: no fdr_dropped counts them"
    ]
    return [record.seq for record in records]


def test_no_record_is_written_past_the_largest_seq(tmp_path: Path) -> None:
    """The review's repro: three records after a newest seq of 2**63-2.  Before:
    ``wait_durable`` True, 3 written, none dropped, and two read back as corrupt
    ("seq out of range"), ``verify`` 1."""
    directory = tmp_path / "fdr"
    segment_with_seqs(directory, 5, MAX_SEQ - 1)
    clock = SteppedClock()
    fdr, ground, _ = _started(directory, clock)
    try:
        for count in range(3):
            fdr.record("deadline_miss", miss(count + 1))
        assert not fdr.wait_durable(5), "two of them were dropped"
    finally:
        fdr.stop()
    # Two records, and the fdr hook's record of the outage's alert.
    assert (fdr.records_written, fdr.records_dropped) == (1, 3)
    assert _read_back(directory) == [5, MAX_SEQ - 1, MAX_SEQ]
    assert [alert.code for alert in ground.alerts] == ["fdr_write_outage"]
    assert "no seq is left" in ground.alerts[0].message
    assert fdr.status()["last_error"].startswith("write: no seq is left")


def test_once_the_seqs_are_spent_every_record_is_dropped_without_a_file_or_a_second_alert(
    tmp_path: Path,
) -> None:
    """The last seq is written and durable; each later record, a second and more
    apart (past the back-off), is dropped and counted: no segment opened for it (a
    file a try), no second alert, and the ``fdr`` hook fails the alert it cannot keep."""
    directory = tmp_path / "fdr"
    segment_with_seqs(directory, 5, MAX_SEQ - 1)
    clock = SteppedClock()
    fdr, ground, dispatcher = _started(directory, clock)
    try:
        fdr.record("deadline_miss", miss(1))
        assert fdr.wait_durable(5), fdr.status()  # MAX_SEQ itself is a seq the reader takes
        files = sorted(path.name for path in directory.iterdir())
        for count in range(3):
            fdr.record("deadline_miss", miss(count + 2))
            assert not fdr.wait_durable(5)
            clock.advance(1.01)
        assert sorted(path.name for path in directory.iterdir()) == files
        assert fdr.records_dropped == 4  # 3 records and the fdr hook's record of the alert
    finally:
        fdr.stop()
    assert sorted(path.name for path in directory.iterdir()) == files  # nor at the stop
    assert _read_back(directory) == [5, MAX_SEQ - 1, MAX_SEQ]
    assert [alert.code for alert in ground.alerts] == ["fdr_write_outage"]
    fdr_hook = dispatcher.status()["hooks"]["fdr"]
    assert (fdr_hook["sent"], fdr_hook["failures"]) == (0, 1)
    assert "dropped the record" in fdr_hook["last_error"]
