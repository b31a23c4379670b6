"""Segment files whose name is not the one the writer gives their index
(``seg-1.fdr`` beside ``seg-0000000001.fdr``: ``framing.segment_index`` reads
both as 1, and ``reader.list_segments`` lists both).  The inventory's scan
(DESIGN.md 258) added both to its arrays under one index and raised
``ValueError`` ("segment 1 is not newer than 1") from ``FlightRecorder.start``,
which ``Daemon._start_recorder`` does not catch (it catches ``OSError``): a stray
copy put there by hand stopped the daemon from starting.  And a segment known only
by such a name was counted but never deleted by the cap (its unlink named the
writer's spelling: ``already_gone``), so it stayed on disk for ever.  Before the
inventory the cap listed the directory and removed both by path."""

from __future__ import annotations

from pathlib import Path

from inferd.fdr import framing
from inferd.fdr.inventory import Inventory
from inferd.fdr.reader import list_segments
from tests.unit.fdr.test_fdr_inventory import SEGMENT, make_segments, recorder, rotate


def _copy_as(directory: Path, index: int, name: str) -> Path:
    """A copy of segment ``index`` under ``name`` (another spelling of its index)."""
    target = directory / name
    target.write_bytes((directory / framing.segment_name(index)).read_bytes())
    return target


def test_two_names_of_one_index_are_scanned_as_the_reader_lists_them(tmp_path: Path) -> None:
    directory = tmp_path / "fdr"
    make_segments(directory, [1, 2, 3], size=100)
    _copy_as(directory, 1, "seg-1.fdr")
    _copy_as(directory, 2, "seg-00000000002.fdr")
    inventory = Inventory.scan(directory)  # raised ValueError
    expected = list_segments(directory)
    assert sorted(inventory.paths_newest_first(directory)) == sorted(expected)
    assert inventory.total == sum(path.lstat().st_size for path in expected)
    assert inventory.kept == (3, 500, 1)


def test_the_recorder_starts_over_a_second_name_and_its_cap_deletes_both(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "fdr"
    make_segments(directory, range(1, 5))
    stray = _copy_as(directory, 1, "seg-1.fdr")
    only = directory / "seg-02.fdr"  # segment 2 known by another spelling only
    (directory / framing.segment_name(2)).rename(only)
    fdr = recorder(directory, kept=4)  # raised ValueError
    status = rotate(fdr, 4)
    assert status["last_error"] is None and status["records_dropped"] == 0
    assert not stray.exists() and not only.exists()
    assert not (directory / framing.segment_name(1)).exists()
    on_disk = sum(path.lstat().st_size for path in list_segments(directory))
    assert fdr._inventory.total == on_disk <= 5 * SEGMENT
