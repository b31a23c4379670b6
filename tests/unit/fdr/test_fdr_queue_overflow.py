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
    assert fdr.status()["records_dropped"] == 20 - 4
    assert fdr.status()["last_error"] is None  # said by the writer, once it looks
    gate.set()
    wait_until(lambda: fdr.status()["last_error"] is not None, message="the overflow said")
    assert fdr.status()["last_error"] == "queue full: the disk is slower than the records come"
    assert fdr.wait_durable(5)
    fdr.record("deadline_miss", miss(21))
    assert fdr.wait_durable(5)
    fdr.stop()
    ((level, code, message),) = [(a.level, a.code, a.message) for a in alerts]
    assert (level, code) == ("ERROR", "fdr_write_outage")
    assert "queue full" in message and "records are dropped and counted" in message
