"""What the recorder keeps on disk, in ``status.fdr``: ``segments_kept``,
``bytes_kept``, ``max_total_bytes`` and ``oldest_segment``, read from the writer's
running inventory (``fdr/inventory.py``), so a ``status`` call lists nothing and
an operator no longer needs ``du`` on the vehicle to see how much flight history
there is and how close it is to the cap."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inferd.config import FdrConfig
from inferd.fdr import framing
from inferd.fdr.inventory import Inventory, Kept
from inferd.fdr.reader import list_segments
from inferd.fdr.writer import FlightRecorder
from tests.unit.fdr.test_fdr_inventory import BIG, SEGMENT, make_segments, recorder

SMALL = {"model": "m", "count": 1, "window_s": 1.0}
NAME_1 = framing.segment_name(1)


def on_disk(directory: Path) -> dict[str, Any]:
    """What ``du`` and ``ls`` would tell the operator, in status's keys."""
    paths = list_segments(directory)
    return {
        "segments_kept": len(paths),
        "bytes_kept": sum(path.lstat().st_size for path in paths),
        "oldest_segment": paths[0].name if paths else None,
    }


def kept(status: dict[str, Any]) -> dict[str, Any]:
    return {key: status[key] for key in ("segments_kept", "bytes_kept", "oldest_segment")}


def write(fdr: FlightRecorder, payload: dict[str, Any], times: int = 1) -> dict[str, Any]:
    for _ in range(times):
        fdr.record("deadline_miss", payload)
    assert fdr.wait_durable(10.0)
    return fdr.status()


def test_the_kept_counts_follow_writes_rotations_and_the_caps_deletions(tmp_path: Path) -> None:
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 4))  # an earlier run's: 3 full segments
    fdr = recorder(directory, kept=5)  # the cap: 6 KiB
    try:
        status = fdr.status()  # the start's scan, before any write
        assert status["max_total_bytes"] == 6 * SEGMENT
        earlier = {"segments_kept": 3, "bytes_kept": 3 * SEGMENT, "oldest_segment": NAME_1}
        assert kept(status) == on_disk(directory) == earlier

        first = write(fdr, SMALL)  # opens segment 4
        assert kept(first) == on_disk(directory)
        assert first["segments_kept"] == 4 and first["bytes_kept"] > 3 * SEGMENT

        second = write(fdr, SMALL)  # the same segment, grown
        assert kept(second) == on_disk(directory)
        assert second["segments_kept"] == 4 and second["bytes_kept"] > first["bytes_kept"]

        rotated = write(fdr, BIG, times=2)  # ~600-byte frames: the second opens segment 5
        assert kept(rotated) == on_disk(directory)
        assert rotated["segments_kept"] == 5 and rotated["segments_deleted"] == 0

        capped = write(fdr, BIG, times=6)  # past the cap: the oldest go
        assert kept(capped) == on_disk(directory)
        assert capped["segments_deleted"] >= 3 and capped["last_error"] is None
        assert capped["bytes_kept"] <= capped["max_total_bytes"]  # the count is not capped
        assert capped["oldest_segment"] > framing.segment_name(3)  # the earlier run's went
    finally:
        fdr.stop()
    assert kept(fdr.status()) == on_disk(directory)  # stopped: nothing changed since


def test_a_status_call_lists_nothing_and_stats_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 300 segments kept, ``status`` makes no listing or ``stat`` call: its cost
    does not grow with what the recorder keeps."""
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 301))
    fdr = recorder(directory, kept=400)
    try:
        write(fdr, SMALL)
        calls: Counter[str] = Counter()
        caller = threading.current_thread()

        def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                if threading.current_thread() is caller:
                    calls[name] += 1
                return real(*args, **kwargs)

            return call

        for name in ("listdir", "scandir", "stat", "lstat"):
            monkeypatch.setattr(os, name, counting(name, getattr(os, name)))
        monkeypatch.setattr(Path, "iterdir", counting("iterdir", Path.iterdir))
        status = fdr.status()
        monkeypatch.undo()
        assert calls == Counter(), f"status listed or stat-ed: {dict(calls)}"
        assert kept(status) == on_disk(directory)
        assert status["segments_kept"] == 301
    finally:
        fdr.stop()


def test_before_start_and_in_an_empty_directory_nothing_is_kept(tmp_path: Path) -> None:
    config = FdrConfig(
        directory=tmp_path / "fdr", segment_max_bytes=SEGMENT, max_total_bytes=4 * SEGMENT
    )
    fdr = FlightRecorder(config, boot_id="boot")
    nothing = {"segments_kept": 0, "bytes_kept": 0, "oldest_segment": None}
    assert kept(fdr.status()) == nothing and fdr.status()["max_total_bytes"] == 4 * SEGMENT
    fdr.start()
    try:
        assert kept(fdr.status()) == nothing  # the first segment opens with the first record
        assert kept(write(fdr, SMALL)) == on_disk(config.directory)
        assert fdr.status()["oldest_segment"] == framing.segment_name(1)
    finally:
        fdr.stop()


def test_a_segment_removed_by_hand_is_counted_until_the_cap_reaches_it(tmp_path: Path) -> None:
    """The inventory is not re-read per status (DESIGN.md 258): a segment removed
    behind the writer's back is still counted, on the safe side (the recorder
    reports more than the disk holds, never less), until the cap drops it."""
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 5))
    fdr = recorder(directory, kept=5)
    try:
        before = write(fdr, SMALL)
        (directory / framing.segment_name(2)).unlink()
        stale = fdr.status()
        assert kept(stale) == kept(before)
        assert stale["segments_kept"] == on_disk(directory)["segments_kept"] + 1
        after = write(fdr, BIG, times=8)  # the cap passes segment 2: dropped, not deleted
        assert kept(after) == on_disk(directory)
    finally:
        fdr.stop()


def test_kept_is_one_value_the_writer_replaces_after_each_change(tmp_path: Path) -> None:
    """Another thread reads ``kept`` whole: after every change it is the count, the
    total and the oldest index the arrays hold, compaction included."""

    def expected(inventory: Inventory) -> Kept:
        oldest = inventory.oldest()[0] if len(inventory) else None
        return (len(inventory), inventory.total, oldest)

    inventory = Inventory()
    assert inventory.kept == (0, 0, None)
    for index in range(1, 10_001):
        inventory.append(index, 100)
        inventory.set_newest_size(100 + index % 7)
        assert inventory.kept == expected(inventory)
    for _ in range(9_000):  # past _COMPACT_AFTER: the arrays are compacted on the way
        inventory.pop_oldest()
        assert inventory.kept == expected(inventory)
    assert inventory.kept == (1000, inventory.total, 9001)
    directory = tmp_path / "fdr"
    make_segments(directory, [3, 5, 8])
    (directory / framing.segment_name(9)).mkdir()  # a directory: not a segment, as before
    scanned = Inventory.scan(directory)
    assert scanned.kept == (3, 3 * SEGMENT, 3) == expected(scanned)
    make_segments(directory, [10], size=500)
    scanned.add_found(directory, 10)
    assert scanned.kept == (4, 3 * SEGMENT + 500, 3)
    while len(scanned):
        scanned.pop_oldest()
    assert scanned.kept == (0, 0, None)
