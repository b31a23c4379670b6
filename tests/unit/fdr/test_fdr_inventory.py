"""The writer's running inventory of its segments (``fdr/inventory.py``): a
rotation no longer lists the directory nor ``lstat``s the segments it keeps (it
did, 15-28 us each: 0.5-0.9 s a rotation at 32,768), the inventory stays what the
disk holds, and files someone else removes or adds behind the writer's back
neither stop it nor break the size cap."""

from __future__ import annotations

import errno
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import FdrConfig
from inferd.fdr import framing
from inferd.fdr.inventory import Inventory
from inferd.fdr.reader import ReadReport, list_segments, read_records
from inferd.fdr.writer import FlightRecorder
from tests.unit.fdr.test_fdr import SteppedClock

SEGMENT = 1024
#: A ~600-byte frame: one per 1 KiB segment, so each record opens a new segment.
BIG = {"model": "m" * 450, "count": 1, "window_s": 1.0}


def make_segments(directory: Path, indices: Iterable[int], size: int = SEGMENT) -> None:
    """Segments as an earlier run left them: a header, then zeros (a torn tail)."""
    directory.mkdir(mode=0o750, exist_ok=True)
    for index in indices:
        header = framing.encode_segment_header(index, 1)
        (directory / framing.segment_name(index)).write_bytes(header + bytes(size - len(header)))


def recorder(directory: Path, kept: int, **clocks: Any) -> FlightRecorder:
    """A recorder whose cap keeps about ``kept`` full 1 KiB segments."""
    config = FdrConfig(
        directory=directory,
        fsync_interval_ms=50,
        segment_max_bytes=SEGMENT,
        max_total_bytes=(kept + 1) * SEGMENT,
    )
    fdr = FlightRecorder(config, boot_id="boot", **clocks)
    fdr.start()
    return fdr


def rotate(fdr: FlightRecorder, times: int) -> dict[str, Any]:
    try:
        for _ in range(times):
            fdr.record("deadline_miss", BIG)
        assert fdr.wait_durable(10.0)
        return fdr.status()
    finally:
        fdr.stop()


def disk_total(directory: Path) -> int:
    return sum(path.lstat().st_size for path in list_segments(directory))


def named_by_retention(directory: Path) -> list[str]:
    return [
        name
        for record in read_records(directory, ReadReport(), kinds=["fdr_retention"])
        for name in record.payload["deleted_segments"]
    ]


def test_a_rotation_neither_lists_the_directory_nor_stats_a_kept_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rotation listed the directory and ``lstat``-ed every kept segment (200
    here: ~200 calls a rotation); now the writer thread makes none of those calls."""
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 201))
    fdr = recorder(directory, kept=200)
    calls: Counter[str] = Counter()

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == "inferd-fdr":
                calls[name] += 1
            return real(*args, **kwargs)

        return call

    for name in ("listdir", "scandir", "stat", "lstat"):
        monkeypatch.setattr(os, name, counting(name, getattr(os, name)))
    status = rotate(fdr, 20)
    assert status["segments_deleted"] >= 15, status  # it rotated, and the cap deleted
    assert status["last_error"] is None
    assert calls == Counter(), f"the writer thread listed or stat-ed: {dict(calls)}"


def test_the_inventory_is_what_the_disk_holds_after_rotations_and_a_failed_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails part way leaves a segment of the bytes written: the
    inventory counts them, as an ``lstat`` would."""
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 9))
    make_segments(directory, [9], size=300)  # a short segment a crash left
    clock = SteppedClock()
    fdr = recorder(directory, kept=8, mono_clock=clock)
    real_write = os.write
    failures = [1]

    def write(fd: int, data: Any) -> int:
        frames = len(data) > 200  # not a new segment's header (its create)
        if failures[0] and frames and threading.current_thread().name == "inferd-fdr":
            failures[0] -= 1
            real_write(fd, bytes(data)[:100])  # a short write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    fdr.record("deadline_miss", BIG)
    assert fdr.wait_durable(10.0)
    monkeypatch.setattr(os, "write", write)
    fdr.record("deadline_miss", BIG)  # rotates, then its write fails part way
    assert not fdr.wait_durable(10.0)
    monkeypatch.undo()
    assert failures == [0]
    assert fdr.status()["last_error"] is not None
    clock.advance(2.0)  # past the second of backing off after a failure
    status = rotate(fdr, 12)
    assert status["segments_deleted"] > 0
    assert fdr._inventory.total == disk_total(directory)
    assert len(fdr._inventory) == len(list_segments(directory))
    assert disk_total(directory) <= 9 * SEGMENT


