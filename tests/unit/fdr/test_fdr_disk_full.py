"""A disk that fills below the recorder's own cap (the engines and builds share
``state_dir``): the recorder deletes its oldest segments to make room for the newest
records.  Before, only the cap deleted: the old history stayed and every new record,
critical ones included, was dropped for as long as the disk stayed full (review R4,
F2: a 2 MiB tmpfs, 17,248 records dropped, no segment deleted).

The disk here: ``os.write`` fails ``ENOSPC`` until a segment is unlinked, as a full
filesystem would until something frees blocks."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from inferd.fdr import segments
from inferd.fdr.reader import read_records
from inferd.fdr.writer import FlightRecorder
from tests.conftest import wait_until
from tests.unit.fdr.test_fdr import SteppedClock, config, miss

#: Inodes counted, some free: the file system's bytes decide.
INODES = {"f_favail": 9, "f_files": 99}


def test_a_full_disk_gives_the_oldest_segments_to_the_newest_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SteppedClock()
    fdr = FlightRecorder(
        config(tmp_path, segment_max_bytes=4096, max_total_bytes=1024 * 1024), mono_clock=clock
    )
    fdr.start()
    seq = 0
    while fdr.status()["segments_kept"] < 4:  # history: closed segments under the cap
        seq += 1
        fdr.record("deadline_miss", miss(seq))
        assert fdr.wait_durable(5)
    oldest = fdr.status()["oldest_segment"]
    full = [True]
    real_write, real_unlink = os.write, Path.unlink

    def write(fd: int, data: Any) -> int:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def unlink(path: Path, missing_ok: bool = False) -> None:
        real_unlink(path, missing_ok)
        full[0] = False  # blocks freed

    real_statvfs = os.statvfs

    def statvfs(path: Any) -> Any:  # a full file system has nothing free
        info = real_statvfs(path)
        free = {
            "f_bavail": 0 if full[0] else info.f_bavail,
            "f_frsize": 4096,
            "f_favail": 9,
            "f_files": 99,
        }
        return type("Full", (), free)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(Path, "unlink", unlink)
    fdr.record("deadline_miss", miss(seq + 1))  # meets the full disk: dropped, counted
    wait_until(lambda: fdr.status()["records_dropped"] == 1, message="the first drop")
    clock.advance(1.1)  # past the writer's backoff after a failure
    critical = {"model": "m", "configured_runtime": "tensorrt", "reason": "engine missing"}
    fdr.record("fallback_to_onnx_trt_ep", {**critical, "active_providers": ["CPU"]})
    assert fdr.wait_durable(5), fdr.status()  # before: dropped, the disk still full
    status = fdr.status()
    assert status["segments_deleted"] == 1 and status["oldest_segment"] != oldest  # one
    fdr.stop()
    kinds = [record.kind for record in read_records(tmp_path)]
    # The loss and the deletion are said in the kept recording, beside the new record.
    assert {"fdr_dropped", "fallback_to_onnx_trt_ep", "fdr_retention"} <= set(kinds[-4:]), kinds


def _after_boots(directory: Path, boots: int) -> tuple[FlightRecorder, SteppedClock]:
    """``boots`` earlier boots' one-record segments, then this boot's recorder, started."""
    for boot in range(boots):
        fdr = FlightRecorder(config(directory), boot_id=f"boot{boot}")
        fdr.start()
        fdr.record("deadline_miss", miss(boot + 1))
        assert fdr.wait_durable(5)
        fdr.stop()
    clock = SteppedClock()
    fdr = FlightRecorder(config(directory), mono_clock=clock, boot_id="now")
    fdr.start()
    return fdr, clock


def test_a_full_disk_with_small_segments_costs_one_segment_not_every_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten boots left one small segment each: one ``ENOSPC`` deleted all ten (the room
    asked for was a whole ``segment_max_bytes``; review R5, F1).  Now one round deletes
    the oldest segment alone, and none while the file system has room for a segment."""
    fdr, clock = _after_boots(tmp_path, 10)
    real_write = os.write
    full = [True]

    def write(fd: int, data: Any) -> int:
        if full[0]:
            full[0] = False  # one failure; the disk has room again after it
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(
        os,
        "statvfs",
        lambda path: type(
            "Full", (), {"f_bavail": 0, "f_frsize": 4096, "f_favail": 9, "f_files": 99}
        ),
    )
    fdr.record("deadline_miss", miss(11))
    assert not fdr.wait_durable(5)
    clock.advance(1.1)
    fdr.record("deadline_miss", miss(12))
    assert fdr.wait_durable(5)
    assert fdr.status()["segments_deleted"] == 1
    fdr.stop()
    boots = sorted({record.boot_id for record in read_records(tmp_path)})
    assert boots == [*(f"boot{boot}" for boot in range(1, 10)), "now"]


@pytest.mark.parametrize(
    ("error", "free"),
    [
        (
            errno.EDQUOT,
            {"f_bavail": 10**9, "f_favail": 10**6, "f_files": 10**7},
        ),  # a quota: statvfs roomy
        (
            errno.ENOSPC,
            {"f_bavail": 10**9, "f_favail": 0, "f_files": 10**7},
        ),  # no inode left, bytes free
    ],
    ids=["quota", "inodes"],
)
def test_a_quota_or_inodes_run_out_with_bytes_free_still_make_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int, free: dict[str, int]
) -> None:
    """``statvfs`` showed bytes free, so the room check found room and deleted nothing,
    every round: every record dropped while the quota or the inodes lasted (review R6,
    F1).  A quota is taken as still there; ``ENOSPC`` with no inode free is full."""
    # An empty oldest segment, as a crash between a segment's creation and its header
    # leaves: it frees nothing, so the one after it goes too (F2).
    (tmp_path / "seg-0000000001.fdr").write_bytes(b"")
    fdr, clock = _after_boots(tmp_path, 3)
    real_write, real_unlink = os.write, Path.unlink
    full = [True]

    def write(fd: int, data: Any) -> int:
        if full[0]:
            raise OSError(error, os.strerror(error))
        return real_write(fd, data)

    def unlink(path: Path, missing_ok: bool = False) -> None:
        real_unlink(path, missing_ok)
        if path.name == "seg-0000000002.fdr":  # boot0's, the oldest holding bytes: room
            full[0] = False

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(os, "statvfs", lambda path: type("Free", (), {"f_frsize": 1, **free}))
    fdr.record("deadline_miss", miss(4))
    assert not fdr.wait_durable(5)
    clock.advance(1.1)
    fdr.record("deadline_miss", miss(5))
    assert fdr.wait_durable(5), fdr.status()  # before: dropped for as long as it lasted
    assert fdr.status()["segments_deleted"] == 2  # the empty one, then the oldest held
    fdr.stop()
    assert sorted({r.boot_id for r in read_records(tmp_path)}) == ["boot1", "boot2", "now"]


def test_a_file_system_that_counts_no_inodes_is_not_taken_as_out_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vfat, exFAT (SD cards), btrfs report ``f_files = f_favail = 0``: "not counted",
    which was read as no inode left, a segment deleted with room to spare (R7, F3)."""
    uncounted = {"f_files": 0, "f_favail": 0, "f_bavail": 10**9, "f_frsize": 1}
    monkeypatch.setattr(os, "statvfs", lambda path: type("Vfat", (), uncounted))
    assert not segments._no_room(tmp_path, config(tmp_path), errno.ENOSPC)
    spent = {**uncounted, "f_files": 100}
    monkeypatch.setattr(os, "statvfs", lambda path: type("Spent", (), spent))
    assert segments._no_room(tmp_path, config(tmp_path), errno.ENOSPC)
