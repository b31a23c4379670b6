"""A quarantine orders what was moved there by the sequence in its names, never by
ctime first (review RF, F3): the kernel stamps ctime from the wall clock, which reads
1970 on a vehicle that boots without an RTC, or is set back mid-run.

ctime cannot be set from user space, so the module's ``os.scandir`` reports the
ctime a kernel with the test's clock would have stamped at each move (as the
review's repro did); everything else is the real module on a real directory."""

from __future__ import annotations

import os
import re
import time
import types
from pathlib import Path
from typing import Any

import pytest

from inferd.engines import quarantine as quarantine_module
from inferd.engines.quarantine import QUARANTINE_DIR, quarantine

NOW_S = int(time.time())


class _Clock:
    """The wall clock the fake kernel stamps ctime with, at a file's first listing
    (``_prune`` lists right after each move)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now_ns = 0
        self.ctimes: dict[str, int] = {}
        real = os.scandir
        clock = self

        class Entry:
            def __init__(self, entry: os.DirEntry[str]) -> None:
                self._entry, self.name, self.path = entry, entry.name, entry.path

            def stat(self, *, follow_symlinks: bool = True) -> Any:
                info = self._entry.stat(follow_symlinks=follow_symlinks)
                ctime = clock.ctimes.setdefault(self.name, clock.now_ns)
                return types.SimpleNamespace(
                    st_ctime_ns=ctime, st_size=info.st_size, st_mode=info.st_mode
                )

        shim = types.ModuleType("os")
        shim.__dict__.update(os.__dict__)
        shim.scandir = lambda directory: [Entry(e) for e in real(directory)]  # type: ignore[attr-defined]
        monkeypatch.setattr(quarantine_module, "os", shim)


def engine(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_bytes(b"e" * 10)
    path.with_name(name + ".sha256").write_text("0" * 64 + "\n")
    return path


def kept(directory: Path) -> list[str]:
    """The quarantined files' own names (before their sequence), companions left out."""
    names = os.listdir(directory / QUARANTINE_DIR)
    return sorted(n.split(".")[0] for n in names if not n.endswith((".sha256", ".reason")))


def test_this_boots_files_are_kept_over_a_previous_flights_after_the_clock_went_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The previous flight (a right clock) quarantined three; this boot (clock at 1970)
    five.  Before, each move pruned this boot's earlier ones and kept last flight's:
    only ``boot4`` of this boot's was left."""
    monkeypatch.setattr(quarantine_module, "QUARANTINE_MAX_ITEMS", 3)
    clock = _Clock(monkeypatch)
    now = time.time_ns()
    for i in range(3):
        clock.now_ns = now - (86400 - i * 60) * 10**9
        quarantine(engine(tmp_path, f"flight{i}.engine"), "failed validation (last flight)")
    for i in range(5):
        clock.now_ns = (600 + i * 60) * 10**9
        quarantine(engine(tmp_path, f"boot{i}.engine"), "failed validation (this boot)")
    assert kept(tmp_path) == ["boot2", "boot3", "boot4"]


def test_names_an_older_daemon_left_are_older_than_every_sequenced_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names without a sequence (``<name>.<time>-<pid>-<hex>``, moved before this
    change) go first, among themselves by ctime."""
    monkeypatch.setattr(quarantine_module, "QUARANTINE_MAX_ITEMS", 3)
    clock = _Clock(monkeypatch)
    folder = tmp_path / QUARANTINE_DIR
    folder.mkdir(mode=0o700)
    for i, age_s in enumerate((3, 1, 2)):  # legacy1 is the newest of them by ctime
        name = f"legacy{i}.engine.20260101T00000{i}-42-00000{i}"
        (folder / name).write_bytes(b"l")
        (folder / f"{name}.reason").write_text("old\n")
        clock.ctimes[name] = (NOW_S - age_s) * 10**9
    clock.now_ns = 600 * 10**9  # this boot: 1970, older than all of them by ctime
    quarantine(engine(tmp_path, "boot0.engine"), "failed validation")
    assert kept(tmp_path) == ["boot0", "legacy1", "legacy2"]
    assert not list(folder.glob("legacy0*"))  # with its .reason
    quarantine(engine(tmp_path, "boot1.engine"), "failed validation")
    quarantine(engine(tmp_path, "boot2.engine"), "failed validation")
    assert kept(tmp_path) == ["boot0", "boot1", "boot2"]


def test_a_quarantined_name_carries_its_sequence_and_stays_readable(tmp_path: Path) -> None:
    """``<name>.<seq, 8 digits>.<%Y%m%dT%H%M%S>-<pid>-<6 hex>``; the next is 1 + the
    highest there, compared as a number (a ninth after an eighth... a tenth after a
    ninth), and the sequence continues from what the directory holds."""
    first = quarantine(engine(tmp_path, "a.engine"), "r")
    pattern = rf"a\.engine\.00000001\.[0-9]{{8}}T[0-9]{{6}}-{os.getpid()}-[0-9a-f]{{6}}"
    assert re.fullmatch(pattern, first.name), first.name
    assert first.with_name(first.name + ".reason").read_text() == "r\n"
    folder = tmp_path / QUARANTINE_DIR
    (folder / "b.engine.000000009.20260101T000000-1-abcdef").write_bytes(b"b")
    second = quarantine(engine(tmp_path, "a.engine"), "r")
    assert second.name.startswith("a.engine.00000010."), second.name


def test_a_stray_name_with_an_overlong_sequence_neither_blocks_nor_outlives_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name with a 200-digit ``seq`` (a stray file) made every later name too long
    to create: each quarantine failed with ``ENAMETOOLONG``, its engine left in
    place, and the stray, highest, was never pruned (review R1 of entry 343,
    finding 4).  It now reads as unsequenced: quarantines go on and it goes first."""
    monkeypatch.setattr(quarantine_module, "QUARANTINE_MAX_ITEMS", 2)
    folder = tmp_path / QUARANTINE_DIR
    folder.mkdir(mode=0o700)
    for digits in (12, 200):  # review R3, F4: 12 digits made every seq after it 13
        stray = f"stray{digits}.engine." + "9" * digits + ".20260101T000000-42-abcdef"
        (folder / stray).write_bytes(b"s")
    for i in range(2):
        moved = engine(tmp_path, f"boot{i}.engine")
        quarantine(moved, "failed validation")
        assert not moved.exists()
    assert kept(tmp_path) == ["boot0", "boot1"]
    assert all(".00000001." in n or ".00000002." in n for n in os.listdir(folder))
