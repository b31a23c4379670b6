"""Review 5 of the flight data recorder, finding 3: a disk failure while recording
was told to nobody off board (log and status only), a loss just before a clean
stop left no ``fdr_dropped`` record, and the ``fdr`` alert hook counted as sent an
alert whose record the failing writer dropped."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.alerts.dispatcher import AlertDispatcher
from inferd.alerts.hooks import FdrAlertHook
from inferd.fdr import segments
from inferd.fdr.reader import read_records
from inferd.fdr.writer import FlightRecorder
from inferd.types import Alert
from tests.conftest import HANG_S, in_process_daemon, wait_until
from tests.integration.test_schemas import assert_valid
from tests.unit.fdr.conftest import KeptAlerts
from tests.unit.fdr.test_fdr import SteppedClock, config, miss

pytestmark = pytest.mark.usefixtures("quiet_logs")


class _Disk:
    """Segment writes fail with EIO while ``failing``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.failing = False
        real = segments.append

        def append(segment: segments.Segment, data: bytes) -> None:
            if self.failing:
                raise OSError(errno.EIO, "Input/output error")
            real(segment, data)

        monkeypatch.setattr(segments, "append", append)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> _Disk:
    return _Disk(monkeypatch)


@pytest.fixture
def clock() -> SteppedClock:
    return SteppedClock()


@pytest.fixture
def recorder(tmp_path: Path, clock: SteppedClock) -> Iterator[FlightRecorder]:
    fdr = FlightRecorder(config(tmp_path), mono_clock=clock, boot_id="b")
    yield fdr
    fdr.stop()


def _lose_one_record(fdr: FlightRecorder, disk: _Disk) -> None:
    fdr.record("deadline_miss", miss(1))
    assert fdr.wait_durable(5)
    disk.failing = True
    fdr.record("deadline_miss", miss(2))
    assert not fdr.wait_durable(5), "the record is lost (and the writer backs off a second)"
    disk.failing = False  # the disk works again; nothing else is recorded


def test_a_loss_just_before_a_stop_is_reported_at_the_stop(
    tmp_path: Path, recorder: FlightRecorder, disk: _Disk
) -> None:
    """Before: no fdr_dropped at all, 1 drop counted.  The stop writes the report,
    even within the second the writer backs off after the failure."""
    recorder.start()
    _lose_one_record(recorder, disk)
    recorder.stop()
    kinds = [(r.kind, r.payload.get("dropped")) for r in read_records(tmp_path)]
    assert kinds == [("deadline_miss", None), ("fdr_dropped", 1)]


def test_a_marker_writes_the_pending_report_once_the_disk_works(
    tmp_path: Path, recorder: FlightRecorder, disk: _Disk, clock: SteppedClock
) -> None:
    """``wait_durable`` with no record behind it: before, False (the loss never
    reported); now the report is written and it is True."""
    recorder.start()
    _lose_one_record(recorder, disk)
    assert recorder.records_dropped == 1
    clock.advance(1.01)
    assert recorder.wait_durable(5), recorder.status()
    (report,) = read_records(tmp_path, kinds=["fdr_dropped"])
    assert report.payload["dropped"] == 1


def test_a_write_failure_alerts_the_ground_once_per_outage(
    tmp_path: Path, recorder: FlightRecorder, disk: _Disk, clock: SteppedClock
) -> None:
    """Before: no alert.  One ``fdr_write_outage`` at the first failure, none for
    the retries that fail too, one more once a record was durable and writes fail
    again; the fdr hook's own record of it is dropped (a failure), never looping."""
    ground = KeptAlerts()
    dispatcher = AlertDispatcher([ground, FdrAlertHook(recorder.record_alert)], rate_limit_s=0)
    recorder.start(dispatcher)
    _lose_one_record(recorder, disk)
    disk.failing = True
    for count in range(3):  # retries, a second apart, all failing: the same outage
        clock.advance(1.01)
        recorder.record("deadline_miss", miss(count))
        assert not recorder.wait_durable(5)
    assert [alert.code for alert in ground.alerts] == ["fdr_write_outage"]
    (alert,) = ground.alerts
    assert alert.level == "ERROR" and "write: Input/output error" in alert.message
    assert alert.fields == {"directory": str(tmp_path)}
    event = {"level": alert.level, "code": alert.code, "message": alert.message}
    assert_valid("event_alert.json", {"ts_ns": 1, "seq": 1, **event, "fields": alert.fields})
    fdr_hook = dispatcher.status()["hooks"]["fdr"]
    assert (fdr_hook["sent"], fdr_hook["failures"]) == (0, 1)
    assert "dropped the record: write failed: recorder is backing off" in fdr_hook["last_error"]

    disk.failing = False
    clock.advance(1.01)
    recorder.record("deadline_miss", miss(9))
    assert recorder.wait_durable(5), recorder.status()  # the outage is over
    disk.failing = True
    recorder.record("deadline_miss", miss(10))
    wait_until(
        lambda: dispatcher.status()["hooks"]["fdr"]["failures"] == 2,
        message="the second outage's alert, its record dropped",
    )
    assert [alert.code for alert in ground.alerts] == ["fdr_write_outage"] * 2
    assert not recorder.wait_durable(5)  # record 10's batch is over: its drop counted
    assert recorder.records_dropped == 7  # 1 + 3 retries + 1, and 2 alert records


def test_the_fdr_hook_fails_an_alert_its_recorder_drops(
    recorder: FlightRecorder, disk: _Disk, clock: SteppedClock
) -> None:
    """Before: sent, though the record was dropped (the writer backing off, the
    recorder stopped).  An alert recorded once the disk is back is sent."""
    hook = FdrAlertHook(recorder.record_alert)
    dispatcher = AlertDispatcher([hook], rate_limit_s=0)
    recorder.start()
    _lose_one_record(recorder, disk)
    dispatcher(Alert("CRITICAL", "engine_worker_died", "example", {"queued": 0}))
    clock.advance(1.01)
    dispatcher(Alert("CRITICAL", "engine_worker_died", "example", {"queued": 1}))
    assert recorder.wait_durable(5), recorder.status()
    recorder.stop()
    dispatcher(Alert("CRITICAL", "engine_worker_died", "example", {"queued": 2}))
    status = dispatcher.status()["hooks"]["fdr"]
    assert (status["sent"], status["failures"]) == (1, 2)
    assert "recorder stopped" in status["last_error"]
    assert recorder.records_dropped == 3


def test_the_daemon_tells_the_ground_and_its_fdr_hook_fails_the_alert(
    short_tmp_path: Path, demo_model: Path, disk: _Disk
) -> None:
    """The composition root hands the recorder its alert dispatcher and the fdr hook
    the recorder's ``record_alert``: before, no alert, and every alert the failing
    recorder dropped counted sent."""
    models: list[dict[str, object]] = [{"name": "demo", "path": str(demo_model)}]
    daemon = in_process_daemon(short_tmp_path, models, alerts={"hooks": ["pub", "fdr"]})
    daemon.start()
    try:
        assert daemon.wait_ready(HANG_S)
        disk.failing = True
        daemon.record("deadline_miss", miss(1))
        hooks = wait_until(
            lambda: (h := daemon.status({})["alerts"]["hooks"])["fdr"]["failures"] and h,
            message="the fdr_write_outage alert",
        )
    finally:
        daemon.stop()
    assert (hooks["pub"]["sent"], hooks["pub"]["failures"]) == (1, 0)
    assert (hooks["fdr"]["sent"], hooks["fdr"]["failures"]) == (0, 1)
    assert "RecordDroppedError" in hooks["fdr"]["last_error"]
