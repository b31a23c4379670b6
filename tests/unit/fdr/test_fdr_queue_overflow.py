"""Records dropped because the recorder's queue is full (a disk slower than the records
come: a stalled SD card) are said as a write failure's are: in ``last_error`` and once
an outage by the ``fdr_write_outage`` alert, which reaches the ground through the PUB
and MAVLink hooks.  Before, they were counted and logged on board only: 19,091 dropped,
``last_error`` None, no alert (review R4, F4), and the size cap could then delete the
``fdr_dropped`` records that said so."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from inferd.fdr.outage import Outage, Overflow
from inferd.fdr.queued import QUEUE_BYTES_FULL, QUEUE_FULL
from inferd.fdr.writer import FlightRecorder
from inferd.types import Alert
from tests.conftest import wait_until
from tests.unit.fdr.test_fdr import EXAMPLES, config, miss


def test_a_full_queue_is_an_outage_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, calls = threading.Event(), [0]
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        calls[0] += 1
        if calls[0] > 1:  # the header's sync passes, the first record's hangs: a slow disk
            gate.wait(30)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    alerts: list[Alert] = []
    fdr = FlightRecorder(config(tmp_path, queue_capacity=4))
    fdr.start(alerts.append)
    fdr.record("daemon_lifecycle", EXAMPLES["daemon_lifecycle"])
    wait_until(lambda: calls[0] >= 2, message="the writer stuck in fdatasync")
    for index in range(20):
        fdr.record("deadline_miss", miss(index + 1))
    # Said at once, while the disk is still stuck (review R5, F3: nothing until it moved).
    status = fdr.status()
    assert status["records_dropped"] == 20 - 4
    assert status["last_error"] == "queue full: the disk is slower than the records come"
    ((level, code, message),) = [(a.level, a.code, a.message) for a in alerts]
    assert (level, code) == ("ERROR", "fdr_write_outage")
    assert "queue full" in message and "records are dropped and counted" in message
    gate.set()
    assert fdr.wait_durable(5)
    fdr.stop()
    assert len(alerts) == 1  # one episode, one alert


def test_a_flood_is_one_episode_not_an_alert_a_batch(tmp_path: Path) -> None:
    """The writer keeps writing while a flood overflows its queue between its batches:
    before, each durable batch ended the outage and the next overflow began another (500
    alerts in 3 s; review R5, F3).  An episode ends only at a batch of the writer's
    during which nothing overflowed; and an alert's own ``fdr`` hook record that finds
    the queue full raises none inside it."""
    alerts: list[Alert] = []
    outage = Outage(tmp_path)
    overflow = Overflow(outage)

    def alert(raised: Alert) -> None:
        alerts.append(raised)
        overflow.dropped(QUEUE_FULL)  # the fdr hook's record of this very alert

    outage.alert = alert
    for _ in range(50):  # a flood: overflows between every two batches
        overflow.dropped(QUEUE_FULL)
        overflow.dropped(QUEUE_BYTES_FULL)
        overflow.batch_done()
    assert len(alerts) == 1
    overflow.batch_done()  # a whole batch with no overflow: the episode is over
    overflow.dropped(QUEUE_FULL)
    assert len(alerts) == 2
