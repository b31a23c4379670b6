"""The recorder's queue is bounded in bytes as well as in records
(``fdr.queue_max_bytes``, ``fdr/queued.py``): a record the recorder takes may be
1 MiB, so a queue bounded only by ``queue_capacity`` held 4 GiB at its default
and 64 GiB at its ceiling.  A record over the byte bound is dropped as one over
the record bound is: counted, logged, and reported by an ``fdr_dropped`` record."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import FdrConfig
from inferd.config.ceilings import FDR_QUEUE_MIN_BYTES, MAX_FDR_QUEUE_BYTES
from inferd.errors import ConfigError
from inferd.fdr import framing
from inferd.fdr.reader import read_records
from inferd.fdr.writer import FlightRecorder
from tests.unit.config.test_config import MINIMAL, load_text
from tests.unit.fdr.test_fdr import EXAMPLES, config

MIB = 1024**2


def alert(message_bytes: int) -> dict[str, Any]:
    """An alert whose frame is ``message_bytes`` and a little more."""
    return {**EXAMPLES["alert"], "message": "x" * message_bytes}


def test_a_record_past_the_byte_bound_is_dropped_counted_and_reported(tmp_path: Path) -> None:
    # The writer is not started yet: nothing leaves the queue.
    fdr = FlightRecorder(config(tmp_path, queue_max_bytes=2 * MIB), boot_id="boot-a")
    with capture_logs() as logs:
        for _ in range(3):
            fdr.record("alert", alert(600_000))  # 3 x ~600 KB fit 2 MiB
        fdr.record("alert", alert(600_000))  # the 4th does not
        fdr.record("deadline_miss", EXAMPLES["deadline_miss"])  # a small one still fits
    assert fdr.status()["records_dropped"] == 1
    assert fdr.status()["queue_depth"] == 4
    assert 3 * 600_000 < fdr.status()["queue_bytes"] <= 2 * MIB  # shown in status.fdr
    (dropped,) = [entry for entry in logs if entry["event"] == "fdr_records_dropped"]
    assert dropped["reason"] == "queue bytes full" and dropped["log_level"] == "error"
    fdr.start()
    try:
        assert fdr.wait_durable(5), fdr.status()  # the loss durably reported
        # Written: their bytes are free again, and three more fit.
        for _ in range(3):
            fdr.record("alert", alert(600_000))
        assert fdr.wait_durable(5), fdr.status()
    finally:
        fdr.stop()
    assert fdr.status()["records_dropped"] == 1
    records = list(read_records(tmp_path))
    assert [r.kind for r in records] == ["fdr_dropped", *["alert"] * 3, "deadline_miss"] + [
        "alert"
    ] * 3
    assert records[0].payload == {"dropped": 1, "reason": "queue bytes full"}


def test_a_full_queue_of_the_largest_records_holds_its_byte_bound(tmp_path: Path) -> None:
    """Measured with tracemalloc: 64 records of 1 MiB held 64 MiB before the bound
    (4 GiB at the default ``queue_capacity``); the default 16 MiB bound holds."""
    fdr = FlightRecorder(config(tmp_path), boot_id="boot-a")  # not started: nothing drains
    largest = alert(framing.MAX_BODY_BYTES - 256)  # a body just under the 1 MiB limit
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(64):
            fdr.record("alert", largest)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert FdrConfig(directory=tmp_path).queue_max_bytes == 16 * MIB
    assert fdr.status()["queue_depth"] == 16 and fdr.status()["records_dropped"] == 48
    assert held <= 16 * MIB + 64 * 1024, held


def test_the_least_byte_bound_holds_the_largest_record(tmp_path: Path) -> None:
    largest_frame = framing.FRAME_HEADER.size + framing.MAX_BODY_BYTES
    assert largest_frame <= FDR_QUEUE_MIN_BYTES
    fdr = FlightRecorder(config(tmp_path, queue_max_bytes=FDR_QUEUE_MIN_BYTES), boot_id="b")
    fdr.record("alert", alert(framing.MAX_BODY_BYTES - 256))
    assert fdr.status()["queue_depth"] == 1 and fdr.status()["records_dropped"] == 0


@pytest.mark.parametrize("value", [FDR_QUEUE_MIN_BYTES - 1, MAX_FDR_QUEUE_BYTES + 1, 0])
def test_queue_max_bytes_out_of_range_is_refused_naming_the_key(tmp_path: Path, value: int) -> None:
    with pytest.raises(ConfigError, match=r"fdr\.queue_max_bytes must be"):
        FdrConfig(directory=tmp_path, queue_max_bytes=value)


def test_queue_max_bytes_is_read_from_the_fdr_table(tmp_path: Path) -> None:
    loaded = load_text(tmp_path, f"[fdr]\nqueue_max_bytes = {MAX_FDR_QUEUE_BYTES}\n{MINIMAL}")
    assert loaded.fdr.queue_max_bytes == MAX_FDR_QUEUE_BYTES