def test_a_segment_someone_removed_behind_the_writer_is_skipped_not_reported(
    tmp_path: Path,
) -> None:
    """Still counted until it is the oldest (the recorder keeps less on disk
    meanwhile, never more); then the cap finds it gone and goes on."""
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 11))
    fdr = recorder(directory, kept=10)
    for index in (2, 3):
        (directory / framing.segment_name(index)).unlink()
    with capture_logs() as logs:
        status = rotate(fdr, 12)
    assert status["last_error"] is None and status["records_dropped"] == 0
    named = named_by_retention(directory)
    assert framing.segment_name(1) in named and framing.segment_name(4) in named
    assert not {framing.segment_name(2), framing.segment_name(3)} & set(named)
    gone = [name for log in logs for name in log.get("already_gone", ())]
    assert gone == [framing.segment_name(2), framing.segment_name(3)]
    assert fdr._inventory.total == disk_total(directory) <= 11 * SEGMENT


def test_a_segment_removed_while_the_cap_deletes_it_does_not_fail_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cap's unlink found the file gone (removed between its listing and its
    unlink): ``FileNotFoundError`` failed the write, dropping the record."""
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 5))
    fdr = recorder(directory, kept=4)
    real_unlink = Path.unlink
    raced: list[str] = []

    def unlink(path: Path, missing_ok: bool = False) -> None:
        if not raced and framing.segment_index(path.name) is not None:
            raced.append(path.name)
            real_unlink(path)  # someone else, just before
        real_unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    status = rotate(fdr, 4)
    assert raced == [framing.segment_name(1)]
    assert status["last_error"] is None and status["records_dropped"] == 0
    assert framing.segment_name(1) not in named_by_retention(directory)


def test_a_directory_put_where_a_kept_segment_was_is_skipped(tmp_path: Path) -> None:
    """``unlink`` says ``EISDIR``: not a segment any more (the reader skips it)."""
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 5))
    fdr = recorder(directory, kept=4)
    (directory / framing.segment_name(1)).unlink()
    (directory / framing.segment_name(1)).mkdir()
    status = rotate(fdr, 4)
    assert status["last_error"] is None and status["records_dropped"] == 0
    assert (directory / framing.segment_name(1)).is_dir()


def test_a_segment_someone_added_is_counted_from_the_next_start(tmp_path: Path) -> None:
    """Under an index the writer passed, it is not counted by this run (the disk
    holds that much more); the next start's scan finds it and the cap deletes it."""
    directory = tmp_path / "fdr"
    make_segments(directory, range(5, 9))
    fdr = recorder(directory, kept=4)
    make_segments(directory, [1])  # behind the writer's back
    rotate(fdr, 2)
    assert (directory / framing.segment_name(1)).exists(), "not counted in this run"
    rotate(recorder(directory, kept=4), 2)
    assert not (directory / framing.segment_name(1)).exists()
    assert framing.segment_name(1) in named_by_retention(directory)


def test_a_name_the_writer_finds_taken_is_counted_at_once(tmp_path: Path) -> None:
    """Someone made the next segment's name: the writer skips it (as before) and
    counts it in the cap, so the disk never holds more than max_total_bytes."""
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 5))
    fdr = recorder(directory, kept=4)
    make_segments(directory, [5, 6])  # the next two names the writer would take
    rotate(fdr, 8)
    assert fdr._inventory.total == disk_total(directory) <= 5 * SEGMENT
    assert framing.segment_name(5) in named_by_retention(directory)


# -- the inventory itself ----------------------------------------------------------------
def test_the_scan_lists_what_the_reader_lists_and_takes_every_name(tmp_path: Path) -> None:
    directory = tmp_path / "fdr"
    make_segments(directory, [3, 1, 7], size=100)
    (directory / framing.segment_name(12)).mkdir()  # index taken, not a segment
    (directory / framing.segment_name(9)).symlink_to(tmp_path / "elsewhere")  # a segment
    (directory / "notes.txt").write_text("x" * 5000)  # not a segment: not counted
    inventory = Inventory.scan(directory)
    expected = list_segments(directory)
    assert list(inventory.paths_newest_first(directory)) == expected[::-1]
    assert inventory.total == sum(path.lstat().st_size for path in expected)
    assert inventory.highest_index == 12
    assert len(inventory) == 4


def test_pops_and_appends_keep_the_order_and_the_total_across_compactions() -> None:
    inventory = Inventory()
    for index in range(1, 10_001):
        inventory.append(index, index)
    for index in range(1, 9_001):
        assert inventory.oldest() == (index, index)
        inventory.pop_oldest()
        inventory.append(10_000 + index, 1)
    assert len(inventory) == 10_000
    assert inventory.oldest() == (9_001, 9_001)
    assert inventory.total == sum(range(9_001, 10_001)) + 9_000
    inventory.set_newest_size(50)
    assert inventory.total == sum(range(9_001, 10_001)) + 9_000 + 49
    with pytest.raises(ValueError, match="not newer"):
        inventory.append(5, 1)


def test_a_name_found_taken_twice_is_counted_once(tmp_path: Path) -> None:
    directory = tmp_path / "fdr"
    make_segments(directory, [1, 2], size=100)
    inventory = Inventory.scan(directory)
    make_segments(directory, [3], size=100)
    inventory.add_found(directory, 3)
    inventory.add_found(directory, 3)  # a create that failed, retried
    inventory.add_found(directory, 4)  # gone meanwhile
    assert (len(inventory), inventory.total) == (3, 300)
