"""``inferd.engines.quarantine``: a file moved aside keeps its sidecar and gets a
reason, and a quarantine keeps only its newest ``QUARANTINE_MAX_ITEMS`` files
(each may be a whole engine; builds that fail validation add one each), the
older ones removed with their companions (DESIGN.md entry 138)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.engines import quarantine as quarantine_module
from inferd.engines.quarantine import QUARANTINE_DIR, quarantine


def engine(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_bytes(name.encode() * 100)
    path.with_name(name + ".sha256").write_text("0" * 64 + "\n")
    return path


def test_a_quarantined_file_keeps_its_sidecar_and_says_why(tmp_path: Path) -> None:
    moved = quarantine(engine(tmp_path, "a.engine"), "failed validation: max error 3.1")
    assert moved.parent == tmp_path / QUARANTINE_DIR and moved.read_bytes() == b"a.engine" * 100
    assert moved.with_name(moved.name + ".sha256").exists()
    assert moved.with_name(moved.name + ".reason").read_text() == (
        "failed validation: max error 3.1\n"
    )
    assert not (tmp_path / "a.engine").exists() and not (tmp_path / "a.engine.sha256").exists()


def test_a_quarantine_keeps_its_newest_files_and_removes_older_ones_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quarantine_module, "QUARANTINE_MAX_ITEMS", 3)
    moved = [quarantine(engine(tmp_path, f"e{i}.engine"), f"reason {i}") for i in range(5)]
    left = sorted(p.name for p in (tmp_path / QUARANTINE_DIR).iterdir())
    kept = sorted(
        name for m in moved[2:] for name in (m.name, m.name + ".sha256", m.name + ".reason")
    )
    assert left == kept


def test_a_quarantine_keeps_its_newest_files_within_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines that failed validation are outside the builds caps: the quarantine's
    own bytes bound them; the file just moved stays, however large."""
    monkeypatch.setattr(quarantine_module, "QUARANTINE_MAX_BYTES", 2000)  # each 900 bytes
    moved = [quarantine(engine(tmp_path, f"e{i}.engine"), f"reason {i}") for i in range(4)]
    left = sorted(p.name for p in (tmp_path / QUARANTINE_DIR).iterdir())
    kept = sorted(
        name for m in moved[2:] for name in (m.name, m.name + ".sha256", m.name + ".reason")
    )
    assert left == kept
    monkeypatch.setattr(quarantine_module, "QUARANTINE_MAX_BYTES", 100)
    last = quarantine(engine(tmp_path, "e4.engine"), "too large for the bound")
    assert sorted(p.name for p in (tmp_path / QUARANTINE_DIR).iterdir()) == [
        last.name,
        last.name + ".reason",
        last.name + ".sha256",
    ]


def test_two_quarantines_of_one_name_in_one_second_keep_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build's engine that failed validation, then its final path's mismatched one:
    same name, same process, same second; the first is never replaced."""
    monkeypatch.setattr(quarantine_module.time, "strftime", lambda _format: "20260101T000000")
    first = quarantine(engine(tmp_path, "a.engine"), "failed validation")
    path = tmp_path / "a.engine"
    path.write_bytes(b"left at the final path")
    second = quarantine(path, "engine does not match its sidecar digest")
    assert first != second
    assert first.read_bytes() == b"a.engine" * 100
    assert first.with_name(first.name + ".reason").read_text() == "failed validation\n"
    assert second.read_bytes() == b"left at the final path"
